"""``python -m train --config FILE [--set key=value ...] [--print-config] [--resume | --fresh]``."""

from __future__ import annotations

import argparse
import sys
import textwrap

from .config import ConfigError, dump_yaml, load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m train", description="Train an nnlite model from a YAML config."
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
        choices=("loss", "step"),
        help="print the decompiled loss or train step (nnlite.show_jaxpr) and exit",
    )
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="require a checkpoint to resume from")
    group.add_argument(
        "--fresh", action="store_true", help="ignore and delete old checkpoints, start over"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_yaml(cfg), end="")
            return 0
        from .loop import show_jaxpr, train  # imports jax: keep --print-config fast

        if args.show_jaxpr:
            from nnlite import UnsupportedPrimitiveError

            try:
                src = show_jaxpr(cfg, args.show_jaxpr)
            except UnsupportedPrimitiveError as e:
                # its message quotes the primitive's params, jaxprs included: one line of it
                msg = textwrap.shorten(str(e), 300, placeholder=" ...")
                print(f"error: --show-jaxpr {args.show_jaxpr}: {msg}", file=sys.stderr)
                return 2
            print(src, end="")  # the source ends in a newline
            return 0
        train(cfg, resume="require" if args.resume else "fresh" if args.fresh else "auto")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
