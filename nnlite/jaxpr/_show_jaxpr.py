"""show_jaxpr: decompile a traced function into runnable Python, and the round trip.

``show_jaxpr(f, *args)`` traces ``f`` with ``jax.make_jaxpr`` and prints one Python
statement per equation, using ``jax.lax`` / ``jax.numpy`` calls. Nested jaxprs become nested
functions called through the construct that made them: ``jax.jit``, ``jax.custom_jvp``
(with its JVP rule), ``jax.custom_vjp`` (with its forward and backward rules),
``lax.cond`` / ``lax.switch``, ``lax.while_loop``, ``lax.scan``, ``jax.checkpoint``,
``jax.shard_map`` (so also ``jax.pmap``, which traces to jit of shard_map). The printed
source is self-contained: executing it defines a function that computes the same thing,
and printing that function again gives the same text. ``show_xla`` prints the HLO that
XLA compiles instead.

Layout: ``_exprs.py`` (expressions) <- ``_printer.py`` (the printer core, empty tables)
<- ``_rules.py``, ``_nested.py``, ``_parallel.py`` (rules that register into the core)
<- this module (the API).
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# The rule modules register into the printer core when imported; nothing else reads them.
from . import _calls, _nested, _parallel, _public, _rules  # noqa: F401
from ._exprs import UnsupportedPrimitiveError, dtype_expr
from ._printer import CONSTS_DICT, IMPORT_LINES, ORIGINS, Printer, sanitize

__all__ = [
    "UnsupportedPrimitiveError",
    "roundtrip",
    "show_jaxpr",
    "show_jaxpr_and_xla",
    "show_xla",
]

_PRINT_OPTIONS = ("name", "simplify", "inline_jit", "max_const_size")
_OUTPUT_OPTIONS = ("file", "add_decls", "add_main")
# jax.make_jaxpr's own options (return_shape would change what it returns: not offered).
_MAKE_JAXPR_OPTIONS = tuple(
    p for p in inspect.signature(jax.make_jaxpr).parameters if p not in ("fun", "return_shape")
)
_JIT_OPTIONS = tuple(p for p in inspect.signature(jax.jit).parameters if p != "fun")


def _check_options(who: str, kwargs: dict, valid: tuple[str, ...]) -> None:
    """Unknown keywords get one clear error listing the valid ones (not make_jaxpr's)."""
    for k in kwargs:
        if k not in valid:
            raise TypeError(
                f"{who}() got an unexpected keyword argument {k!r}; valid keywords: "
                f"{', '.join(valid)}"
            )


def show_jaxpr(
    f: Callable,
    *args: Any,
    name: str | None = None,
    simplify: bool = False,
    inline_jit: bool = False,
    max_const_size: int = 1000,
    file: Any = None,
    add_decls: bool = True,
    add_main: bool = False,
    **make_jaxpr_kwargs: Any,
) -> str:
    """Decompile ``f`` traced at ``args`` into Python source that runs.

    Executing the returned source defines ``name(...)`` taking one argument per
    flattened input of ``f`` (each annotated with its type, e.g. ``# f32[11,7]``) and
    returning the flattened outputs. ``roundtrip`` executes it for you.

    Args:
        f: the function to trace; ``args`` are its example arguments (arrays, pytrees,
            or ``jax.ShapeDtypeStruct``).
        name: name of the printed function (default: ``f.__name__``).
        simplify: inline ``jit`` calls of at most one equation and drop identity
            equations (same-type conversions, no-op reshapes/broadcasts/transposes).
        inline_jit: inline every ``jit`` call into its caller.
        max_const_size: captured constants with more elements than this are not printed;
            the source reads them from a module-level ``LARGE_CONSTS`` dict that
            ``roundtrip`` supplies.
        file: also write the source there: a path (the file is replaced) or an open text
            file (the seed's option).
        add_decls: start with the imports the source needs (default; the seed added them
            only when writing to a file). ``False``: the definitions alone.
        add_main: end with an ``if __name__ == "__main__":`` block that calls the function
            on arguments of the traced shapes and dtypes (random floats, zero integers)
            and prints the result, so a file written with ``file=`` runs as a script.
        static_argnums, axis_env: passed to ``jax.make_jaxpr``.

    Returns:
        The source text, formatted as ``ruff format`` would leave it.

    Raises:
        TypeError: an unknown keyword argument (the message lists the valid ones).
        UnsupportedPrimitiveError: a primitive (named, with its parameters) has no Python
            spelling.

    Example:
        >>> import jax.numpy as jnp
        >>> print(show_jaxpr(lambda x, y: jnp.sin(x) * y, jnp.ones(3), 2.0, name="f"))
        import jax.numpy as jnp
        from jax import lax
        <BLANKLINE>
        <BLANKLINE>
        def f(
            a,  # f32[3]
            b,  # f32[] (weak)
        ):
            c = lax.sin(a)
            d = lax.convert_element_type(b, new_dtype=jnp.float32)
            e = lax.mul(c, d)
            return e
        <BLANKLINE>
    """
    _check_options(
        "show_jaxpr", make_jaxpr_kwargs, _PRINT_OPTIONS + _OUTPUT_OPTIONS + _MAKE_JAXPR_OPTIONS
    )
    src, _, _, fname, closed = _decompile(
        f, args, name, simplify, inline_jit, max_const_size, make_jaxpr_kwargs
    )
    if not add_decls:
        src = _without_imports(src)
    if add_main:
        src += _main_block(fname, closed)
    _write(file, src)
    return src


def _without_imports(src: str) -> str:
    lines = src.split("\n")
    k = 0
    while k < len(lines) and (lines[k] in IMPORT_LINES or lines[k].startswith("# Needs")):
        k += 1
    keep = [ln for ln in lines[:k] if ln.startswith("# Needs")]
    rest = lines[k:]
    while rest and not rest[0]:
        rest = rest[1:]
    return "\n".join(keep + rest)


def _main_block(fname: str, closed) -> str:
    """``if __name__ == "__main__":`` calling ``fname`` on arguments of the traced types:
    standard-normal floats, integer and bool zeros, keys from ``jax.random.key(0)``."""
    args = []
    for v in closed.jaxpr.invars:
        shape, dtype = tuple(v.aval.shape), v.aval.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            n = math.prod(shape)
            key = "jax.random.key(0)"
            args.append(f"jax.random.split({key}, {n}).reshape({shape})" if shape else key)
        elif jax.dtypes.issubdtype(dtype, np.inexact):
            args.append(f"jnp.asarray(rng.standard_normal({shape}), {dtype_expr(dtype)})")
        else:
            args.append(f"jnp.zeros({shape}, {dtype_expr(dtype)})")
    lines = [
        "",
        "",
        'if __name__ == "__main__":',
        "    import jax",
        "    import jax.numpy as jnp",
        "    import numpy as np",
        "",
        "    rng = np.random.default_rng(0)",
        f"    print({fname}(",
        *(f"        {a}," for a in args),
        "    ))",
    ]
    return "\n".join(lines) + "\n"


def _write(file: Any, text: str) -> None:
    if file is None:
        return
    if isinstance(file, (str, os.PathLike)):
        with open(file, "w") as fh:
            fh.write(text)
    elif hasattr(file, "write"):
        file.write(text)
    else:
        raise TypeError(f"file must be a path or an open text file, got {type(file).__name__}")


def show_xla(
    f: Callable, *args: Any, file: Any = None, optimized: bool = False, **jit_kwargs: Any
) -> str:
    """The HLO module XLA compiles for ``jax.jit(f)`` at ``args`` (the seed's ``show_xla``).

    Args:
        f: the function; ``args`` its example arguments (arrays or ``ShapeDtypeStruct``).
        file: also write the text there (a path or an open text file).
        optimized: the HLO after XLA's optimisation passes (compiles ``f``) instead of
            the HLO JAX hands to XLA.
        **jit_kwargs: passed to ``jax.jit`` (``static_argnums``, ...).

    Returns:
        The HLO text.

    Example:
        >>> import jax.numpy as jnp
        >>> print(show_xla(lambda x: x * 2, jnp.ones(3)).splitlines()[0])
        HloModule jit__lambda, entry_computation_layout={(f32[3]{0})->f32[3]{0}}
    """
    _check_options("show_xla", jit_kwargs, ("file", "optimized", *_JIT_OPTIONS))
    lowered = jax.jit(f, **jit_kwargs).lower(*args)
    text = lowered.compile().as_text() if optimized else lowered.as_text(dialect="hlo")
    _write(file, text)
    return text


def show_jaxpr_and_xla(
    f: Callable, *args: Any, file: Any = None, optimized: bool = False, **kwargs: Any
) -> str:
    """``show_jaxpr`` then ``show_xla`` of the same function, as one text.

    Keyword arguments are ``show_jaxpr``'s (``static_argnums`` goes to both).

    Example:
        >>> import jax.numpy as jnp
        >>> text = show_jaxpr_and_xla(lambda x: x * 2, jnp.ones(3), name="double")
        >>> "def double(" in text and "HloModule" in text
        True
    """
    _check_options(
        "show_jaxpr_and_xla",
        kwargs,
        ("file", "optimized", *_PRINT_OPTIONS, "add_decls", "add_main", *_MAKE_JAXPR_OPTIONS),
    )
    jit_kwargs = {k: kwargs[k] for k in ("static_argnums",) if k in kwargs}
    text = (
        show_jaxpr(f, *args, **kwargs)
        + "\n\n"
        + show_xla(f, *args, optimized=optimized, **jit_kwargs)
    )
    _write(file, text)
    return text


def roundtrip(f: Callable, *args: Any, **kwargs: Any) -> Callable:
    """Decompile ``f`` with ``show_jaxpr`` and execute the source; return the new function.

    The returned function takes the flattened inputs of ``f`` (``jax.tree.leaves(args)``)
    and returns its flattened outputs (a single array when there is one).
    Keyword arguments are those of ``show_jaxpr``.

    Example:
        >>> import jax.numpy as jnp
        >>> g = roundtrip(lambda x: jnp.cumsum(x) ** 2, jnp.arange(3.0))
        >>> g(jnp.arange(3.0))
        Array([0., 1., 9.], dtype=float32)
    """
    _check_options("roundtrip", kwargs, _PRINT_OPTIONS + _MAKE_JAXPR_OPTIONS)
    opts = {k: kwargs.pop(k) for k in _PRINT_OPTIONS if k in kwargs}
    src, origins, large, fname, _ = _decompile(
        f,
        args,
        opts.get("name"),
        opts.get("simplify", False),
        opts.get("inline_jit", False),
        opts.get("max_const_size", 1000),
        kwargs,
    )
    filename = f"<nnlite.show_jaxpr:{fname}:{next(_COUNTER)}>"
    # Register the text so tracebacks show it, and where each nested construct came from so
    # that decompiling the rebuilt function names the original source lines (a fixed point).
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ORIGINS[filename] = origins
    namespace: dict[str, Any] = {"__name__": "nnlite_show_jaxpr_generated", CONSTS_DICT: large}
    exec(compile(src, filename, "exec"), namespace)
    return namespace[fname]


_COUNTER = itertools.count()


def _decompile(f, args, name, simplify, inline_jit, max_const_size, make_jaxpr_kwargs):
    closed = jax.make_jaxpr(f, **make_jaxpr_kwargs)(*args)
    fname = sanitize(name or getattr(f, "__name__", "fn"))
    p = Printer(simplify=simplify, inline_jit=inline_jit, max_const_size=max_const_size)
    return (*p.module(closed, fname), fname, closed)
