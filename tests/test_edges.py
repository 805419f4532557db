"""Small promises at the edges: messages that name the key, an empty config, progress
shown as plain lines when nobody watches a bar."""

import subprocess
import sys
from pathlib import Path

import pytest

from train.config import load_config
from train.errors import ConfigError
from train.loop.trainer import train
from train.report import console

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, *overrides):
    return load_config(
        ROOT / "configs/digits_mlp.yaml",
        [f"log.dir={tmp_path}", "log.plot=false", "train.batch_size=32", *overrides],
    )


def test_unknown_activation_names_the_key(tmp_path):
    cfg = _cfg(tmp_path, "model.activation=relu3")
    with pytest.raises(ConfigError, match=r"model.activation: unknown activation 'relu3'; valid: relu"):  # fmt: skip
        train(cfg, resume="fresh", echo=lambda *_: None)


def test_an_empty_config_file_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty.yaml: the config is empty .*--set"):
        load_config(empty)
    assert load_config(empty, ["train.steps=3"]).train.steps == 3  # overrides: a choice
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", str(empty)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "the config is empty" in proc.stderr


def test_progress_off_prints_one_line_per_evaluation(tmp_path, capsys):
    cfg = _cfg(tmp_path, "log.progress=false", "train.steps=20", "train.eval_every=5")
    train(cfg, resume="fresh", echo=print)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "test accuracy" in ln]
    evals = [ln for ln in lines if ln.startswith("digits_mlp: step ")]
    assert [ln.split(",")[0] for ln in evals] == [f"digits_mlp: step {s}/20" for s in (5, 10, 15, 20)]  # fmt: skip
    assert all("test loss" in ln for ln in evals)


def test_a_log_file_gets_plain_lines_not_a_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(console, "PLAIN_EVERY_S", 0.0)  # every log boundary
    cfg = _cfg(tmp_path, "log.progress=true", "train.steps=10", "train.log_every=5")
    train(cfg, resume="fresh", echo=print)  # under pytest stderr is no terminal
    out = capsys.readouterr()
    assert "\r" not in out.err and "\r" not in out.out
    train_lines = [ln for ln in out.out.splitlines() if ln.startswith("digits_mlp: step 5/10, loss")]  # fmt: skip
    assert len(train_lines) == 1, out.out
