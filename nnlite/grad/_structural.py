"""Hand-derived VJPs of JAX's structural and linear primitives.

One pair per primitive, named after it and taking its parameters as keywords:
``broadcast_in_dim(x, shape=..., broadcast_dimensions=...)`` and
``broadcast_in_dim_vjp(x, dret, shape=..., broadcast_dimensions=...)``, in the seed's form
(one cotangent per operand, ``None`` for integer operands). ``manual_grads`` applies them to
the equations of a user's loss that compute on param-derived values outside any layer's
rule (``tok + pos``, ``jnp.mean(h, axis=-2)``, ``h[:, 0]``, ``x.reshape(...)``, ...), and
``show_grad`` prints them. Each is exact: the primitive is linear in the operands it is
applied to (``mul`` and ``div`` only when the other operand, the divisor, ``dot_general``
only when one side is not differentiated; ``manual_grads`` checks that).

The rules read their operands' shapes and, only where the math needs it, values (the
factor of ``mul``, the indices of ``gather``). Axes may be negative when called directly.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((1, 3))
    >>> broadcast_in_dim_vjp(x, jnp.ones((4, 3)), shape=(4, 3), broadcast_dimensions=(0, 1))
    Array([[4., 4., 4.]], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Note: this module defines ``slice`` (as ``lax.slice``); the builtin is not used here.

__all__ = [
    "add", "add_vjp", "broadcast_in_dim", "broadcast_in_dim_vjp", "concatenate",
    "concatenate_vjp", "convert_element_type", "convert_element_type_vjp", "copy", "copy_vjp",
    "cumsum", "cumsum_vjp", "div", "div_vjp", "dot_general", "dot_general_vjp",
    "dynamic_slice", "dynamic_slice_vjp", "dynamic_update_slice", "dynamic_update_slice_vjp",
    "gather", "gather_vjp", "mul", "mul_vjp", "neg", "neg_vjp", "pad", "pad_vjp", "pvary",
    "pvary_vjp", "reduce_sum", "reduce_sum_vjp", "reshape", "reshape_vjp", "rev", "rev_vjp",
    "scatter", "scatter_add", "scatter_add_vjp", "scatter_vjp", "select_n", "select_n_vjp",
    "slice", "slice_vjp", "split", "split_vjp", "squeeze", "squeeze_vjp", "stack",
    "stack_vjp", "stop_gradient", "stop_gradient_vjp", "sub", "sub_vjp", "tile", "tile_vjp",
    "transpose", "transpose_vjp",
]  # fmt: skip


# --- helpers ------------------------------------------------------------------------------


def _axes(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(int(a) % ndim if ndim else int(a) for a in axes)


def _zeros(x) -> jax.Array:
    """Zeros of ``x``'s shape and dtype (``x`` may be a ``jax.ShapeDtypeStruct``)."""
    return jnp.zeros(x.shape, x.dtype)


def _sum_to(dret: jax.Array, shape: Sequence[int]) -> jax.Array:
    """``dret`` summed back to ``shape``: over the axes an operand of that shape was
    broadcast along (a rank-0 operand: all of them; size-1 axes, and missing leading ones)."""
    shape = tuple(shape)
    if dret.shape == shape:
        return dret
    lead = dret.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and dret.shape[lead + i] != 1
    )
    return jnp.sum(dret, axis=axes).reshape(shape)


def _broadcast(*xs):
    shape = np.broadcast_shapes(*(np.shape(x) for x in xs))
    return [jnp.broadcast_to(x, shape) for x in xs]


def _one_or_tuple(cts: Sequence):
    """A rule returns a bare cotangent for a one-operand call, else one per operand."""
    return cts[0] if len(cts) == 1 else tuple(cts)


# --- layout: broadcast, reshape, transpose, squeeze ---------------------------------------


def broadcast_in_dim(operand, *, shape, broadcast_dimensions, sharding=None):
    """``lax.broadcast_in_dim``: operand axis ``i`` becomes result axis
    ``broadcast_dimensions[i]`` (size 1 or the result's size); the other axes are new."""
    dims = _axes(broadcast_dimensions, len(shape))
    return lax.broadcast_in_dim(operand, tuple(shape), dims, out_sharding=sharding)


def broadcast_in_dim_vjp(operand, dret, *, shape, broadcast_dimensions, sharding=None):
    """Sum ``dret`` over the new axes and the size-1 axes that were stretched."""
    bdims = _axes(broadcast_dimensions, len(shape))
    new = tuple(i for i in range(len(shape)) if i not in bdims)
    stretched = tuple(
        b for i, b in enumerate(bdims) if operand.shape[i] == 1 and dret.shape[b] != 1
    )
    return jnp.sum(dret, axis=new + stretched).reshape(operand.shape)


def _sizes(operand, new_sizes) -> tuple[int, ...]:
    """``new_sizes`` with a ``-1`` (allowed when calling the rule directly) filled in."""
    sizes = [int(n) for n in new_sizes]
    if -1 in sizes:
        known = int(np.prod([n for n in sizes if n != -1]))
        sizes[sizes.index(-1)] = int(np.prod(operand.shape)) // max(known, 1)
    return tuple(sizes)


def reshape(operand, *, new_sizes, dimensions=None, sharding=None):
    """``lax.reshape`` (``new_sizes`` may hold one ``-1``); ``dimensions``: transpose first."""
    return lax.reshape(operand, _sizes(operand, new_sizes), dimensions, out_sharding=sharding)


def reshape_vjp(operand, dret, *, new_sizes, dimensions=None, sharding=None):
    """The same numbers in the operand's shape (and order, when ``dimensions`` transposed)."""
    if dimensions is None:
        return dret.reshape(operand.shape)
    perm = _axes(dimensions, operand.ndim)
    moved = dret.reshape(tuple(operand.shape[d] for d in perm))
    return lax.transpose(moved, tuple(int(i) for i in np.argsort(perm)))


def transpose(operand, *, permutation):
    """``lax.transpose``: result axis ``i`` is operand axis ``permutation[i]``."""
    return lax.transpose(operand, _axes(permutation, operand.ndim))


def transpose_vjp(operand, dret, *, permutation):
    """The inverse permutation."""
    perm = _axes(permutation, operand.ndim)
    return lax.transpose(dret, tuple(int(i) for i in np.argsort(perm)))


def squeeze(operand, *, dimensions):
    """``lax.squeeze``: drop size-1 axes."""
    return lax.squeeze(operand, _axes(dimensions, operand.ndim))


def squeeze_vjp(operand, dret, *, dimensions):
    """Put the size-1 axes back."""
    return dret.reshape(operand.shape)


def rev(operand, *, dimensions):
    """``lax.rev``: reverse along ``dimensions`` (``jnp.flip``)."""
    return lax.rev(operand, _axes(dimensions, operand.ndim))


def rev_vjp(operand, dret, *, dimensions):
    """Reverse the cotangent the same way."""
    return lax.rev(dret, _axes(dimensions, operand.ndim))


def tile(operand, *, reps):
    """``jnp.tile`` (the ``tile`` primitive): ``reps[i]`` copies along axis ``i``."""
    return jnp.tile(operand, tuple(reps))


def tile_vjp(operand, dret, *, reps):
    """Add up the copies: view axis ``i`` as ``(reps[i], size_i)`` and sum the copy axes."""
    nd = max(len(reps), operand.ndim)
    reps = (1,) * (nd - len(reps)) + tuple(int(r) for r in reps)
    shape = (1,) * (nd - operand.ndim) + tuple(operand.shape)
    split = tuple(itertools.chain.from_iterable(zip(reps, shape, strict=True)))
    return jnp.sum(dret.reshape(split), axis=tuple(range(0, 2 * nd, 2))).reshape(operand.shape)


def copy(operand):
    """A copy (``jnp.array(x, copy=True)``)."""
    return jnp.array(operand, copy=True)


def copy_vjp(operand, dret):
    return dret


def convert_element_type(operand, *, new_dtype, weak_type=False, sharding=None):
    """``x.astype(new_dtype)`` (float to float: an int result carries no gradient)."""
    return lax.convert_element_type(operand, new_dtype)


def convert_element_type_vjp(operand, dret, *, new_dtype, weak_type=False, sharding=None):
    """The cotangent cast back to the operand's dtype."""
    return dret.astype(operand.dtype)


def stop_gradient(operand):
    """``lax.stop_gradient``: the value, and no gradient through it."""
    return lax.stop_gradient(operand)


def stop_gradient_vjp(operand, dret):
    return _zeros(operand)


# --- arithmetic: add, sub, neg, and products with a factor that is not differentiated ----


def add(x, y):
    """``x + y`` with NumPy broadcasting (size-1 and missing leading axes), in ``x``'s dtype:
    a residual connection, or ``[T, F]`` position embeddings added to every sequence of a
    ``[B, T, F]`` batch. In manual-gradient mode its hand VJP is ``add_vjp``.

    Example:
        >>> import jax.numpy as jnp
        >>> add(jnp.zeros((2, 3)), jnp.arange(3.0))
        Array([[0., 1., 2.],
               [0., 1., 2.]], dtype=float32)
    """
    try:
        shape = np.broadcast_shapes(np.shape(x), np.shape(y))
    except ValueError:
        raise ValueError(
            f"add: shapes {tuple(np.shape(x))} and {tuple(np.shape(y))} do not broadcast "
            "(NumPy rules: equal sizes or 1, aligned from the last axis)"
        ) from None
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, shape) + jnp.broadcast_to(y, shape).astype(x.dtype)


def add_vjp(x, y, dret):
    """``dret`` for each, summed over the axes it was broadcast along."""
    return _sum_to(dret, np.shape(x)).astype(x.dtype), _sum_to(dret, np.shape(y)).astype(y.dtype)


def sub(x, y):
    """``x - y`` (NumPy broadcasting)."""
    x, y = _broadcast(x, y)
    return x - y


def sub_vjp(x, y, dret):
    return _sum_to(dret, np.shape(x)), _sum_to(-dret, np.shape(y))


def neg(x):
    """``-x``."""
    return -x


def neg_vjp(x, dret):
    return -dret


def mul(x, y):
    """``x * y`` (NumPy broadcasting). Linear in each factor; ``manual_grads`` uses the rule
    when one factor is not differentiated (a mask, a scale, a constant)."""
    x, y = _broadcast(x, y)
    return x * y


def mul_vjp(x, y, dret):
    xb, yb = _broadcast(x, y)
    return _sum_to(dret * yb, np.shape(x)), _sum_to(xb * dret, np.shape(y))


def div(x, y):
    """``x / y`` (NumPy broadcasting); linear in ``x`` (the rule is used when ``y`` is not
    differentiated: ``jnp.mean``'s division by the count)."""
    x, y = _broadcast(x, y)
    return lax.div(x, y)


def div_vjp(x, y, dret):
    xb, yb = _broadcast(x, y)
    return _sum_to(dret / yb, np.shape(x)), _sum_to(-dret * xb / (yb * yb), np.shape(y))


def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield tuple(range(start, start + len(x)))
        start += len(x)


def _remaining(n: int, *removed) -> list[int]:
    gone = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in gone]


def dot_general(
    lhs, rhs, *, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
):
    """``lax.dot_general`` (``x @ W``, ``jnp.einsum``). Linear in each side; ``manual_grads``
    uses the rule when one side is not differentiated (``x @ params.W`` on the input data)."""
    return lax.dot_general(
        lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding
    )


def _dot_transpose_lhs(dret, lhs, rhs, dimension_numbers, precision, swap_ans=False):
    (l_contract, r_contract), (l_batch, r_batch) = dimension_numbers
    l_kept = _remaining(len(lhs.shape), l_contract, l_batch)
    r_kept = _remaining(len(rhs.shape), r_contract, r_batch)
    if swap_ans:
        ans_batch, ans_r, _ = _ranges_like(l_batch, r_kept, l_kept)
    else:
        ans_batch, _, ans_r = _ranges_like(l_batch, l_kept, r_kept)
    dims = ((ans_r, tuple(r_kept)), (ans_batch, tuple(r_batch)))
    l_contract_by_r = [l_contract[i] for i in np.argsort(r_contract)]
    out_axes = np.argsort(list(l_batch) + l_kept + l_contract_by_r)
    d = lax.dot_general(dret, rhs, dims, precision, preferred_element_type=dret.dtype)
    return lax.transpose(d, tuple(int(i) for i in out_axes))


def dot_general_vjp(
    lhs,
    rhs,
    dret,
    *,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
):
    """``dlhs = dret`` contracted with ``rhs`` over the kept axes of ``rhs``, and
    symmetrically ``drhs``; each transposed back into its operand's axis order."""
    (l_contract, r_contract), (l_batch, r_batch) = dimension_numbers
    dlhs = _dot_transpose_lhs(dret, lhs, rhs, dimension_numbers, precision)
    swapped = ((r_contract, l_contract), (r_batch, l_batch))
    drhs = _dot_transpose_lhs(dret, rhs, lhs, swapped, precision, swap_ans=True)
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype)


# --- reductions ---------------------------------------------------------------------------


def reduce_sum(operand, *, axes, out_sharding=None):
    """``jnp.sum(operand, axis=axes)`` (``jnp.mean`` is this and a ``div``)."""
    return lax.reduce_sum(operand, _axes(axes, operand.ndim))


def reduce_sum_vjp(operand, dret, *, axes, out_sharding=None):
    """``dret`` broadcast back along the summed axes."""
    summed = _axes(axes, operand.ndim)
    kept = tuple(i for i in range(operand.ndim) if i not in summed)
    return lax.broadcast_in_dim(dret, operand.shape, kept)


def cumsum(operand, *, axis, reverse=False):
    """``lax.cumsum`` along ``axis``."""
    return lax.cumsum(operand, int(axis) % operand.ndim, reverse)


def cumsum_vjp(operand, dret, *, axis, reverse=False):
    """A cumulative sum the other way round."""
    return lax.cumsum(dret, int(axis) % operand.ndim, not reverse)


# --- joining and cutting: concatenate, split, stack, slices, pad --------------------------


def concatenate(*operands, dimension):
    """``lax.concatenate`` along ``dimension``."""
    return lax.concatenate(operands, int(dimension) % operands[0].ndim)


def concatenate_vjp(*operands_and_dret, dimension):
    """Each operand's piece of ``dret``."""
    *operands, dret = operands_and_dret
    axis = int(dimension) % dret.ndim
    sizes = [op.shape[axis] for op in operands]
    starts = np.cumsum([0, *sizes])
    return _one_or_tuple(
        [
            lax.slice_in_dim(dret, int(s), int(s) + n, axis=axis)
            for s, n in zip(starts, sizes, strict=False)
        ]
    )


def split(operand, *, sizes, axis):
    """``lax.split``: consecutive pieces of ``sizes`` along ``axis`` (a tuple)."""
    return tuple(lax.split(operand, tuple(int(s) for s in sizes), int(axis) % operand.ndim))


def split_vjp(operand, *drets, sizes, axis):
    """The pieces' cotangents, joined."""
    return lax.concatenate(drets, int(axis) % operand.ndim)


def stack(*operands, axis):
    """``jnp.stack`` (the ``stack`` primitive): a new axis ``axis``."""
    return jnp.stack(operands, axis=axis)


def stack_vjp(*operands_and_dret, axis):
    """Row ``i`` of ``dret`` along the new axis for operand ``i``."""
    *operands, dret = operands_and_dret
    ax = int(axis) % dret.ndim
    return _one_or_tuple(
        [lax.index_in_dim(dret, i, ax, keepdims=False) for i in range(len(operands))]
    )


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


# --- shard_map: a replicated value meeting a device-varying one ---------------------------


def pvary(operand, *, axes):
    """``lax.pcast(x, axes, to="varying")``: a replicated value used where values differ
    per device (inside ``shard_map``, JAX inserts it when ``tok + pos`` mixes the two)."""
    return lax.pcast(operand, tuple(axes), to="varying")


def pvary_vjp(operand, dret, *, axes):
    """Every device's cotangent adds up to the replicated value's: a ``psum``."""
    return lax.psum(dret, tuple(axes))


# --- the table manual_grads and show_grad read --------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """The hand rule of one primitive, and when it applies.

    ``linear_in``: operand positions the primitive is linear in *jointly*, or ``None`` for
    all of them. A rule applies when the differentiated operands are among ``linear_in``
    and, for a product (``mul``, ``dot_general``), at most one of them is differentiated.
    The rule functions take the primitive's parameters they need as keywords; others
    (``out_dtype=None`` of an arithmetic primitive, the ``update_jaxpr`` of a scatter) are
    not passed.
    """

    f: Callable
    f_vjp: Callable
    linear_in: tuple[int, ...] | None = None
    product: bool = False
    requires: Callable | None = None  # params -> reason it does not apply, or None

    def refusal(self, params: dict, diff: Sequence[bool]) -> str | None:
        """Why this rule does not give the exact VJP for these operands, or ``None``."""
        which = [i for i, d in enumerate(diff) if d]
        if self.linear_in is not None and any(i not in self.linear_in for i in which):
            return "it is not linear in the differentiated operand"
        if self.product and len(which) > 1:
            return (
                "both factors depend on the params: a product is linear in each factor "
                "alone, not in both"
            )
        return self.requires(params) if self.requires is not None else None

    def params(self, params: dict) -> dict:
        """The primitive's parameters that the rule functions take."""
        names = _keywords(self.f_vjp)
        return {k: v for k, v in params.items() if k in names}


@functools.cache
def _keywords(f: Callable) -> frozenset[str]:
    return frozenset(
        n for n, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY
    )


def _distinct_indices(params: dict) -> str | None:
    if params.get("unique_indices"):
        return None
    return (
        "`x.at[idx].set(u)` with indices that may repeat keeps one of the updates, which one "
        "XLA decides; use distinct (static) indices, or .at[idx].add"
    )


#: primitive name -> its rule.
PRIMITIVE_RULES: dict[str, PrimitiveRule] = {
    "broadcast_in_dim": PrimitiveRule(broadcast_in_dim, broadcast_in_dim_vjp),
    "reshape": PrimitiveRule(reshape, reshape_vjp),
    "transpose": PrimitiveRule(transpose, transpose_vjp),
    "squeeze": PrimitiveRule(squeeze, squeeze_vjp),
    "rev": PrimitiveRule(rev, rev_vjp),
    "tile": PrimitiveRule(tile, tile_vjp),
    "copy": PrimitiveRule(copy, copy_vjp),
    "copy_p": PrimitiveRule(copy, copy_vjp),
    "convert_element_type": PrimitiveRule(convert_element_type, convert_element_type_vjp),
    "add": PrimitiveRule(add, add_vjp),
    "sub": PrimitiveRule(sub, sub_vjp),
    "neg": PrimitiveRule(neg, neg_vjp),
    "mul": PrimitiveRule(mul, mul_vjp, product=True),
    "div": PrimitiveRule(div, div_vjp, linear_in=(0,)),
    "dot_general": PrimitiveRule(dot_general, dot_general_vjp, product=True),
    "reduce_sum": PrimitiveRule(reduce_sum, reduce_sum_vjp),
    "cumsum": PrimitiveRule(cumsum, cumsum_vjp),
    "concatenate": PrimitiveRule(concatenate, concatenate_vjp),
    "split": PrimitiveRule(split, split_vjp),
    "stack": PrimitiveRule(stack, stack_vjp),
    "slice": PrimitiveRule(slice, slice_vjp),
    "dynamic_slice": PrimitiveRule(dynamic_slice, dynamic_slice_vjp, linear_in=(0,)),
    "dynamic_update_slice": PrimitiveRule(
        dynamic_update_slice, dynamic_update_slice_vjp, linear_in=(0, 1)
    ),
    "pad": PrimitiveRule(pad, pad_vjp),
    "gather": PrimitiveRule(gather, gather_vjp, linear_in=(0,)),
    "scatter-add": PrimitiveRule(scatter_add, scatter_add_vjp, linear_in=(0, 2)),
    "scatter": PrimitiveRule(scatter, scatter_vjp, linear_in=(0, 2), requires=_distinct_indices),
    "select_n": PrimitiveRule(select_n, select_n_vjp, linear_in=None),
    "pvary": PrimitiveRule(pvary, pvary_vjp),
}
