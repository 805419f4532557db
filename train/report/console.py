"""What a run shows a person: its first line, the progress bar and its closing line."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from ..parallel import distributed as dist
from ..report.machine import machine_lines
from ..report.units import format_bytes

# Short names of metrics on the progress bar.
BAR_NAMES = {"loss": "loss", "accuracy": "acc", "bits_per_char": "bpc", "bits_per_token": "bpt"}


def banner(
    r, num_params: int, start: int, state_bytes: int | None = None, trained: int | None = None
) -> str:
    """The run's first line: devices, model size (``trained``: how many of the params train
    when some are frozen, LoRA's adapters; ``state_bytes``, the params and optimizer state
    one device holds), gradient mode (``auto`` as resolved), data, run directory (``r``: a
    Run whose step is built), and notes on lines below."""
    cfg = r.cfg
    procs = f"{jax.process_count()} processes x " if dist.is_multiprocess() else ""
    per_proc = len(r.devices) // jax.process_count()
    # what the machine has (the CPU's ISA, or the accelerator's kind)
    note = "".join(f"\n  {line}" for line in machine_lines(r.devices[0], cfg.train.precision))
    if r.data.note:
        note += f"\n  note: {r.data.name}: {r.data.note}"
    if r.grad.note:  # why auto fell back to autodiff: the operation without a rule
        note += f"\n  {r.grad.note}"
    if r.grad.rules_note:  # the user's hand rules: checked against jax.vjp, or not
        note += f"\n  {r.grad.rules_note}"
    per_device = ""
    if state_bytes is not None:
        per_device = f", params + optimizer {format_bytes(state_bytes)} per device"
    size = f"{num_params:,} params"
    if trained is not None and trained < num_params:  # frozen params: say how many train
        size = (
            f"params: {trained:,} trainable of {num_params:,} ({100 * trained / num_params:.1f}%)"
        )
    return (
        f"nnlite train: {cfg.name}  devices: {procs}{per_proc} x {r.devices[0].platform} "
        f"({r.strategy.describe()})  model: {cfg.model.name} ({size}{per_device})  grad: {r.grad.describe()}  data: {r.data.name} ({r.data.describe()})  "
        f"run dir: {r.run_dir}" + (f"  resuming at step {start}" if start else "") + note
    )


def done(r, last_eval: dict, skipped: int, wall: float, rate: float) -> str:
    """The closing line: final held-out metrics, skipped steps, wall time and speed."""
    split, window = r.data.eval_split, r.data.window
    more = "".join(
        f", {split} {name.replace('_', ' ')} {last_eval[name]:.4f}"
        for name in ("accuracy", "bits_per_token", "bits_per_char")
        if name in last_eval
    )
    skip = f", {skipped} non-finite steps skipped" if skipped else ""
    speed = f"{rate:,.0f} examples/s" if window is None else f"{rate * window:,.0f} tokens/s"
    loss = last_eval.get("loss", float("nan"))
    return f"done: step {r.step}, {split} loss {loss:.4f}{more}{skip}, wall {wall:.1f} s, {speed}"


def already_finished(r, last_eval: dict) -> str:
    """The line for a rerun of a run that has reached ``train.steps``."""
    shown = ", ".join(
        f"test {k} {v:.4f}" if isinstance(v, float) else f"test {k} {v}"
        for k, v in sorted(last_eval.items(), key=lambda kv: kv[0] != "loss")
    )
    return (
        f"already finished: step {r.step} of train.steps={r.cfg.train.steps}"
        + (f", {shown}" if shown else "")
        + f" (from {r.run_dir / 'metrics.jsonl'}); nothing to train. Raise train.steps "
        "to train on, or use --fresh to start over"
    )


def stopped_before(r, reason: str | None) -> str:
    """A rerun of a run a callback stopped early: say so; train nothing."""
    why = f": {reason}" if reason else ""
    return (
        f"{r.cfg.name}: stopped early at step {r.step} of {r.cfg.train.steps}{why}; nothing "
        f"to train (run dir {r.run_dir}; --fresh starts over)"
    )


#: The unit of each task's loss, for the plot's axis.
LOSS_UNITS = {
    "classification": "cross-entropy, nats",
    "regression": "mean squared error",
    "language_model": "cross-entropy, nats/token",
}


def plot_labels(r) -> tuple[str, str]:
    """``(title, loss unit)`` of a run's curves.png: the run name and model, the unit."""
    return f"{r.cfg.name} ({r.cfg.model.name})", LOSS_UNITS.get(r.model.task, "")


def bar_postfix(metrics: dict, rate: float, window: int | None) -> dict:
    """What the progress bar shows after a log: the metrics and examples (tokens) per s."""
    # the norms (log.norms) go to the records, not the bar
    shown = {BAR_NAMES.get(k, k): f"{v:.4f}" for k, v in metrics.items() if not k.endswith("_norm")}
    if window is not None:
        shown["tok_s"] = f"{rate * window:,.0f}"
    else:
        shown["ex_s"] = f"{rate:,.0f}"
    return shown


class ProgressBar(Protocol):
    """What the loop uses of a tqdm bar."""

    def set_postfix(self, **kwargs: Any) -> None: ...

    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


class _NoBar:
    def set_postfix(self, **_):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


class PlainLines:
    """Progress as plain lines on stdout, never a carriage return: one per evaluation, and
    (``periodic``: the output is no terminal, a log file) the train metrics at a log
    boundary at most every ``every_s`` seconds."""

    def __init__(self, name: str, total: int, start: int, *, periodic: bool, every_s: float):
        self.name, self.total, self.step = name, total, start
        self.periodic, self.every_s = periodic, every_s
        self._last = time.monotonic()

    def set_postfix(self, **kwargs: Any) -> None:
        now = time.monotonic()
        if self.periodic and now - self._last >= self.every_s:
            self._last = now
            shown = ", ".join(f"{k} {v}" for k, v in kwargs.items())
            print(f"{self.name}: step {self.step}/{self.total}, {shown}", flush=True)

    def update(self, n: int) -> None:
        self.step += n

    def eval_line(self, step: int, split: str, metrics: dict) -> None:
        shown = ", ".join(
            f"{split} {k.replace('_', ' ')} {v:.4f}" for k, v in metrics.items() if k != "time"
        )
        print(f"{self.name}: step {step}/{self.total}, {shown}", flush=True)

    def close(self) -> None:
        pass


# A log file gets the train metrics at most this often (seconds) instead of a bar.
PLAIN_EVERY_S = 10.0


def report_eval(bar: ProgressBar, step: int, split: str, metrics: dict) -> None:
    """An evaluation's line, where the progress is shown as lines (not on a tqdm bar,
    whose postfix shows the train metrics)."""
    line = getattr(bar, "eval_line", None)
    if line is not None:
        line(step, split, metrics)


def progress_bar(cfg, start: int, *, show: bool = True) -> ProgressBar:
    """A tqdm bar over ``train.steps`` on a terminal; plain lines (:class:`PlainLines`)
    when ``log.progress`` is off (one per evaluation) or stderr is no terminal (also the
    train metrics every :data:`PLAIN_EVERY_S` s); nothing when not ``show``."""
    if not show:
        return _NoBar()
    if not cfg.log.progress or not sys.stderr.isatty():
        return PlainLines(
            cfg.name, cfg.train.steps, start, periodic=cfg.log.progress, every_s=PLAIN_EVERY_S
        )
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.steps, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True
    )


@dataclass
class IntervalMeans:
    """The train metrics' means over the steps since the last log (what a train record
    shows), summed on the host in step order in float64. A checkpoint saves the partial
    sums (:meth:`state`), so a run resumed between two logs logs the same means as one
    that never stopped. Non-finite values (a skipped step's) are left out of the means."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, metrics: dict) -> None:
        """Fold in one compiled call's metrics (``{name: [K]}``, or ``[devices, K]``)."""
        for name, v in metrics.items():
            if name == "nonfinite":
                continue
            values = np.asarray(v if v.is_fully_addressable else v.addressable_data(0))
            for x in values.reshape(-1, values.shape[-1])[0].astype(np.float64):
                if math.isfinite(x):
                    self.sums[name] = self.sums.get(name, 0.0) + float(x)
                    self.counts[name] = self.counts.get(name, 0) + 1
                else:
                    self.sums.setdefault(name, 0.0)
                    self.counts.setdefault(name, 0)

    def take(self) -> dict[str, float]:
        """The means (nan for a metric with no finite value), and start a new interval."""
        names = sorted(self.sums, key=lambda k: k != "loss")  # the loss first
        out = {k: self.sums[k] / self.counts[k] if self.counts[k] else math.nan for k in names}
        self.sums, self.counts = {}, {}
        return out

    def state(self) -> dict:
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    @classmethod
    def from_state(cls, state: dict | None) -> IntervalMeans:
        state = state or {}
        return cls(dict(state.get("sums", {})), dict(state.get("counts", {})))
