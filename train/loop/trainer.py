"""The training loop: one compiled call after another, stopping at the boundaries to log,
evaluate and checkpoint. Building and compiling live in ``build.py``, the run directory
in ``rundir.py``, where a run starts in ``resume.py``, faults in ``faults.py``."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import faults
from ..checkpoint import rundir
from ..checkpoint import store as ckpt
from ..checkpoint.best import META_KEY as BEST_KEY
from ..checkpoint.best import BestCheckpoints
from ..checkpoint.resume import agree_on_start, metadata
from ..checkpoint.writer import Writer
from ..config import Config, to_dict
from ..data import feed, overfit
from ..data.dataset import Dataset, Sampler
from ..data.feed import BatchFeed, call_schedule
from ..data.source import DataError
from ..data.text.units import name_metrics
from ..errors import ERROR_LOG, ConfigError, UserCodeError
from ..optim import ema
from ..optim.named import schedule
from ..parallel import distributed as dist
from ..parallel.finite import finite_on_devices
from ..report import console as report
from ..report import perf
from ..report.loggers import MetricsLog
from ..report.plot import CurvePlotter, plot_curves
from ..report.profile import Profiler
from ..report.timings import Timings
from . import nonfinite
from .build import Prepared, Run, build, init_compiler_options, make_stepper, prepare
from .callbacks import Callback, Callbacks, LoopState, build_callbacks
from .checkgrads import check_grads, check_user_rules
from .monitors import check_monitors
from .step import policy_loss_fn, step_flags

#: Checkpoint metadata: a SIGTERM/SIGINT stopped the evaluation at the checkpoint's step.
EVAL_PENDING_KEY = "eval_pending"


def boundaries(cfg: Config) -> list[int]:
    """The cadences (in steps) at which the loop stops to log, evaluate or checkpoint."""
    tc = cfg.train
    return [tc.eval_every, tc.log_every] + ([cfg.checkpoint.every] if cfg.checkpoint.every else [])


def steps_in_call(cfg: Config, step: int, every: list[int]) -> int:
    """How many steps the call starting at ``step`` runs: up to ``train.steps_per_call``,
    stopping at the next boundary (``every``: :func:`boundaries`) or the end."""
    tc = cfg.train
    k = tc.steps_per_call - step % tc.steps_per_call
    nxt = min([tc.steps] + [(step // e + 1) * e for e in every])
    return min(k, nxt - step)


def train(
    cfg: Config,
    *,
    resume: str = "auto",
    echo=print,
    timings: Timings | None = None,
    plotter=None,
    data: Dataset | Future | None = None,
    callbacks: Sequence[Any] = (),
    optimizer: Any = None,
    loggers: Sequence[Any] = (),
) -> Run:
    """Train per ``cfg``. ``resume``: "auto" (latest checkpoint if any), "require", "fresh".
    ``callbacks``: objects called at the loop's events (train/loop/callbacks.py), after
    the config's; ``optimizer``: the optax GradientTransformation that
    ``optimizer.name: given`` stands for.

    Raises ConfigError on bad input, ``faults.Preempted`` after a SIGTERM/SIGINT checkpoint
    and ``faults.NonFinite`` when a step goes non-finite with ``train.nonfinite=stop``.

    ``timings`` (train/report/timings.py) collects where the time goes; ``plotter`` (a
    ``train.report.plot.CurvePlotter``) draws curves.png in its helper process, and the caller
    waits for it (without one, the run draws it before returning); ``data``: see
    :func:`build`; ``loggers``: logger objects (train/report/loggers.py) that get every
    record, after the config's ``log.loggers``.

    The skeleton: build and compile; agree on the starting state (checkpoint or init)
    before writing anything; then one compiled call after another, stopping at the
    boundaries to log, evaluate and checkpoint (each a method of :class:`_Loop`).
    """
    dist.initialize(cfg.distributed)  # before anything touches a device
    if not dist.is_main():
        echo = _quiet
    timings = timings or Timings()
    try:
        r = build(cfg, data, timings, optimizer)
        cbs = build_callbacks(cfg.callbacks, cfg.train.early_stopping, callbacks)
        loop = _Loop.begin(r, resume, echo, timings, plotter, cbs, loggers)
    except UserCodeError as e:  # at start-up: nothing trained (the CLI's exit 2)
        write_error_log(e, Path(cfg.log.dir) / cfg.name)
        raise
    pending = loop.eval_pending  # a signal stopped the evaluation at the resumed step
    if (loop.step >= cfg.train.steps and not pending) or loop.stopped_before:
        return loop.already_finished()
    try:
        with loop.watch, loop.watchdog:
            loop.call("on_fit_start", loop.view)
            # the evaluation a signal stopped, then its step checkpointed again (not pending)
            stop = pending and loop.evaluated(Boundary(False, True, True, False))
            while loop.step < cfg.train.steps and not stop:
                loop.run_call()
                at = loop.boundary()
                if at is None:
                    continue
                loop.written(wait=loop.on_checkpoint_waits)  # a finished async write
                loop.check_nonfinite()
                record = loop.log_train() if at.log else {}
                loop.call("on_step_end", loop.view, loop.step, record)
                stop = loop.evaluated(at)
            loop.written(wait=True)  # the last checkpoint complete before on_fit_end
        loop.close()  # a logger's close, on_fit_end: the user's code fails after step 1 too
        return loop.finish()
    except BaseException as e:
        if isinstance(e, UserCodeError | DataError):
            loop.failed(e)
        with contextlib.suppress(Exception):  # the failure that stopped the run is the news
            loop.close()
        raise


def write_error_log(e: UserCodeError, run_dir: Path) -> None:
    """The full traceback of a failure of the user's code in ``run_dir/error.log``
    (process 0; ``e.log`` says where, or stays None if it could not be written)."""
    if not dist.is_main():
        return
    path = run_dir / ERROR_LOG
    stack = "".join(traceback.format_list(traceback.extract_tb(e.__traceback__)))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"{e.trace}\nin the run, at (most recent call last):\n{stack}\nerror: {e}\n"
        )
    except OSError:
        return
    e.log = path


@dataclass(frozen=True)
class Boundary:
    """What the loop does after the call that ended at a step."""

    log: bool
    eval: bool
    checkpoint: bool
    stop: bool  # a SIGTERM/SIGINT was agreed on: checkpoint and leave


@dataclass
class _Loop:
    """The state of a training run between compiled calls, and its named steps."""

    r: Run
    prep: Prepared
    sampler: Sampler
    echo: Callable[[str], None]
    step: int  # steps done
    p_leaves: list  # params and optimizer state, placed for the stepper
    o_leaves: list
    s_leaves: list  # a stateful model's state, placed ([] for a stateless model)
    skipped: int  # non-finite steps skipped (train.nonfinite=skip)
    good_step: int  # the last state known finite and saved (or the initial state)
    good_ckpt: Path | None
    start_step: int = 0  # the step this run started (or resumed) at
    calls: int = 0
    metrics: dict = field(default_factory=dict)  # the last call's metrics (on the device)
    pending: list = field(default_factory=list)  # each call's metrics since the last boundary
    pending_from: int = 0
    last_eval: dict = field(default_factory=dict)
    window_start: int = 0  # examples/s is measured over the steps since the last log
    t_start: float = 0.0
    t_window: float = 0.0
    log: MetricsLog | None = None  # metrics.jsonl and the other loggers (process 0 only)
    means: report.IntervalMeans = field(default_factory=report.IntervalMeans)
    lr: Callable | None = None  # the optimizer's schedule: step -> learning rate
    bar: report.ProgressBar | None = None
    watch: faults.PreemptionWatch | None = None
    timings: Timings = field(default_factory=Timings)
    plotter: CurvePlotter | None = None  # None: draw in finish()
    watchdog: faults.Watchdog | None = None
    in_flight: list = field(default_factory=list)  # outputs of calls not yet waited for
    feed: BatchFeed | None = None  # streamed data: each call's batch, placed a call ahead
    callbacks: Callbacks | None = None  # run on process 0 (train/loop/callbacks.py)
    view: LoopState | None = None  # what the callbacks read, and their stop request
    stopped_before: bool = False  # the checkpoint resumed from ended an early-stopped run
    best: BestCheckpoints | None = None  # checkpoint.keep_best: the ranking (process 0)
    writer: Writer | None = None  # writes checkpoints inline, or on a thread (async)
    on_checkpoint_waits: bool = False  # a callback has on_checkpoint: async writes are
    # collected at the next boundary, waiting there, so its events keep one order
    t_ckpt: float = 0.0  # when the last checkpoint was taken (checkpoint.every_minutes)
    flops: float | None = None  # model FLOPs per step (None: not known, e.g. pmap)
    peak: float | None = None  # the devices' peak FLOP/s in the compute dtype
    profiler: Profiler | None = None  # --profile START:STOP
    eval_pending: bool = False  # this step's evaluation was stopped by a signal (evaluated)

    @classmethod
    def begin(
        cls,
        r: Run,
        resume: str,
        echo,
        timings: Timings,
        plotter=None,
        callbacks=None,
        loggers: Sequence = (),
    ) -> _Loop:
        """Compile, agree on the starting state, then (process 0) set up the run directory."""
        cfg = r.cfg
        callbacks = Callbacks([], []) if callbacks is None else callbacks
        sampler = overfit.run_sampler(cfg, r.data)  # train.overfit_batches: N, repeated
        first = dist.process_share(sampler.batches(0, steps_in_call(cfg, 0, boundaries(cfg))))
        prep = prepare(r, cfg.train.nonfinite, first)
        timings.lap("compile")
        check_monitors(r, prep, callbacks)  # before anything is written
        # Decide where to start before writing anything: a bad checkpoint must not cost files.
        begin = agree_on_start(
            cfg,
            resume,
            r.run_dir / "checkpoints",
            prep.params0,
            prep.opt0,
            r.strategy,
            r.grad_mode,
            prep.state0,
        )
        start = begin.step
        if cfg.train.check_grads and start < cfg.train.steps:  # issue 34: rules checked first
            check_grads(r, prep.params0, prep.state0, sampler, echo)
        elif start < cfg.train.steps:  # issue 46: the user's own rules, before step 1
            check_user_rules(r, prep.params0, prep.state0, sampler)
        if r.data.stream is not None:  # an iterable source continues at its saved position
            saved = begin.checkpoint and ckpt.read_metadata(begin.checkpoint)
            sampler.restore(start, saved or None)
        if dist.is_main():  # only process 0 writes the run directory
            rundir.open_run_dir(r.run_dir, r.cfg, resume, start)
        state_bytes = sum(r.strategy.bytes_per_device(t) for t in (prep.params0, prep.opt0))
        trained = None if r.plan is None else r.plan.num_trained(prep.params0)
        echo(report.banner(r, prep.params0.num_params(), start, state_bytes, trained))
        if r.backward is not None and r.backward.describe():  # issue 34: what policies do
            echo(r.backward.describe())
        put = prep.stepper.put_state
        loop = cls(
            r,
            prep,
            sampler,
            echo,
            step=start,
            p_leaves=put(begin.p_leaves),
            o_leaves=put(begin.o_leaves),
            s_leaves=put(begin.s_leaves),
            skipped=begin.skipped,
            good_step=start,
            good_ckpt=begin.checkpoint,
            start_step=start,
            pending_from=start,
            window_start=start,
            timings=timings,
            plotter=plotter,
        )
        loop.bar = report.progress_bar(cfg, start, show=dist.is_main())
        pending = begin.meta.get(EVAL_PENDING_KEY) == "1"  # the resumed step's evaluation
        if dist.is_main() and (start < cfg.train.steps or pending) and not begin.stopped:
            loop.log = MetricsLog.open(
                r.run_dir, start, to_dict(cfg), cfg.log.loggers, cfg.log.tensorboard, loggers
            )
        loop.means = report.IntervalMeans.from_state(begin.log_window)
        loop.lr = host_schedule(schedule(cfg.optimizer, cfg.train.steps))
        loop.watch = faults.PreemptionWatch(dist.is_multiprocess())
        settings = dist.resolve(cfg.distributed)
        loop.watchdog = faults.Watchdog(
            cfg.train.step_timeout,
            multiprocess=dist.is_multiprocess(),
            # automatic: fire before JAX's heartbeat abort does (a C++ stack, status -6)
            cap=0.5 * settings.heartbeat_timeout if settings else None,
            fresh_line=cfg.log.progress and dist.is_main(),
        )
        if r.data.streamed:
            every = boundaries(cfg)
            calls = call_schedule(start, cfg.train.steps, lambda s: steps_in_call(cfg, s, every))
            loop.feed = BatchFeed(r.data, sampler, prep.stepper, calls)
        loop.callbacks = callbacks if dist.is_main() else Callbacks([], [])
        loop.view = LoopState(cfg, r.model, r.run_dir, loop.host_state)
        loop.view.step = start
        loop.stopped_before = begin.stopped
        if begin.checkpoint is not None and loop.callbacks:
            loop.callbacks.load(begin.meta.get("callbacks"), f"checkpoint {begin.checkpoint}")
            # the uninterrupted run called on_checkpoint after saving this state: again
            loop.call("on_checkpoint", loop.view, start, begin.checkpoint)
        loop.view.stop_reason = begin.meta.get("stopped")
        loop.eval_pending = begin.meta.get(EVAL_PENDING_KEY) == "1"
        ck = cfg.checkpoint
        loop.best = BestCheckpoints(ck.keep_best, ck.monitor, ck.mode)
        if begin.checkpoint is not None and loop.best and dist.is_main():
            loop.best.load(begin.meta.get(BEST_KEY), f"checkpoint {begin.checkpoint}")
        loop.writer = Writer(ck.async_)
        loop.on_checkpoint_waits = any(
            callable(getattr(cb, "on_checkpoint", None))
            and getattr(type(cb), "on_checkpoint", None) is not Callback.on_checkpoint
            for cb in loop.callbacks.items
        )
        loop.t_ckpt = time.monotonic()
        loop.flops, loop.peak = _flops_and_peak(r, prep)  # MFU (train/report/perf.py)
        loop.profiler = Profiler.from_config(cfg, r.run_dir, echo)  # --profile START:STOP
        loop.t_start = loop.t_window = time.perf_counter()
        timings.lap("other")
        return loop

    # -- the steps of the loop ---------------------------------------------------------

    def run_call(self) -> None:
        """One compiled call: up to ``train.steps_per_call`` steps, up to the next boundary."""
        cfg, stepper = self.r.cfg, self.prep.stepper
        k = steps_in_call(cfg, self.step, boundaries(cfg))
        if self.feed is not None:  # streamed: read and placed while the last call ran
            batch = self.feed.get(self.step, k)
        else:
            batch = stepper.put_indices(
                dist.process_share(self.sampler.batches(self.step, k)), self.step
            )
        self.profiler.before_call(self.step, k)
        if faults.stuck_here(self.step, k, jax.process_index()):  # test hook
            stuck = faults.StuckCall()
            self.watchdog.watch(self.step, stuck)
            stuck.block_until_ready()  # as at any sync point: never returns
        self.p_leaves, self.o_leaves, self.s_leaves, self.metrics = stepper.run(
            self.p_leaves, self.o_leaves, self.s_leaves, self.prep.X, self.prep.Y, batch
        )
        self.watchdog.watch(self.step, self.metrics)
        # Several processes on CPU (gloo): every local device's part of a call runs on a
        # shared thread pool and blocks its thread inside gloo's collectives. With many
        # calls in flight, the pool fills with parts waiting in a collective (or for a
        # device's in-flight slot) while the part they wait for has no thread left: a
        # deadlock with every process alive (2 x 8 devices: ~step 45; pmap 2 x 2: ~100).
        # Bounding the calls in flight rules that out.
        limit = max_in_flight(dist.is_multiprocess(), len(stepper.devices))
        if limit is not None:
            self.in_flight.append(self.metrics)
            while len(self.in_flight) > limit:
                jax.block_until_ready(self.in_flight.pop(0))
        self.step += k
        self.profiler.after_call(self.step, self.metrics)
        self.calls += 1
        self.bar.update(k)
        self.pending.append(self.metrics)  # non-finite flags: read at the next boundary

    def boundary(self) -> Boundary | None:
        """What to do now that ``self.step`` steps are done (None: just carry on)."""
        cfg, step = self.r.cfg, self.step
        last = step == cfg.train.steps
        at = Boundary(
            log=step % cfg.train.log_every == 0 or last,
            eval=step % cfg.train.eval_every == 0 or last,
            checkpoint=bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last,
            stop=self.watch.should_stop(self.calls),
        )
        return at if (at.log or at.eval or at.checkpoint or at.stop) else None

    def evaluated(self, at: Boundary) -> bool:
        """The rest of a boundary: evaluate, a callback's stop, the checkpoint, a signal's
        stop (``faults.Preempted``). True: a callback stopped the run.

        A SIGTERM/SIGINT during the evaluation (one process) ends it after the chunk being
        evaluated: the run checkpoints this step with the evaluation marked pending
        (``eval_pending``), which the resumed run does first, so the records and the
        callbacks' events are the uninterrupted run's."""
        if at.eval and not self.evaluate():
            at = Boundary(at.log, False, at.checkpoint, stop=True)
            self.eval_pending = True
        elif at.eval:
            self.eval_pending = False
            self.call("on_eval_end", self.view, self.step, self.last_eval)
        stop = self.agree_on_stop()  # a callback's stop, agreed by every process
        wanted = self.checkpoint_wanted(at.eval)  # best k, checkpoint.every_minutes
        if at.checkpoint or at.stop or stop or wanted:
            self.checkpoint()
        if at.stop:
            self.written(wait=True)
            raise faults.Preempted(self.step, self.good_ckpt, self.watch.signal_name)
        return stop

    def check_nonfinite(self) -> None:
        """At a boundary the host syncs anyway: read the steps' non-finite flags."""
        flags = np.concatenate([step_flags(m) for m in self.pending])
        for m in self.pending:
            self.means.add(m)
        first, self.pending, self.pending_from = self.pending_from, [], self.step
        if flags.any() and self.r.cfg.train.nonfinite == "stop":
            self._stop_nonfinite(first + int(np.argmax(flags)) + 1)
        self.skipped += int(flags.sum())

    def call(self, event: str, *args) -> None:
        """Run the callbacks' ``event`` (process 0; a no-op without callbacks)."""
        if self.callbacks:
            self.view.step = self.step
            self.callbacks.call(event, *args)

    def agree_on_stop(self) -> bool:
        """Whether a callback asked to stop at this boundary (every process agrees: the
        callbacks run on process 0)."""
        asked = self.view.stop_reason is not None
        if dist.is_multiprocess():
            asked = bool(dist.broadcast(np.array([asked], np.int32))[0])
        return asked

    def log_train(self) -> dict:
        """A train record in metrics.jsonl (the metrics' means over the steps since the last
        record, and the learning rate of the last step) and the progress bar."""
        tc = self.r.cfg.train
        m = name_metrics(self.means.take(), self.r.data.loss_unit, None)
        now = time.perf_counter()
        rate = (self.step - self.window_start) * tc.batch_size / max(now - self.t_window, 1e-9)
        self.t_window, self.window_start = now, self.step
        extra = {"skipped_steps": self.skipped} if tc.nonfinite == "skip" else {}
        window = self.r.data.window
        rates = {"examples_per_s": round(rate, 1)}
        if window is not None:
            rates["tokens_per_s"] = round(rate * window, 1)
        rates.update(perf.utilisation(self.flops, 1, tc.batch_size / max(rate, 1e-9), self.peak))
        self._write(
            {
                "step": self.step,
                "split": "train",
                **m,
                **({} if self.lr is None else {"lr": self.lr(self.step - 1)}),
                **extra,
                **rates,
                "time": round(now - self.t_start, 3),
            }
        )
        self.bar.set_postfix(**report.bar_postfix(m, rate, window))
        return m

    def evaluate(self) -> bool:
        """Metrics on the whole held-out split (process 0): a "test" record, or "val" for
        text (its fixed set of validation windows). False: a SIGTERM/SIGINT stopped it
        between two chunks (one process; no record)."""
        prep = self.prep
        jax.block_until_ready(self.p_leaves)  # the training so far is charged to "train"
        self.timings.lap("train")
        # Every process takes part in gathering a state sharded across processes (fsdp: a
        # collective); process 0 alone evaluates.
        leaves = prep.stepper.get_state(self.eval_leaves())
        state = [] if prep.state0 is None else [self.model_state(prep.eval_device)]
        if not dist.is_main():
            return True
        params = jax.tree.unflatten(prep.p_def, jax.device_put(leaves, prep.eval_device))
        # One process stops between chunks on a signal (several agree at a compiled call)
        stop = None if self.watch.multiprocess else lambda: self.watch.signal_name is not None
        if self.r.data.streamed:  # a chunk at a time from the host
            chunk = feed.eval_chunk(self.r.data)
            result = feed.evaluate(
                prep.evaluate, params, self.r.data, chunk, prep.eval_device, *state, stop=stop
            )
        elif prep.Y_test is None:  # a text split on the device, a chunk per call
            result = feed.sum_chunks(prep.evaluate, params, prep.X_test, state, stop)
        else:
            result = prep.evaluate(params, prep.X_test, prep.Y_test, *state)
        if result is None:
            self.timings.lap("eval")
            return False
        self.last_eval = {k: float(v) for k, v in result.items()}
        data = self.r.data
        self.last_eval = name_metrics(self.last_eval, data.loss_unit, data.chars_per_token)
        report.report_eval(self.bar, self.step, self.r.data.eval_split, self.last_eval)
        self._write(
            {
                "step": self.step,
                "split": self.r.data.eval_split,
                **self.last_eval,
                "time": round(time.perf_counter() - self.t_start, 3),
            }
        )
        self.timings.lap("eval")
        return True

    def checkpoint(self) -> None:
        """Save the state (process 0 writes), after checking it is finite: now, or with
        ``checkpoint.async`` on the writer thread from a snapshot (train/checkpoint/writer.py)."""
        jax.block_until_ready(self.p_leaves)
        self.timings.lap("train")
        self.written(wait=True)  # at most one write in flight
        cfg, step, background = self.r.cfg, self.step, self.writer.background
        if self.r.strategy.sharded_state:
            return self.checkpoint_sharded()
        if background:  # copies on the devices: the next steps donate these buffers
            watch = lambda flags: self.watchdog.watch(step, flags)  # noqa: E731
            if cfg.train.nonfinite == "stop" and not finite_on_devices(self.p_leaves, watch).all():
                self._stop_nonfinite(step)
            get = self.prep.stepper.get_state
            snap = [_device_copy(get(v)) for v in (self.p_leaves, self.o_leaves, self.s_leaves)]
        else:
            state = self.host_state()
            # The loss-only flag cannot see a last step that broke the params.
            if cfg.train.nonfinite == "stop" and not nonfinite.all_finite(state[0]):
                self._stop_nonfinite(step)
        write = None
        if dist.is_main():
            meta, protect = self._metadata(), frozenset(self.best.steps())
            prep = self.prep

            def write():
                p, o, s = _host_trees(prep, *snap) if background else (*state, self.model_state())
                return ckpt.save(
                    self.r.run_dir / "checkpoints", step, p, o, meta, cfg.checkpoint.keep,
                    state=s, protect=protect, model=self.r.model,
                )  # fmt: skip

        self.writer.submit(step, write)
        self.t_ckpt = time.monotonic()
        self.timings.lap("checkpoint")
        self.written(wait=False)  # a synchronous write: on_checkpoint now

    def checkpoint_sharded(self) -> None:
        """Save a sharded state: every process writes the shards its devices hold (never
        gathered: no ``get_state``), process 0 the metadata last (``ckpt.save_sharded``)."""
        prep, cfg, step = self.prep, self.r.cfg, self.step
        watch = lambda flags: self.watchdog.watch(step, flags)  # noqa: E731
        if cfg.train.nonfinite == "stop" and not finite_on_devices(self.p_leaves, watch).all():
            self._stop_nonfinite(step)
        leaves = self.p_leaves, self.o_leaves, self.s_leaves
        if self.writer.background:  # copies on the devices, sharded as the state is
            leaves = [_device_copy(v) for v in leaves]
        p, o, s = (
            jax.tree.unflatten(d, v) for d, v in zip((prep.p_def, prep.o_def, prep.s_def), leaves)
        )
        meta, protect = self._metadata(), frozenset(self.best.steps())

        def write():
            return ckpt.save_sharded(
                self.r.run_dir / "checkpoints", step, p, o, meta, cfg.checkpoint.keep,
                barrier=dist.barrier, state=None if prep.state0 is None else s, protect=protect,
                model=self.r.model,
            )  # fmt: skip

        self.writer.submit(step, write)
        self.t_ckpt = time.monotonic()
        self.timings.lap("checkpoint")
        self.written(wait=False)

    def written(self, wait: bool) -> None:
        """Account for the checkpoint writes that finished (``wait``: wait for the one in
        flight): the last good state, and the callbacks' ``on_checkpoint``."""
        for step, path in self.writer.collect(wait):
            self.good_step = step
            if path is not None:
                self.good_ckpt = path
            self.call("on_checkpoint", self.view, step, self.good_ckpt)

    def checkpoint_wanted(self, evaluated: bool) -> bool:
        """Whether to checkpoint at this boundary besides ``checkpoint.every``: this
        evaluation entered the best k, or ``checkpoint.every_minutes`` have passed since the
        last checkpoint (process 0 decides; every process agrees)."""
        ck = self.r.cfg.checkpoint
        if not (ck.keep_best or ck.every_minutes):
            return False
        best = evaluated and dist.is_main() and self.best.consider(self.step, self.last_eval)
        timed = bool(ck.every_minutes) and time.monotonic() - self.t_ckpt >= 60 * ck.every_minutes
        wanted = best or timed
        if dist.is_multiprocess():
            wanted = bool(dist.broadcast(np.array([wanted], np.int32))[0])
        return wanted

    def already_finished(self) -> Run:
        """A rerun of a finished run: say so, with its final metrics; train nothing."""
        r = self.r
        self.close()
        r.params, r.opt_state = self.host_state()
        r.state = self.model_state()
        r.step = self.step
        records = [rec for _, rec in rundir.read_metrics(r.run_dir / "metrics.jsonl")]
        final = next((rec for rec in reversed(records) if rec.get("split") == "test"), {})
        self.last_eval = {k: v for k, v in final.items() if k not in ("step", "split", "time")}
        r.summary = {"step": self.step, **{f"test_{k}": v for k, v in self.last_eval.items()}}
        if self.stopped_before:
            r.summary["stopped"] = self.view.stop_reason or "stopped early"
            self.echo(report.stopped_before(r, self.view.stop_reason))
        else:
            self.echo(report.already_finished(r, self.last_eval))
        return r

    def failed(self, e: ConfigError) -> None:
        """The user's code (``UserCodeError``) or data (``DataError``) stopped the run:
        during it (a step was done), record the step and the newest checkpoint, kept, on
        ``e`` (the CLI's exit 1; before the first step it stays bad input, exit 2); the
        traceback to error.log."""
        if self.step > self.start_step:
            self.writer.drain()  # a write in flight completes: it is the newest kept
            for step, path in self.writer.collect(False):
                self.good_step, self.good_ckpt = step, path or self.good_ckpt
            e.step, e.checkpoint, e.checkpoint_step = self.step, self.good_ckpt, self.good_step
        if isinstance(e, UserCodeError):
            write_error_log(e, self.r.run_dir)

    def close(self) -> None:
        if self.writer is not None:  # a run ending with an error: the write in flight
            self.writer.drain()
        if self.profiler is not None:
            self.profiler.close(self.step)
        if self.feed is not None:
            self.feed.close()
        self.bar.close()
        if self.log is not None:
            self.log.close()

    def finish(self) -> Run:
        """Final params and summary on the Run, the plot, and the closing line."""
        r, tc = self.r, self.r.cfg.train
        wall = time.perf_counter() - self.t_start
        self.timings.lap("train")
        r.params, r.opt_state = self.host_state()
        r.state = self.model_state()
        r.step = self.step
        split, window = r.data.eval_split, r.data.window
        rate = (self.step - self.start_step) * tc.batch_size / max(wall, 1e-9)
        r.summary = {
            "step": self.step,
            **{f"{split}_{k}": v for k, v in self.last_eval.items()},
            "skipped_steps": self.skipped,
            "wall_s": wall,
            "examples_per_s": rate,
            **({"tokens_per_s": rate * window} if window is not None else {}),
        }
        trained = self.timings.phases.get("train", 0.0) or wall  # compile, eval, ckpt aside
        use = perf.utilisation(self.flops, self.step - self.start_step, trained, self.peak)
        r.summary.update(use)
        if r.cfg.log.plot and dist.is_main():
            labels = report.plot_labels(r)
            if self.plotter is not None:  # the caller waits for it
                self.plotter.draw(r.run_dir / "metrics.jsonl", r.run_dir / "curves.png", *labels)
            else:
                plot_curves(r.run_dir / "metrics.jsonl", r.run_dir / "curves.png", *labels)
                self.timings.lap("plot")
        if self.view.stop_reason is not None:
            r.summary["stopped"] = self.view.stop_reason
            self.echo(f"stopped early at step {self.step}: {self.view.stop_reason}")
        self.call("on_fit_end", self.view, r.summary)
        self.echo(report.done(r, self.last_eval, self.skipped, wall, rate) + perf.describe(use))
        return r

    # -- helpers -----------------------------------------------------------------------

    def _metadata(self) -> dict:
        r = self.r
        meta = metadata(r.cfg, r.data, self.step, self.sampler, self.skipped, r.model, r.grad_mode)
        meta["log_window"] = json.dumps(self.means.state())  # the train metrics' partial sums
        if self.callbacks:
            meta["callbacks"] = self.callbacks.state()
        if self.best:  # the best k so far (this step included if it entered)
            meta[BEST_KEY] = self.best.state()
        if self.view.stop_reason is not None:  # a rerun says so instead of training again
            meta["stopped"] = self.view.stop_reason
        if self.eval_pending:  # a signal stopped this step's evaluation: the resume does it
            meta[EVAL_PENDING_KEY] = "1"
        return meta

    def eval_leaves(self) -> list:
        """The params evaluation sees: the trained ones, or (``eval.use_ema``) their moving
        average, which the optimizer state holds (train/optim/ema.py)."""
        if not self.r.cfg.eval.use_ema:
            return self.p_leaves
        index = ema.ema_index(self.prep.params0, self.prep.opt0)
        return ema.swap_in(self.p_leaves, self.o_leaves, index)

    def host_state(self) -> tuple:
        """``(params, opt_state)`` as host numpy leaves in their trees."""
        prep = self.prep
        get = prep.stepper.get_state
        return (
            jax.tree.unflatten(prep.p_def, [np.asarray(v) for v in get(self.p_leaves)]),
            jax.tree.unflatten(prep.o_def, [np.asarray(v) for v in get(self.o_leaves)]),
        )

    def model_state(self, device=None):
        """A stateful model's state as host numpy leaves in its tree (on ``device`` if
        given), or None for a stateless model."""
        prep = self.prep
        if prep.state0 is None:
            return None
        leaves = [np.asarray(v) for v in prep.stepper.get_state(self.s_leaves)]
        if device is not None:
            leaves = jax.device_put(leaves, device)
        return jax.tree.unflatten(prep.s_def, leaves)

    def _stop_nonfinite(self, flagged: int):
        self.writer.drain()  # the replay starts from a complete checkpoint
        for step, path in self.writer.collect(False):
            self.good_step, self.good_ckpt = step, path or self.good_ckpt
        r, prep = self.r, self.prep
        checker = make_stepper(r, prep.p_def, prep.o_def, "check", prep.s_def)
        loss_fn = policy_loss_fn(r.model, r.grad_mode, r.backward)  # names the bad leaf
        raise faults.NonFinite(
            nonfinite.explain_nonfinite(
                r,
                self.sampler,
                checker,
                loss_fn,
                prep.params0,
                prep.opt0,
                flagged,
                self.good_step,
                self.good_ckpt,
                prep.state0,
            )
        )

    def _write(self, record: dict) -> None:
        if self.log is not None:  # process 0 writes the run directory
            self.log.write(record)


def host_schedule(lr: Callable | None) -> Callable | None:
    """The learning-rate schedule ``lr`` (an optax schedule, None: none) as one compiled
    program ``step -> float``: called eagerly, each of its jnp operations would compile a
    program of its own at the first log line (seven for a cosine schedule, 0.3 s of the
    digits MLP's start-up)."""
    if lr is None:
        return None
    compiled = (
        jax.jit(lr, compiler_options=init_compiler_options())
        .lower(jax.ShapeDtypeStruct((), np.int32))
        .compile()
    )
    return lambda step: float(compiled(np.int32(step)))


def _flops_and_peak(r: Run, prep: Prepared) -> tuple[float | None, float | None]:
    """Model FLOPs per step from the lowered step, and the devices' peak FLOP/s. A step
    mapped over a batch axis (pmap, shard_map) is lowered as one device's program, run by
    every device; a ``jit`` over sharded arrays (one device, fsdp, tensor) as the global one."""
    devices = r.strategy.devices
    copies = 1 if r.strategy.axis is None else len(devices)
    flops = perf.step_flops(prep.step_cost, copies, r.cfg.train.grad_accum_steps)
    if flops is None:
        return None, None
    return flops, perf.peak_flops(devices, r.cfg.train.precision)[0]


def _quiet(*_args, **_kwargs) -> None:
    pass


@jax.jit
def _device_copy(leaves: list) -> list:
    """A copy of placed arrays on their devices, as they are sharded: what an async write
    reads while the next steps donate and overwrite the originals."""
    return [jax.numpy.copy(v) for v in leaves]


def _host_trees(prep: Prepared, p: list, o: list, s: list) -> tuple:
    """``(params, opt_state, state or None)`` of snapshot leaves, as host numpy trees."""
    host = lambda leaves: [np.asarray(v) for v in leaves]  # noqa: E731
    state = None if prep.state0 is None else jax.tree.unflatten(prep.s_def, host(s))
    return jax.tree.unflatten(prep.p_def, host(p)), jax.tree.unflatten(prep.o_def, host(o)), state


# Benchmark hook, never set in normal runs: no bound on the calls in flight (the stall the
# bound prevents comes back: benchmarks/stress_multidevice.py measures both).
UNBOUNDED_ENV = "NNLITE_BENCH_UNBOUNDED_CALLS"


def max_in_flight(multiprocess: bool, devices: int = 1) -> int | None:
    """How many compiled calls may be in flight at once (None: no limit). Several CPU
    processes need a bound (see ``_Loop.run_call``), whatever the strategy: with one more
    shard_map call queued, a peer killed mid-call left the survivor a gloo "collective
    mismatch" abort (two calls' collectives interleaved) in 1 run of 4. One process
    driving several CPU ``devices`` has the same pool: its devices' parts of queued calls
    filled it while a part of the running call waited for a thread (docs/distributed.md,
    "Why CPU runs bound the calls in flight")."""
    if jax.devices()[0].platform != "cpu" or not (multiprocess or devices > 1):
        return None
    if os.environ.get(UNBOUNDED_ENV):  # benchmarks/stress_multidevice.py's "before" rows
        return None
    return 0
