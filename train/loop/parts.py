"""The parts of a running training loop (``_Loop`` in trainer.py): the state between
compiled calls and its counters, each call's batch, what the run reports as it goes, and
the bookkeeping of its checkpoints."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.best import BestCheckpoints
from ..checkpoint.writer import Writer
from ..data.dataset import Sampler
from ..data.feed import BatchFeed
from ..data.text.units import name_metrics
from ..parallel import distributed as dist
from ..report import console as report
from ..report import perf
from ..report.loggers import MetricsLog
from ..report.plot import CurvePlotter
from ..report.profile import Profiler
from ..report.timings import Timings


@dataclass
class TrainState:
    """The training state between compiled calls, placed on the devices for the stepper,
    and the loop's counters."""

    step: int  # steps done
    p_leaves: list  # params and optimizer state, placed for the stepper
    o_leaves: list
    s_leaves: list  # a stateful model's state, placed ([] for a stateless model)
    skipped: int  # non-finite steps skipped (train.nonfinite=skip)
    start_step: int  # the step this run started (or resumed) at
    calls: int = 0  # compiled calls done (every process counts alike)
    metrics: dict = field(default_factory=dict)  # the last call's metrics (on the device)
    pending: list = field(default_factory=list)  # each call's metrics since the last boundary
    pending_from: int = 0  # the step ``pending`` starts at
    in_flight: list = field(default_factory=list)  # outputs of calls not yet waited for

    @property
    def leaves(self) -> tuple[list, list, list]:
        return self.p_leaves, self.o_leaves, self.s_leaves


@dataclass
class Batches:
    """Each compiled call's batch: this process's share of the (seed, step) order's indices,
    placed for the stepper (the data lives on the devices), or with streamed data the
    batch itself, read and placed a call ahead by ``feed``."""

    sampler: Sampler
    stepper: Any
    feed: BatchFeed | None = None

    def get(self, step: int, k: int):
        """The batch of the call that runs steps ``step + 1 .. step + k``."""
        if self.feed is not None:  # streamed: read and placed while the last call ran
            return self.feed.get(step, k)
        return self.stepper.put_indices(dist.process_share(self.sampler.batches(step, k)), step)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()


@dataclass
class Reporter:
    """What the run says as it goes: the console (``echo``), the progress bar,
    metrics.jsonl and the other loggers (process 0 only), the timings, the profiler, and
    the FLOP counts behind MFU."""

    echo: Callable[[str], None]
    bar: report.ProgressBar
    timings: Timings
    profiler: Profiler  # --profile START:STOP
    log: MetricsLog | None = None  # metrics.jsonl and the other loggers (process 0 only)
    means: report.IntervalMeans = field(default_factory=report.IntervalMeans)
    lr: Callable | None = None  # the optimizer's schedule: step -> learning rate
    plotter: CurvePlotter | None = None  # None: the run draws curves.png itself
    flops: float | None = None  # model FLOPs per step (None: not known, e.g. pmap)
    peak: float | None = None  # the devices' peak FLOP/s in the compute dtype
    last_eval: dict = field(default_factory=dict)  # the last evaluation's metrics
    t_start: float = 0.0  # when the training started
    t_window: float = 0.0  # examples/s is measured over the steps since the last record
    window_start: int = 0

    def start(self, step: int) -> None:
        """The clock starts: training begins at ``step``."""
        self.t_start = self.t_window = time.perf_counter()
        self.window_start = step

    def write(self, record: dict) -> None:
        if self.log is not None:  # process 0 writes the run directory
            self.log.write(record)

    def train_record(self, r, step: int, skipped: int) -> dict:
        """A train record in metrics.jsonl (the metrics' means over the steps since the last
        record, and the learning rate of the last step) and the progress bar; the means."""
        tc = r.cfg.train
        m = name_metrics(self.means.take(), r.data.loss_unit, None)
        now = time.perf_counter()
        rate = (step - self.window_start) * tc.batch_size / max(now - self.t_window, 1e-9)
        self.t_window, self.window_start = now, step
        extra = {"skipped_steps": skipped} if tc.nonfinite == "skip" else {}
        window = r.data.window
        rates = {"examples_per_s": round(rate, 1)}
        if window is not None:
            rates["tokens_per_s"] = round(rate * window, 1)
        rates.update(perf.utilisation(self.flops, 1, tc.batch_size / max(rate, 1e-9), self.peak))
        self.write(
            {
                "step": step,
                "split": "train",
                **m,
                **({} if self.lr is None else {"lr": self.lr(step - 1)}),
                **extra,
                **rates,
                "time": round(now - self.t_start, 3),
            }
        )
        self.bar.set_postfix(**report.bar_postfix(m, rate, window))
        return m

    def eval_record(self, r, step: int, result: dict) -> None:
        """An evaluation's ``result`` as the last evaluation, its record and its line."""
        data = r.data
        metrics = {k: float(v) for k, v in result.items()}
        self.last_eval = name_metrics(metrics, data.loss_unit, data.chars_per_token)
        report.report_eval(self.bar, step, data.eval_split, self.last_eval)
        self.write(
            {
                "step": step,
                "split": data.eval_split,
                **self.last_eval,
                "time": round(time.perf_counter() - self.t_start, 3),
            }
        )
        self.timings.lap("eval")

    def close(self, step: int) -> None:
        self.profiler.close(step)
        self.bar.close()
        if self.log is not None:
            self.log.close()


@dataclass
class CheckpointBook:
    """The run's checkpoints as the loop keeps track of them: the writer (inline, or a
    thread with ``checkpoint.async``), the last state known good, the best k, and when the
    last checkpoint was taken."""

    writer: Writer
    best: BestCheckpoints  # checkpoint.keep_best: the ranking (process 0)
    good_step: int  # the last state known finite and saved (or the initial state)
    good_ckpt: Path | None
    # A callback has on_checkpoint: async writes are collected at the next boundary,
    # waiting there, so that its events keep one order.
    waits: bool = False
    t_last: float = field(default_factory=time.monotonic)  # checkpoint.every_minutes

    def collect(self, wait: bool) -> list[tuple[int, Path | None]]:
        """The writes that finished (``wait``: for the one in flight), each as ``(step, the
        newest checkpoint then)``, the last good state moved to them."""
        done = []
        for step, path in self.writer.collect(wait):
            self.good_step, self.good_ckpt = step, path or self.good_ckpt
            done.append((step, self.good_ckpt))
        return done

    def drain(self) -> None:
        """The write in flight completes: the newest checkpoint is the last good state."""
        self.writer.drain()
        self.collect(False)

    def wanted(self, ck, evaluated: bool, step: int, last_eval: dict) -> bool:
        """Whether to checkpoint at this boundary besides ``checkpoint.every`` (``ck``): this
        evaluation entered the best k, or ``checkpoint.every_minutes`` have passed since the
        last checkpoint (process 0 decides; every process agrees)."""
        if not (ck.keep_best or ck.every_minutes):
            return False
        best = evaluated and dist.is_main() and self.best.consider(step, last_eval)
        timed = bool(ck.every_minutes) and time.monotonic() - self.t_last >= 60 * ck.every_minutes
        wanted = best or timed
        if dist.is_multiprocess():
            wanted = bool(dist.broadcast(np.array([wanted], np.int32))[0])
        return wanted
