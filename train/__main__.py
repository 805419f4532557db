"""``nnlite-train --config FILE [--set key=value ...] [--print-config] [--resume | --fresh]
[--processes N] [--timings]``, and its commands ``nnlite-train prepare | sample | predict |
lr-find | verify | export ...`` (``COMMANDS``). In a checkout, ``python -m train`` is the same
command; installed, ``python -m nnlite.train`` is too.

Exit statuses: 0 done, 1 unexpected failure (a lost peer included), 2 bad input,
3 preempted (a checkpoint was written, or a signal came before/after the loop; rerun to
resume), 4 stopped on a non-finite step, 5 stuck (no compiled call finished within
train.step_timeout).
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import signal
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import faults
from .data.registry import plots_accuracy
from .errors import ConfigError, missing_extra
from .parallel import xla_collectives
from .report.plot import CurvePlotter
from .report.profile import parse as parse_profile
from .report.timings import Timings

# SIGTERM/SIGINT while the command imports (a C extension interrupted in the middle of its
# import fails to load: a traceback, status 1): recorded here and raised as
# faults.Interrupted (exit 3 and its line) once the import is done. Run as a module (a
# checkout's ``python -m train``, or ``python -m nnlite.train``), this module records them
# from its first statement on; before it, the interpreter's default applies.
_PENDING: list[int] = []
_DEFERRING = [False]


def _record(signum, _frame):
    _PENDING.append(signum)


if __name__ == "__main__":
    for _s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_s, _record)


#: The command's name, as every printed command spells it (it runs from any directory once
#: nnlite is installed; in a checkout ``python -m train`` is the same command).
PROG = "nnlite-train"

#: ``nnlite-train COMMAND ...``: the module (relative to this package) whose ``main(argv)``
#: runs it, and what it does (``nnlite-train --help`` lists them).
COMMANDS = {
    "prepare": (".prepare", "text files -> token files for data.name: tokens (a tokenizer)"),
    "sample": (".sample", "generate text from a trained language model (--run DIR)"),
    "predict": (".predict", "a trained run's predictions for an .npz file (--run DIR)"),
    "lr-find": (".lr_find", "an LR range test: suggest a learning rate for a config"),
    "verify": (".verify", "check a run's checkpoints against their checksums"),
    "export": (".export", "a Hugging Face run back as a model directory or a peft adapter"),
}


def _commands_help() -> str:
    rows = "\n".join(f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items())
    statuses = textwrap.fill(
        "exit statuses: 0 done, 1 failure, 2 bad input, 3 preempted (checkpoint written; "
        "rerun to resume), 4 stopped on a non-finite loss/gradient/param, 5 stuck (no "
        "compiled call finished within train.step_timeout)",
        78,
    )
    return f"commands ({PROG} COMMAND --help for each):\n{rows}\n\n{statuses}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --config FILE [--set KEY=VALUE ...] [options]\n"
        f"       {PROG} {{{','.join(COMMANDS)}}} ...",
        description="Train an nnlite model from a YAML config, or run one of the commands below.",
        epilog=_commands_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--config",
        required=True,
        help="YAML config file (the checkout's configs/ has the shipped ones)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=100 (repeatable)",
    )
    ap.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    ap.add_argument(
        "--show-jaxpr",
        choices=("loss", "step", "grad"),
        help="print the decompiled loss or train step (nnlite.show_jaxpr), or the backward "
        "pass as hand rule calls per layer (grad: nnlite.show_grad), and exit",
    )
    ap.add_argument(
        "--eject",
        metavar="DIR",
        help="write the run as a standalone training script into the new directory DIR "
        "(the train step as Python with the hand rules by name, the optax chain, the "
        "loop; see docs/gradients.md) and exit",
    )
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="require a checkpoint to resume from")
    group.add_argument(
        "--fresh", action="store_true", help="ignore and delete old checkpoints, start over"
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="run as N local processes on loopback (CPU devices, gloo collectives); "
        "see docs/distributed.md",
    )
    ap.add_argument(
        "--timings",
        action="store_true",
        help="write where the wall time went (imports, data, compile, train, eval, "
        "checkpoint, plot, ...) to <run dir>/timings.json and print it to stderr",
    )
    ap.add_argument(
        "--fast-dev-run",
        nargs="?",
        type=int,
        const=2,
        default=None,
        metavar="N",
        help="check that every part of the run works: N steps (default 2) of train, eval "
        "and checkpoint, a resume from that checkpoint, load_run; in a temporary directory, "
        "nothing written to log.dir (docs/training.md#debugging-runs)",
    )
    # issue 32 (perf helper): a profiler trace of some steps, the model summary
    ap.add_argument(
        "--profile",
        metavar="START:STOP",
        help="write a jax.profiler trace of steps START+1..STOP to <run dir>/profile "
        "(log.profile; TensorBoard or Perfetto)",
    )
    ap.add_argument(
        "--summary",
        action="store_true",
        help="print the model's layers (output shapes, params, FLOPs, activation memory) "
        "and exit without training",
    )
    ap.add_argument(  # issue 34
        "--check-grads",
        action="store_true",
        help="before step 0, check every hand rule the model runs against jax.vjp at the "
        "run's shapes, dtype and strategy, print the table, and refuse a wrong rule "
        "(the same as --set train.check_grads=true)",
    )
    return ap.parse_args(argv)


def _without_processes(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            out.append(a)
    return out


def resume_command(argv: list[str]) -> str:
    """The command that resumes this run: the same one, minus --fresh (it would delete),
    spelt as it runs from the user's directory."""
    args = [a for a in argv if a != "--fresh"]
    return shlex.join([PROG, *args])


def run_command(argv: list[str]) -> int:
    """``nnlite-train COMMAND ARGS``: the command's own ``main(ARGS)``; an unknown one is one
    line, exit 2."""
    import importlib

    name = argv[0]
    if name not in COMMANDS:
        import difflib

        known = ", ".join(COMMANDS)
        close = difflib.get_close_matches(name.replace("_", "-"), COMMANDS, n=1)
        hint = f"; did you mean {PROG} {close[0]}?" if close else ""
        if name.endswith((".yaml", ".yml")):
            hint = f"; to train, {PROG} --config {shlex.quote(name)}"
        print(
            f"error: {PROG}: unknown command {name!r}; the commands are {known}, or "
            f"--config FILE to train{hint}",
            file=sys.stderr,
        )
        return faults.EXIT_BAD_INPUT
    module = importlib.import_module(COMMANDS[name][0], __package__)
    return module.main(argv[1:])


def _show_jaxpr(cfg, what: str) -> int:
    from nnlite import ManualGradError, UnsupportedPrimitiveError  # start-up: imports JAX

    from .loop.show import show_jaxpr  # start-up: imports JAX

    try:
        src = show_jaxpr(cfg, what)
    except ManualGradError as e:  # the backward pass has an op without a hand rule
        print(f"error: --show-jaxpr {what}: {' '.join(str(e).split())}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    except UnsupportedPrimitiveError as e:
        # its message quotes the primitive's params, jaxprs included: one line of it
        msg = textwrap.shorten(str(e), 300, placeholder=" ...")
        print(f"error: --show-jaxpr {what}: {msg}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    print(src, end="")  # the source ends in a newline
    return 0


# Models this small get their learned params printed at the end (linreg: w -> 2, b -> -1).
PRINT_PARAMS_MAX = 100


def compile_cache_dir(setting: str | None) -> Path | None:
    """Where ``compile_cache`` puts JAX's persistent compilation cache (None: off)."""
    if setting is None:
        return None
    if setting == "auto":
        from .data.text.corpus import cache_dir  # start-up: the standard library only

        return cache_dir() / "jax"
    return Path(setting).expanduser()


def enable_compile_cache(setting: str | None) -> None:
    """Turn on JAX's persistent compilation cache for this process (the CLI only: library
    users and in-process tests keep JAX's defaults). JAX_COMPILATION_CACHE_DIR in the
    environment wins over ``auto``."""
    import jax

    if setting == "auto" and os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = compile_cache_dir(setting)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"note: compile cache off: cannot create {path} ({e.strerror})", file=sys.stderr)
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    # JAX caches only compiles above 1 s by default; a small model's take ~0.1-0.3 s.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def format_params(params) -> str:
    """``/W = [[2.0003]]`` lines for each leaf of a (small) ParamsDict."""
    import numpy as np

    return "\n".join(
        f"  {path} = {np.array2string(np.asarray(leaf), precision=4, separator=', ')}"
        for path, leaf in params.items()
    )


class _Session:
    """What ``main`` holds across its steps: the curve plotter started early (closed when
    the run draws no curves) and whether the run spans several processes."""

    plotter = None
    multiprocess = False

    def drop_plotter(self) -> None:
        if self.plotter is not None:
            self.plotter.close()  # no curves (an error, a preemption): stop the helper
            self.plotter = None


def main(
    argv: list[str] | None = None, *, compile_cache: bool = False, standalone: bool = False
) -> int:
    """The CLI (``argv``: a command's name first runs that command, ``COMMANDS``).
    ``compile_cache``: honour the config's ``compile_cache`` (``nnlite-train`` does;
    in-process callers leave JAX's global cache settings alone). ``standalone``: the
    process ends when this returns (``nnlite-train``), so the garbage collector is tuned
    for a short-lived process (see ``_freeze_heap``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-"):  # nnlite-train prepare|sample|... ARGS
        return run_command(argv)
    timings = Timings()
    if standalone:
        gc.disable()  # imports make few cycles; back on (frozen heap) once JAX is loaded
    args = parse_args(argv)
    if standalone:  # before JAX's backend starts: the watchdog, not XLA, ends a stuck call
        xla_collectives.apply()
    session = _Session()
    saved = {s: signal.signal(s, _interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cfg = _load(args, session, standalone)
        _check_kernel_settings()
        if standalone:  # NNLITE_CPU_MEMORY=keep, before JAX's backend starts
            from nnlite.core._host_memory import keep_if_asked  # start-up: JAX, as above

            keep_if_asked()
        timings.lap("config")
        status = _act(cfg, args, argv, compile_cache)
        if status is not None:
            return status
        return _train(cfg, args, session, timings, compile_cache, standalone)
    except (Exception, faults.Interrupted) as e:  # each failure: its line and exit status
        status = _failed(e, argv, session.multiprocess)
        if status is None:
            raise
        return status
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        session.drop_plotter()
        if standalone:
            _freeze_heap()


def _load(args, session: _Session, standalone: bool):
    """The config the command line names, with its flags as overrides (the curve plotter
    started meanwhile when the command trains)."""
    with _ImportsDeferSignals():
        from .config import load_config, peek  # start-up: PyYAML, and a missing one's line

    if standalone and _trains(args):
        plot, data_name = peek(args.config, args.overrides, "log.plot", "data.name")
        if plot is not False:
            # Imports matplotlib in another process while this one builds the config
            # (which imports the model's module and so JAX); closed if no curves are drawn.
            session.plotter = CurvePlotter(accuracy=plots_accuracy(data_name))
    if args.check_grads:
        args.overrides.append("train.check_grads=true")
    if args.profile is not None:
        try:
            parse_profile(args.profile)
        except ValueError as e:
            raise ConfigError(f"--profile {e}") from None
        args.overrides.append(f"log.profile='{args.profile}'")  # quoted: YAML reads 1:2 as 62
    return load_config(args.config, args.overrides)


def _check_kernel_settings() -> None:
    """``NNLITE_CPU_ATTENTION``, ``NNLITE_CPU_GEMM`` and ``NNLITE_CPU_MEMORY`` checked before
    anything runs: a bad value is an error even where the model never reaches that kernel."""
    from nnlite.core._native import check_settings  # start-up: JAX, imported by the config

    try:
        check_settings()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _act(cfg, args, argv: list[str], compile_cache: bool) -> int | None:
    """The flags that do something else than train here (a summary, the config, an
    ejected script, other processes, a jaxpr): their exit status; None: train."""
    if args.summary:
        from .loop.show import model_summary  # start-up: imports JAX

        print(model_summary(cfg))
        return 0
    if args.print_config:
        from .config import dump_yaml  # start-up: PyYAML (imported by _load already)

        print(dump_yaml(cfg), end="")
        return 0
    if args.eject:
        from .loop.eject import eject  # start-up: imports JAX

        if args.processes is not None or args.show_jaxpr:
            other = "--processes" if args.processes is not None else "--show-jaxpr"
            raise ConfigError(f"--eject writes a one-process script: leave out {other}")
        script = eject(cfg, args.eject)
        print(f"wrote {script} (+ params and data beside it): python {script}")
        return 0
    if args.processes is not None:
        if args.processes < 1:
            raise ConfigError(f"--processes must be >= 1, got {args.processes}")
        from .parallel.launch import launch  # start-up: the launcher's processes import JAX

        return launch(cfg, _without_processes(argv), args.processes, echo=print)
    if args.fast_dev_run is not None and args.fast_dev_run < 1:
        raise ConfigError(f"--fast-dev-run: expected steps >= 1, got {args.fast_dev_run}")
    if args.fast_dev_run is not None and args.resume:
        raise ConfigError(
            "--fast-dev-run runs in a temporary directory, with no checkpoint to --resume "
            "from; leave --resume out"
        )
    if args.show_jaxpr:
        if compile_cache:
            enable_compile_cache(cfg.compile_cache)
        return _show_jaxpr(cfg, args.show_jaxpr)
    return None


def _train(cfg, args, session: _Session, timings, compile_cache: bool, standalone: bool) -> int:
    """Train ``cfg`` (its data loading while JAX imports), then print what the run asks."""
    from .parallel import distributed as dist  # start-up: numpy, before the data thread

    settings = dist.resolve(cfg.distributed)
    session.multiprocess = settings is not None
    main_process = settings is None or settings.process_id == 0
    if not cfg.log.plot or not main_process:
        session.drop_plotter()
    elif session.plotter is None:
        session.plotter = CurvePlotter(accuracy=plots_accuracy(cfg.data.name))
    with _ImportsDeferSignals():
        from .data.builtin import data_section, load_dataset, text_context  # start-up: numpy

    with ThreadPoolExecutor(1, thread_name_prefix="nnlite-data") as pool:
        # The data loads while JAX imports (numpy, gzip and file reads release the GIL).
        data = pool.submit(load_dataset, data_section(cfg), text_context(cfg))
        with _ImportsDeferSignals():
            if compile_cache:
                enable_compile_cache(cfg.compile_cache)  # imports jax
            from .loop.trainer import train  # start-up: JAX, imported while the data loads

        timings.lap("imports")
        if standalone:
            _freeze_heap()
            gc.enable()
        if args.fast_dev_run is not None:
            return _fast_dev_run(cfg, args, timings, session.plotter, data)
        resume = "require" if args.resume else "fresh" if args.fresh else "auto"
        r = train(cfg, resume=resume, timings=timings, plotter=session.plotter, data=data)
    if r.params is not None and dist.is_main() and r.params.num_params() <= PRINT_PARAMS_MAX:
        print(f"learned params ({r.params.num_params()}):\n{format_params(r.params)}")
    if session.plotter is not None:
        session.plotter.wait()  # curves.png: requested by train() once the metrics were final
        timings.lap("plot")
    if args.timings and main_process:
        timings.end()
        print(timings.write(Path(cfg.log.dir) / cfg.name / "timings.json"), file=sys.stderr)
    return 0


def _failed(e: BaseException, argv: list[str], multiprocess: bool) -> int | None:
    """The line and exit status of a failure (None: let it propagate, a traceback)."""
    if isinstance(e, ConfigError):  # bad input; the user's code or data failing (_failure)
        return _exit(*_failure(e, argv), multiprocess)
    if isinstance(e, faults.Preempted):
        print(
            f"preempted by {e.signal_name} at step {e.step}: wrote {e.checkpoint}; "
            f"resume with: {resume_command(argv)}",
            file=sys.stderr,
        )
        return faults.EXIT_PREEMPTED
    if isinstance(e, faults.Interrupted):
        return _exit(
            f"stopped by {e.signal_name} outside the training loop (start-up or shutdown); "
            f"checkpoints on disk are intact; resume with: {resume_command(argv)}",
            faults.EXIT_PREEMPTED,
            multiprocess,
        )
    if isinstance(e, faults.NonFinite):
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_NONFINITE
    if isinstance(e, OSError):
        if multiprocess:
            return None
        # the disk filled up, a directory vanished or became read-only mid-run
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return faults.EXIT_FAILURE
    if isinstance(e, ImportError):
        if missing_extra(e) is None:
            return None
        return _exit(f"error: {missing_extra(e)}", faults.EXIT_BAD_INPUT, multiprocess)
    if not multiprocess:
        return None
    # A collective failed: almost always another process died. A normal exit would wait
    # in JAX's shutdown barrier for the dead peer, then abort; leave at once.
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _exit(
        f"error: this process (multi-process run) failed, most likely because another "
        f"process died or was killed: {type(e).__name__}: {first}",
        faults.EXIT_FAILURE,
        multiprocess,
    )


def _trains(args) -> bool:
    """Whether the command trains in this process (not a summary, a printed config, an
    ejected script, a printed jaxpr or the launcher of ``--processes``)."""
    return not (
        args.summary
        or args.print_config
        or args.eject
        or args.show_jaxpr
        or args.processes is not None
    )


def _fast_dev_run(cfg, args, timings, plotter, data) -> int:
    """``--fast-dev-run``: train/loop/devrun.py; a phase that ran but did not do what it
    must is exit 1, a stop by a signal exit 3 (nothing to resume: nothing is kept)."""
    from .loop.devrun import DevRunFailed, fast_dev_run  # start-up: imports JAX

    try:
        fast_dev_run(
            cfg,
            args.fast_dev_run,
            data=data,
            plotter=plotter,
            timings=timings,
            show_timings=args.timings,
        )
    except DevRunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_FAILURE
    except faults.Preempted as e:
        print(
            f"fast-dev-run: stopped by {e.signal_name} at step {e.step}; its temporary "
            "directory was removed (a dev run keeps nothing to resume)",
            file=sys.stderr,
        )
        return faults.EXIT_PREEMPTED
    return 0


def _freeze_heap() -> None:
    """Exclude every object alive now from the garbage collector's scans (``gc.freeze``).

    A JAX process holds a few hundred thousand long-lived objects (modules, functions,
    jaxprs); each full collection walks all of them: about 0.1 s after the imports and
    about 1 s at interpreter exit, where finalization collects several times. Frozen
    objects are still freed by reference counting; only cycles among them outlive the
    process's last moments, which a process that is about to end does not miss.
    """
    gc.freeze()


def _interrupted(signum, _frame):
    """SIGTERM/SIGINT before the training loop takes over (or after it): stop with exit 3
    and a line, not a silent 143 or a KeyboardInterrupt traceback (during an import:
    recorded, raised when it is done, see ``_PENDING``)."""
    if _DEFERRING[0]:
        _PENDING.append(signum)
        return
    raise faults.Interrupted(signal.Signals(signum).name)


class _ImportsDeferSignals:
    """``with _ImportsDeferSignals():`` imports run whole; a signal that came meanwhile
    (or before ``main``) is raised after them."""

    def __enter__(self):
        _raise_pending()
        _DEFERRING[0] = True

    def __exit__(self, *exc):
        _DEFERRING[0] = False
        if exc[0] is None:
            _raise_pending()


def _raise_pending() -> None:
    if _PENDING:
        raise faults.Interrupted(signal.Signals(_PENDING[0]).name)


def _failure(e: ConfigError, argv: list[str]) -> tuple[str, int]:
    """The line and exit status for bad input (2), and for the user's code (or data)
    failing: before the first step, bad input too; during the run (``e.step``, set by the
    loop), a failure (1) that the newest checkpoint resumes."""
    log = getattr(e, "log", None)
    traceback = f" (traceback: {log})" if log else ""
    if getattr(e, "step", None) is None:
        return f"error: {e}{traceback}", faults.EXIT_BAD_INPUT
    kept = (
        f"the last checkpoint, {e.checkpoint} (step {e.checkpoint_step}), is kept: fix it and "
        "resume with"
        if e.checkpoint is not None
        else "no checkpoint was written yet: fix it and rerun"
    )
    line = f"error: {e}; stopped at step {e.step}{traceback}; {kept}: {resume_command(argv)}"
    return line, faults.EXIT_FAILURE


def _exit(message: str, status: int, multiprocess: bool) -> int:
    print(message, file=sys.stderr)
    if multiprocess:
        # The others may be blocked in a collective with us: vanish so that they notice.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def run() -> None:
    """The ``nnlite-train`` command (installed with the package), from any directory, a
    user's project included (one with its own ``train.py`` or ``models/``)."""
    sys.exit(main(compile_cache=True, standalone=True))


if __name__ == "__main__":
    run()
