"""Every documented command, from a user's own project directory as after ``pip install``:
a project with its own ``models/`` package and its own ``train.py`` runs ``nnlite-train``
(train, a SIGTERM and the resume command it prints, prepare, sample, predict, lr-find,
verify) without the checkout on its path, and no command nnlite prints there fails. A
config's relative paths are read from its own directory, then the current one, and every
"not found" says which base it used. The trainer's own texts name only commands that run
there (``nnlite-train``), never the checkout's ``python -m train``."""

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _common import write_files
from _xla import xla_flags

from train.__main__ import COMMANDS, main, resume_command

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # where pip put nnlite-train

FILES = {
    "models/__init__.py": "",
    "models/net.py": """
        import nnlite as nl


        class Net(nl.Module):
            in_features: int
            num_classes: int
            task = "classification"

            def setup(self):
                self.mlp = nl.FFN(self.in_features, (8,), self.num_classes)

            def __call__(self, params, x):
                return self.mlp(params.mlp, x)
        """,
    # the user's own script named like the trainer: nothing of nnlite's may run it
    "train.py": 'raise SystemExit("the project\'s own train.py ran")\n',
    "parts.py": """
        import os
        import signal


        class TermAt:
            '''SIGTERM this process at step TERM_AT (a preemption mid-run).'''

            def on_step_end(self, loop, step, metrics):
                if os.environ.get("TERM_AT") == str(step):
                    os.kill(os.getpid(), signal.SIGTERM)
        """,
    # data.path d.npz lies beside the config, not in the directory the commands run in
    "configs/c.yaml": """
        name: c
        model: {name: "models.net:Net"}
        data: {name: npz, path: d.npz}
        callbacks: [{name: "parts:TermAt"}]
        train: {steps: 8, batch_size: 16, eval_every: 4, log_every: 2}
        checkpoint: {every: 2}
        log: {progress: false, plot: false}
        """,
    # tok/ is in the project's directory: ../tok from the config's
    "configs/lm.yaml": """
        name: lm
        model: {name: gpt, n_layer: 1, n_head: 2, n_embd: 8, context: 8}
        data: {name: tokens, path: ../tok, eval_windows: 4}
        train: {steps: 2, batch_size: 4, eval_every: 2}
        log: {progress: false, plot: false}
        """,
    "text.txt": "the quick brown fox jumps over the lazy dog. " * 40,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = write_files(tmp_path_factory.mktemp("own_project"), FILES)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    np.savez(root / "configs" / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    return root


def user_env(**extra) -> dict:
    """The environment of a user's shell after pip install: nnlite-train on PATH, no
    checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "XLA_FLAGS": xla_flags(1), **extra}


def shell(project: Path, argv: list[str], **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=project, env=user_env(**extra), capture_output=True, text=True, timeout=300
    )


# Run in the project's directory by one interpreter (``nnlite-train``'s own ``main``, as
# its entry point calls it; one JAX start-up for all of them): each documented command's
# exit status and output, and what ``python -m nnlite.train[.X]`` does there.
DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys
    import nnlite.train as train
    from nnlite.train.__main__ import main

    assert sys.modules["nnlite.train"] is train and hasattr(train, "Callback")
    results = []
    for argv in json.loads(sys.argv[1]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if argv[0] == "-m":  # python -m MODULE ARGS (as a fresh process runs it)
                    for name in (argv[1], argv[1] + ".__main__"):
                        if name != "nnlite.train":
                            sys.modules.pop(name, None)
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                    code = 0
                else:
                    code = main(argv)
            except SystemExit as e:
                code = e.code or 0
        results.append([argv, code, out.getvalue()])
    print(json.dumps(results))
    """
)

DRIVEN = [
    ["predict", "--run", "runs/c", "--data", "configs/d.npz"],
    ["verify", "runs/c"],
    ["lr-find", "--config", "configs/c.yaml", "--steps", "30", "--set", "callbacks=[]"],
    ["prepare", "--input", "text.txt", "--out", "tok", "--tokenizer", "char"],
    ["--config", "configs/lm.yaml"],
    ["sample", "--run", "runs/lm", "--prompt", "the ", "--tokens", "5"],
    *[[name, "--help"] for name in COMMANDS],
    ["-m", "nnlite.train", "--help"],
    ["-m", "nnlite.train.predict", "--help"],
]


@pytest.fixture(scope="module")
def commands(project):
    """SIGTERM mid-run, the printed resume command run as printed, then the other
    commands: ``[(argv, exit status, output)]``."""
    first = shell(project, ["nnlite-train", "--config", "configs/c.yaml"], TERM_AT="4")
    hint = next((ln for ln in first.stderr.splitlines() if "resume with: " in ln), "")
    printed = shlex.split(hint.split("resume with: ")[-1]) if hint else ["(none)"]
    resumed = shell(project, printed, NNLITE_CPU_MEMORY="keep")  # its banner says so
    driven = shell(project, [sys.executable, "-c", DRIVER, json.dumps(DRIVEN)])
    assert driven.returncode == 0, driven.stderr[-3000:]
    runs = [
        (["nnlite-train", "--config", "configs/c.yaml"], first.returncode, first.stderr),
        (printed, resumed.returncode, resumed.stdout + resumed.stderr),
    ]
    return runs + [tuple(r) for r in json.loads(driven.stdout.strip().splitlines()[-1])]


def test_a_preempted_run_resumes_with_the_command_it_prints(commands):
    (_, code, err), (printed, resumed, out) = commands[:2]
    assert code == 3 and "preempted by SIGTERM" in err, err
    assert printed == ["nnlite-train", "--config", "configs/c.yaml"], err
    assert resumed == 0 and "resuming at step" in out, out
    if sys.platform.startswith("linux"):  # NNLITE_CPU_MEMORY=keep: freed memory kept (glibc)
        assert "host memory: freed blocks kept for the next step" in out, out


def test_every_command_runs_from_the_projects_directory(project, commands):
    for argv, code, out in commands[2:]:
        assert code == 0, (argv, out)
    by = {" ".join(map(str, argv)): out for argv, _, out in commands}
    assert "accuracy" in by["predict --run runs/c --data configs/d.npz"]
    assert (project / "runs" / "c" / "predictions.npz").is_file()
    kept = sorted((project / "runs" / "c" / "checkpoints").glob("ckpt_*"))
    assert len(kept) > 1 and by["verify runs/c"].splitlines() == [
        f"intact: {p.relative_to(project)}" for p in kept
    ]
    assert "suggested learning rate" in by[" ".join(DRIVEN[2])]
    assert (project / "tok" / "meta.json").is_file()
    assert (project / "runs" / "lm" / "checkpoints").is_dir()
    for name in COMMANDS:
        assert by[f"{name} --help"].startswith(f"usage: nnlite-train {name}"), name
    assert by["-m nnlite.train --help"].startswith("usage: nnlite-train --config FILE")


def test_no_command_printed_there_fails(commands):
    """Every command the outputs name is nnlite-train's, with a command it has."""
    for argv, _, out in commands:
        assert "python -m train" not in out, (argv, out)
        for m in re.finditer(r"nnlite-train (\S+)", out):
            word = m.group(1).strip("`'\",.;:)")
            known = word in COMMANDS or word == "COMMAND" or word.startswith(("-", "{"))
            assert known, (argv, out)


def test_a_bad_command_is_one_line(capsys):
    assert main(["lr_find", "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'lr_find'" in err, err
    assert "did you mean nnlite-train lr-find?" in err
    assert main(["cfg.yaml"]) == 2
    assert "to train, nnlite-train --config cfg.yaml" in capsys.readouterr().err


def test_the_resume_command_is_the_installed_one():
    argv = ["--config", "my dir/c.yaml", "--fresh", "--set", "train.steps=9"]
    assert resume_command(argv) == "nnlite-train --config 'my dir/c.yaml' --set train.steps=9"


def test_verify_names_a_damaged_checkpoint(tmp_path, capsys):
    import nnlite as nl
    from train.verify import main as verify

    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    good = nl.save(ckpt / "ckpt_00000001.safetensors", {"w": np.arange(64.0)})
    bad = nl.save(ckpt / "ckpt_00000002.safetensors", {"w": np.arange(64.0)})
    data = bytearray(bad.read_bytes())
    data[-8] ^= 0xFF  # a flipped byte in the tensor's data
    bad.write_bytes(bytes(data))
    assert verify([str(tmp_path / "run")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"intact: {good}" and out[1].startswith("damaged: ") and bad.name in out[1]
    assert verify([str(good)]) == 0
    assert verify([str(tmp_path / "nope")]) == 2
    assert "relative" not in capsys.readouterr().err  # an absolute path names its base


# -- paths in a config --------------------------------------------------------------------
def test_a_configs_relative_paths_are_read_from_its_directory_then_the_current_one(
    tmp_path, monkeypatch
):
    from train.config import load_config

    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "beside.npz").write_bytes(b"")
    (tmp_path / "here.npz").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfgs" / "c.yaml"

    def path_of(value: str, *overrides: str) -> str:
        config.write_text(f"data: {{name: npz, path: {value}}}\n")
        return load_config(config, list(overrides)).data.path

    assert path_of("beside.npz") == os.path.join("cfgs", "beside.npz")  # the config's dir
    assert path_of("here.npz") == "here.npz"  # else the current one (as before)
    assert path_of("x.npz", "data.path=here.npz") == "here.npz"  # --set: the current one
    assert path_of(str(tmp_path / "here.npz")) == str(tmp_path / "here.npz")


def test_a_hugging_face_directory_follows_the_same_rule(tmp_path, monkeypatch):
    from train.config import _resolve_paths

    (tmp_path / "cfgs" / "smollm").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    raw = {"model": {"name": "hf:smollm", "path": "smollm"}}
    _resolve_paths(raw, {}, tmp_path / "cfgs", "cfgs/c.yaml")
    smollm = os.path.join("cfgs", "smollm")
    assert raw["model"] == {"name": f"hf:{smollm}", "path": smollm}
    given = {"model.name": "--set model.name=hf:smollm", "model": "--set model.name=hf:smollm"}
    raw = {"model": {"name": "hf:smollm"}}
    _resolve_paths(raw, given, tmp_path / "cfgs", "cfgs/c.yaml")
    assert raw["model"] == {"name": "hf:smollm"}  # --set: the current directory's


def test_not_found_states_the_base_it_used(tmp_path, monkeypatch, capsys):
    (tmp_path / "cfgs").mkdir()
    config = tmp_path / "cfgs" / "c.yaml"
    config.write_text("data: {name: npz, path: gone.npz}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "cfgs/c.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"not found in the config file's directory {tmp_path / 'cfgs'}" in err
    assert f"nor in the current directory {tmp_path}" in err
    assert "read from the file's directory, then the current directory" in err
    # a path given on the command line: the current directory
    assert main(["--config", "cfgs/c.yaml", "--set", "data.path=gone.npz"]) == 2
    err = capsys.readouterr().err
    assert f"file not found (relative to the current directory {tmp_path})" in err, err
    assert main(["--config", "nope.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"nope.yaml (relative to the current directory {tmp_path})" in err, err


def test_the_trainers_texts_name_only_installed_commands():
    """``python -m train`` runs only in a checkout: nnlite's messages, --help texts and
    docs write ``nnlite-train``, and say once where the checkout's spelling is the same."""
    found = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "train").rglob("*.py"),
                 *(ROOT / "nnlite").rglob("*.py")]:  # fmt: skip
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            near = " ".join(lines[max(n - 2, 0) : n])  # this line and the one before
            if re.search(r"python -m train\b", line) and "checkout" not in near:
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found
    readme = (ROOT / "README.md").read_text()
    assert "In a checkout,\n`python -m train --config FILE` is the same command" in readme


def test_an_ejected_script_names_no_absolute_directory(tmp_path, monkeypatch, capsys):
    """The script finds the user's modules relative to itself, then from where it runs."""
    (tmp_path / "mods.py").write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp
            import nnlite as nl


            def twice_vjp(x, dret):
                return 2.0 * dret


            @nl.hand_rule(twice_vjp)
            def twice(x):
                return 2.0 * x


            class Net(nl.Module):
                in_features: int
                num_classes: int
                task = "classification"

                def setup(self):
                    self.inp = nl.Linear(self.in_features, self.num_classes)

                def __call__(self, params, x):
                    return twice(self.inp(params.inp, x))
            """
        )
    )
    (tmp_path / "c.yaml").write_text(
        'model: {name: "mods:Net"}\ndata: {name: npz, path: d.npz}\nloss: {grad: manual}\n'
        "train: {steps: 3, batch_size: 8}\n"
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "c.yaml", "--eject", "out/ejected"]) == 0, capsys.readouterr().err
    src = (tmp_path / "out" / "ejected" / "train_ejected.py").read_text()
    assert "from mods import twice" in src and str(tmp_path) not in src
    assert "sys.path[:0] = [os.path.join(HERE, '../..'), os.getcwd()]" in src


def test_the_launchers_processes_run_its_own_package():
    """``--processes N`` starts the trainer it belongs to (``nnlite.train`` installed), not
    whatever ``train`` the user's directory holds."""
    import importlib

    for package in ("train", "nnlite.train"):
        launch = importlib.import_module(f"{package}.parallel.launch")
        assert launch.TRAINER == package


@pytest.mark.parametrize(
    "env,value,expected",
    [
        ("NNLITE_CPU_GEMM", "blas", "expected one of auto, mkl, xla"),
        ("NNLITE_CPU_ATTENTION", "bogus", "expected one of fused, xla"),
        ("NNLITE_CPU_MEMORY", "fast", "expected one of auto, keep, release"),
    ],
)
def test_a_bad_kernel_switch_is_one_line_before_anything_runs(
    env, value, expected, tmp_path, monkeypatch, capsys
):
    # the digits MLP reaches neither kernel: the switch is still checked, not ignored
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(env, value)
    config = Path(__file__).parents[1] / "configs" / "digits_mlp.yaml"
    assert main(["--config", str(config), "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {env}={value!r}: {expected}\n"
    assert not (tmp_path / "runs").exists()
