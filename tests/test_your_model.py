"""A user's own model, in the user's own directory, through everything the trainer does.

The models and configs are written into a temporary project outside the repository and
trained with ``python -m train`` from there (the checkout is put on PYTHONPATH, as the
README's editable install puts it on sys.path).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import TINY_LM
from _xla import xla_flags

import nnlite as nl
import train
from train.__main__ import main
from train.checkpoint.rundir import TIMING_KEYS

ROOT = Path(__file__).resolve().parents[1]

MODELS_PY = f'''
import jax
import jax.numpy as jnp
import nnlite as nl


class ResMLP(nl.Module):
    """A residual MLP classifier built from nnlite layers (every one has a hand rule)."""

    in_features: int
    num_classes: int
    width: int = 16
    depth: int = 2

    task = "classification"

    def init(self, key):
        keys = jax.random.split(key, self.depth + 2)
        return nl.ParamsDict(
            inp=nl.Linear(self.in_features, self.width).init(keys[0]),
            blocks=[nl.Linear(self.width, self.width).init(k) for k in keys[1:-1]],
            out=nl.Linear(self.width, self.num_classes).init(keys[-1]),
        )

    def __call__(self, params, x, *, key=None):
        h = nl.relu(nl.Linear(self.in_features, self.width)(params.inp, x))
        for p in params.blocks:
            h = nl.add(h, nl.relu(nl.Linear(self.width, self.width)(p, h)))
        return nl.Linear(self.width, self.num_classes)(params.out, h)


{TINY_LM}

class RawLgamma(nl.Module):
    """lax.lgamma has no hand rule: loss.grad=manual must refuse it by name."""

    in_features: int
    num_classes: int

    task = "classification"

    def init(self, key):
        return nl.ParamsDict(lin=nl.Linear(self.in_features, self.num_classes).init(key))

    def __call__(self, params, x, *, key=None):
        return jax.lax.lgamma(1.0 + jnp.abs(nl.Linear(self.in_features, self.num_classes)(params.lin, x)))


class NeedsDepth(nl.Module):
    in_features: int
    num_classes: int
    depth: int  # required: no default, not filled by the data
    task = "classification"

    def init(self, key):
        return nl.ParamsDict()


class NoTask(nl.Module):
    in_features: int

    def init(self, key):
        return nl.ParamsDict()


class NotAModule:
    task = "classification"
'''

RES_YAML = """
name: res
seed: 0
model:
  name: usermodels:ResMLP
  width: 16
data:
  name: npz
  path: small.npz
train:
  batch_size: 32
  steps: 40
  eval_every: 20
  log_every: 10
checkpoint:
  every: 5
log:
  progress: false
  plot: false
"""

LM_YAML = """
name: lm
model:
  name: usermodels:TinyLM
data:
  name: text
  path: corpus.txt
  context: 16
  eval_windows: 32
train:
  batch_size: 8
  steps: 10
  eval_every: 10
  log_every: 5
log:
  progress: false
  plot: false
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's project directory: their model module, configs and data, nothing else."""
    d = tmp_path_factory.mktemp("userproject")
    (d / "usermodels.py").write_text(MODELS_PY)
    (d / "broken.py").write_text("raise RuntimeError('this module does not import')\n")
    (d / "res.yaml").write_text(RES_YAML)
    (d / "lm.yaml").write_text(LM_YAML)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype(np.float32)
    y = ((x[:, 0] > 0) + 2 * (x[:, 1] > 0)).astype(np.int32)
    np.savez(d / "small.npz", x=x[:256], y=y[:256], x_test=x[256:], y_test=y[256:])
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran"]
    (d / "corpus.txt").write_text(" ".join(words[i] for i in rng.integers(0, 8, 3000)))
    return d


def env(devices: int = 1) -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["XLA_FLAGS"] = xla_flags(devices)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        e.pop(k, None)
    return e


def run_cli(project, *args, module="train", devices=1, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=project,
        env=env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sets(*overrides) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def final_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("ckpt_*.safetensors"))[-1]


def metrics(run_dir: Path) -> list[dict]:
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def assert_same_tree(a, b):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.fixture(scope="module")
def ref_run(project):
    """The uninterrupted run of res.yaml, from the project's directory."""
    proc = run_cli(project, "--config", "res.yaml", "--fresh")
    assert proc.returncode == 0, proc.stderr
    return project / "runs" / "res"


def test_user_model_trains_from_its_directory_and_records_only_its_keys(project, ref_run):
    assert ref_run.is_dir()  # runs/ under the user's directory, not the repository
    import yaml

    saved = yaml.safe_load((ref_run / "config.yaml").read_text())
    assert saved["model"] == {
        "name": "usermodels:ResMLP",
        "in_features": 8,
        "num_classes": 4,
        "width": 16,
        "depth": 2,
    }
    records = metrics(ref_run)
    train_records = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_records] == [10, 20, 30, 40]
    assert all(r["lr"] == pytest.approx(1e-3) for r in train_records)
    assert train_records[-1]["loss"] < train_records[0]["loss"]


def test_user_model_resumes_bit_identically_after_sigkill(project, ref_run, monkeypatch, capsys):
    args = ["--config", "res.yaml", *sets("name=killed", "train.log_every=7"), "--fresh"]
    for attempt in range(3):  # kill once mid-run; a machine fast enough to finish first retries
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", *args],
            cwd=project,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        ckpt_dir = project / "runs" / "killed" / "checkpoints"
        deadline = time.monotonic() + 120
        while not (ckpt_dir / "ckpt_00000010.safetensors").exists():
            assert proc.poll() is None or attempt < 2, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if proc.returncode == -signal.SIGKILL:
            break
    assert proc.returncode == -signal.SIGKILL
    args.remove("--fresh")
    # The resume and the uninterrupted reference in-process (the CLI's main, which python
    # -m train runs; train.fit is the CLI's run to the bit:
    # test_fit_with_a_model_instance_is_the_cli_run): the killed process is the subprocess.
    monkeypatch.chdir(project)
    capsys.readouterr()
    assert main(args) == 0
    assert "resuming at step" in capsys.readouterr().out
    ref = _fit(project, "unkilled", "train.log_every=7")
    killed = project / "runs" / "killed"
    a = nl.load(final_checkpoint(killed))
    b = nl.load(final_checkpoint(ref.run_dir))
    assert_same_tree(a, b)
    # The train records are means over each logging interval (7 steps across checkpoints
    # every 5): the resumed run restores the partial sums and logs the same values.
    assert metrics(killed) == metrics(ref.run_dir)


def _fit(project, name, *overrides):
    cfg_path = project / "res.yaml"
    return train.fit(
        None,
        cfg_path,
        overrides=[f"name={name}", f"log.dir={project / 'fit_runs'}", *overrides],
        resume="fresh",
        echo=lambda line: None,
    )


TEN = ["train.steps=10", "checkpoint.every=0"]


def _fit_in(project, name, *overrides):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)  # data.path is relative to the current directory
        return _fit(project, name, *overrides)


@pytest.fixture(scope="module")
def one_device(project):
    """10 steps on one device, with TensorBoard on: the reference of the data-parallel
    tests and the run whose event files test_tensorboard_scalars_match_metrics_jsonl reads
    (TensorBoard only writes: the params are those of a run without it)."""
    return _fit_in(project, "one", *TEN, "log.tensorboard=true")


@pytest.fixture(scope="module")
def shard_map_4(project):
    """10 steps under shard_map on 4 devices: data_parallel_equals_one_device[shard_map]
    and the two-process run's reference."""
    return _fit_in(project, "shard_map", *TEN, "parallel.strategy=shard_map", "parallel.devices=4")


@pytest.mark.parametrize("strategy", ["pmap", "shard_map"])
def test_user_model_data_parallel_equals_one_device(project, strategy, one_device, shard_map_4):
    one = one_device
    if strategy == "shard_map":
        many = shard_map_4
    else:
        par = [f"parallel.strategy={strategy}", "parallel.devices=4"]
        many = _fit_in(project, strategy, *TEN, *par)
    init = one.model.init(jax.random.key(0))
    moved = max(
        float(np.max(np.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, (one.params, init)))
    )
    assert moved > 1e-3  # it trained
    # Same global batch: only the order of the gradient sums differs (float32 rounding,
    # a few ulps per step; a wrong reduction is off by the learning rate or more).
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(many.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=2e-5)


def test_fit_with_a_model_instance_is_the_cli_run(project, ref_run, monkeypatch):
    monkeypatch.chdir(project)
    sys.path.insert(0, str(project))
    try:
        import usermodels

        run = train.fit(
            usermodels.ResMLP(in_features=None, num_classes=None, width=16),
            project / "res.yaml",
            overrides={"log.dir": str(project / "fit_runs"), "name": "instance"},
            resume="fresh",
            echo=lambda line: None,
        )
    finally:
        sys.path.remove(str(project))
    assert run.step == 40 and run.run_dir == project / "fit_runs" / "instance"
    assert "test_accuracy" in run.summary
    assert_same_tree(run.params, nl.load(final_checkpoint(ref_run), subtree="params"))


def test_load_run_and_predict(project, ref_run, tmp_path, capsys):
    loaded = train.load_run(ref_run)
    assert type(loaded.model).__name__ == "ResMLP" and loaded.step == 40
    assert_same_tree(loaded.params, nl.load(final_checkpoint(ref_run), subtree="params"))
    data = np.load(project / "small.npz")
    np.savez(tmp_path / "new.npz", x=data["x_test"], y=data["y_test"])
    # train.predict's main in-process (python -m train.predict is this function; the
    # user's project under python -m train as a subprocess is ref_run)
    from train.predict import main as predict_main

    out_path = tmp_path / "pred.npz"
    code = predict_main(
        ["--run", str(ref_run), "--data", str(tmp_path / "new.npz"), "--out", str(out_path)]
    )
    stdout = capsys.readouterr().out
    assert code == 0
    out = np.load(out_path)
    logits = loaded.predict(data["x_test"])
    np.testing.assert_array_equal(out["predictions"], logits.argmax(-1))
    assert out["probabilities"].shape == (64, 4)
    accuracy = float(np.mean(out["predictions"] == data["y_test"]))
    assert f"accuracy {accuracy:.4f}" in stdout
    # Bad input: one line, exit 2.
    np.savez(tmp_path / "wide.npz", x=np.zeros((3, 9), np.float32))
    code = predict_main(["--run", str(ref_run), "--data", str(tmp_path / "wide.npz")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "expected input with last axis 8" in err


def test_user_language_model_trains_samples_and_generates(project, monkeypatch, capsys):
    # train.fit of the config file (a user's model from its directory under python -m train
    # as a subprocess: ref_run; train.fit is the CLI's run to the bit:
    # test_fit_with_a_model_instance_is_the_cli_run and the sigkill test's reference)
    from train.sample import main as sample_main

    monkeypatch.chdir(project)
    fitted = train.fit(None, "lm.yaml", echo=lambda line: None)
    assert "val_bits_per_char" in fitted.summary
    run_dir = project / "runs" / "lm"  # (fitted.run_dir: relative to the project)
    assert_same_tree(fitted.params, nl.load(final_checkpoint(run_dir), subtree="params"))
    capsys.readouterr()
    code = sample_main(["--run", str(run_dir), "--prompt", "the ", "--tokens", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("the ") and len(out.rstrip("\n")) == 24
    loaded = train.load_run(run_dir)
    greedy = loaded.generate("the cat ", 12, temperature=0)
    assert greedy.startswith("the cat ") and len(greedy) == 20
    assert greedy == loaded.generate("the cat ", 12, temperature=0, seed=5)  # greedy: no key


def test_generation_by_windows_equals_the_gpts_cache_within_the_context():
    from models.gpt import GPT
    from train.inference import generate_by_windows

    model = GPT(vocab_size=11, context=12, n_layer=1, n_head=2, n_embd=16)
    params = model.init(jax.random.key(0))
    prompt = jax.numpy.asarray([[1, 2, 3]])
    key = jax.random.key(1)
    # both jitted: one compile each instead of op-by-op dispatch (the promise is equality)
    cached = jax.jit(lambda p, x, k: model.generate(p, x, 9, k, 0.0, None))(params, prompt, key)
    windows = jax.jit(lambda p, x, k: generate_by_windows(model, p, x, 9, k, 0.0, None))(
        params, prompt, key
    )
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(windows))


def test_user_model_show_jaxpr_and_manual_gradients(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    assert main(["--config", "res.yaml", "--show-jaxpr", "loss"]) == 0
    assert "def loss(" in capsys.readouterr().out
    auto = _fit(project, "auto", "train.steps=3", "checkpoint.every=0", "loss.grad=autodiff")
    manual = _fit(project, "manual", "train.steps=3", "checkpoint.every=0", "loss.grad=manual")
    for a, b in zip(jax.tree.leaves(auto.params), jax.tree.leaves(manual.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    code = main(
        ["--config", "res.yaml", *sets("model={name: 'usermodels:RawLgamma'}", "loss.grad=manual")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "`lgamma` at usermodels.py:" in err and "in layer RawLgamma" in err
    assert "loss.grad=autodiff" in err  # the trainer's words for the library's second fix


def test_user_model_on_two_processes_equals_one_process(project, shard_map_4):
    par = ["parallel.strategy=shard_map", *TEN]
    proc = run_cli(
        project,
        "--config",
        "res.yaml",
        *sets("name=two", "parallel.devices=2", *par),
        "--processes",
        "2",
        devices=2,
    )
    assert proc.returncode == 0, proc.stderr
    assert "devices: 2 processes x 2 x cpu" in proc.stdout
    one = shard_map_4  # the same 10 steps over 4 devices in one process
    two = nl.load(final_checkpoint(project / "runs" / "two"), subtree="params")
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    "model, message",
    [
        (
            "{name: 'usermodels:ResMLP', widht: 3}",
            r"unknown key 'model.widht'; model.name=usermodels:ResMLP \(ResMLP\) takes in_features, num_classes, width, depth",
        ),
        (
            "{name: 'usermodels:NeedsDepth'}",
            r"model.depth is required by model.name=usermodels:NeedsDepth \(NeedsDepth.depth: int\)",
        ),
        ("{name: 'usermodels:ResMLP', width: wide}", r"model.width: expected int, got 'wide'"),
        (
            "{name: 'nosuchmodule:Model'}",
            r"model.name=nosuchmodule:Model: no module named 'nosuchmodule'",
        ),
        (
            "{name: 'broken:Model'}",
            r"model.name=broken:Model: importing broken failed: RuntimeError: this module does not import",
        ),
        (
            "{name: 'usermodels:Missing'}",
            r"model.name=usermodels:Missing: module usermodels \(.*usermodels.py\) has no Missing; its classes: NeedsDepth, NoTask, NotAModule",
        ),
        (
            "{name: 'usermodels:NotAModule'}",
            r"model.name=usermodels:NotAModule: class NotAModule is not an nnlite Module \(subclass nl.Module\)",
        ),
        (
            "{name: 'usermodels:NoTask'}",
            r"NoTask.task must be one of classification, regression, language_model \(a class attribute\), got None",
        ),
        (
            "{name: 'usermodels:TinyLM'}",
            r"model.name=usermodels:TinyLM is a language_model model but data.name=npz is a classification data set",
        ),
        (
            "{name: 'usermodels:ResMLP', num_classes: 2}",
            r"model.num_classes=2 does not fit the data, which has num_classes=4",
        ),
        ("{name: 'usermodels:ResMLP', width: 0}", None),  # the model's own check (Linear refuses)
    ],
)
def test_bad_model_config_is_one_line_exit_2(project, capsys, monkeypatch, model, message):
    monkeypatch.chdir(project)
    code = main(["--config", "res.yaml", *sets(f"model={model}", "name=bad")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    if message is not None:
        import re

        assert re.search(message, err), err
    assert not (project / "runs" / "bad").exists()  # nothing written for bad input


def test_quiet_data_surprises_are_said(project, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(project)
    code = main(["--config", "res.yaml", *sets("train.batch_size=1000", "name=big")])
    err = capsys.readouterr().err
    assert (
        code == 2 and "train.batch_size=1000 is larger than the training set (256 examples" in err
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    np.savez(tmp_path / "float.npz", x=x, y=(x[:, 0] > 0).astype(np.float32))
    code = main(["--config", "res.yaml", *sets(f"data.path={tmp_path / 'float.npz'}", "name=flt")])
    err = capsys.readouterr().err
    assert code == 2 and "float labels are read as regression targets" in err
    assert "y.astype(np.int64)" in err
    np.savez(tmp_path / "gaps.npz", x=x, y=rng.integers(1, 4, 64).astype(np.int32))
    over = sets(
        f"data.path={tmp_path / 'gaps.npz'}", "name=gaps", "train.steps=2", "checkpoint.every=0"
    )
    assert main(["--config", "res.yaml", *over, "--set", f"log.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "labels run 0..3 but 1 of those classes never occur (0)" in out


def test_install_puts_the_trainer_on_the_path():
    """The install puts train/ and models/ inside nnlite's namespace (nnlite.train,
    nnlite.models) with an nnlite-train command, so a user's project trains from its own
    directory and keeps its own names (tests/test_packaging.py checks the package list)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert {"nnlite", "nnlite.train", "nnlite.models"} <= set(setuptools["packages"])
    assert not any(p.split(".")[0] in ("train", "models") for p in setuptools["packages"])
    assert project["project"]["scripts"]["nnlite-train"] == "nnlite.train.__main__:run"


def _events(directory: Path) -> list:
    """The Event protos of TensorBoard event files (TFRecord: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            n = int.from_bytes(data[i : i + 8], "little")
            events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 12 + n + 4
    return events


def test_tensorboard_scalars_match_metrics_jsonl(one_device):
    run = one_device  # 10 steps, log.tensorboard=true
    scalars = {
        (v.tag, e.step): v.simple_value
        for e in _events(run.run_dir / "tensorboard")
        for v in e.summary.value
    }
    for record in metrics(run.run_dir):
        for k in ("loss", "accuracy"):
            assert scalars[(f"{record['split']}/{k}", record["step"])] == pytest.approx(record[k])
    assert scalars[("train/lr", 10)] == pytest.approx(1e-3)


def test_plot_is_titled_with_the_run_and_the_losss_unit(project, ref_run):
    from train.report.console import plot_labels

    loaded = train.load_run(ref_run)

    class R:
        cfg, model = loaded.config, loaded.model

    assert plot_labels(R) == ("res (usermodels:ResMLP)", "cross-entropy, nats")
