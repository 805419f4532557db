"""A user's own project, outside the repository, with its own ``models/`` package: its
model, a map-style data source, a callback that stops at a validation-loss plateau, an
optax chain from a factory; trained with ``python -m train`` (a checkout on the path), ``python -m nnlite.train`` (the
install's name) and ``train.fit``; killed mid-run and resumed bit-identically, callback
state included; equal to one device under shard_map and fsdp."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from _common import write_files
from _xla import xla_flags

import nnlite as nl

ROOT = Path(__file__).resolve().parents[1]

FILES = {
    "models/__init__.py": "",
    # a package named like the shipped one: it must keep its name
    "models/net.py": """
        import jax
        import nnlite as nl


        class Net(nl.Module):
            in_features: int
            num_classes: int
            hidden: int = 32
            task: str = "classification"

            def init(self, key):
                return nl.ParamsDict(mlp=self.mlp.init(key))

            @property
            def mlp(self):
                return nl.FFN(self.in_features, (self.hidden,), self.num_classes)

            def __call__(self, params, x, *, key=None):
                return self.mlp(params.mlp, x)
        """,
    "parts.py": """
        import os
        import signal

        import numpy as np
        import optax


        class Plateau:
            '''Stop when the validation loss has not improved by min_delta for patience
            evaluations; SIGKILL itself at step KILL_AT (a crash mid-run).'''

            def __init__(self, patience: int = 2, min_delta: float = 0.02):
                self.patience, self.min_delta = patience, min_delta
                self.best, self.bad, self.history = None, 0, []

            def on_step_end(self, loop, step, metrics):
                if os.environ.get("KILL_AT") == str(step):
                    os.kill(os.getpid(), signal.SIGKILL)

            def on_eval_end(self, loop, step, metrics):
                self.history.append([step, metrics["loss"]])
                if self.best is None or metrics["loss"] < self.best - self.min_delta:
                    self.best, self.bad = metrics["loss"], 0
                    return
                self.bad += 1
                if self.bad >= self.patience:
                    loop.stop(f"plateau: best loss {self.best:.4f}")

            def state_dict(self):
                return {"best": self.best, "bad": self.bad, "history": self.history}

            def load_state_dict(self, state):
                self.best, self.bad = state["best"], state["bad"]
                self.history = state["history"]


        def make_optimizer(learning_rate: float, clip: float = 1.0):
            return optax.chain(optax.clip_by_global_norm(clip), optax.adam(learning_rate))


        class Blobs:
            '''A map-style source: len and a batch of indices -> (x, y), rows made from a
            seeded table, labelled by which of 4 centres is nearest.'''

            num_classes = 4

            def __init__(self, n: int, seed: int):
                rng = np.random.default_rng(seed)
                self.centres = rng.normal(size=(4, 16)).astype(np.float32)
                self.x = rng.normal(size=(n, 16)).astype(np.float32) + self.centres[np.arange(n) % 4]
                d = ((self.x[:, None, :] - self.centres[None]) ** 2).sum(-1)
                self.y = d.argmin(1).astype(np.int32)

            def __len__(self):
                return len(self.x)

            def __getitem__(self, indices):
                return self.x[indices], self.y[indices]


        def make_data(n: int = 2000, seed: int = 0):
            return Blobs(n, seed)
        """,
    "cfg.yaml": """
        name: run
        model: {name: "models.net:Net"}
        data: {name: "parts:make_data", options: {n: 2000}, placement: host}
        optimizer: {name: "parts:make_optimizer", learning_rate: 0.01}
        callbacks: [{name: "parts:Plateau", patience: 2}]
        train: {steps: 2000, batch_size: 64, eval_every: 50, log_every: 50}
        checkpoint: {every: 50, keep: 2}
        log: {progress: false, plot: false}
        """,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_files(tmp_path_factory.mktemp("userproj"), FILES)


def run(project: Path, *args, devices: int = 1, module: str = "train", **env):
    """``python -m <module> --config cfg.yaml args`` from the project's directory; the
    checkout is on the path the way a user's checkout would be (PYTHONPATH)."""
    full = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(devices), **env)
    return subprocess.run(
        [sys.executable, "-m", module, "--config", "cfg.yaml", *args],
        cwd=project,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def last_checkpoint(run_dir: Path):
    """The newest checkpoint: its path, its tensors by key, its metadata."""
    path = sorted((run_dir / "checkpoints").glob("ckpt_*"))[-1]
    return path, safetensors.numpy.load_file(str(path)), nl.load_metadata(path)


@pytest.fixture(scope="module")
def ref_stop(project) -> str:
    """The project's run to its plateau (runs/ref), under the install's name; its
    "stopped early at step N: plateau: ..." line."""
    ref = run(project, "--set", "name=ref", module="nnlite.train")  # the installed name
    assert ref.returncode == 0, ref.stderr
    return next(ln for ln in ref.stdout.splitlines() if ln.startswith("stopped early"))


def test_the_project_trains_stops_at_a_plateau_and_resumes_exactly_after_a_kill(project, ref_stop):
    stop = ref_stop
    stop_step = int(stop.split("at step ")[1].split(":")[0])
    assert 100 < stop_step < 2000, stop

    killed = run(project, "--set", "name=killed", KILL_AT=str(stop_step - 50))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run(project, "--set", "name=killed")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {stop_step - 100}" in resumed.stdout
    assert stop in resumed.stdout

    path_a, a, meta_a = last_checkpoint(project / "runs" / "ref")
    path_b, b, meta_b = last_checkpoint(project / "runs" / "killed")
    assert path_a.name == path_b.name == f"ckpt_{stop_step:08d}.safetensors"
    assert sorted(a) == sorted(b) and any(k.startswith("opt_state") for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    cb_a, cb_b = json.loads(meta_a["callbacks"]), json.loads(meta_b["callbacks"])
    assert cb_a == cb_b and len(cb_a["0:parts:Plateau"]["history"]) == stop_step // 50
    assert meta_a["stopped"] == meta_b["stopped"] == stop.split(": ", 1)[1]
    # (a rerun of ref says so and trains nothing: test_train_fit_takes_callback_and_optimizer_objects's
    # process runs it, one interpreter fewer)


def test_train_fit_takes_callback_and_optimizer_objects(project, ref_stop):
    # One process (the project's models package is not the shipped one that this one
    # imported): train.fit, then the CLI's main in it (python -m train runs this main; its
    # exit status from a shell: tests/test_train.py's test_cli_bad_input_exits_2_without_traceback),
    # twice: the refusal below, and a rerun of the plateau test's finished run (ref_stop)
    code = textwrap.dedent(
        """
        import contextlib, io, json, optax
        import nnlite.train as train
        from nnlite.train.__main__ import main
        from models.net import Net
        from parts import Plateau, make_data

        cb = Plateau(patience=2)
        run = train.fit(
            Net(16, 4),
            {"train": {"steps": 2000, "batch_size": 64,
             "eval_every": 50, "log_every": 50}, "log": {"progress": False, "plot": False}},
            overrides={"name": "fit"},
            callbacks=[cb],
            optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.01)),
            data=make_data(2000, 0),
            echo=lambda *a: None,
        )
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            cli = main(["--config", "cfg.yaml", "--set", "name=fit", "--set", "optimizer.name=given"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            again = main(["--config", "cfg.yaml", "--set", "name=ref"])
        print(json.dumps({"stopped": run.summary.get("stopped"), "step": run.step,
                          "history": cb.history, "cli": [cli, err.getvalue()],
                          "again": [again, out.getvalue()]}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env=dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=xla_flags(1)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["stopped"].startswith("plateau") and got["step"] == got["history"][-1][0]
    config = (project / "runs" / "fit" / "config.yaml").read_text()
    assert "name: given" in config  # the optimizer object, named for what it is
    # the CLI refuses to resume it without the object, in one line
    code, err = got["cli"]
    assert code == 2 and err.count("\n") == 1 and "train.fit(optimizer=...)" in err, err
    # a rerun of a run that stopped early says so, and trains nothing
    code, out = got["again"]
    assert code == 0 and "stopped early at step" in out and "nothing to train" in out, out


TRAIN_100 = ["--set", "train.steps=100", "--set", "callbacks=[]"]


@pytest.fixture(scope="module")
def one_device(project) -> Path:
    """100 steps on one device: the reference of both strategies' runs."""
    one = run(project, *TRAIN_100, "--set", "name=one")
    assert one.returncode == 0, one.stderr
    return project / "runs" / "one"


@pytest.mark.parametrize("strategy", ["shard_map", "fsdp"])
def test_the_project_under_parallel_strategies_equals_one_device(project, one_device, strategy):
    many = run(
        project,
        *TRAIN_100,
        "--set",
        f"name={strategy}",
        "--set",
        f"parallel.strategy={strategy}",
        devices=8,
    )
    assert many.returncode == 0, many.stderr
    a, b = (
        dict(nl.load(sorted((d / "checkpoints").glob("ckpt_*"))[-1], subtree="params").items())
        for d in (one_device, project / "runs" / strategy)
    )
    assert a and sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=2e-5, err_msg=k)
