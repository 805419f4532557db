"""curves.png: the helper process draws the same PNG as plot_curves, and never leaves a run
without one (or with one it should not have)."""

import json
import sys

from train.report.plot import CurvePlotter, plot_curves


def _metrics(tmp_path, accuracy=True):
    path = tmp_path / "metrics.jsonl"
    records = []
    for step in range(10, 110, 10):
        rec = {"step": step, "split": "train", "loss": 2.0 / step, "time": 0.1}
        records.append({**rec, **({"accuracy": 1 - 1 / step} if accuracy else {})})
        if step % 50 == 0:
            records.append({"step": step, "split": "test", "loss": 2.5 / step})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_helper_draws_the_same_png_as_plot_curves(tmp_path, monkeypatch):
    metrics = _metrics(tmp_path)
    monkeypatch.chdir(tmp_path)  # a user's directory, not the checkout: the helper still starts
    plotter = CurvePlotter(accuracy=True)
    plotter.draw(metrics, tmp_path / "helper.png")
    plotter.wait()
    assert plotter.by_helper  # drawn by the helper, not by the fallback here
    plot_curves(metrics, tmp_path / "here.png")
    assert (tmp_path / "helper.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["helper.png", "here.png", "metrics.jsonl"]


def test_a_failed_or_slow_helper_means_drawing_here(tmp_path, monkeypatch):
    metrics = _metrics(tmp_path, accuracy=False)
    plot_curves(metrics, tmp_path / "want.png")
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the helper exits 1 at once
    failed = CurvePlotter()
    failed.draw(metrics, tmp_path / "failed.png")
    failed.wait()
    monkeypatch.undo()
    slow = CurvePlotter(timeout=0.01)  # still importing matplotlib when the wait ends
    slow.draw(metrics, tmp_path / "slow.png")
    slow.wait()
    for name in ("failed.png", "slow.png"):
        assert (tmp_path / name).read_bytes() == (tmp_path / "want.png").read_bytes()


def test_close_without_a_request_stops_the_helper_and_draws_nothing(tmp_path):
    plotter = CurvePlotter()
    proc = plotter._proc
    plotter.close()
    assert proc.poll() is not None
    plotter.wait()  # nothing requested: nothing drawn
    assert list(tmp_path.iterdir()) == []
