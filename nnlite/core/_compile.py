"""The XLA options nnlite compiles its programs with: ``compiler_options``.

On the CPU, XLA (jaxlib 0.10) hands every matrix product to a YNNPACK fusion by default.
At the shapes of a transformer's layers that is slower than XLA's own dot (Eigen's GEMM):
measured side by side on a 2-core Intel Xeon with AVX-512, ``[16384, 384] @ [384, 1152]``
at 106 GFLOP/s against 174, a batched attention product at 38 against 53, and the
GPT 6x6x384 training step 10.5 s against 7.8 s. So nnlite's programs turn the YNNPACK
fusions off on the CPU, unless the process's ``XLA_FLAGS`` set that option itself (the user's
choice wins). Elsewhere the options are XLA's defaults.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax

from ._jax_private import at_top_level

__all__ = ["compiler_options", "jit"]

# XLA:CPU's option naming the kinds of op YNNPACK may take; empty: none.
_YNN = "xla_cpu_experimental_ynn_fusion_type"
CPU_OPTIONS = {_YNN: ""}


def compiler_options(backend: str | None = None) -> dict[str, str]:
    """The XLA options nnlite's own programs are compiled with on ``backend`` (default
    ``jax.default_backend()``): on the CPU XLA's own dot instead of YNNPACK's fusions,
    elsewhere none. An option the process's ``XLA_FLAGS`` already sets is left out, so
    ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot`` brings YNNPACK back.

    Pass them to your own programs for the same speed (:func:`jit` does)::

        step = jax.jit(train_step, compiler_options=nl.compiler_options())

    Example:
        >>> compiler_options("cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""} or (
        ...     "xla_cpu_experimental_ynn_fusion_type" in os.environ.get("XLA_FLAGS", ""))
        True
        >>> compiler_options("gpu")
        {}
    """
    if (backend or jax.default_backend()) != "cpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in CPU_OPTIONS.items() if f"--{k}" not in flags}


class jit:  # noqa: N801 -- used as jax.jit is
    """``jax.jit(fun, **jit_kwargs)`` compiled with :func:`compiler_options`.

    JAX takes ``compiler_options`` only on a top-level ``jax.jit``; called under another
    trace (inside your own ``jax.jit``, ``jax.make_jaxpr``, ``jax.grad``) this is the same
    ``jax.jit`` without them, and the outer program's options apply. Its ``lower``,
    ``trace``, ``eval_shape`` are the top-level function's. The options are read at the
    first top-level use, when the backend is known, so ``nl.jit`` may decorate a function
    at import time as ``jax.jit`` does.

    Example:
        >>> import jax.numpy as jnp
        >>> double = jit(lambda x: 2 * x)
        >>> double(jnp.ones(2)), jax.jit(lambda x: double(x) + 1)(jnp.ones(2))
        (Array([2., 2.], dtype=float32), Array([3., 3.], dtype=float32))
        >>> @jit(static_argnames="n")
        ... def power(x, n):
        ...     return x**n
        >>> power(jnp.full(2, 3.0), n=2).tolist()
        [9.0, 9.0]
    """

    def __new__(cls, fun: Callable | None = None, **jit_kwargs: Any):
        if fun is None:  # @nl.jit(static_argnames=...): a decorator
            return functools.partial(cls, **jit_kwargs)
        return super().__new__(cls)

    def __init__(self, fun: Callable, **jit_kwargs: Any):
        self._given = jit_kwargs.pop("compiler_options", None) or {}
        self._jit_kwargs = jit_kwargs
        self._nested = jax.jit(fun, **jit_kwargs)
        functools.update_wrapper(self, fun)

    @functools.cached_property
    def _top(self) -> Any:
        options = {**compiler_options(), **self._given}
        if not options:
            return self._nested
        return jax.jit(self.__wrapped__, compiler_options=options, **self._jit_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self._top if at_top_level() else self._nested)(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # a method, as jax.jit's are
        return self if obj is None else functools.partial(self, obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._top, name)
