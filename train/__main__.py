"""``python -m train --config FILE [--set key=value ...] [--print-config] [--resume | --fresh]
[--processes N]``.

Exit statuses: 0 done, 1 unexpected failure (a lost peer included), 2 bad input,
3 preempted (a checkpoint was written; rerun to resume), 4 stopped on a non-finite step.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap

from . import faults
from .config import ConfigError, dump_yaml, load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m train",
        description="Train an nnlite model from a YAML config.",
        epilog="exit statuses: 0 done, 1 failure, 2 bad input, 3 preempted (checkpoint "
        "written; rerun to resume), 4 stopped on a non-finite loss/gradient/param",
    )
    ap.add_argument("--config", required=True, help="YAML config file (see configs/)")
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
        "pass as hand VJP calls per layer (grad: nnlite.show_grad), and exit",
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
    """The command that resumes this run: the same one, minus --fresh (it would delete)."""
    args = [a for a in argv if a != "--fresh"]
    return shlex.join(["python", "-m", "train", *args])


def _show_jaxpr(cfg, what: str) -> int:
    from nnlite import UnsupportedPrimitiveError

    from .loop import show_jaxpr

    try:
        src = show_jaxpr(cfg, what)
    except UnsupportedPrimitiveError as e:
        # its message quotes the primitive's params, jaxprs included: one line of it
        msg = textwrap.shorten(str(e), 300, placeholder=" ...")
        print(f"error: --show-jaxpr {what}: {msg}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    print(src, end="")  # the source ends in a newline
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    multiprocess = False
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_yaml(cfg), end="")
            return 0
        if args.show_jaxpr:
            return _show_jaxpr(cfg, args.show_jaxpr)
        if args.processes is not None:
            if args.processes < 1:
                raise ConfigError(f"--processes must be >= 1, got {args.processes}")
            from .launch import launch

            return launch(cfg, _without_processes(argv), args.processes, echo=print)

        from . import distributed as dist

        multiprocess = dist.resolve(cfg.distributed) is not None
        from .loop import train  # imports jax: keep --print-config and config errors fast

        train(cfg, resume="require" if args.resume else "fresh" if args.fresh else "auto")
    except ConfigError as e:
        return _exit(f"error: {e}", faults.EXIT_BAD_INPUT, multiprocess)
    except faults.Preempted as e:
        print(
            f"preempted by {e.signal_name} at step {e.step}: wrote {e.checkpoint}; "
            f"resume with: {resume_command(argv)}",
            file=sys.stderr,
        )
        return faults.EXIT_PREEMPTED
    except faults.NonFinite as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_NONFINITE
    except Exception as e:
        if not multiprocess:
            raise
        # A collective failed: almost always another process died. A normal exit would
        # wait in JAX's shutdown barrier for the dead peer, then abort; leave at once.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _exit(
            f"error: this process (multi-process run) failed, most likely because another "
            f"process died or was killed: {type(e).__name__}: {first}",
            faults.EXIT_FAILURE,
            multiprocess,
        )
    return 0


def _exit(message: str, status: int, multiprocess: bool) -> int:
    print(message, file=sys.stderr)
    if multiprocess:
        # The others may be blocked in a collective with us: vanish so that they notice.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
