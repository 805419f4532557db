"""Hand rules of JAX's indexing primitives: static and dynamic slices and their updates,
``pad``, ``gather``, ``scatter-add``, ``scatter`` (distinct indices) and ``select_n``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._prim_layout import _zeros

# Note: this module defines ``slice`` (as ``lax.slice``); the builtin is not used here.

__all__ = ['dynamic_slice', 'dynamic_slice_vjp', 'dynamic_update_slice', 'dynamic_update_slice_vjp', 'gather', 'gather_vjp', 'pad', 'pad_vjp', 'scatter', 'scatter_add', 'scatter_add_vjp', 'scatter_vjp', 'select_n', 'select_n_vjp', 'slice', 'slice_vjp']  # fmt: skip


def slice(operand, *, start_indices, limit_indices, strides=None):  # noqa: A001
    """``lax.slice`` (``x[:, 2:5]``, ``x[:, 0]`` before its squeeze, ``x[::2]``)."""
    return lax.slice(operand, tuple(start_indices), tuple(limit_indices), strides)


def slice_vjp(operand, dret, *, start_indices, limit_indices, strides=None):
    """``dret`` padded with zeros back into place: before the start, between strided
    elements, after the last element read."""
    strides = tuple(strides) if strides is not None else (1,) * operand.ndim
    if 0 in dret.shape:
        return _zeros(operand).astype(dret.dtype)
    config = []
    for size, start, n, step in zip(operand.shape, start_indices, dret.shape, strides, strict=True):
        last = int(start) + (n - 1) * int(step)
        config.append((int(start), size - last - 1, int(step) - 1))
    return lax.pad(dret, jnp.zeros((), dret.dtype), config)


def dynamic_slice(operand, *start_indices, slice_sizes):
    """``lax.dynamic_slice`` at traced ``start_indices`` (clamped into range, as XLA does)."""
    return lax.dynamic_slice(operand, start_indices, tuple(slice_sizes))


def dynamic_slice_vjp(operand, *indices_and_dret, slice_sizes):
    """``dret`` written into zeros at the same (clamped) place; ``None`` for the indices."""
    *indices, dret = indices_and_dret
    dx = lax.dynamic_update_slice(_zeros(operand).astype(dret.dtype), dret, indices)
    return (dx, *([None] * len(indices)))


def dynamic_update_slice(operand, update, *start_indices):
    """``lax.dynamic_update_slice``: ``update`` written into ``operand``."""
    return lax.dynamic_update_slice(operand, update, start_indices)


def dynamic_update_slice_vjp(operand, update, *indices_and_dret):
    """The operand gets ``dret`` with the overwritten block zeroed, the update that block."""
    *indices, dret = indices_and_dret
    doperand = lax.dynamic_update_slice(dret, _zeros(update).astype(dret.dtype), indices)
    dupdate = lax.dynamic_slice(dret, indices, update.shape)
    return (doperand, dupdate, *([None] * len(indices)))


def pad(operand, padding_value, *, padding_config):
    """``lax.pad``: ``(low, high, interior)`` per axis; negative low/high crop."""
    return lax.pad(operand, padding_value, tuple(tuple(c) for c in padding_config))


def pad_vjp(operand, padding_value, dret, *, padding_config):
    """Undo the edges (zeros where the forward cropped), then every ``interior + 1``-th
    element; the padding value gets the rest of ``dret``."""
    lo, hi, interior = zip(*padding_config, strict=True)
    unpadded = lax.pad(
        dret,
        jnp.zeros((), dret.dtype),
        [(-int(a), -int(b), 0) for a, b in zip(lo, hi, strict=True)],
    )
    dx = lax.slice(unpadded, (0,) * dret.ndim, unpadded.shape, tuple(int(i) + 1 for i in interior))
    dpad = (jnp.sum(dret) - jnp.sum(dx)).astype(jnp.result_type(padding_value))
    return dx, dpad


# --- indexing: gather, scatter, select ----------------------------------------------------


def gather(
    operand,
    start_indices,
    *,
    dimension_numbers,
    slice_sizes,
    indices_are_sorted=False,
    unique_indices=False,
    mode=None,
    fill_value=None,
):
    """``lax.gather`` (``x[:, idx]``, ``jnp.take_along_axis`` with an integer array)."""
    return lax.gather(
        operand,
        start_indices,
        dimension_numbers,
        tuple(slice_sizes),
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
        fill_value=fill_value,
    )


def gather_vjp(
    operand,
    start_indices,
    dret,
    *,
    dimension_numbers,
    slice_sizes,
    indices_are_sorted=False,
    unique_indices=False,
    mode=None,
    fill_value=None,
):
    """Scatter-add ``dret`` into zeros at the gathered places (a place read twice gets both
    cotangents); ``None`` for the indices."""
    dn = dimension_numbers
    scatter_dn = lax.ScatterDimensionNumbers(
        update_window_dims=dn.offset_dims,
        inserted_window_dims=dn.collapsed_slice_dims,
        scatter_dims_to_operand_dims=dn.start_index_map,
        operand_batching_dims=dn.operand_batching_dims,
        scatter_indices_batching_dims=dn.start_indices_batching_dims,
    )
    dx = lax.scatter_add(
        _zeros(operand).astype(dret.dtype),
        start_indices,
        dret,
        scatter_dn,
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
    )
    return dx, None


def _gather_back(dret, indices, dn, updates_shape, mode, indices_are_sorted, unique_indices):
    """The update-shaped piece of ``dret`` each scattered update landed on."""
    gather_dn = lax.GatherDimensionNumbers(
        offset_dims=dn.update_window_dims,
        collapsed_slice_dims=dn.inserted_window_dims,
        start_index_map=dn.scatter_dims_to_operand_dims,
        operand_batching_dims=dn.operand_batching_dims,
        start_indices_batching_dims=dn.scatter_indices_batching_dims,
    )
    sizes, pos = [], 0
    for i in range(dret.ndim):
        if i in dn.inserted_window_dims or i in dn.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(updates_shape[dn.update_window_dims[pos]])
            pos += 1
    return lax.gather(
        dret,
        indices,
        gather_dn,
        tuple(sizes),
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
        fill_value=0,
    )


def scatter_add(
    operand,
    scatter_indices,
    updates,
    *,
    dimension_numbers,
    indices_are_sorted=False,
    unique_indices=False,
    mode=None,
):
    """``lax.scatter_add`` (``x.at[idx].add(u)``)."""
    return lax.scatter_add(
        operand,
        scatter_indices,
        updates,
        dimension_numbers,
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
    )


def scatter_add_vjp(
    operand,
    scatter_indices,
    updates,
    dret,
    *,
    dimension_numbers,
    indices_are_sorted=False,
    unique_indices=False,
    mode=None,
):
    """The operand gets ``dret``; each update the piece of ``dret`` it was added to."""
    dupdates = _gather_back(
        dret,
        scatter_indices,
        dimension_numbers,
        updates.shape,
        mode,
        indices_are_sorted,
        unique_indices,
    )
    return dret, None, dupdates


def scatter(
    operand,
    scatter_indices,
    updates,
    *,
    dimension_numbers,
    indices_are_sorted=False,
    unique_indices=False,
    mode=None,
):
    """``lax.scatter`` (``x.at[idx].set(u)``). Its rule below is exact for distinct indices
    (``unique_indices``: a static index, a slice); ``manual_grads`` checks that."""
    return lax.scatter(
        operand,
        scatter_indices,
        updates,
        dimension_numbers,
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
    )


def scatter_vjp(
    operand,
    scatter_indices,
    updates,
    dret,
    *,
    dimension_numbers,
    indices_are_sorted=False,
    unique_indices=False,
    mode=None,
):
    """The operand gets ``dret`` with the overwritten places zeroed; each update the piece
    of ``dret`` at its place."""
    doperand = lax.scatter(
        dret,
        scatter_indices,
        _zeros(updates).astype(dret.dtype),
        dimension_numbers,
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        mode=mode,
    )
    dupdates = _gather_back(
        dret,
        scatter_indices,
        dimension_numbers,
        updates.shape,
        mode,
        indices_are_sorted,
        unique_indices,
    )
    return doperand, None, dupdates


def select_n(which, *cases):
    """``lax.select_n``: ``cases[which]`` elementwise (``jnp.where(mask, a, b)``)."""
    return lax.select_n(which, *cases)


def select_n_vjp(which, *cases_and_dret):
    """Each case gets ``dret`` where it was selected, zero elsewhere; ``None`` for
    ``which``."""
    *cases, dret = cases_and_dret
    zero = jnp.zeros((), dret.dtype)
    cts = [
        lax.select_n(
            which,
            *[dret if j == i else jnp.broadcast_to(zero, dret.shape) for j in range(len(cases))],
        )
        for i in range(len(cases))
    ]
    return (None, *cts)
