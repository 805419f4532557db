"""The run's ``curves.png``, and a helper process that draws it off the critical path.

Importing matplotlib costs about 0.7 s of CPU and drawing these curves 0.3-0.4 s: more
than the digits MLP spends compiling and training. ``nnlite-train`` therefore starts a
:class:`CurvePlotter` first thing: a child process that imports matplotlib and draws a
throwaway figure of the same layout (loading fonts and filling matplotlib's text caches)
while the run imports JAX, compiles and trains on the other core. At the end the run
hands it the finished ``metrics.jsonl`` and waits for the PNG. The image is the one
:func:`plot_curves` draws in-process, byte for byte (the caches only save work); if the
helper fails or takes too long, the run draws in-process as before.

This module imports no JAX and no matplotlib at import time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# How long the run waits for the helper's PNG before drawing it itself.
DRAW_TIMEOUT_S = 60.0


def plot_curves(metrics_path: Path, out: Path, title: str = "", loss_unit: str = "") -> None:
    """Train/test loss (and accuracy when present) against step, as a PNG titled
    ``title``, the loss axis labelled with its unit."""
    _draw(_read_records(Path(metrics_path)), Path(out), title=title, loss_unit=loss_unit)


def _read_records(metrics_path: Path) -> list[dict]:
    return [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]


def _draw(
    records: list[dict], out: Path | None, buffer=None, title: str = "", loss_unit: str = ""
) -> None:
    """Draw ``records`` to ``out`` (written under a temporary name, then renamed) or, with
    ``out=None``, into the file object ``buffer``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric_names = ["loss"] + (["accuracy"] if any("accuracy" in r for r in records) else [])
    fig, axes = plt.subplots(
        1, len(metric_names), figsize=(5 * len(metric_names), 3.5), squeeze=False
    )
    for ax, name in zip(axes[0], metric_names):
        for split in ("train", "test", "val"):
            pts = [  # null: a skipped step's non-finite value
                (r["step"], r[name])
                for r in records
                if r["split"] == split and r.get(name) is not None
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=split, marker=None if split == "train" else "o", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{name} ({loss_unit})" if name == "loss" and loss_unit else name)
        if name == "loss":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if out is None:
        fig.savefig(buffer, format="png", dpi=100)
        plt.close(fig)
        return
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)


def _warm_up(accuracy: bool) -> None:
    """Draw a throwaway figure laid out like a run's (log-scale loss over a few decades,
    accuracy, legends): fonts, mathtext tick labels and text metrics get cached."""
    import io

    records = []
    for i in range(1, 31):
        step = 50 * i
        for split in ("train", "test"):
            r = {"step": step, "split": split, "loss": 2.5 * 0.8**i}
            if accuracy:
                r["accuracy"] = 1 - 0.9 * 0.85**i
            records.append(r)
    _draw(records, None, io.BytesIO(), title="warm-up", loss_unit="nats")


def _child(accuracy: bool) -> int:
    """The helper process: warm up, then draw the one request read from stdin
    (``{"metrics": path, "out": path}``); exits at once on EOF (the run ended without
    curves: an error, a preemption)."""
    try:
        _warm_up(accuracy)
    except Exception:  # the real draw will fail too and say why, in the run itself
        return 1
    line = sys.stdin.readline()
    if not line:
        return 0
    request = json.loads(line)
    plot_curves(
        Path(request["metrics"]), Path(request["out"]), request["title"], request["loss_unit"]
    )
    # The PNG is in place (written, closed, renamed): end without the interpreter's
    # teardown of matplotlib, ~0.1 s that the run would otherwise wait for.
    os._exit(0)


class CurvePlotter:
    """Draws ``curves.png`` in a helper process started now (see the module docstring).

    Call :meth:`draw` once the metrics are final, then :meth:`wait`; or :meth:`close` to
    stop the helper without drawing. Waits are bounded by ``timeout`` seconds, after
    which the run draws in-process.
    """

    def __init__(self, accuracy: bool = True, timeout: float = DRAW_TIMEOUT_S):
        self.timeout = timeout
        self._request: tuple[Path, Path, str, str] | None = None
        # The helper imports this module by the name it has here: installed
        # (``nnlite.train.report.plot``) the interpreter finds it; run from a checkout
        # (``train.report.plot``), from the directory holding ``train/``, whatever the cwd.
        code = "import sys; "
        if not __name__.startswith("nnlite."):
            root = str(Path(__file__).resolve().parents[2])
            code += f"sys.path.insert(0, {root!r}); "
        code += f"from {__name__} import _child; sys.exit(_child({bool(accuracy)}))"
        self.by_helper = False  # whether the PNG came from the helper (else in-process)
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self._proc = None  # no helper: wait() draws in-process

    def draw(self, metrics_path: Path, out: Path, title: str = "", loss_unit: str = "") -> None:
        """Hand the finished metrics to the helper (returns at once)."""
        self._request = (Path(metrics_path), Path(out), title, loss_unit)
        if self._proc is None:
            return
        try:
            request = {
                "metrics": str(metrics_path),
                "out": str(out),
                "title": title,
                "loss_unit": loss_unit,
            }
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.close()
        except OSError:  # the helper died: wait() draws in-process
            self._stop()

    def wait(self) -> None:
        """Return once the requested PNG is written: by the helper, or else drawn here."""
        if self._request is None:
            self.close()
            return
        metrics_path, out, title, loss_unit = self._request
        self._request = None
        ok = False
        if self._proc is not None:
            try:
                ok = self._proc.wait(self.timeout) == 0 and out.is_file()
                self.by_helper = ok
            except subprocess.TimeoutExpired:
                pass
            self._stop()
        if not ok:
            plot_curves(metrics_path, out, title, loss_unit)

    def close(self) -> None:
        """Stop the helper without drawing (bounded: it exits on EOF, else it is killed)."""
        self._request = None
        if self._proc is None:
            return
        try:
            self._proc.stdin.close()
            self._proc.wait(1.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._stop()

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def plot_lr_find(
    points: list[dict], out: Path, title: str = "", marks: dict[str, float] | None = None
) -> None:
    """An LR range test (``nnlite-train lr-find``) as a PNG: the loss and its smoothed
    curve against the learning rate (log scale), a dashed line at each of ``marks``
    (label -> learning rate). ``points``: ``{"lr", "loss", "smoothed_loss"}`` records."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = [p["lr"] for p in points]
    raw = [p["loss"] if math.isfinite(p["loss"]) else float("nan") for p in points]
    smooth = [p["smoothed_loss"] for p in points]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(lrs, raw, alpha=0.3, label="loss")
    ax.plot(lrs, smooth, label="smoothed loss")
    for (label, lr), color in zip((marks or {}).items(), ("C2", "C3", "C4")):
        ax.axvline(lr, color=color, linestyle="--", label=f"{label}: {lr:.2g}")
    finite = [v for v in smooth if math.isfinite(v)]
    if finite:  # the divergence at the end would flatten the interesting part
        low = min(finite + [v for v in raw if math.isfinite(v)])
        top = max(finite[: max(1, len(finite) // 10)])
        ax.set_ylim(low - 0.05 * (top - low + 1e-12), top + 0.25 * (top - low + 1e-12))
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
