"""The user's own code failing (docs/faults.md): a callback, logger or data source that
raises is one line naming the user's file and line, exit 2 before the first step and exit
1 during the run (the newest checkpoint kept, the traceback in the run's error.log); a
non-finite value from a user's data source is named before it reaches a step."""

import json
import os
import re
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import user_module

from train import faults
from train.__main__ import main
from train.callbacks import Callback
from train.checkpoint.rundir import TIMING_KEYS
from train.data.dataset import epoch_order
from train.data.source import DataError

ROOT = Path(__file__).resolve().parents[1]

USER = '''
import train


class Boom(train.Callback):
    def on_fit_start(self, loop):
        raise ValueError("boom")


def no_optimizer(learning_rate: float = 0.1):
    raise ValueError("no optimizer")


def no_data():
    raise ValueError("no data")


def no_metric(outputs, labels):
    raise ValueError("no metric")


class FailingLog:
    """Raises from the record of step ``at`` on (``at`` 0: never)."""

    def __init__(self, at: int = 0):
        self.at = at

    def log(self, step, metrics):
        if self.at and step >= self.at:
            raise RuntimeError("the tracker is down")

    def close(self):
        pass
'''


RAISES = {  # the function that raises -> what its line says
    "on_fit_start": 'raise ValueError("boom")',
    "log": 'raise RuntimeError("the tracker is down")',
    **{
        f: f'raise ValueError("{f.replace("_", " ")}")'
        for f in ("no_optimizer", "no_data", "no_metric")
    },
}
USER_LINES = {  # the line of USER (uf_user.py) each of them raises at
    f: next(i + 1 for i, line in enumerate(USER.splitlines()) if line.strip() == text)
    for f, text in RAISES.items()
}


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    with user_module(tmp_path_factory.mktemp("userfail"), "uf_user", USER) as root:
        yield root


def argv(tmp_path, *overrides) -> list[str]:
    base = ["model.hidden_sizes=[8]", "log.progress=false", "log.plot=false", "name=run"]
    out = ["--config", str(ROOT / "configs" / "digits_mlp.yaml"), "--set", f"log.dir={tmp_path}"]
    for o in (*base, *overrides):
        out += ["--set", o]
    return out


def test_a_callback_raising_at_start_up_is_one_line_and_exit_2(tmp_path, user, capsys):
    rc = main(argv(tmp_path, "train.steps=4", 'callbacks=[{name: "uf_user:Boom"}]'))
    err = capsys.readouterr().err
    assert rc == faults.EXIT_BAD_INPUT, err
    log = tmp_path / "run" / "error.log"
    assert err == (
        f"error: callback {user / 'uf_user.py'}:{USER_LINES['on_fit_start']} in on_fit_start: "
        "ValueError: boom "
        f"(traceback: {log})\n"
    )
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and 'raise ValueError("boom")' in text
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt_*"))
    assert main([*argv(tmp_path, "train.steps=2"), "--fresh"]) == 0  # started over:
    assert not log.exists()  # the old failure's log goes with the old checkpoints


@pytest.mark.parametrize(
    "kind, override, function",
    [
        ("optimizer factory", "optimizer={name: 'uf_user:no_optimizer'}", "no_optimizer"),
        ("data source", "data={name: 'uf_user:no_data'}", "no_data"),
        ("metric", "eval.metrics=['uf_user:no_metric']", "no_metric"),
    ],
)
def test_a_factory_or_metric_raising_is_one_line(tmp_path, user, capsys, kind, override, function):
    assert main(argv(tmp_path, "train.steps=2", override)) == faults.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {kind} {user / 'uf_user.py'}:{USER_LINES[function]} in {function}: ValueError: "
    ), err
    assert err.count("\n") == 1 and (tmp_path / "run" / "error.log").is_file()


def test_a_logger_raising_mid_run_keeps_the_checkpoint_and_resumes(tmp_path, user, capsys):
    over = ["train.steps=12", "train.log_every=4", "checkpoint.every=4", "train.eval_every=100"]
    logger = 'log.loggers=[jsonl, {name: "uf_user:FailingLog", at: %d}]'
    rc = main(argv(tmp_path, *over, logger % 8))
    err = capsys.readouterr().err
    assert rc == faults.EXIT_FAILURE, err
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "ckpt_00000004.safetensors"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        f"error: logger {user / 'uf_user.py'}:{USER_LINES['log']} in log: RuntimeError: the "
        "tracker is down; "
        f"stopped at step 8 (traceback: {run / 'error.log'}); the last checkpoint, {ckpt} "
        "(step 4), is kept: fix it and resume with: "
    ), err
    assert "the tracker is down" in (run / "error.log").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [ckpt.name]
    # fixed (it never raises now): the printed command resumes at step 4 and finishes
    assert main(argv(tmp_path, *over, logger % 0)) == 0
    out = capsys.readouterr().out
    assert "resuming at step 4" in out and "done: step 12" in out


# -- non-finite values from a user's data source ---------------------------------------------
N, FEATURES, BATCH = 128, 6, 16
BAD = int(epoch_order(0, 0, N)[5 * BATCH + 3])  # step 6 reads it, as row 3: nan in x[BAD, 2]


class Rows:
    """A map-style source of N rows."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(N, FEATURES)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int64)

    def __len__(self):
        return N

    def __getitem__(self, indices):
        return self.x[indices], self.y[indices]


class NanRows(Rows):
    """A map-style source whose row BAD has a nan."""

    def __init__(self):
        super().__init__()
        self.x[BAD, 2] = np.nan


def nan_fit(tmp_path, placement, source=None):
    import train

    test = NanRows().x[:16].copy(), NanRows().y[:16]
    test[0][BAD % 16] = 0.0
    config = {
        "name": "run",
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "data": {"placement": placement},
        "train": {"steps": 40, "batch_size": BATCH, "log_every": 8, "eval_every": 100},
        "log": {"dir": str(tmp_path), "plot": False, "progress": False},
    }
    data = {"train": source or NanRows(), "test": test}
    return train.fit(None, config, data=data, echo=lambda *_: None)


def test_a_nan_from_a_streamed_source_is_named_with_its_step_and_row(tmp_path):
    order = epoch_order(0, 0, N)  # the (seed, step) order: step s reads slice s - 1
    at = int(np.flatnonzero(order == BAD)[0])
    step, row = at // BATCH + 1, at % BATCH
    assert step > 1  # read during the run, so the steps before it ran
    with pytest.raises(DataError) as e:
        nan_fit(tmp_path, "host")
    assert str(e.value) == (
        f"data source test_faults_user.NanRows: step {step}, row {row} of its batch "
        f"(row {BAD} of the source): "
        "x[2] is nan; a non-finite input makes the step's loss non-finite; fix the source or "
        "leave the row out"
    )
    assert e.value.step == step - 1 and e.value.checkpoint is None  # the CLI: exit 1


class FailingRows(Rows):
    """A map-style source whose batch read of row BAD (step 6's) raises (not its first
    reads at load: the first rows, the labels' scan)."""

    def __getitem__(self, indices):
        if len(indices) == BATCH and BAD in np.asarray(indices):
            raise OSError("the bucket is gone")
        return super().__getitem__(indices)


def test_a_source_raising_mid_run_names_its_line_and_the_step(tmp_path):
    from train.errors import UserCodeError

    with pytest.raises(UserCodeError) as e:
        nan_fit(tmp_path, "host", FailingRows())
    assert re.fullmatch(
        r"data source .*test_faults_user.py:\d+ in __getitem__: OSError: the bucket is gone "
        r"\(test_faults_user.FailingRows, __getitem__ of 16 indices\)",
        str(e.value),
    ), str(e.value)
    assert e.value.step == 5 and e.value.log == tmp_path / "run" / "error.log"  # CLI: exit 1
    assert "the bucket is gone" in e.value.log.read_text()


class NanBatches:
    """An iterable of 16-row batches whose fourth (step 3's) holds an inf."""

    def __iter__(self):
        rng = np.random.default_rng(0)
        for i in range(100):
            x = rng.normal(size=(16, FEATURES)).astype(np.float32)
            y = (x[:, 0] > 0).astype(np.int64)
            if i == 3:  # the first batch is held out as the test split: this is step 3's
                x[5, 2] = np.inf
            yield x, y


def test_an_inf_from_an_iterable_is_named_with_its_step_and_row(tmp_path):
    import train

    config = {
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "train": {"steps": 10, "batch_size": 16, "log_every": 5, "eval_every": 100},
        "log": {"dir": str(tmp_path), "plot": False, "progress": False},
    }
    with pytest.raises(DataError) as e, pytest.warns(UserWarning, match="not exact"):
        train.fit(None, config, data=NanBatches(), echo=lambda *_: None)
    assert str(e.value).startswith(
        "data source test_faults_user.NanBatches: step 3, row 5 of its batch: x[2] is inf; "
    )


def test_a_nan_in_a_source_read_whole_is_named_at_load(tmp_path):
    with pytest.raises(
        DataError, match=rf"NanRows: row {BAD} of the training split: x\[2\] is nan"
    ):
        nan_fit(tmp_path, "device")
    assert not (tmp_path / "run").exists() and not any(tmp_path.iterdir())


# -- Ctrl-C during an evaluation ---------------------------------------------------------------
class HeldOut:
    """A held-out split of 160 rows that, once armed, sends this process SIGINT at its first
    read and counts the reads (chunks) after it."""

    def __init__(self):
        rng = np.random.default_rng(1)
        self.x = rng.normal(size=(160, FEATURES)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int64)
        self.armed, self.reads = False, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, indices):
        if self.armed:
            self.reads += 1
            if self.reads == 1:
                os.kill(os.getpid(), signal.SIGINT)
        return self.x[indices], self.y[indices]


class ArmAt(Callback):
    def __init__(self, test: HeldOut, at: int):
        self.test, self.at = test, at

    def on_step_end(self, loop, step, metrics):
        self.test.armed = step == self.at


def eval_fit(tmp_path, name, test, callbacks=(), resume="auto"):
    import train

    config = {
        "name": name,
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "train": {"steps": 16, "batch_size": BATCH, "log_every": 8, "eval_every": 8},
        "checkpoint": {"every": 8},
        "log": {"dir": str(tmp_path), "plot": False, "progress": False},
    }
    data = {"train": Rows(), "test": test}
    return train.fit(
        None, config, data=data, callbacks=callbacks, echo=lambda *_: None, resume=resume
    )


def test_sigint_during_an_evaluation_stops_after_a_chunk_and_resumes_exactly(tmp_path, monkeypatch):
    from train.data import feed

    monkeypatch.setattr(feed, "EVAL_CHUNK_BYTES", 8 * FEATURES * 4)  # 8 rows a chunk: 20 chunks
    test = HeldOut()
    with pytest.raises(faults.Preempted) as e:
        eval_fit(tmp_path, "run", test, [ArmAt(test, 8)])
    assert e.value.step == 8 and e.value.signal_name == "SIGINT"
    # the chunk being evaluated, and those the prefetcher had read ahead: not all 20
    assert 1 <= test.reads <= 2 + feed.DEPTH, test.reads
    run = tmp_path / "run"
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records] == [(8, "train")]  # no partial eval
    assert e.value.checkpoint == run / "checkpoints" / "ckpt_00000008.safetensors"
    # the resume evaluates step 8 first: the records are an uninterrupted run's
    eval_fit(tmp_path, "run", HeldOut())
    eval_fit(tmp_path, "ref", HeldOut())

    def metrics(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(ln).items() if k not in TIMING_KEYS} for ln in lines]

    assert [(r["step"], r["split"]) for r in metrics("run")] == [
        (8, "train"), (8, "test"), (16, "train"), (16, "test")
    ]  # fmt: skip
    assert metrics("run") == metrics("ref")


# -- a checkpoint path that is a directory -----------------------------------------------------
def test_a_checkpoint_path_that_is_a_directory_is_one_line(tmp_path, capsys):
    import nnlite as nl
    import train

    assert main(argv(tmp_path, "train.steps=2")) == 0
    run = tmp_path / "run"
    newest = run / "checkpoints" / "ckpt_00000002.safetensors"
    for given in (run / "checkpoints", run):
        with pytest.raises(nl.CheckpointError) as e:
            nl.load(given)
        assert not isinstance(e.value, nl.CheckpointCorruptError)  # not damaged: misnamed
        assert str(e.value).startswith(
            f"checkpoint {given}: a directory, not a checkpoint; it holds 1 checkpoint(s), "
            f"the last by name {newest}: give one of them"
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(nl.CheckpointError, match="a directory, not a checkpoint; it holds no "):
        nl.load(tmp_path / "empty")
    with pytest.raises(train.ConfigError) as e:  # the trainer: one line (exit 2 in a command)
        train.load_run(run, checkpoint=run / "checkpoints")
    assert "\n" not in str(e.value) and "give one of them" in str(e.value)


def test_a_split_on_the_device_in_chunks_stops_between_them():
    """A text split kept on the device is evaluated a chunk per call (build.device_eval):
    a stop (a signal came) ends it after the chunk being evaluated."""
    from train.data import feed

    x, y = np.arange(10.0)[:, None], np.arange(10)
    chunks = feed.device_chunks(x, y, 4, jax.devices()[0])
    assert [int(valid) for _, _, valid in chunks] == [4, 4, 2]  # the last one padded
    calls = []

    def sums(params, x, y, valid):
        calls.append(int(valid))
        keep = np.arange(len(x)) < valid
        return {"loss": float(np.sum(np.asarray(x)[:, 0] * keep))}, int(valid)

    assert feed.sum_chunks(sums, None, chunks) == {"loss": 4.5}  # the mean of 0..9
    calls.clear()
    assert feed.sum_chunks(sums, None, chunks, stop=lambda: len(calls) == 1) is None
    assert calls == [4]
