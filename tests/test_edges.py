"""Small promises at the edges: messages that name the key, an empty config, progress
shown as plain lines when nobody watches a bar."""

import signal
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


# -- language models on tokens: bits per token, and per character where it is known ------------
def test_token_runs_report_bits_per_token_and_true_bits_per_char(tmp_path):
    import json

    import numpy as np

    from train.config import config_from_dict
    from train.data.text import units
    from train.data.text.tokenizer import from_dir
    from train.prepare import main as prepare

    text = "héllo wörld, the king and the queen. " * 300  # non-ASCII: bytes != chars
    (tmp_path / "c.txt").write_text(text)
    runs = {}
    for kind in ("char", "byte", "bpe"):
        extra = ["--vocab-size", "300"] if kind == "bpe" else []
        out = tmp_path / kind
        assert prepare(["--input", str(tmp_path / "c.txt"), "--out", str(out), "--tokenizer", kind, *extra]) == 0  # fmt: skip
        tok = from_dir(out)
        ids = tok.encode(text)
        # every token's characters add up to the text's
        assert int(units.char_lengths(tok)[ids].sum()) == len(text), kind
        if kind == "char":  # a token is a character: bits_per_char stays (tests/test_text.py)
            continue
        raw = {
            "name": kind,
            "model": {"name": "gpt", "context": 8, "n_layer": 1, "n_head": 2, "n_embd": 16},
            "data": {"name": "tokens", "path": str(out), "eval_windows": 16},
            "loss": {"grad": "autodiff"},
            "train": {"batch_size": 4, "steps": 2, "eval_every": 2, "log_every": 1},
            "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
        }
        r = train(config_from_dict(raw), resume="fresh", echo=lambda *_: None)
        recs = [json.loads(x) for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[kind] = (r, recs[-1], [x for x in recs if x["split"] == "train"][-1])
    assert units.name_metrics({"bits_per_char": 2.0}, "char", 1.0) == {"bits_per_char": 2.0}
    for kind in ("byte", "bpe"):
        r, val, tr = runs[kind]
        assert "bits_per_token" in tr and "bits_per_char" not in tr, tr
        cpt = units.chars_per_token(from_dir(tmp_path / kind), r.data.y_test)
        assert cpt == r.data.chars_per_token and (cpt < 1 if kind == "byte" else cpt > 1)
        assert val["bits_per_token"] == pytest.approx(val["loss"] / np.log(2), rel=1e-5)
        assert val["bits_per_char"] == pytest.approx(val["bits_per_token"] / cpt, rel=1e-6)


def test_label_ids_exit_2_as_the_readme_says_and_a_small_gap_is_a_note(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 4)).astype(np.float32)
    ids = tmp_path / "ids.npz"
    np.savez(ids, x=x, y=np.repeat([100, 200, 300], 30))
    cfg = _cfg(tmp_path, "data.name=npz", f"data.path={ids}", "train.steps=2")
    with pytest.raises(ConfigError, match=r"labels must be class indices 0..K-1, but the largest is 300 and only 3 distinct labels occur .*map them to 0..2"):  # fmt: skip
        train(cfg, resume="fresh", echo=lambda *_: None)
    gap = tmp_path / "gap.npz"
    np.savez(gap, x=x, y=np.repeat([1, 2, 3], 30))  # class 0 absent from this sample
    from train.data.builtin import load_dataset

    data = load_dataset(_cfg(tmp_path, "data.name=npz", f"data.path={gap}").data)
    assert data.num_classes == 4 and "never occur (0)" in data.note


def test_a_run_remembers_its_preprocessing_and_predict_applies_it(tmp_path):
    import numpy as np

    import train as train_pkg
    from train.data.builtin import load_digits_arrays

    r = train(_cfg(tmp_path, "train.steps=30", "log.progress=false"), resume="fresh", echo=lambda *_: None)  # fmt: skip
    back = train_pkg.load_run(r.run_dir)
    assert back.preprocess == {"scale": 1 / 16}
    raw, _ = load_digits_arrays()  # pixels 0..16, as scikit-learn's load_digits gives them
    want = back.predict(raw[:20] / 16, preprocessed=True)
    np.testing.assert_allclose(back.predict(raw[:20]), want, rtol=1e-6)
    assert not np.allclose(back.predict(raw[:20], preprocessed=True), want)
    # python -m train.predict on raw pixels: the same predictions
    np.savez(tmp_path / "new.npz", x=raw[:20])
    from train.predict import main as predict_main

    assert predict_main(["--run", str(r.run_dir), "--data", str(tmp_path / "new.npz")]) == 0
    with np.load(r.run_dir / "predictions.npz") as f:
        np.testing.assert_array_equal(f["predictions"], want.argmax(-1))


class _Proc:
    """A finished child process, as the launcher's supervisor sees it."""

    def __init__(self, code):
        self.returncode = code

    def poll(self):
        return self.returncode

    def kill(self):
        pass

    def wait(self):
        return self.returncode


def test_a_killed_process_is_named_when_all_exit_between_two_polls(tmp_path):
    """On a busy machine the launcher can first look when process 1 (SIGKILLed) and process
    0 (failed on the lost peer) have both exited: the killed one is the cause."""
    from train.parallel.launch import _supervise

    lines = []
    procs = [_Proc(1), _Proc(-signal.SIGKILL)]
    status = _supervise(procs, 2, tmp_path, lambda s, **_: lines.append(s), [])
    assert status == 1 and len(lines) == 1, lines
    assert "error: process 1 of 2 was killed by SIGKILL; stopped the other processes" in lines[0]


def test_launcher_leaves_the_childs_message_last(tmp_path):
    from train.parallel.launch import _supervise

    lines = []

    def echo(line, file=None):
        lines.append(line)

    # process 0 stopped with a documented status and said why: no line after its own
    assert _supervise([_Proc(2), _Proc(-9)], 2, tmp_path, echo, []) == 2
    assert lines == []
    # process 1 failed: the launcher's line, then process 1's own last line
    (tmp_path / "process1.log").write_text("starting\nerror: data.path 'x' does not exist\n\n")
    assert _supervise([_Proc(0), _Proc(1)], 2, tmp_path, echo, []) == 1
    assert lines[0].startswith("error: process 1 of 2 exited with status 1")
    assert lines[-1] == "process 1: error: data.path 'x' does not exist"
