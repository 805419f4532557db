"""Glue between layers, with hand rules: the residual and positional-embedding add."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..grad._manual import hand_rule

__all__ = ["add", "add_vjp"]


def add_vjp(x: jax.Array, y: jax.Array, dret: jax.Array):
    """Hand VJP of ``add``: ``dx = dret``; ``dy`` sums ``dret`` over the axes ``y`` was
    broadcast along."""
    lead = dret.ndim - y.ndim
    dy = jnp.sum(dret, axis=tuple(range(lead))) if lead else dret
    return dret, dy.astype(y.dtype)


@hand_rule(add_vjp)
def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x + y`` with ``y`` broadcast along ``x``'s leading axes (``y.shape`` is a suffix of
    ``x.shape``): a residual connection, or ``[T, F]`` position embeddings added to every
    sequence of a ``[B, T, F]`` batch. In manual-gradient mode its hand VJP is ``add_vjp``.

    Example:
        >>> import jax.numpy as jnp
        >>> add(jnp.zeros((2, 3)), jnp.arange(3.0))
        Array([[0., 1., 2.],
               [0., 1., 2.]], dtype=float32)
    """
    if x.shape[x.ndim - y.ndim :] != y.shape or y.ndim > x.ndim:
        raise ValueError(
            f"add: y's shape {tuple(y.shape)} must be a suffix of x's shape {tuple(x.shape)}"
        )
    return x + jnp.broadcast_to(y, x.shape).astype(x.dtype)
