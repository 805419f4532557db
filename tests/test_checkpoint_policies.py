"""Early stopping (``train.early_stopping``), the best k checkpoints (``checkpoint.keep_best``,
``load_run(which="best")``, ``--best``), the time cadence (``checkpoint.every_minutes``) and
asynchronous checkpoint writes (``checkpoint.async``), for a model in a user's own file,
under ``none`` and ``fsdp``: a SIGKILL during an async write and an interrupted fsdp run
both resume bit-identically to an uninterrupted synchronous run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _inject
import numpy as np
import pytest
import safetensors.numpy
from _xla import xla_flags

import nnlite as nl
import train
from train.checkpoint import store, writer
from train.checkpoint.rundir import TIMING_KEYS
from train.errors import ConfigError, UserCodeError

ROOT = Path(__file__).resolve().parents[1]

MODEL = '''
import nnlite as nl


class Net(nl.Module):
    """A user's classifier: Linear -> relu -> Linear."""

    in_features: int
    num_classes: int
    hidden: int = 32

    task = "classification"

    def setup(self):
        self.ffn = nl.FFN(self.in_features, (self.hidden,), self.num_classes, "relu")

    def __call__(self, params, x):
        return self.ffn(params.ffn, x)
'''

# Stops early (accuracy plateaus) well before train.steps; evaluates and checkpoints every 5.
CONFIG = """
name: run
model: {{name: "usermodel:Net"}}
data: {{name: npz, path: {data}}}
optimizer: {{learning_rate: 0.02}}
train:
  steps: 400
  batch_size: 32
  eval_every: 5
  log_every: 5
  early_stopping: {{monitor: accuracy, mode: max, patience: 3, min_delta: 0.0}}
  ema_decay: 0.9  # the EMA's state rides in every checkpoint the kill tests compare
checkpoint: {{every: 5, keep: 2, keep_best: 2, monitor: accuracy, mode: max, async: {async_}}}
log: {{progress: false, plot: false, dir: {runs}}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory, npz) -> Path:
    root = tmp_path_factory.mktemp("ckproj")
    (root / "usermodel.py").write_text(MODEL)
    data = npz.split("=", 1)[1]
    for async_ in ("true", "false"):
        text = CONFIG.format(data=data, async_=async_, runs=root / "runs")
        (root / f"{async_}.yaml").write_text(text)
    return root


def fit(project: Path, cfg: str, quiet=True, **kw):
    """``train.fit`` of a project config (its model imported from the project's directory)."""
    if "echo" not in kw and quiet:
        kw["echo"] = lambda *a: None
    return train.fit(None, project / cfg, **kw)


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def tensors(path: Path) -> dict:
    if path.is_dir():  # a sharded checkpoint, read whole
        flat = {}
        tree = nl.load(path)
        for k, v in tree.items():
            flat[k] = np.asarray(v)
        return flat
    return safetensors.numpy.load_file(str(path))


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb) and ta
    for k in ta:
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    ma, mb = nl.load_metadata(a), nl.load_metadata(b)
    for key in ("callbacks", "best_checkpoints", "stopped", "log_window", "data_position"):
        assert ma.get(key) == mb.get(key), key


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS} for x in lines]


@pytest.fixture(scope="module")
def reference(project):
    """The uninterrupted, synchronous run: it stops early."""
    return fit(project, "false.yaml", overrides={"name": "ref"}, resume="fresh")


# -- the config and its errors -------------------------------------------------------------
@pytest.mark.parametrize(
    "override, message",
    [
        ({"train.early_stopping": True}, "train.early_stopping: expected a mapping {monitor"),
        ({"train.early_stopping.patience": 0}, "train.early_stopping.patience must be >= 1"),
        ({"train.early_stopping.min_delta": -1}, "train.early_stopping.min_delta must be >= 0"),
        ({"train.early_stopping.mode": "up"}, "train.early_stopping.mode: 'up' is not one of"),
        ({"checkpoint.keep_best": -1}, "checkpoint.keep_best must be >= 0"),
        ({"checkpoint.every_minutes": -2}, "checkpoint.every_minutes must be >= 0"),
        (
            {"checkpoint.keep_best": 0, "checkpoint.monitor": "accuracy"},
            "checkpoint.monitor ranks the best checkpoints, but",
        ),
        ({"checkpoint.async": "yes"}, "checkpoint.async: expected bool, got 'yes'"),
        ({"checkpoint.asynch": True}, "unknown key 'checkpoint.asynch'; valid keys in"),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(project, override, message):
    with pytest.raises(ConfigError, match=None) as e:
        fit(project, "true.yaml", overrides=override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_monitor_the_evaluation_does_not_log_is_refused_before_anything_is_written(project):
    for override, key in [
        ({"train.early_stopping.monitor": "acc"}, "train.early_stopping.monitor='acc'"),
        ({"checkpoint.monitor": "bits_per_char"}, "checkpoint.monitor='bits_per_char'"),
    ]:
        with pytest.raises(ConfigError) as e:
            fit(project, "true.yaml", overrides={"name": "badmon", **override})
        assert str(e.value) == (
            f"{key} is not a metric the evaluation logs; it logs accuracy, loss"
        )
    assert not (project / "runs" / "badmon").exists()


# -- one device: early stopping, best k, async, a SIGKILL mid-write ------------------------
def test_early_stopping_stops_cleanly_and_a_rerun_says_so(project, reference):
    r = reference
    stop = r.summary["stopped"]
    assert stop.startswith("early stopping: accuracy has not improved on ")
    assert stop.endswith("for 3 evaluations (patience 3)") and 20 < r.step < 400
    evals = [x for x in records(r.run_dir) if x["split"] == "test"]
    best_acc = max(x["accuracy"] for x in evals)
    # the 3 evaluations after the best one did not beat it, and that is where it stopped
    first_best = next(x["step"] for x in evals if x["accuracy"] == best_acc)
    assert r.step == first_best + 15 and evals[-1]["step"] == r.step
    assert (
        nl.load_metadata(r.run_dir / "checkpoints" / f"ckpt_{r.step:08d}.safetensors")["stopped"]
        == stop
    )
    lines = []
    again = fit(project, "false.yaml", overrides={"name": "ref"}, echo=lines.append)
    assert again.step == r.step and again.summary["stopped"] == stop
    assert any(f"stopped early at step {r.step} of 400: {stop}; nothing" in x for x in lines)


def test_best_checkpoints_survive_the_rotation_and_load_by_which(project, reference):
    r = reference
    evals = [x for x in records(r.run_dir) if x["split"] == "test"]
    ranked = sorted(evals, key=lambda x: (-x["accuracy"], x["step"]))[:2]
    best_steps = {x["step"] for x in ranked}
    newest = {r.step - 5, r.step}  # checkpoint.keep: 2
    assert checkpoints(r.run_dir) == [
        f"ckpt_{s:08d}.safetensors" for s in sorted(best_steps | newest)
    ]
    best = train.load_run(r.run_dir, which="best")
    assert best.step == ranked[0]["step"] and train.load_run(r.run_dir).step == r.step
    assert best.step < r.step - 5  # kept although older than the newest 2
    with pytest.raises(
        ConfigError, match="which must be one of 'latest', 'last', 'best', got 'top'"
    ):
        train.load_run(r.run_dir, which="top")


def test_predict_and_sample_take_best(project, reference, npz, tmp_path, capsys):
    from train import predict, sample

    run_dir = str(reference.run_dir)
    out = tmp_path / "p.npz"
    assert predict.main(["--run", run_dir, "--data", npz.split("=", 1)[1], "--best",
                         "--out", str(out)]) == 0  # fmt: skip
    best = train.load_run(run_dir, which="best")
    data = np.load(npz.split("=", 1)[1])
    want = np.argmax(best.predict(data["x"], preprocessed=True), axis=-1)
    np.testing.assert_array_equal(np.load(out)["predictions"], want)
    assert sample.main(["--run", run_dir, "--best"]) == 2  # loaded, but not a language model
    assert f"{best.checkpoint}: no vocabulary" in capsys.readouterr().err
    plain = fit(project, "false.yaml", overrides={"name": "nobest", "train.steps": 5,
                                                  "checkpoint.keep_best": 0,
                                                  "checkpoint.monitor": "loss",
                                                  "checkpoint.mode": "min"},
                resume="fresh")  # fmt: skip
    assert predict.main(["--run", str(plain.run_dir), "--data", npz.split("=", 1)[1],
                         "--best"]) == 2  # fmt: skip
    assert "kept no best checkpoints (its config has checkpoint.keep_best: 0)" in (
        capsys.readouterr().err
    )


def spawn(project: Path, *args, pause: float) -> subprocess.Popen:
    """``python -m train`` in ``project``, every checkpoint write paused twice for
    ``pause`` s (tests/_inject.py)."""
    full = _inject.env(dict(os.environ, XLA_FLAGS=xla_flags(1)), pause=pause)
    return subprocess.Popen(
        [sys.executable, "-m", "_inject", "--config", "true.yaml", *args],
        cwd=project,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_during_an_async_write_resumes_bit_identically(project, reference):
    """The async run is killed while a checkpoint write is half done on its thread (the
    test hook pauses every write), then resumed: it ends exactly as the synchronous,
    uninterrupted run (its params, best checkpoints, early-stopping state, metrics)."""
    run_dir = project / "runs" / "run"
    ckpt_dir = run_dir / "checkpoints"
    proc = spawn(project, "--fresh", pause=0.3)
    try:
        while proc.poll() is None:
            tmp = [p for p in ckpt_dir.glob("ckpt_*.tmp")] if ckpt_dir.exists() else []
            if any(int(p.name[5:13]) >= 15 for p in tmp):
                break
            time.sleep(0.01)
        time.sleep(0.1)
        proc.kill()
        proc.communicate()
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert list(ckpt_dir.glob("*.tmp")), "the kill must land during a write"
    # resumed in this process (a new process all the same; the reference's programs are
    # compiled here already): the killed run's files are all it has
    lines = []
    resumed = fit(project, "true.yaml", echo=lines.append)
    out = "\n".join(map(str, lines))
    assert "resuming at step" in out
    r = reference
    assert resumed.step == r.step
    assert f"stopped early at step {r.step}: {r.summary['stopped']}" in out
    assert checkpoints(run_dir) == checkpoints(r.run_dir)
    for name in checkpoints(r.run_dir):  # the best k and the newest, written async
        assert_same_checkpoint(ckpt_dir / name, r.run_dir / "checkpoints" / name)
    assert records(run_dir) == records(r.run_dir)


def test_an_error_in_the_writer_thread_is_one_line_and_not_lost(project, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", "ckpt_00000005.safetensors")

    monkeypatch.setattr(store, "save", full_disk)
    with pytest.raises(writer.CheckpointWriteError) as e:
        fit(project, "true.yaml", overrides={"name": "full", "train.steps": 20}, resume="fresh")
    assert str(e.value) == (
        "the checkpoint write of step 5 failed on the writer thread (checkpoint.async): "
        "OSError: No space left on device: ckpt_00000005.safetensors; the checkpoints "
        "written before it are intact: rerun to resume from the newest"
    )


def test_writer_waits_bounded_and_keeps_one_write_in_flight(monkeypatch):
    monkeypatch.setattr(writer, "WAIT_FLOOR_S", 0.2)
    w = writer.Writer(background=True)
    w.submit(1, lambda: (time.sleep(0.05), Path("a"))[1])
    with pytest.raises(RuntimeError, match="still in flight"):
        w.submit(2, lambda: Path("b"))
    assert w.collect(wait=True) == [(1, Path("a"))] and not w.in_flight()
    w.submit(3, lambda: time.sleep(2))
    t0 = time.monotonic()
    # the bound: max(floor, 20 x the slowest write so far, 0.05 s)
    with pytest.raises(writer.CheckpointWriteError, match="step 3 did not finish within 1 s"):
        w.collect(wait=True)
    assert 0.9 < time.monotonic() - t0 < 1.9


# -- fsdp: the same features, an interrupted run resumed exactly -----------------------------
class Crash(Exception):
    pass


class Interrupt:
    """Ends the run abruptly at step ``at`` (None: never), as a crash would."""

    def __init__(self, at=None):
        self.at = at

    def on_step_end(self, loop, step, metrics):
        if step == self.at:
            raise Crash


def test_fsdp_early_stopping_best_k_async_and_every_minutes_resume_exactly(project, reference):
    over = {
        "parallel.strategy": "fsdp",
        "parallel.fsdp_min_bytes": 0,
        "checkpoint.every": 0,
        "checkpoint.every_minutes": 1e-6,  # due at every boundary
    }
    ref = fit(project, "false.yaml", overrides={"name": "fsdp_ref", **over}, resume="fresh",
              callbacks=[Interrupt()])  # fmt: skip
    assert ref.summary["stopped"].startswith("early stopping: accuracy")
    # every boundary checkpointed (every_minutes), the newest 2 and the best 2 kept
    evals = [x for x in records(ref.run_dir) if x["split"] == "test"]
    best = {x["step"] for x in sorted(evals, key=lambda x: (-x["accuracy"], x["step"]))[:2]}
    names = [f"ckpt_{s:08d}.shards" for s in sorted(best | {ref.step - 5, ref.step})]
    assert checkpoints(ref.run_dir) == names
    np.testing.assert_allclose(  # the same training as one device
        [x["loss"] for x in evals], [x["loss"] for x in records(reference.run_dir)
                                     if x["split"] == "test"][: len(evals)], rtol=1e-4)  # fmt: skip
    name = {"name": "fsdp_cut", **over}
    with pytest.raises(UserCodeError, match="in on_step_end: Crash"):  # docs/faults.md
        fit(project, "true.yaml", overrides=name, resume="fresh", callbacks=[Interrupt(20)])
    cut = project / "runs" / "fsdp_cut"
    assert max(store.step_of(p) for p in store.list_checkpoints(cut / "checkpoints")) < 20 + 5
    done = fit(project, "true.yaml", overrides=name, callbacks=[Interrupt()])
    assert done.step == ref.step and done.summary["stopped"] == ref.summary["stopped"]
    assert checkpoints(cut) == names
    for n in names:
        assert_same_checkpoint(cut / "checkpoints" / n, ref.run_dir / "checkpoints" / n)
    assert records(cut) == records(ref.run_dir)
    assert (
        train.load_run(cut, which="best").step
        == min(evals, key=lambda x: (-x["accuracy"], x["step"]))["step"]
    )


def test_early_stopping_resumed_with_another_monitor_counts_it_from_the_resume():
    from train.callbacks import EarlyStopping

    saved = EarlyStopping("accuracy", "max", patience=3)
    saved.best, saved.bad = 0.9, 2
    same, other = EarlyStopping("accuracy", "max", patience=5), EarlyStopping("loss", "min")
    same.load_state_dict(saved.state_dict())
    other.load_state_dict(saved.state_dict())
    assert (same.best, same.bad) == (0.9, 2) and (other.best, other.bad) == (None, 0)
