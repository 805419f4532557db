"""``nnlite-train --config FILE --fast-dev-run [N]``: does every part of this run work?

A few steps of everything a real run does, in a temporary directory, so that a mistake in
a model, a data source, a callback, a logger or a parallel layout shows in seconds rather
than at the first evaluation or checkpoint of a long run:

1. train N steps (logging every step), evaluate, checkpoint;
2. resume from that checkpoint (the callbacks' state too) and train N more, evaluate,
   checkpoint, draw the curves;
3. read the run back with ``train.load_run`` and predict on two held-out examples.

The config is the user's, with the strategy, model, data, optimizer and callbacks as
given; only the step counts and cadences, the run directory, the held-out split (its
first :func:`eval_rows` rows) and the loggers that write outside the run directory
(W&B, MLflow, a user's logger class) differ. Nothing is written to ``log.dir``: the
temporary directory is removed at the end, whatever happened. The last line says that
every phase passed; a phase that fails says which one, and the run exits with the status
the same failure has in a real run (2 bad input, 4 non-finite, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from ..checkpoint import store as ckpt
from ..config import Config
from ..data.builtin import data_section, load_dataset, text_context
from ..errors import ConfigError
from ..inference import load_run
from ..parallel import distributed as dist
from .trainer import train

DEFAULT_STEPS = 2


class DevRunFailed(Exception):
    """A phase ran but did not do what it must (no checkpoint, a NaN evaluation...)."""


#: loggers that write into the run directory (kept); the others are off in a dev run
IN_RUN_DIR = ("jsonl", "csv", "tensorboard")


def eval_rows(cfg: Config) -> int:
    """Held-out rows (or text windows) a dev run evaluates: a few batches' worth."""
    return max(2 * cfg.train.batch_size, 64)


def dev_config(cfg: Config, steps: int, log_dir: Path, *, plot: bool) -> tuple[Config, list]:
    """``cfg`` as a dev run's phase runs it (``steps`` in all), and the loggers left out."""
    tc = dataclasses.replace(cfg.train, steps=steps, eval_every=steps, log_every=1)
    kept, off = [], []
    for entry in cfg.log.loggers:
        name = entry.get("name") if isinstance(entry, dict) else entry
        (kept if name in IN_RUN_DIR else off).append(entry if name in IN_RUN_DIR else name)
    log = dataclasses.replace(
        cfg.log, dir=str(log_dir), progress=False, plot=plot, loggers=tuple(kept)
    )
    every = cfg.checkpoint.every and min(cfg.checkpoint.every, steps)
    ckpt = dataclasses.replace(cfg.checkpoint, every=every or steps)
    return dataclasses.replace(cfg, train=tc, log=log, checkpoint=ckpt), off


def fast_dev_run(
    cfg: Config,
    steps: int = DEFAULT_STEPS,
    *,
    echo: Callable[[str], None] = print,
    data=None,
    plotter=None,
    timings=None,
    show_timings: bool = False,
) -> dict:
    """Run the phases (module docstring) for ``cfg``; return what each found. ``data``:
    the data set, or a Future of it (None: load it); ``plotter``: a ``CurvePlotter`` for
    the last phase's curves."""
    if steps < 1:
        raise ConfigError(f"--fast-dev-run: expected a number of steps >= 1, got {steps}")
    t0 = time.perf_counter()
    data, rows = _dev_data(cfg, data)
    multiprocess = dist.initialize(cfg.distributed) is not None
    main = dist.is_main()
    log_dir_existed = Path(cfg.log.dir).exists()
    root = _dev_root(cfg, multiprocess)
    run_dir = root / cfg.name
    first, off = dev_config(cfg, steps, root, plot=False)
    second, _ = dev_config(cfg, 2 * steps, root, plot=cfg.log.plot)
    found: dict = {"run_dir": str(run_dir)}
    say = echo if main else (lambda *_: None)
    say(
        f"fast-dev-run: {steps} step{'s' if steps > 1 else ''} of train, eval (first "
        f"{min(rows, len(data.x_test))} held-out rows) and checkpoint, then a resume and "
        f"load_run, in {root} (removed at the end; nothing is written to {cfg.log.dir}/)"
        + (f"; loggers off in a dev run: {', '.join(off)}" if off else "")
    )
    phase = "1/3 train, eval, checkpoint"
    try:
        say(f"fast-dev-run [{phase}]")
        r = train(first, resume="fresh", echo=echo, data=data, timings=timings)
        stopped = r.summary.get("stopped")
        if multiprocess:  # process 0 ran the callbacks: every process follows its decision
            flag = dist.broadcast(np.array([stopped is not None], np.int32))[0]
            stopped = (stopped or "a callback on process 0 stopped the run") if flag else None
        _check_eval(r, phase)
        if main:
            _check_checkpoint(ckpt.list_checkpoints(run_dir / "checkpoints"), r.step, phase)
        found["train"] = r.step
        phase = "2/3 resume"
        if stopped:
            say(f"fast-dev-run [{phase}]: skipped: a callback stopped the run: {stopped}")
            found["resume"] = f"skipped ({stopped})"
        else:
            say(f"fast-dev-run [{phase}] from the step-{r.step} checkpoint to step {2 * steps}")
            r = train(
                second, resume="require", echo=echo, data=data, plotter=plotter, timings=timings
            )
            _check_resumed(r, plotter, phase)
            found["resume"] = r.step
        phase = "3/3 load_run, predict"
        if main:
            say(f"fast-dev-run [{phase}]")
            found["load_run"] = _check_load_run(r, data, phase)
        if show_timings and timings is not None and main:
            timings.end()
            line = timings.write(run_dir / "timings.json").rsplit("; wrote", 1)[0]
            print(f"{line} (a dev run keeps no timings.json)", file=sys.stderr)
    except ConfigError as e:
        raise ConfigError(f"fast-dev-run [{phase}]: {e}") from None
    except DevRunFailed:
        raise
    except BaseException:
        if main:
            print(f"fast-dev-run [{phase}]: failed", file=sys.stderr)
        raise
    finally:
        if multiprocess:
            _barrier_quietly("fast-dev-run-end")
        if main:
            shutil.rmtree(root, ignore_errors=True)
            if not log_dir_existed:  # made for the shared directory: not left behind
                with contextlib.suppress(OSError):
                    Path(cfg.log.dir).rmdir()
    skipped = "" if isinstance(found.get("resume"), int) else " (resume skipped)"
    say(
        f"fast-dev-run: all phases passed{skipped}: train {steps} step"
        f"{'s' if steps > 1 else ''}, eval, checkpoint, resume to step {r.step}, "
        f"load_run + predict, in {time.perf_counter() - t0:.1f} s; {root} removed, nothing "
        f"written to {cfg.log.dir}/"
    )
    return found


def _dev_data(cfg: Config, data) -> tuple:
    """``(data set, held-out rows)`` of a dev run: ``data`` (a data set, a Future of one, or
    None: loaded) with its held-out split cut to :func:`eval_rows`."""
    if isinstance(data, Future):
        data = data.result()
    if data is None:
        data = load_dataset(data_section(cfg), text_context(cfg))
    rows = eval_rows(cfg)
    if len(data.x_test) > rows:
        data = dataclasses.replace(data, x_test=data.x_test[:rows], y_test=data.y_test[:rows])
    return data, rows


def _dev_root(cfg: Config, multiprocess: bool) -> Path:
    """The directory a dev run writes in: a temporary one, or with several processes (each
    writes its shards into one directory) a shared path under ``log.dir``."""
    if not multiprocess:
        return Path(tempfile.mkdtemp(prefix=f"nnlite-fast-dev-run-{cfg.name}-"))
    root = Path(cfg.log.dir) / f".fast-dev-run-{cfg.name}"
    if dist.is_main():  # a dev run killed before its cleanup
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier("fast-dev-run-start")
    return root


def _check_resumed(r, plotter, phase: str) -> None:
    """The resumed run evaluated, checkpointed its last step and drew its curves."""
    _check_eval(r, phase)
    if not dist.is_main():
        return
    if plotter is not None:
        plotter.wait()
    _check_checkpoint(ckpt.list_checkpoints(r.run_dir / "checkpoints"), r.step, phase)
    if r.cfg.log.plot and not (r.run_dir / "curves.png").is_file():
        raise DevRunFailed(f"fast-dev-run [{phase}]: no curves.png was drawn")


def _check_load_run(r, data, phase: str) -> int:
    """``train.load_run`` reads the run back at its last step and predicts finite values;
    its step."""
    loaded = load_run(r.run_dir)
    out = loaded.predict(np.asarray(data.x_test[:2]), preprocessed=True)
    if loaded.step != r.step or not np.all(np.isfinite(out)):
        raise DevRunFailed(
            f"fast-dev-run [{phase}]: load_run gave step {loaded.step} (expected "
            f"{r.step}) and {'finite' if np.all(np.isfinite(out)) else 'non-finite'} "
            "predictions"
        )
    return loaded.step


def _check_eval(r, phase: str) -> None:
    """The evaluation ran and its loss is a number (a NaN loss in eval only: a model bug)."""
    split = r.data.eval_split
    loss = r.summary.get(f"{split}_loss")
    if dist.is_main() and (loss is None or not math.isfinite(loss)):
        raise DevRunFailed(
            f"fast-dev-run [{phase}]: the evaluation's loss is {loss} at step {r.step}"
        )


def _check_checkpoint(found: list[Path], step: int, phase: str) -> None:
    if not found or ckpt.step_of(found[-1]) != step:
        newest = found[-1].name if found else "none"
        raise DevRunFailed(
            f"fast-dev-run [{phase}]: expected a checkpoint at step {step}, the newest is {newest}"
        )


def _barrier_quietly(name: str) -> None:
    try:
        dist.barrier(name, timeout_s=60.0)
    except Exception:  # noqa: BLE001 -- a failed peer: its own status says why
        pass
