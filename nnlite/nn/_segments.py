"""Packed sequences: several documents in one window, told apart by segment ids.

A window of ``T`` tokens holding documents one after another carries ``segment_ids [B, T]``
(equal ids for the tokens of one document, documents contiguous; by convention 0 marks
padding). Each document then attends only to itself (:func:`segment_mask`) and its
positions restart at 0 (:func:`segment_positions`), so its logits are those it would have
alone in a window of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["segment_mask", "segment_positions"]


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """``[B, 1, T, T]`` boolean: query ``i`` may attend key ``j`` of the same segment (the
    causal part is the attention's own); broadcasts over heads.

    Example:
        >>> import jax.numpy as jnp
        >>> segment_mask(jnp.array([[1, 1, 2]]))[0, 0].astype(int).tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    if getattr(segment_ids, "ndim", 0) != 2:
        raise ValueError(
            f"segment_ids: expected [batch, T] integers, got shape "
            f"{tuple(getattr(segment_ids, 'shape', ()))}"
        )
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` int32 positions restarting at 0 at each segment's first token (the count
    of earlier tokens of the same segment; segments are contiguous).

    Example:
        >>> import jax.numpy as jnp
        >>> segment_positions(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
        [[0, 1, 2, 0, 1, 0]]
    """
    t = segment_ids.shape[-1]
    same = segment_mask(segment_ids)[:, 0]
    earlier = (jnp.arange(t)[None, :] < jnp.arange(t)[:, None])[None]  # [1, i, j]: j before i
    return jnp.sum(jnp.logical_and(same, earlier), axis=-1, dtype=jnp.int32)
