"""Debug and tuning runs, with a model, a metric and a callback in a user's own file:
train.overfit_batches (the loss goes to ~0, evaluated on the same batches, exact resume),
eval.metrics (computed in the compiled evaluation, monitored by early stopping), the
--fast-dev-run flag and python -m train.lr_find; none and fsdp."""

import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import user_module

import train
from train.__main__ import main
from train.config import ConfigError, config_from_dict
from train.data.source import ResumeNotExactWarning

ROOT = Path(__file__).resolve().parents[1]

USER = """
import jax
import jax.numpy as jnp
import nnlite as nl


class Net(nl.Module):
    in_features: int
    num_classes: int
    width: int = 16
    task = "classification"

    def setup(self):
        self.a = nl.Linear(self.in_features, self.width)
        self.b = nl.Linear(self.width, self.num_classes)

    def __call__(self, params, x):
        return self.b(params.b, jax.nn.relu(self.a(params.a, x)))


def top3(logits, y):  # per example
    top = jnp.argsort(logits, axis=-1)[:, -3:]
    return jnp.any(top == y[:, None], axis=-1)


def margin(logits, y):  # a scalar for the batch: its mean
    picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
    return jnp.mean(picked - jnp.max(logits, axis=-1))


def one_argument(logits):
    return 0.0


def whole_logits(logits, y):
    return logits
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    with user_module(tmp_path_factory.mktemp("debug_user"), "debug_user", USER) as root:
        yield root


def sections(log_dir, **train_keys):
    return {
        "model": {"name": "debug_user:Net"},
        "data": {"name": "digits"},
        "optimizer": {"learning_rate": 0.02},
        "train": {"batch_size": 32, **train_keys},
        "log": {"dir": str(log_dir), "progress": False, "plot": False},
    }


def fit(raw, *overrides, **kw):
    return train.fit(None, raw, overrides=list(overrides), echo=lambda *_: None, **kw)


def records(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.fixture(scope="module")
def overfit_run(user, tmp_path_factory):
    """The user's model on the same 2 batches for 150 steps, one device, its metrics."""
    raw = sections(tmp_path_factory.mktemp("runs"), steps=150, eval_every=150, log_every=50)
    raw["train"]["overfit_batches"] = 2
    raw["eval"] = {"metrics": ["debug_user:top3", "debug_user:margin"]}
    return fit(raw, "name=overfit")


def test_overfit_batches_drive_the_loss_to_zero_on_what_is_evaluated(overfit_run):
    r = overfit_run
    assert records(r.run_dir, "train")[-1]["loss"] < 0.02
    assert r.summary["test_loss"] < 0.02 and r.summary["test_accuracy"] == 1.0
    # the held-out split is the rows of the 2 batches the run repeats (steps 0 and 1)
    from train.data.builtin import load_dataset
    from train.data.dataset import make_sampler

    digits = load_dataset(r.cfg.data)
    rows = make_sampler(r.cfg.seed, digits, 32).batches(0, 2).reshape(-1)
    np.testing.assert_array_equal(r.data.x_test, digits.x[rows])
    np.testing.assert_array_equal(r.data.y_test, digits.y[rows])
    # the user's metrics, computed in the compiled evaluation, equal numpy's on its logits
    logits = np.asarray(r.model(jax.tree.map(np.asarray, r.params), r.data.x_test))
    top3 = np.argsort(logits, axis=-1)[:, -3:]
    expected = np.mean(np.any(top3 == r.data.y_test[:, None], axis=-1))
    assert r.summary["test_top3"] == pytest.approx(expected, abs=1e-6)
    picked = logits[np.arange(len(logits)), r.data.y_test]
    assert r.summary["test_margin"] == pytest.approx(np.mean(picked - logits.max(-1)), abs=1e-5)
    assert {"top3", "margin"} <= set(records(r.run_dir, "test")[-1])


def test_overfit_and_a_monitored_metric_resume_bit_identically(user, tmp_path):
    """Early stopping on the user's metric (max top3, with its best checkpointed) over the
    same batch again and again: stopped at step 20, resumed, the run ends as the one that
    never stopped (params, evaluations, stop reason)."""
    raw = sections(tmp_path, steps=60, eval_every=10, log_every=10)
    raw["train"]["overfit_batches"] = 1
    raw["eval"] = {"metrics": ["debug_user:top3"]}
    raw["callbacks"] = [{"name": "early_stopping", "monitor": "top3", "mode": "max", "patience": 2}]
    raw["checkpoint"] = {"every": 10}
    whole = fit(raw, "name=whole")
    assert "top3" in whole.summary["stopped"] and whole.step < 60
    tops = [r["top3"] for r in records(whole.run_dir, "test")]
    assert tops[-3:] == [max(tops)] * 3  # best, then 2 evaluations without improvement
    first = fit(raw, "name=cut", "train.steps=20")
    assert first.step == 20 and "stopped" not in first.summary
    resumed = fit(raw, "name=cut")
    assert resumed.step == whole.step and resumed.summary["stopped"] == whole.summary["stopped"]
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    untimed = lambda run: [  # noqa: E731
        {k: v for k, v in rec.items() if k != "time"} for rec in records(run.run_dir, "test")
    ]
    assert untimed(whole) == untimed(resumed)
    # a resume with another overfit_batches would train on other data: refused
    from train.checkpoint import store
    from train.checkpoint.resume import check_resumable

    ckpt = store.list_checkpoints(whole.run_dir / "checkpoints")[-1]
    other = config_from_dict(raw, ["train.overfit_batches=2"])
    with pytest.raises(ConfigError, match="train.overfit_batches=1 but the config has .*=2"):
        check_resumable(other, store.read_metadata(ckpt), ckpt)


def test_bad_eval_metrics_and_overfit_batches_are_refused_in_one_line(user, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(sections(tmp_path / "runs", steps=5)))
    cases = {
        '["debug_user:one_argument"]': "one_argument(logits) cannot be called as",
        '["no_such_module:top3"]': "no module named 'no_such_module'",
        '["debug_user:top5"]': "has no top5; it defines: Net",
        '["debug_user:Net"]': "expected a function metric",
        '["debug_user:top3", "debug_user:top3"]': "eval.metrics[0] is logged as 'top3' too",
        "[top3]": "expected 'module:function'",
        # found when the run is built: on the model's outputs, before anything is written
        '["debug_user:whole_logits"]': "returned float32[1, 10] for a batch of 1",
    }
    for value, message in cases.items():
        assert main(["--config", str(path), "--set", f"eval.metrics={value}"]) == 2, value
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert message in err, (value, err)
    assert main(["--config", str(path), "--set", "train.overfit_batches=-1"]) == 2
    assert "train.overfit_batches must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()

    def batches():  # an iterable source: read in order, once; it cannot repeat a batch
        rng = np.random.default_rng(0)
        while True:
            x = rng.normal(size=(32, 8)).astype(np.float32)
            yield x, (x[:, 0] > 0).astype(np.int32)

    test = (np.zeros((16, 8), np.float32), np.zeros(16, np.int32))
    raw = sections(tmp_path / "runs", steps=5, overfit_batches=2)
    with (
        warnings.catch_warnings(),
        pytest.raises(ConfigError, match="overfit_batches=2 .* an iterable"),
    ):
        warnings.simplefilter("ignore", ResumeNotExactWarning)  # said before the refusal
        fit(raw, data={"train": batches(), "test": test})


def test_fast_dev_run_under_fsdp_checks_every_phase_and_leaves_nothing(user, tmp_path, capsys):
    """With the user's model, metric and an early stopping on it, on 2 batches over and
    over (train.overfit_batches) under fsdp: all of it runs in a dev run."""
    log_dir = tmp_path / "runs"
    raw = sections(log_dir, steps=1000, eval_every=500, overfit_batches=2)
    raw["eval"] = {"metrics": ["debug_user:top3"]}
    raw["callbacks"] = [{"name": "early_stopping", "monitor": "top3", "mode": "max"}]
    raw["parallel"] = {"strategy": "fsdp"}
    raw["log"]["loggers"] = ["csv", "debug_user_logger:Nope"]  # not a real logger: refused
    path = tmp_path / "dev.yaml"
    path.write_text(json.dumps(raw))
    assert main(["--config", str(path), "--fast-dev-run"]) == 2  # bad input, as a run says
    assert "debug_user_logger" in capsys.readouterr().err
    raw["log"]["loggers"] = ["csv"]
    path.write_text(json.dumps(raw))
    before = set(Path(tempfile.gettempdir()).glob("nnlite-fast-dev-run-*"))
    assert main(["--config", str(path), "--fast-dev-run", "3"]) == 0
    out = capsys.readouterr().out
    assert "fast-dev-run [1/3 train, eval, checkpoint]" in out
    assert "resuming at step 3" in out and "test top3" in out and "(fsdp," in out
    assert "train.overfit_batches=2: training on the same 2 batches (64 examples)" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("fast-dev-run: all phases passed: train 3 steps, eval, checkpoint, ")
    assert "resume to step 6, load_run + predict" in last
    assert not log_dir.exists()  # nothing in runs/, and the temporary directory is gone
    assert set(Path(tempfile.gettempdir()).glob("nnlite-fast-dev-run-*")) == before
    assert main(["--config", str(path), "--fast-dev-run", "--resume"]) == 2
    assert "no checkpoint to --resume" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lr_find_run(user, tmp_path_factory):
    from train.lr_find import main as lr_find

    root = tmp_path_factory.mktemp("lr")
    path = root / "lr.yaml"
    raw = sections(root / "runs", steps=1000)
    raw["name"] = "tune"
    path.write_text(json.dumps(raw))
    args = ["--config", str(path), "--min-lr", "1e-4", "--max-lr", "100", "--smoothing", "0.9"]
    args += ["--steps", "80"]
    assert lr_find(args) == 0
    return root, path, args


def test_lr_find_writes_its_curve_and_suggests_a_rate(lr_find_run, capsys):
    root, _, _ = lr_find_run
    out = root / "runs" / "tune_lr_find"
    record = json.loads((out / "lr_find.json").read_text())
    points = record["points"]
    lrs = np.array([p["lr"] for p in points])
    assert lrs[0] == pytest.approx(1e-4) and np.allclose(lrs[1:] / lrs[:-1], 10 ** (6 / 79))
    # adam at lr 100 diverges: the test stopped once the smoothed loss passed 4 x its minimum
    stopped = record["stopped"]
    assert stopped is not None and len(points) < 80 and stopped["step"] == points[-1]["step"]
    smooth = [p["smoothed_loss"] for p in points]
    assert smooth[-1] > 4 * min(smooth) and all(s <= 4 * min(smooth) for s in smooth[1:-1])
    lr = record["suggested_lr"]
    assert record["suggest"] == "steepest" and lr == record["suggestions"]["steepest"]
    assert 1e-3 < lr < lrs[int(np.argmin(smooth))]  # on the way down to the minimum
    assert record["suggestions"]["min10"] == pytest.approx(lrs[int(np.argmin(smooth))] / 10)
    rows = (out / "lr_find.csv").read_text().splitlines()
    assert rows[0] == "step,lr,loss,smoothed_loss" and len(rows) == len(points) + 1
    assert (out / "lr_find.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "config.yaml").is_file() and not (root / "runs" / "tune").exists()


def test_lr_find_under_fsdp_sees_the_same_losses(lr_find_run, capsys):
    from train.lr_find import main as lr_find

    root, path, args = lr_find_run
    none = json.loads((root / "runs" / "tune_lr_find" / "lr_find.json").read_text())
    fsdp_out = root / "fsdp"
    argv = [*args[:-1], "30", "--set", "parallel.strategy=fsdp", "--out", str(fsdp_out)]
    assert lr_find(argv) == 0
    printed = capsys.readouterr().out
    assert "suggested learning rate: " in printed and "(steepest descent of the smoothed" in printed
    fsdp = json.loads((fsdp_out / "lr_find.json").read_text())
    # the same start: the same first batch, the same first update (at --min-lr), the same loss
    assert fsdp["points"][0]["lr"] == none["points"][0]["lr"] == 1e-4
    for a, b in zip(fsdp["points"][:2], none["points"][:2], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_lr_find_is_a_module_with_one_line_errors(tmp_path):
    """The command as users run it (python -m train.lr_find): bad input is one line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.lr_find",
            "--config",
            "x.yaml",
            "--min-lr",
            "1",
            "--max-lr",
            "0.5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        proc.returncode == 2 and proc.stderr == "error: --min-lr (1) must be below --max-lr (0.5)\n"
    )
