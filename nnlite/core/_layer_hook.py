"""A trace-time hook around every layer call: what per-layer backward diagnostics and
backward policies chosen by path (a trainer's ``log.grad_by_layer``, its non-finite guard,
``loss.backward_policies``) are built on, without changing a model's code.

While ``layer_hook(fn)`` is active on a thread, each call of a Module that has params runs
as ``fn(call)`` instead, where ``call`` is a :class:`LayerCall`: the layer's path in the
model (``blocks[2].attn``, the names its parents call it by), the module, its params and
arguments, and ``call.run(*args, **kwargs)``, the call itself. The hook may change the
input it passes on and wrap the output (identity forwards with a changed VJP), and it runs
inside the layer's frame, so the layer's children are hooked too. Like manual mode it acts
while a function is traced; nothing of it runs in a compiled program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LayerCall", "current_layer_hook", "layer_hook"]

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One layer call seen by a :func:`layer_hook`.

    ``path``: where the layer sits in the model, ``""`` for the outermost module (the model
    itself); ``depth``: 0 for the model, 1 for its children, ...; ``args``/``kwargs``: what
    the layer was called with (``args[0]`` its params, ``args[1]`` its input, usually);
    ``run(*args, **kwargs)``: the layer's own ``__call__`` on them."""

    path: str
    depth: int
    module: Any
    args: tuple
    kwargs: dict
    run: Callable[..., Any]

    @property
    def params(self) -> Any:
        return self.args[0] if self.args else self.kwargs.get("params")


def current_layer_hook() -> Callable[[LayerCall], Any] | None:
    """The hook active on this thread, or None."""
    return getattr(_local, "hook", None)


@contextlib.contextmanager
def layer_hook(fn: Callable[[LayerCall], Any] | None) -> Iterator[None]:
    """Run every call of a Module with params as ``fn(call)`` in the block (see the module
    docstring); ``None`` turns an outer hook off. Restores the previous hook after.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> net = nl.FFN(3, (4,), 2)
        >>> p = jax.jit(net.init)(jax.random.key(0))
        >>> seen = []
        >>> def record(call):
        ...     seen.append(call.path)
        ...     return call.run(*call.args, **call.kwargs)
        >>> with nl.layer_hook(record):
        ...     _ = net(p, jnp.ones((1, 3)))
        >>> seen
        ['', 'layers[0]', 'layers[1]']
    """
    prev = current_layer_hook()
    _local.hook = fn
    try:
        yield
    finally:
        _local.hook = prev
