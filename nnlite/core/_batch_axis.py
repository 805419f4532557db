"""The data-parallel batch axis: which mapped axis (``pmap``/``shard_map``) splits the batch.

Layers that compute statistics over the batch (``BatchNorm``) average them over this axis,
so every device normalises with the statistics of the whole global batch and updates the
same running statistics. The trainer sets it around its step (each parallel strategy knows
its axis); a user's own ``pmap``/``shard_map`` sets it with ``nl.batch_axis``. A layer's
own ``axis_name`` field, when given, takes precedence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ._jax_private import batch_axis_trace_state

batch_axis_trace_state()  # registered now, not on first use (see its docstring)

__all__ = ["batch_axis", "current_batch_axis"]


@contextlib.contextmanager
def batch_axis(axis_name: str | None) -> Iterator[None]:
    """Within the block, layers that compute batch statistics average them over the mapped
    axis ``axis_name`` (None: the batch a layer sees is the whole batch, as under ``jit``).

    The setting is part of JAX's trace context, so what JAX caches by function is traced
    once per axis.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> bn = nl.BatchNorm(2)
        >>> p, s = jax.jit(bn.init)(jax.random.key(0)), bn.init_state()
        >>> def forward(x):  # each device holds 2 of the 4 examples
        ...     with nl.batch_axis("devices"):
        ...         return bn(p, x, state=s, train=True)[1].mean
        >>> x = jnp.arange(8.0).reshape(2, 2, 2)
        >>> means = jax.jit(jax.vmap(forward, axis_name="devices"))(x)
        >>> [round(v, 4) for v in means[0].tolist()]
        [0.3, 0.4]
    """
    with batch_axis_trace_state()(axis_name):
        yield


def current_batch_axis() -> str | None:
    """The axis set by the innermost ``batch_axis`` block, or None."""
    return batch_axis_trace_state().value
