"""The training loop: one compiled call after another, stopping at the boundaries to log,
evaluate and checkpoint. Building and compiling live in ``build.py``, the loop's parts (its
state and counters, batches, reporting, checkpoint bookkeeping) in ``parts.py``, the run
directory in ``rundir.py``, where a run starts in ``resume.py``, faults in ``faults.py``."""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import faults
from ..callbacks import Callback, Callbacks, LoopState, build_callbacks
from ..checkpoint import rundir
from ..checkpoint import store as ckpt
from ..checkpoint.best import META_KEY as BEST_KEY
from ..checkpoint.best import BestCheckpoints
from ..checkpoint.resume import Start, agree_on_start, metadata
from ..checkpoint.writer import Writer
from ..config import Config, to_dict
from ..data import feed, overfit
from ..data.dataset import Dataset, Sampler
from ..data.feed import BatchFeed, call_schedule
from ..data.source import DataError
from ..errors import ERROR_LOG, ConfigError, UserCodeError
from ..optim import ema
from ..optim.named import schedule
from ..parallel import distributed as dist
from ..parallel.finite import finite_on_devices
from ..report import console as report
from ..report import perf
from ..report.loggers import MetricsLog
from ..report.plot import plot_curves
from ..report.profile import Profiler
from ..report.timings import Timings
from ..step.checkgrads import check_grads, check_user_rules
from ..step.step import policy_loss_fn, step_flags
from . import nonfinite
from .build import Prepared, Run, build, init_compiler_options, make_stepper, prepare
from .monitors import check_monitors
from .parts import Batches, CheckpointBook, Reporter, TrainState

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
    ``callbacks``: objects called at the loop's events (train/callbacks.py), after
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
    if (loop.state.step >= cfg.train.steps and not pending) or loop.stopped_before:
        return loop.already_finished()
    try:
        with loop.watch, loop.watchdog:
            loop.call("on_fit_start", loop.view)
            # the evaluation a signal stopped, then its step checkpointed again (not pending)
            stop = pending and loop.evaluated(Boundary(False, True, True, False))
            while loop.state.step < cfg.train.steps and not stop:
                loop.run_call()
                at = loop.boundary()
                if at is None:
                    continue
                loop.written(wait=loop.ckpt.waits)  # a finished async write
                loop.check_nonfinite()
                record = loop.log_train() if at.log else {}
                loop.call("on_step_end", loop.view, loop.state.step, record)
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
    """A training run between compiled calls: its parts (train/loop/parts.py), and the
    loop's named steps."""

    r: Run  # the run: config, model, data, strategy
    prep: Prepared  # the compiled programs and the initial state's trees
    state: TrainState  # the state on the devices, and the counters
    batches: Batches  # each call's batch
    report: Reporter  # the console, the progress bar, metrics.jsonl and the loggers
    ckpt: CheckpointBook  # the writer, the last good checkpoint, the best k
    watch: faults.PreemptionWatch  # SIGTERM/SIGINT: checkpoint at an agreed step, exit 3
    watchdog: faults.Watchdog  # a compiled call that never finishes: exit 5
    callbacks: Callbacks  # run on process 0 (train/callbacks.py)
    view: LoopState | None = None  # what the callbacks read, and their stop request
    stopped_before: bool = False  # the checkpoint resumed from ended an early-stopped run
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
            cfg, resume, r.run_dir / "checkpoints", prep.params0, prep.opt0, r.strategy,
            r.grad_mode, prep.state0,
        )  # fmt: skip
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
        for line in _banner(r, prep, start):
            echo(line)
        if not dist.is_main():
            callbacks = Callbacks([], [])  # run on process 0
        put = prep.stepper.put_state
        leaves = [put(v) for v in (begin.p_leaves, begin.o_leaves, begin.s_leaves)]
        loop = cls(
            r,
            prep,
            TrainState(start, *leaves, begin.skipped, start_step=start, pending_from=start),
            _batches(r, sampler, prep.stepper, start),
            _reporter(r, prep, begin, echo, timings, plotter, loggers),
            _checkpoint_book(cfg, begin, callbacks),
            faults.PreemptionWatch(dist.is_multiprocess()),
            _watchdog(cfg),
            callbacks,
            stopped_before=begin.stopped,
            eval_pending=begin.meta.get(EVAL_PENDING_KEY) == "1",
        )
        loop.view = LoopState(cfg, r.model, r.run_dir, loop.host_state)
        loop.view.step = start
        loop.resumed(begin)
        loop.report.start(start)
        timings.lap("other")
        return loop

    def resumed(self, begin: Start) -> None:
        """The callbacks' and the best k's state from the checkpoint ``begin`` resumed from
        (none for a fresh run), and its ``on_checkpoint`` again."""
        if begin.checkpoint is not None and self.callbacks:
            where = f"checkpoint {begin.checkpoint}"
            self.callbacks.load(begin.meta.get("callbacks"), where)
            # the uninterrupted run called on_checkpoint after saving this state: again
            self.call("on_checkpoint", self.view, begin.step, begin.checkpoint)
        self.view.stop_reason = begin.meta.get("stopped")
        if begin.checkpoint is not None and self.ckpt.best and dist.is_main():
            self.ckpt.best.load(begin.meta.get(BEST_KEY), f"checkpoint {begin.checkpoint}")

    # -- the steps of the loop ---------------------------------------------------------

    def run_call(self) -> None:
        """One compiled call: up to ``train.steps_per_call`` steps, up to the next boundary."""
        s, stepper = self.state, self.prep.stepper
        k = steps_in_call(self.r.cfg, s.step, boundaries(self.r.cfg))
        batch = self.batches.get(s.step, k)
        self.report.profiler.before_call(s.step, k)
        s.p_leaves, s.o_leaves, s.s_leaves, s.metrics = stepper.run(
            *s.leaves, self.prep.X, self.prep.Y, batch
        )
        self.watchdog.watch(s.step, s.metrics)
        # Several processes on CPU (gloo): every local device's part of a call runs on a
        # shared thread pool and blocks its thread inside gloo's collectives. With many
        # calls in flight, the pool fills with parts waiting in a collective (or for a
        # device's in-flight slot) while the part they wait for has no thread left: a
        # deadlock with every process alive (2 x 8 devices: ~step 45; pmap 2 x 2: ~100).
        # Bounding the calls in flight rules that out.
        limit = max_in_flight(dist.is_multiprocess(), len(stepper.devices))
        if limit is not None:
            s.in_flight.append(s.metrics)
            while len(s.in_flight) > limit:
                jax.block_until_ready(s.in_flight.pop(0))
        s.step += k
        self.report.profiler.after_call(s.step, s.metrics)
        s.calls += 1
        self.report.bar.update(k)
        s.pending.append(s.metrics)  # non-finite flags: read at the next boundary

    def boundary(self) -> Boundary | None:
        """What to do now that ``state.step`` steps are done (None: just carry on)."""
        cfg, step = self.r.cfg, self.state.step
        last = step == cfg.train.steps
        at = Boundary(
            log=step % cfg.train.log_every == 0 or last,
            eval=step % cfg.train.eval_every == 0 or last,
            checkpoint=bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last,
            stop=self.watch.should_stop(self.state.calls),
        )
        return at if (at.log or at.eval or at.checkpoint or at.stop) else None

    def evaluated(self, at: Boundary) -> bool:
        """The rest of a boundary: evaluate, a callback's stop, the checkpoint, a signal's
        stop (``faults.Preempted``). True: a callback stopped the run.

        A SIGTERM/SIGINT during the evaluation (one process) ends it after the chunk being
        evaluated: the run checkpoints this step with the evaluation marked pending
        (``eval_pending``), which the resumed run does first, so the records and the
        callbacks' events are the uninterrupted run's."""
        step = self.state.step
        if at.eval and not self.evaluate():
            at = Boundary(at.log, False, at.checkpoint, stop=True)
            self.eval_pending = True
        elif at.eval:
            self.eval_pending = False
            self.call("on_eval_end", self.view, step, self.report.last_eval)
        stop = self.agree_on_stop()  # a callback's stop, agreed by every process
        # besides checkpoint.every: the best k, checkpoint.every_minutes
        wanted = self.ckpt.wanted(self.r.cfg.checkpoint, at.eval, step, self.report.last_eval)
        if at.checkpoint or at.stop or stop or wanted:
            self.checkpoint()
        if at.stop:
            self.written(wait=True)
            raise faults.Preempted(step, self.ckpt.good_ckpt, self.watch.signal_name)
        return stop

    def check_nonfinite(self) -> None:
        """At a boundary the host syncs anyway: read the steps' non-finite flags."""
        s = self.state
        flags = np.concatenate([step_flags(m) for m in s.pending])
        for m in s.pending:
            self.report.means.add(m)
        first, s.pending, s.pending_from = s.pending_from, [], s.step
        if flags.any() and self.r.cfg.train.nonfinite == "stop":
            self._stop_nonfinite(first + int(np.argmax(flags)) + 1)
        s.skipped += int(flags.sum())

    def call(self, event: str, *args) -> None:
        """Run the callbacks' ``event`` (process 0; a no-op without callbacks)."""
        if self.callbacks:
            self.view.step = self.state.step
            self.callbacks.call(event, *args)

    def agree_on_stop(self) -> bool:
        """Whether a callback asked to stop at this boundary (every process agrees: the
        callbacks run on process 0)."""
        asked = self.view.stop_reason is not None
        if dist.is_multiprocess():
            asked = bool(dist.broadcast(np.array([asked], np.int32))[0])
        return asked

    def log_train(self) -> dict:
        """A train record in metrics.jsonl and the progress bar (``Reporter.train_record``)."""
        return self.report.train_record(self.r, self.state.step, self.state.skipped)

    def evaluate(self) -> bool:
        """Metrics on the whole held-out split (process 0): a "test" record, or "val" for
        text (its fixed set of validation windows). False: a SIGTERM/SIGINT stopped it
        between two chunks (one process; no record)."""
        prep, data = self.prep, self.r.data
        jax.block_until_ready(self.state.p_leaves)  # the training so far is charged to "train"
        self.report.timings.lap("train")
        # Every process takes part in gathering a state sharded across processes (fsdp: a
        # collective); process 0 alone evaluates.
        leaves = prep.stepper.get_state(self.eval_leaves())
        state = [] if prep.state0 is None else [self.model_state(prep.eval_device)]
        if not dist.is_main():
            return True
        params = jax.tree.unflatten(prep.p_def, jax.device_put(leaves, prep.eval_device))
        # One process stops between chunks on a signal (several agree at a compiled call)
        stop = None if self.watch.multiprocess else lambda: self.watch.signal_name is not None
        if data.streamed:  # a chunk at a time from the host
            chunk = feed.eval_chunk(data)
            result = feed.evaluate(
                prep.evaluate, params, data, chunk, prep.eval_device, *state, stop=stop
            )
        elif prep.Y_test is None:  # a text split on the device, a chunk per call
            result = feed.sum_chunks(prep.evaluate, params, prep.X_test, state, stop)
        else:
            result = prep.evaluate(params, prep.X_test, prep.Y_test, *state)
        if result is None:
            self.report.timings.lap("eval")
            return False
        self.report.eval_record(self.r, self.state.step, result)
        return True

    def checkpoint(self) -> None:
        """Save the state (process 0 writes), after checking it is finite: now, or with
        ``checkpoint.async`` on the writer thread from a snapshot (train/checkpoint/writer.py)."""
        s = self.state
        jax.block_until_ready(s.p_leaves)
        self.report.timings.lap("train")
        self.written(wait=True)  # at most one write in flight
        cfg, step, background = self.r.cfg, s.step, self.ckpt.writer.background
        if self.r.strategy.sharded_state:
            return self.checkpoint_sharded()
        if background:  # copies on the devices: the next steps donate these buffers
            self._check_finite_on_devices()
            get = self.prep.stepper.get_state
            snap = [_device_copy(get(v)) for v in s.leaves]
        else:
            state = self.host_state()
            # The loss-only flag cannot see a last step that broke the params.
            if cfg.train.nonfinite == "stop" and not nonfinite.all_finite(state[0]):
                self._stop_nonfinite(step)
        write = None
        if dist.is_main():
            meta, protect = self._metadata(), frozenset(self.ckpt.best.steps())
            prep = self.prep

            def write():
                p, o, s = _host_trees(prep, *snap) if background else (*state, self.model_state())
                return ckpt.save(
                    self.r.run_dir / "checkpoints", step, p, o, meta, cfg.checkpoint.keep,
                    state=s, protect=protect, model=self.r.model,
                )  # fmt: skip

        self._submit(step, write)

    def checkpoint_sharded(self) -> None:
        """Save a sharded state: every process writes the shards its devices hold (never
        gathered: no ``get_state``), process 0 the metadata last (``ckpt.save_sharded``)."""
        prep, cfg, step = self.prep, self.r.cfg, self.state.step
        self._check_finite_on_devices()
        leaves = self.state.leaves
        if self.ckpt.writer.background:  # copies on the devices, sharded as the state is
            leaves = [_device_copy(v) for v in leaves]
        p, o, s = (
            jax.tree.unflatten(d, v) for d, v in zip((prep.p_def, prep.o_def, prep.s_def), leaves)
        )
        meta, protect = self._metadata(), frozenset(self.ckpt.best.steps())

        def write():
            return ckpt.save_sharded(
                self.r.run_dir / "checkpoints", step, p, o, meta, cfg.checkpoint.keep,
                barrier=dist.barrier, state=None if prep.state0 is None else s, protect=protect,
                model=self.r.model,
            )  # fmt: skip

        self._submit(step, write)

    def _check_finite_on_devices(self) -> None:
        """``train.nonfinite=stop``: the params are finite, tested where they lie."""
        step = self.state.step
        watch = lambda flags: self.watchdog.watch(step, flags)  # noqa: E731
        if self.r.cfg.train.nonfinite == "stop":
            if not finite_on_devices(self.state.p_leaves, watch).all():
                self._stop_nonfinite(step)

    def _submit(self, step: int, write) -> None:
        """Hand the checkpoint ``write`` of ``step`` to the writer (None: another process
        writes it); a synchronous write's ``on_checkpoint`` runs now."""
        self.ckpt.writer.submit(step, write)
        self.ckpt.t_last = time.monotonic()
        self.report.timings.lap("checkpoint")
        self.written(wait=False)

    def written(self, wait: bool) -> None:
        """Account for the checkpoint writes that finished (``wait``: wait for the one in
        flight): the last good state, and the callbacks' ``on_checkpoint``."""
        for step, path in self.ckpt.collect(wait):
            self.call("on_checkpoint", self.view, step, path)

    def already_finished(self) -> Run:
        """A rerun of a finished run: say so, with its final metrics; train nothing."""
        r, rep = self.r, self.report
        self.close()
        r.params, r.opt_state = self.host_state()
        r.state = self.model_state()
        r.step = self.state.step
        records = [rec for _, rec in rundir.read_metrics(r.run_dir / "metrics.jsonl")]
        final = next((rec for rec in reversed(records) if rec.get("split") == "test"), {})
        rep.last_eval = {k: v for k, v in final.items() if k not in ("step", "split", "time")}
        r.summary = {"step": r.step, **{f"test_{k}": v for k, v in rep.last_eval.items()}}
        if self.stopped_before:
            r.summary["stopped"] = self.view.stop_reason or "stopped early"
            rep.echo(report.stopped_before(r, self.view.stop_reason))
        else:
            rep.echo(report.already_finished(r, rep.last_eval))
        return r

    def failed(self, e: ConfigError) -> None:
        """The user's code (``UserCodeError``) or data (``DataError``) stopped the run:
        during it (a step was done), record the step and the newest checkpoint, kept, on
        ``e`` (the CLI's exit 1; before the first step it stays bad input, exit 2); the
        traceback to error.log."""
        if self.state.step > self.state.start_step:
            self.ckpt.drain()  # a write in flight completes: it is the newest kept
            e.step, e.checkpoint = self.state.step, self.ckpt.good_ckpt
            e.checkpoint_step = self.ckpt.good_step
        if isinstance(e, UserCodeError):
            write_error_log(e, self.r.run_dir)

    def close(self) -> None:
        self.ckpt.writer.drain()  # a run ending with an error: the write in flight
        self.batches.close()
        self.report.close(self.state.step)

    def finish(self) -> Run:
        """Final params and summary on the Run, the plot, and the closing line."""
        r, rep, tc = self.r, self.report, self.r.cfg.train
        wall = time.perf_counter() - rep.t_start
        rep.timings.lap("train")
        r.params, r.opt_state = self.host_state()
        r.state = self.model_state()
        r.step = self.state.step
        split, window = r.data.eval_split, r.data.window
        steps = r.step - self.state.start_step
        rate = steps * tc.batch_size / max(wall, 1e-9)
        r.summary = {
            "step": r.step,
            **{f"{split}_{k}": v for k, v in rep.last_eval.items()},
            "skipped_steps": self.state.skipped,
            "wall_s": wall,
            "examples_per_s": rate,
            **({"tokens_per_s": rate * window} if window is not None else {}),
        }
        trained = rep.timings.phases.get("train", 0.0) or wall  # compile, eval, ckpt aside
        use = perf.utilisation(rep.flops, steps, trained, rep.peak)
        r.summary.update(use)
        if r.cfg.log.plot and dist.is_main():
            labels = report.plot_labels(r)
            if rep.plotter is not None:  # the caller waits for it
                rep.plotter.draw(r.run_dir / "metrics.jsonl", r.run_dir / "curves.png", *labels)
            else:
                plot_curves(r.run_dir / "metrics.jsonl", r.run_dir / "curves.png", *labels)
                rep.timings.lap("plot")
        if self.view.stop_reason is not None:
            r.summary["stopped"] = self.view.stop_reason
            rep.echo(f"stopped early at step {r.step}: {self.view.stop_reason}")
        self.call("on_fit_end", self.view, r.summary)
        done = report.done(r, rep.last_eval, self.state.skipped, wall, rate)
        rep.echo(done + perf.describe(use))
        return r

    # -- helpers -----------------------------------------------------------------------

    def _metadata(self) -> dict:
        r, s = self.r, self.state
        sampler = self.batches.sampler
        meta = metadata(r.cfg, r.data, s.step, sampler, s.skipped, r.model, r.grad_mode)
        # the train metrics' partial sums
        meta["log_window"] = json.dumps(self.report.means.state())
        if self.callbacks:
            meta["callbacks"] = self.callbacks.state()
        if self.ckpt.best:  # the best k so far (this step included if it entered)
            meta[BEST_KEY] = self.ckpt.best.state()
        if self.view.stop_reason is not None:  # a rerun says so instead of training again
            meta["stopped"] = self.view.stop_reason
        if self.eval_pending:  # a signal stopped this step's evaluation: the resume does it
            meta[EVAL_PENDING_KEY] = "1"
        return meta

    def eval_leaves(self) -> list:
        """The params evaluation sees: the trained ones, or (``eval.use_ema``) their moving
        average, which the optimizer state holds (train/optim/ema.py)."""
        if not self.r.cfg.eval.use_ema:
            return self.state.p_leaves
        index = ema.ema_index(self.prep.params0, self.prep.opt0)
        return ema.swap_in(self.state.p_leaves, self.state.o_leaves, index)

    def host_state(self) -> tuple:
        """``(params, opt_state)`` as host numpy leaves in their trees."""
        prep = self.prep
        get = prep.stepper.get_state
        return (
            jax.tree.unflatten(prep.p_def, [np.asarray(v) for v in get(self.state.p_leaves)]),
            jax.tree.unflatten(prep.o_def, [np.asarray(v) for v in get(self.state.o_leaves)]),
        )

    def model_state(self, device=None):
        """A stateful model's state as host numpy leaves in its tree (on ``device`` if
        given), or None for a stateless model."""
        prep = self.prep
        if prep.state0 is None:
            return None
        leaves = [np.asarray(v) for v in prep.stepper.get_state(self.state.s_leaves)]
        if device is not None:
            leaves = jax.device_put(leaves, device)
        return jax.tree.unflatten(prep.s_def, leaves)

    def _stop_nonfinite(self, flagged: int):
        self.ckpt.drain()  # the replay starts from a complete checkpoint
        r, prep = self.r, self.prep
        checker = make_stepper(r, prep.p_def, prep.o_def, "check", prep.s_def)
        loss_fn = policy_loss_fn(r.model, r.grad_mode, r.backward)  # names the bad leaf
        raise faults.NonFinite(
            nonfinite.explain_nonfinite(
                r,
                self.batches.sampler,
                checker,
                loss_fn,
                prep.params0,
                prep.opt0,
                flagged,
                self.ckpt.good_step,
                self.ckpt.good_ckpt,
                prep.state0,
            )  # fmt: skip
        )


# -- the parts of a loop, as it begins ---------------------------------------------------


def _banner(r: Run, prep: Prepared, start: int) -> list[str]:
    """What the run is (train/report/console.py), and what its backward policies do."""
    state_bytes = sum(r.strategy.bytes_per_device(t) for t in (prep.params0, prep.opt0))
    trained = None if r.plan is None else r.plan.num_trained(prep.params0)
    lines = [report.banner(r, prep.params0.num_params(), start, state_bytes, trained)]
    if r.backward is not None and r.backward.describe():  # issue 34: what policies do
        lines.append(r.backward.describe())
    return lines


def _batches(r: Run, sampler: Sampler, stepper, start: int) -> Batches:
    """Each call's batch from ``start`` on: streamed data read a call ahead."""
    if not r.data.streamed:
        return Batches(sampler, stepper)
    every = boundaries(r.cfg)
    calls = call_schedule(start, r.cfg.train.steps, lambda s: steps_in_call(r.cfg, s, every))
    return Batches(sampler, stepper, BatchFeed(r.data, sampler, stepper, calls))


def _reporter(r: Run, prep: Prepared, begin: Start, echo, timings, plotter, loggers) -> Reporter:
    """The run's reporting from the step ``begin`` starts at: metrics.jsonl and the loggers
    open on process 0 unless the run has nothing left to do."""
    cfg, start = r.cfg, begin.step
    rep = Reporter(
        echo,
        report.progress_bar(cfg, start, show=dist.is_main()),
        timings,
        Profiler.from_config(cfg, r.run_dir, echo),  # --profile START:STOP
        means=report.IntervalMeans.from_state(begin.log_window),
        lr=host_schedule(schedule(cfg.optimizer, cfg.train.steps)),
        plotter=plotter,
    )
    pending = begin.meta.get(EVAL_PENDING_KEY) == "1"  # the resumed step's evaluation
    if dist.is_main() and (start < cfg.train.steps or pending) and not begin.stopped:
        rep.log = MetricsLog.open(
            r.run_dir, start, to_dict(cfg), cfg.log.loggers, cfg.log.tensorboard, loggers
        )
    rep.flops, rep.peak = _flops_and_peak(r, prep)  # MFU (train/report/perf.py)
    return rep


def _checkpoint_book(cfg: Config, begin: Start, callbacks: Callbacks) -> CheckpointBook:
    """The checkpoints from the one resumed from (or the initial state) on."""
    ck = cfg.checkpoint
    waits = any(
        callable(getattr(cb, "on_checkpoint", None))
        and getattr(type(cb), "on_checkpoint", None) is not Callback.on_checkpoint
        for cb in callbacks.items
    )
    best = BestCheckpoints(ck.keep_best, ck.monitor, ck.mode)
    return CheckpointBook(Writer(ck.async_), best, begin.step, begin.checkpoint, waits)


def _watchdog(cfg: Config) -> faults.Watchdog:
    settings = dist.resolve(cfg.distributed)
    return faults.Watchdog(
        cfg.train.step_timeout,
        multiprocess=dist.is_multiprocess(),
        # automatic: fire before JAX's heartbeat abort does (a C++ stack, status -6)
        cap=0.5 * settings.heartbeat_timeout if settings else None,
        fresh_line=cfg.log.progress and dist.is_main(),
    )


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
    """Model FLOPs per step counted from the traced step (``step_cost``: every loop by its
    trip count, a mapped step's body once per device, so the total over the devices), and
    the devices' peak FLOP/s."""
    flops = perf.step_flops(prep.step_cost)
    if flops is None:
        return None, None
    return flops, perf.peak_flops(r.strategy.devices, r.cfg.train.precision)[0]


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
    return 0
