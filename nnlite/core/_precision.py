"""A compute-dtype scope: inside ``nl.precision(dtype)`` layers accept params cast to
``dtype`` in place of their ``param_dtype`` (a mixed-precision policy keeps float32 params
and casts them for the forward pass; the trainer's ``train.precision`` does this)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

__all__ = ["precision", "precision_dtype"]

_state = threading.local()


def precision_dtype() -> Any:
    """The dtype params may be cast to in the current ``precision`` scope, or None."""
    return getattr(_state, "dtype", None)


@contextlib.contextmanager
def precision(dtype: Any) -> Iterator[None]:
    """Trace a model whose params were cast to ``dtype`` (``"bfloat16"``, ``"float16"``):
    each layer's params check then accepts that dtype too. The check runs at trace time, so
    the scope must surround the call (or the ``jax.jit`` trace), not the compiled run.

    Example:
        >>> import jax, jax.numpy as jnp, nnlite as nl
        >>> layer = nl.Linear(3, 2)
        >>> p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), layer.init(jax.random.key(0)))
        >>> with nl.precision("bfloat16"):
        ...     y = layer(p, jnp.ones((1, 3), jnp.bfloat16))
        >>> y.dtype
        dtype(bfloat16)
    """
    prev = precision_dtype()
    _state.dtype = None if dtype is None else jnp.dtype(dtype)
    try:
        yield
    finally:
        _state.dtype = prev
