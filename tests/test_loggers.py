"""Loggers (train/report/loggers.py): every logger gets the records metrics.jsonl holds,
W&B offline and MLflow's local store included; resume cuts and appends; bad input is one
line before training."""

import csv
import json
import re
import struct
from pathlib import Path

import pytest

from train.__main__ import main
from train.checkpoint.rundir import TIMING_KEYS
from train.config import load_config
from train.errors import ConfigError
from train.loop.fitting import fit
from train.report import loggers

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/digits_mlp.yaml"
QUIET = ["log.progress=false", "log.plot=false", "train.batch_size=64"]


def records(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def numbers(record):
    return {k: v for k, v in record.items() if k not in ("step", "split")}


def wandb_history(run_dir) -> dict:
    """``{(key, step): value}`` read back from a run directory's W&B offline runs'
    ``.wandb`` files: the LevelDB log format (7-byte file header, 32 KiB blocks of records
    each with a 7-byte header ``crc32, length, type``) around W&B's protobuf ``Record``s."""
    out = {}
    for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):  # by start
        out.update(_wandb_file_history(path))
    return out


def _wandb_file_history(path: Path) -> dict:
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, out = path.read_bytes(), 32768, 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {  # "train/loss" is stored as the nested key ["train", "loss"]
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                step = record.history.step.num
                out.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
    return out


def test_wandb_offline_and_mlflow_local_log_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store opts in
    store = f"file:{tmp_path / 'mlruns'}"
    overrides = [
        f"log.dir={tmp_path}",
        *QUIET,
        "train.steps=10",
        "train.log_every=5",
        "train.eval_every=5",
        "checkpoint.every=5",
        f"log.loggers=[jsonl, csv, wandb, {{name: mlflow, tracking_uri: '{store}'}}]",
    ]
    run = fit(None, CONFIG, overrides=overrides, echo=lambda *_: None)
    want = records(run.run_dir)
    assert [(r["step"], r["split"]) for r in want] == [
        (5, "train"),
        (5, "test"),
        (10, "train"),
        (10, "test"),
    ]

    with open(run.run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(want)
    for row, record in zip(rows, want, strict=True):
        assert (int(row["step"]), row["split"]) == (record["step"], record["split"])
        assert {k: float(row[k]) for k in numbers(record)} == pytest.approx(numbers(record))

    history = wandb_history(run.run_dir)
    expected = {(f"{r['split']}/{k}", r["step"]): v for r in want for k, v in numbers(r).items()}
    assert history == pytest.approx(expected)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    run_id = (run.run_dir / "mlflow-run-id").read_text().strip()
    logged = {
        (key, m.step): m.value
        for key in {k for k, _ in expected}
        for m in client.get_metric_history(run_id, key)
    }
    assert logged == pytest.approx(expected)
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["train.steps"] == "10"
    assert mlflow_run.info.run_name == run.run_dir.name

    # Killed after step 10's records, before its checkpoint: the resumed run logs them
    # again, each tracker into the same run, none twice.
    (run.run_dir / "checkpoints" / "ckpt_00000010.safetensors").unlink()
    fit(None, CONFIG, overrides=overrides, echo=lambda *_: None)
    again = records(run.run_dir)
    assert [(r["step"], r["split"]) for r in again] == [(r["step"], r["split"]) for r in want]
    same = {(f"{r['split']}/{k}", r["step"]): v for r in again for k, v in numbers(r).items()}
    same = {key: v for key, v in same.items() if key[0].split("/")[1] not in TIMING_KEYS}
    (first, second) = sorted(run.run_dir.glob("wandb/offline-run-*"))
    assert first.name.split("-")[-1] == second.name.split("-")[-1]  # the same W&B run id
    history = wandb_history(run.run_dir)
    assert {key: history[key] for key in same} == pytest.approx(same)
    assert (run.run_dir / "mlflow-run-id").read_text().strip() == run_id
    steps = {key: [m.step for m in client.get_metric_history(run_id, key)] for key, _ in same}
    assert all(s == [5, 10] for s in steps.values()), steps
    logged = {
        (key, m.step): m.value for key, _ in same for m in client.get_metric_history(run_id, key)
    }
    assert {key: logged[key] for key in same} == pytest.approx(same)
    assert client.get_run(run_id).info.status == "FINISHED"


RECORDER = '''
import json
from pathlib import Path


class Recorder:
    """Writes what the loop calls into a JSON lines file."""

    def __init__(self, file="calls.jsonl"):
        self.file = file

    def open(self, run_dir, start):
        self.path = Path(run_dir) / self.file
        self._add(["open", start])

    def log_config(self, config):
        self._add(["config", config["train"]["steps"]])

    def log(self, step, metrics):
        self._add(["log", step, metrics["split"], metrics["loss"]])

    def close(self):
        self._add(["close"])

    def _add(self, call):
        with open(self.path, "a") as f:
            f.write(json.dumps(call) + "\\n")
'''


class Calls:
    def __init__(self):
        self.calls = []

    def log(self, step, metrics):
        self.calls.append((step, metrics["split"]))
        metrics["loss"] = "changed"  # a logger's copy: the others see the original

    def close(self):
        self.calls.append("close")


def test_resume_cuts_back_and_appends_to_every_logger(tmp_path):
    (tmp_path / "mylogs.py").write_text(RECORDER)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        CONFIG.read_text() + "log:\n  loggers: [csv, {name: 'mylogs:Recorder', file: mine.jsonl}]\n"
    )
    common = [
        f"log.dir={tmp_path}",
        *QUIET,
        "train.steps=20",
        "train.log_every=5",
        "train.eval_every=10",
        "checkpoint.every=10",
    ]
    first = fit(None, config, overrides=common, echo=lambda *_: None)
    run_dir = first.run_dir
    before = records(run_dir)
    # A kill between the checkpoints at 10 and 20: the records of 15 and 20 were logged.
    (run_dir / "checkpoints" / "ckpt_00000020.safetensors").unlink()
    given = Calls()
    second = fit(None, config, overrides=common, echo=lambda *_: None, loggers=[given])
    after = records(run_dir)
    assert [(r["step"], r["split"]) for r in after] == [(r["step"], r["split"]) for r in before]
    assert second.step == 20
    assert given.calls == [(15, "train"), (20, "train"), (20, "test"), "close"]

    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), r["split"]) for r in rows] == [(r["step"], r["split"]) for r in after]
    for row, record in zip(rows, after, strict=True):
        same = {k: v for k, v in numbers(record).items() if k not in TIMING_KEYS}
        assert {k: float(row[k]) for k in same} == pytest.approx(same)

    mine = [json.loads(ln) for ln in (run_dir / "mine.jsonl").read_text().splitlines()]
    logs = lambda calls: [c[1:3] for c in calls if c[0] == "log"]  # noqa: E731
    assert mine[:2] == [["open", 0], ["config", 20]]
    resumed = mine.index(["open", 10])
    assert mine[resumed - 1] == ["close"] and mine[-1] == ["close"]
    assert logs(mine[:resumed]) == [[r["step"], r["split"]] for r in before]
    assert logs(mine[resumed:]) == [[15, "train"], [20, "train"], [20, "test"]]
    # every logger saw the loss itself, not the "changed" that Calls wrote into its copy
    assert [c[3] for c in mine[resumed:] if c[0] == "log"] == [r["loss"] for r in after[-3:]]

    # A finished run's rerun logs nothing.
    third = Calls()
    fit(None, config, overrides=common, echo=lambda *_: None, loggers=[third])
    assert third.calls == [] and records(run_dir) == after


@pytest.mark.parametrize(
    "value, message",
    [
        ("[nope]", "log.loggers[0]=nope is not a logger (jsonl, tensorboard, csv, wandb, mlflow)"),
        ("[csv, {name: csv}]", "log.loggers[1]: csv is listed twice"),
        ("[{name: csv, sep: ';'}]", "unknown key 'log.loggers[0].sep'; CsvLogger takes filename"),
        ("[{file: x}]", "log.loggers[0]: expected a logger name (jsonl, tensorboard, csv"),
        ("csv", "log.loggers: expected list of str or dict, got 'csv'"),
        ("['nosuchmodule:Logger']", "log.loggers[0]=nosuchmodule:Logger: no module named"),
        ("['json:nothing']", "log.loggers[0]=json:nothing: module json"),
    ],
)
def test_a_bad_logger_is_one_line_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(CONFIG, [f"log.loggers={value}"])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"--set log.loggers={value}: ")


def test_a_missing_tracker_package_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(
        loggers.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real(name, *a),
    )
    argv = ["--config", str(CONFIG), "--set", f"log.dir={tmp_path}", "--set", "log.loggers=[wandb]"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: log.loggers[0]=wandb needs the wandb package: pip install 'nnlite[wandb]'"
    )
    assert not (tmp_path / "digits_mlp").exists()  # nothing written, nothing trained


class Broken:
    def open(self, run_dir, start):
        raise RuntimeError("the tracker's server is down\nsecond line")

    def log(self, step, metrics):
        raise AssertionError("never called")

    def close(self):
        pass


def test_fit_takes_logger_objects_and_refuses_others(tmp_path, monkeypatch):
    short = [f"log.dir={tmp_path}", *QUIET, "train.steps=2", "checkpoint.every=0"]
    for bad, message in [
        ([object()], r"train.fit\(loggers=...\)\[0\]: <object .*> is not a logger"),
        ([Calls], r"\[0\]: .* is not a logger: .* \(a class\? pass an instance\)"),
        (Calls(), "train.fit: loggers must be a list of logger objects"),
    ]:
        with pytest.raises(ConfigError, match=message):
            fit(None, CONFIG, overrides=short, loggers=bad)
    with pytest.raises(ConfigError) as e:
        fit(None, CONFIG, overrides=short, echo=lambda *_: None, loggers=[Broken()])
    assert re.fullmatch(  # the user's code: its file and line (train/errors.py)
        r"logger .*test_loggers.py:\d+ in open: RuntimeError: the tracker's server is down "
        r"\.\.\. \(train.fit\(loggers=...\)\[0\] could not start\)",
        str(e.value),
    ), str(e.value)
    # Only process 0 logs: another process calls no logger and writes no metrics.jsonl.
    from train.parallel import distributed as dist

    monkeypatch.setattr(dist, "is_main", lambda: False)
    other = Calls()
    run = fit(None, CONFIG, overrides=[*short, "name=other"], loggers=[other])
    assert other.calls == [] and not (run.run_dir / "metrics.jsonl").exists()


def test_jsonl_and_csv_hold_every_record_a_new_metric_and_a_non_finite_value(tmp_path):
    nan = float("nan")
    log = loggers.MetricsLog.open(tmp_path, 0, {}, ["csv"])
    log.write({"step": 1, "split": "train", "loss": 0.5, "lr": 0.1})
    log.write({"step": 1, "split": "test", "loss": 0.25, "accuracy": 0.75})  # a new column
    log.write({"step": 2, "split": "train", "loss": nan, "lr": 0.1})
    log.close()
    assert records(tmp_path)[2] == {"step": 2, "split": "train", "loss": None, "lr": 0.1}
    text = (tmp_path / "metrics.csv").read_text().splitlines()
    assert text == [
        "step,split,loss,lr,accuracy",
        "1,train,0.5,0.1,",
        "1,test,0.25,,0.75",
        "2,train,nan,0.1,",
    ]
    # A run resumed at step 1 keeps the rows up to it and appends after them.
    log = loggers.MetricsLog.open(tmp_path, 1, {}, ["csv"])
    log.write({"step": 2, "split": "train", "loss": 0.125, "lr": 0.1})
    log.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines()[3:] == ["2,train,0.125,0.1,"]
