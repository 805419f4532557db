"""The user's own code failing (docs/faults.md): a callback, logger or data source that
raises is one line naming the user's file and line, exit 2 before the first step and exit
1 during the run (the newest checkpoint kept, the traceback in the run's error.log); a
non-finite value from a user's data source is named before it reaches a step."""

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from train import faults
from train.__main__ import main
from train.data.dataset import epoch_order
from train.data.source import DataError

ROOT = Path(__file__).resolve().parents[1]

USER = '''
import os
import signal

import numpy as np

import train


class Boom(train.Callback):
    def on_fit_start(self, loop):
        raise ValueError("boom")  # line 12


class FailingLog:
    """Raises from the record of step ``at`` on (``at`` 0: never)."""

    def __init__(self, at: int = 0):
        self.at = at

    def log(self, step, metrics):
        if self.at and step >= self.at:
            raise RuntimeError("the tracker is down")  # line 23

    def close(self):
        pass
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    root = tmp_path_factory.mktemp("userfail")
    (root / "uf_user.py").write_text(textwrap.dedent(USER))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("uf_user", None)


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
        f"error: callback {user / 'uf_user.py'}:12 in on_fit_start: ValueError: boom "
        f"(traceback: {log})\n"
    )
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and 'raise ValueError("boom")' in text
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt_*"))


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
        f"error: logger {user / 'uf_user.py'}:23 in log: RuntimeError: the tracker is down; "
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


class NanRows:
    """A map-style source whose row BAD has a nan; counts the rows it was asked for."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(N, FEATURES)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int64)
        self.x[BAD, 2] = np.nan

    def __len__(self):
        return N

    def __getitem__(self, indices):
        return self.x[indices], self.y[indices]


def nan_fit(tmp_path, placement):
    import train

    test = NanRows().x[:16].copy(), NanRows().y[:16]
    test[0][BAD % 16] = 0.0
    config = {
        "model": {"name": "mlp", "hidden_sizes": [8]},
        "data": {"placement": placement},
        "train": {"steps": 40, "batch_size": BATCH, "log_every": 8, "eval_every": 100},
        "log": {"dir": str(tmp_path), "plot": False, "progress": False},
    }
    data = {"train": NanRows(), "test": test}
    return train.fit(None, config, data=data, echo=lambda *_: None)


def test_a_nan_from_a_streamed_source_is_named_with_its_step_and_row(tmp_path):
    order = epoch_order(0, 0, N)  # the (seed, step) order: step s reads slice s - 1
    at = int(np.flatnonzero(order == BAD)[0])
    step, row = at // BATCH + 1, at % BATCH
    assert step > 1  # read during the run, so the steps before it ran
    with pytest.raises(DataError) as e:
        nan_fit(tmp_path, "host")
    assert str(e.value) == (
        f"data source test_faults_user.NanRows: step {step}, row {row} of its batch (row {BAD} of the source): "
        "x[2] is nan; a non-finite input makes the step's loss non-finite; fix the source or "
        "leave the row out"
    )
    assert e.value.step == step - 1 and e.value.checkpoint is None  # the CLI: exit 1


def test_a_nan_in_a_source_read_whole_is_named_at_load(tmp_path):
    with pytest.raises(
        DataError, match=rf"NanRows: row {BAD} of the training split: x\[2\] is nan"
    ):
        nan_fit(tmp_path, "device")
    assert not (tmp_path / "run").exists() and not any(tmp_path.iterdir())
