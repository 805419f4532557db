"""Command line: print the decompiled jaxpr of any importable function.

    python -m nnlite.jaxpr_cli MODULE:FUNCTION --shapes 'f32[3,4]' 'i32[3]' [--simplify]

(The CLI has a name of its own so that ``nnlite.show_jaxpr`` is only ever the function.)
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

import jax
import jax.numpy as jnp

from .jaxpr._show_jaxpr import show_jaxpr as _show_jaxpr

__all__ = ["main", "parse_shape"]

_DTYPES = {
    "bool": jnp.bool_, "bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32,
    "f64": jnp.float64, "i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "i64": jnp.int64,
    "u8": jnp.uint8, "u16": jnp.uint16, "u32": jnp.uint32, "u64": jnp.uint64,
}  # fmt: skip
_SHAPE = re.compile(r"(\w+)\[([0-9, ]*)\]")


def parse_shape(spec: str) -> jax.ShapeDtypeStruct:
    """``'f32[3,4]'`` -> ``ShapeDtypeStruct((3, 4), float32)``; ``'i32[]'`` is a scalar.

    Example:
        >>> parse_shape("f32[3,4]")
        ShapeDtypeStruct(shape=(3, 4), dtype=float32)
    """
    m = _SHAPE.fullmatch(spec.strip())
    if not m or m.group(1) not in _DTYPES:
        raise ValueError(
            f"bad --shapes entry {spec!r}: expected DTYPE[DIMS] like 'f32[3,4]' or 'i32[]', "
            f"with DTYPE one of {', '.join(_DTYPES)}"
        )
    dims = tuple(int(d) for d in m.group(2).replace(" ", "").split(",") if d)
    return jax.ShapeDtypeStruct(dims, _DTYPES[m.group(1)])


def _load(target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"bad target {target!r}: expected MODULE:FUNCTION, e.g. 'jax.nn:relu'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{target!r} is not callable (it is a {type(obj).__name__})")
    return obj


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, print the decompiled function; bad arguments exit 2 with one message."""
    parser = argparse.ArgumentParser(
        prog="python -m nnlite.jaxpr_cli",
        description="Print a function's jaxpr as runnable Python (see nnlite.show_jaxpr).",
    )
    parser.add_argument("target", help="MODULE:FUNCTION, e.g. jax.nn:relu")
    parser.add_argument(
        "--shapes", nargs="*", default=[], metavar="TYPE", help="one per input: 'f32[3,4]' 'i32[]'"
    )
    parser.add_argument("--name", default=None, help="name of the printed function")
    parser.add_argument("--simplify", action="store_true", help="inline trivial calls")
    parser.add_argument("--inline-jit", action="store_true", help="inline every jit call")
    args = parser.parse_args(argv)
    try:
        fn = _load(args.target)
        shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as e:
        parser.error(str(e))
    try:
        src = _show_jaxpr(
            fn, *shapes, name=args.name, simplify=args.simplify, inline_jit=args.inline_jit
        )
    except Exception as e:  # the user's function failed to trace at these shapes
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        parser.error(f"tracing {args.target} at {' '.join(args.shapes) or 'no arguments'} failed: "
                     f"{type(e).__name__}: {first}")  # fmt: skip
    sys.stdout.write(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
