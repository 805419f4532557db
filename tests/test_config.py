"""Bad input to the training CLI: one clear line, exit status 2, nothing damaged."""

import re
from pathlib import Path

import numpy as np
import pytest

from train import config as config_mod
from train.__main__ import main
from train.model import registry as models

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs/digits_mlp.yaml")


def cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_registry_names_resolve_to_their_classes():
    for name in models.MODELS:
        assert models.class_path(models.resolve(name)) == name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.bogus=1"], r"unknown key 'train.bogus'; valid keys in train: batch_size, steps"),
        (["bogus.key=1"], r"unknown key 'bogus'; valid keys in the top level: name, seed, model"),
        (["train.steps=abc"], r"train.steps: expected int, got 'abc'"),
        (["train.steps=0"], r"train.steps must be >= 1, got 0"),
        (["seed=-1"], r"seed must be in \[0, 2147483647\], got -1"),
        (
            ["data.split_seed=2147483648"],
            r"data.split_seed must be in \[0, 2147483647\], got 2147483648",
        ),
        (["optimizer.learning_rate=fast"], r"optimizer.learning_rate: expected float, got 'fast'"),
        (
            ["optimizer.name=adamax"],
            r"optimizer.name=adamax is not a named optimizer \(sgd, momentum, adam, adamw, "
            r"lion\) and not an import path 'module:name' of your own",
        ),
        (
            ["parallel.strategy=ddp"],
            r"parallel.strategy: 'ddp' is not one of none, pmap, shard_map",
        ),
        (
            ["parallel.devices=many"],
            r"parallel.devices must be 'all' or a positive int, got 'many'",
        ),
        (
            ["model.name=vit"],
            r"model.name=vit is not a shipped model \(mlp, linreg, cnn, gpt, resnet\) and not an "
            r"import path 'module:Class'",
        ),
        (["model.hidden_sizes=12"], r"model.hidden_sizes: expected list of int, got 12"),
        (["model.depth=3"], r"unknown key 'model.depth'; model.name=mlp \(MLP\) takes in_features"),
        (
            ["model.hidden_sizes=[]"],
            r"model.name=mlp \(MLP\): model.hidden_sizes must be a non-empty list of positive ints",
        ),
        (["data.name=npz"], r"data.path is required when data.name is npz"),
        (["data.test_fraction=1.5"], r"data.test_fraction must be in \(0, 1\), got 1.5"),
        (["train=3"], r"train must be a mapping, got 3"),
        (["train.steps"], r"--set 'train.steps': expected section.key=value"),
        (
            ["parallel.strategy=pmap", "parallel.devices=8", "train.batch_size=100"],
            r"train.batch_size=100 does not split across 8 devices; use a multiple of 8, e.g. 96 or 104",
        ),
        (
            ["parallel.strategy=pmap", "parallel.devices=64"],
            r"parallel.devices=64 but only 8 local devices exist",
        ),
        (
            ["data.name=linreg"],
            r"model.name=mlp is a classification model but data.name=linreg is a regression",
        ),
    ],
)
def test_bad_config_values(capsys, tmp_path, overrides, message):
    sets = [x for o in ["log.plot=false", *overrides] for x in ("--set", o)]  # (NO_PLOT)
    code, err = cli(capsys, "--config", DIGITS, "--set", f"log.dir={tmp_path}", *sets)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err), err
    assert not (tmp_path / "digits_mlp").exists()  # nothing written for bad input


def test_missing_config_file(capsys, tmp_path):
    code, err = cli(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "config file not found" in err and "nope.yaml" in err


def test_bad_yaml(capsys, tmp_path):
    code, err = cli(capsys, "--config", write(tmp_path, "train: [1, 2\n"))
    assert code == 2 and "not valid YAML at line" in err


def test_top_level_not_a_mapping(capsys, tmp_path):
    code, err = cli(capsys, "--config", write(tmp_path, "- 1\n- 2\n"))
    assert code == 2 and "expected a mapping of sections" in err


def test_error_names_the_file(capsys, tmp_path):
    path = write(tmp_path, "train:\n  stepz: 3\n")
    code, err = cli(capsys, "--config", path)
    assert code == 2 and path in err and "train.stepz" in err


# NO_PLOT: log.plot=false where the CLI gets past the config: with curves on it starts the
# plotter's helper process (a Python that imports matplotlib, ~1 s of CPU) before the data
# loads, and an error then stops it: tests/test_plot.py's promises, not these tests'.


def npz_args(path, tmp_path, *sets):
    """CLI arguments training the digits config on the npz file ``path`` (NO_PLOT)."""
    args = ["--config", DIGITS]
    for o in ("data.name=npz", f"data.path={path}", f"log.dir={tmp_path}", "log.plot=false", *sets):
        args += ["--set", o]
    return args


def npz_case(tmp_path, capsys, **arrays):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return cli(capsys, *npz_args(path, tmp_path))


X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
Y = np.arange(40) % 4


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": X}, r"missing array 'y'; found \['x'\]"),
        ({"x": X, "y": Y[:30]}, r"y has shape \(30,\) but x has 40 rows"),
        ({"x": np.where(X > 1, np.nan, X), "y": Y}, r"x has \d+ non-finite values"),
        ({"x": X, "y": Y - 1}, r"labels must be >= 0, found -1"),
        ({"x": X, "y": Y, "x_test": X}, r"x_test and y_test must be given together"),
        (
            {"x": X, "y": Y, "x_test": X[:, :2], "y_test": Y},
            r"x_test has feature shape \(2,\), x has \(3,\)",
        ),
        (
            {"x": X.reshape(40, 3, 1), "y": Y},
            r"x must have shape \[n, features\], got \(40, 3, 1\)",
        ),
        (
            {"x": X, "y": np.stack([Y, Y], 1)},
            r"integer labels y must have shape \[n\], got \(40, 2\)",
        ),
        (
            {"x": X, "y": np.array(["a"] * 40)},
            r"y must be integer labels or float targets, got dtype <U1",
        ),
        ({"x": X.astype(str), "y": Y}, r"x must be numeric, got dtype <U"),
        (
            {"x": X, "y": Y.astype(bool)},
            r"y must be integer labels or float targets, got dtype bool",
        ),
        # 10^9 as a label: not a 7.45 GiB bincount, not a 10^9-way output layer
        (
            {"x": X, "y": np.where(Y == 3, 10**9, Y)},
            r"labels must be class indices 0..K-1, but the largest is 1000000000 and only 4 "
            r"distinct labels occur .*map them to 0..3",
        ),
    ],
)
def test_bad_npz(tmp_path, capsys, arrays, message):

    code, err = npz_case(tmp_path, capsys, **arrays)
    assert code == 2 and re.search(message, err), err


@pytest.mark.parametrize(
    "content, message",
    [
        (
            b"x,y\n1.0,2\n",
            r"is a text file \(first line 'x,y'\), not an .npz; expected an .npz archive",
        ),
        (b"", r"the file is empty"),
        (b"\x00\x01\x02binary", r"not an .npz archive \(it starts with b'\\x00\\x01"),
    ],
)
def test_npz_that_is_something_else_says_what_it_is(tmp_path, capsys, content, message):
    path = tmp_path / "d.npz"
    path.write_bytes(content)
    code, err = cli(capsys, *npz_args(path, tmp_path))
    assert code == 2 and err.count("\n") == 1 and re.search(message, err), err
    assert "pickled" not in err
    np.save(tmp_path / "one.npy", X)
    (tmp_path / "one.npy").rename(path)
    code, err = cli(capsys, *npz_args(path, tmp_path))
    assert code == 2 and "is a .npy file (a single array)" in err, err


def test_npz_missing_and_unreadable(tmp_path, capsys):
    code, err = cli(capsys, *npz_args(f"{tmp_path}/no.npz", tmp_path))
    assert code == 2 and "no.npz" in err and "file not found" in err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    code, err = cli(capsys, *npz_args(bad, tmp_path))
    assert code == 2 and "is a text file (first line 'not a zip'), not an .npz" in err


def test_npz_trains(tmp_path, capsys):
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(3, 5)) * 4
    y = np.arange(300) % 3
    x = (centers[y] + rng.normal(size=(300, 5))).astype(np.float32)
    path = tmp_path / "blobs.npz"
    np.savez(path, x=x, y=y)
    sets = ("train.steps=200", "train.batch_size=32", "log.progress=false", "name=blobs")
    code = main(npz_args(path, tmp_path, *sets))
    assert code == 0
    assert "test accuracy" in capsys.readouterr().out


def small_run(tmp_path, *sets):
    args = ["--config", DIGITS, "--set", f"log.dir={tmp_path}", "--set", "log.progress=false"]
    for o in ("log.plot=false", "model.hidden_sizes=[8]", "train.steps=4", *sets):
        args += ["--set", o]
    return args


@pytest.fixture(scope="module")
def small_done(tmp_path_factory):
    """``small_done(log_dir)``: the finished run of ``small_run`` (4 steps, a checkpoint at
    step 4), trained once for the module and copied into ``log_dir``; its run directory.
    ``small_done.out``: what that run printed."""
    import contextlib
    import io
    import shutil

    trained = tmp_path_factory.mktemp("small_done")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(small_run(trained)) == 0

    def copy(log_dir):
        return Path(shutil.copytree(trained / "digits_mlp", log_dir / "digits_mlp"))

    copy.out = out.getvalue()
    return copy


def test_bad_checkpoint_is_reported_and_left_alone(small_done, tmp_path, capsys):
    base = small_run(tmp_path)
    run_dir = small_done(tmp_path)
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    ckpt = run_dir / "checkpoints" / "ckpt_00000004.safetensors"
    ckpt_before = ckpt.read_bytes()

    # A different architecture: refused by the key that changed, before the tensors are read.
    code, err = cli(capsys, *base, "--set", "model.hidden_sizes=[32]", "--set", "train.steps=8")
    assert code == 2
    assert (
        "was written with model.hidden_sizes=[8] but the config has model.hidden_sizes=[32]" in err
    )
    # A changed hyperparameter that keeps the shapes: refused by name.
    code, err = cli(capsys, *base, "--set", "optimizer.learning_rate=0.5", "--set", "train.steps=8")
    assert (
        code == 2
        and "optimizer.learning_rate=0.003 but the config has optimizer.learning_rate=0.5" in err
    )
    # A corrupt file.
    ckpt.write_bytes(b"\x00" * 16)
    code, err = cli(capsys, *base, "--set", "train.steps=8")
    assert code == 2 and f"checkpoint {ckpt}: not a safetensors file" in err
    ckpt.write_bytes(ckpt_before)
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before

    code, err = cli(capsys, *base, "--resume", "--set", f"log.dir={tmp_path}/empty")
    assert code == 2 and "--resume: no checkpoint in" in err


# -- issue 14: every bad input one clear line ------------------------------------------------
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optimizer.learning_rate=.nan",
            r"optimizer.learning_rate: expected a finite number, got nan",
        ),
        (
            "optimizer.learning_rate=.inf",
            r"optimizer.learning_rate: expected a finite number, got inf",
        ),
        ("optimizer.learning_rate=1e400", r"expected a finite number, got 1e400"),
        ("optimizer.clip_norm=-.inf", r"optimizer.clip_norm: expected a finite number, got -inf"),
        ("optimizer.momentum=.nan", r"optimizer.momentum: expected a finite number, got nan"),
        ("name=../escaped", r"name must be one directory name .* got '../escaped'"),
        ("name=a/b", r"name must be one directory name .* got 'a/b'"),
        ("name=''", r"name must be one directory name .* got ''"),
        ("name=.hidden", r"name must be one directory name .* got '.hidden'"),
        ("train.steps=100000000000000000000000", r"train.steps: .* is out of range"),
        ("train.steps=3000000000", r"train.steps must be at most 2147483647 .*int32"),
        ("train.step_timeout=-1", r"train.step_timeout must be >= 0"),
        ("distributed.heartbeat_timeout=99999999999", r"heartbeat_timeout must be at most"),
        ("compile_cache=''", r"compile_cache must be 'auto', a directory or null"),
    ],
)
def test_more_bad_values_are_named_against_their_set(capsys, tmp_path, override, message):
    code, err = cli(capsys, "--config", DIGITS, "--set", f"log.dir={tmp_path}", "--set", override)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --set {override}: "), err  # --set is the source, not the file
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir()) and not (ROOT / "escaped").exists()


def test_set_typos_name_the_set_not_the_file(capsys):
    code, err = cli(capsys, "--config", DIGITS, "--set", "trian.steps=3")
    assert code == 2 and err.startswith("error: --set trian.steps=3: unknown key 'trian'"), err
    code, err = cli(capsys, "--config", DIGITS, "--set", "train.stepz=3", "--set", "seed=1")
    assert err.startswith("error: --set train.stepz=3: unknown key 'train.stepz'"), err
    code, err = cli(capsys, "--config", DIGITS, "--set", "train.steps=abc")
    assert err.startswith("error: --set train.steps=abc: train.steps: expected int"), err


def test_exponent_floats_without_a_dot_are_floats(capsys, tmp_path):
    path = write(tmp_path, "optimizer:\n  learning_rate: 1e-4\n  weight_decay: 5E-3\n")
    cfg = config_mod.load_config(path, ["optimizer.clip_norm=1e0", "data.test_fraction=2.5e-1"])
    assert cfg.optimizer.learning_rate == 1e-4 and cfg.optimizer.weight_decay == 5e-3
    assert cfg.optimizer.clip_norm == 1.0 and cfg.data.test_fraction == 0.25
    # an int key stays an int key; a word is still refused
    code, err = cli(capsys, "--config", DIGITS, "--set", "train.steps=1e3")
    assert code == 2 and "train.steps: expected int, got '1e3'" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "optimizer:\n  name: caf\xe9\n".encode("latin-1"),
            r"not UTF-8 text \(byte 0xe9 at line 2\)",
        ),
        ("train:\n  steps: 3\n".encode("utf-16"), r"the file is UTF-16 text; save it as UTF-8"),
        (b"\x7fELF\x02\x01\x01\x00\x00\x00", r"not a text file \(it contains NUL bytes\)"),
    ],
)
def test_config_files_that_are_not_utf8(capsys, tmp_path, content, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    code, err = cli(capsys, "--config", str(path))
    assert code == 2 and err.count("\n") == 1 and re.search(message, err), err
    assert str(path) in err


def test_utf8_with_bom_is_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes("\ufefftrain:\n  steps: 3\n".encode())
    assert config_mod.load_config(path).train.steps == 3


def test_untrusted_checkpoint_metadata_and_nan_checkpoints_are_refused(
    small_done, tmp_path, capsys
):
    import safetensors
    import safetensors.numpy

    from nnlite.core._save import CHECKSUMS, checksums_json

    base = small_run(tmp_path)
    ckpt = small_done(tmp_path) / "checkpoints" / "ckpt_00000004.safetensors"
    with safetensors.safe_open(str(ckpt), framework="numpy") as f:
        meta = dict(f.metadata())
    tensors = safetensors.numpy.load_file(str(ckpt))
    later = [*base, "--set", "train.steps=8"]

    def resume_with(meta, tensors=tensors):
        safetensors.numpy.save_file(tensors, str(ckpt), metadata=meta)
        return cli(capsys, *later)

    from train.checkpoint.store import restore

    # Each through the check that every resume's restore makes (before a tensor is read;
    # the templates are not needed), the last also through the CLI, one line and exit 2
    # as every ConfigError (each CLI run compiles the step before it resumes).
    for changed, message in [
        ({"step": None}, "its metadata has no 'step'"),
        ({"step": "four"}, "its metadata 'step' is 'four', not an integer"),
        ({"step": "-4"}, "its metadata 'step' is '-4', not an integer"),
        ({"skipped_steps": "1.5"}, "'skipped_steps' is '1.5', not an integer"),
        ({"step": "3"}, "its metadata says step 3 but its name says step 4"),
    ]:
        m = {k: v for k, v in {**meta, **changed}.items() if v is not None}
        safetensors.numpy.save_file(tensors, str(ckpt), metadata=m)
        with pytest.raises(config_mod.ConfigError) as e:
            restore(ckpt, None, None)
        said = str(e.value)
        assert said.startswith(f"checkpoint {ckpt}: ") and message in said, said
        assert "\n" not in said
    code, err = resume_with(m)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    key = next(k for k in tensors if k.startswith("params/"))
    nan = {**tensors, key: np.full_like(tensors[key], np.nan)}
    # written with NaN (its checksums match): the finiteness check refuses it
    code, err = resume_with({**meta, CHECKSUMS: checksums_json(nan)}, nan)
    assert code == 2 and f"'{key}' holds non-finite values, so it cannot be resumed" in err, err
    assert "last good checkpoint" not in err
    code, err = resume_with(meta)
    assert code == 0, err


def test_checkpoints_past_step_99999999_are_found_in_step_order(tmp_path):
    from train.checkpoint.store import list_checkpoints

    for step in (99999999, 100000000, 7):
        (tmp_path / f"ckpt_{step:08d}.safetensors").write_bytes(b"")
    assert [p.name[5:-12] for p in list_checkpoints(tmp_path)] == [
        "00000007",
        "99999999",
        "100000000",
    ]


# -- absurd sizes: refused before anything is allocated, naming the key ---------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.batch_size=1000000000000"], r"reduce train.batch_size \(now 1000000000000\)"),
        (
            ["model.hidden_sizes=[10000000000]"],
            r"reduce model.hidden_sizes \(now \[10000000000\]\)",
        ),
        (
            ["parallel.strategy=shard_map", "train.batch_size=4000000000"],
            r"reduce train.batch_size \(now 4000000000\)",
        ),
        (["data.name=mnist1d", "data.num_samples=100000000000"], r"data.num_samples=100000000000"),
    ],
)
def test_absurd_sizes_are_refused_before_allocating(capsys, tmp_path, overrides, message):
    sets = [x for o in ["log.plot=false", *overrides] for x in ("--set", o)]  # (NO_PLOT)
    code, err = cli(capsys, "--config", DIGITS, "--set", f"log.dir={tmp_path}", *sets)
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"needs at least [\d.]+ [KMGTP]iB", err), err
    assert "this machine has" in err and re.search(message, err), err
    assert not any(tmp_path.iterdir())


def test_memory_estimate_is_a_lower_bound_that_passes_real_configs():
    import jax

    from train.loop import build, memory

    cfg = config_mod.load_config(DIGITS, ["parallel.strategy=shard_map"])
    r = build.build(cfg)
    est = memory.estimate(cfg, r.model, r.optimizer, r.data, r.strategy)
    p = r.model.init(jax.random.key(0)).num_params() * 4
    assert est.state >= p * (1 + 8 * 2)  # host copy + params and grads on each device
    assert est.data >= 9 * r.data.x.nbytes and est.total < est.limit


def test_file_system_problems_are_one_line_and_damage_nothing(small_done, tmp_path, capsys):
    # (the run directory problems before the run: its files afterwards are small_done's)
    logfile = tmp_path / "logfile"
    logfile.write_text("x")
    code, err = cli(capsys, *small_run(logfile))
    assert code == 2 and err.count("\n") == 1, err
    assert f"{logfile} is a file, but it must be a directory (log.dir)" in err
    (tmp_path / "digits_mlp").write_text("x")
    code, err = cli(capsys, *small_run(tmp_path))
    assert code == 2 and "digits_mlp is a file, but it must be the run directory" in err, err
    (tmp_path / "digits_mlp").unlink()
    run_dir = small_done(tmp_path)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").write_text("not a directory")
    capsys.readouterr()
    code, err = cli(capsys, *small_run(tmp_path, "train.steps=8"))
    assert code == 2 and err.count("\n") == 1, err
    assert "checkpoints is a file, but it must be the checkpoint directory" in err
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name in before}
    assert after == before  # metrics.jsonl was not rewritten


def test_a_read_only_run_directory_is_refused_before_writing(
    small_done, tmp_path, capsys, monkeypatch
):
    import os
    import tempfile

    run_dir = small_done(tmp_path)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    run_dir.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: make the write fail as it would for others
        real = tempfile.mkstemp

        def mkstemp(*a, dir=None, **k):
            if dir is not None and Path(dir) == run_dir:
                raise PermissionError(13, "Permission denied")
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    try:
        capsys.readouterr()
        code, err = cli(capsys, *small_run(tmp_path, "train.steps=8"))
    finally:
        run_dir.chmod(0o755)
    assert code == 2 and err.count("\n") == 1, err
    assert f"cannot write in {run_dir} (Permission denied)" in err
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_rerunning_a_finished_run_says_so_with_its_final_metrics(small_done, tmp_path, capsys):
    small_done(tmp_path)
    done = small_done.out.splitlines()[-1]
    assert main(small_run(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "already finished: step 4 of train.steps=4, test loss " in out, out
    assert "test accuracy" in out and "nan" not in out and "examples/s" not in out
    loss = re.search(r"test loss (\d\.\d{4})", done).group(1)
    assert f"test loss {loss}" in out


def test_peek_reads_a_key_as_load_config_will_before_any_import(tmp_path):
    # The CLI starts the curves' helper before the config is built (building it imports the
    # model's module, and so JAX): it decides from these values.
    from train.config import peek

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  name: linreg\nlog:\n  plot: false\n")
    assert peek(path, [], "log.plot", "data.name", "model.name") == (False, "linreg", None)
    assert peek(path, ["log.plot=true"], "log.plot") == (True,)  # --set wins, as it will
    assert peek(tmp_path / "missing.yaml", [], "log.plot", "data.name") == (None, None)
    path.write_text("log: [1, 2]\n")  # not a section: load_config says so, peek finds nothing
    assert peek(path, [], "log.plot") == (None,)
