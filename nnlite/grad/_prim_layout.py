"""Hand rules of JAX's layout primitives: broadcast, reshape, transpose, squeeze, flip,
tile, copies and casts, sums, concatenation, splitting and stacking, ``pvary``.

Each rule is named after its primitive and takes the primitive's parameters as keywords
(see ``_structural.py``); the helpers here serve the other primitive modules too.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((1, 3))
    >>> broadcast_in_dim_vjp(x, jnp.ones((4, 3)), shape=(4, 3), broadcast_dimensions=(0, 1))
    Array([[4., 4., 4.]], dtype=float32)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ['broadcast_in_dim', 'broadcast_in_dim_vjp', 'concatenate', 'concatenate_vjp', 'convert_element_type', 'convert_element_type_vjp', 'copy', 'copy_vjp', 'cumsum', 'cumsum_vjp', 'pvary', 'pvary_vjp', 'reduce_sum', 'reduce_sum_vjp', 'reshape', 'reshape_vjp', 'rev', 'rev_vjp', 'split', 'split_vjp', 'squeeze', 'squeeze_vjp', 'stack', 'stack_vjp', 'stop_gradient', 'stop_gradient_vjp', 'tile', 'tile_vjp', 'transpose', 'transpose_vjp']  # fmt: skip


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


def _permutation(permutation, ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim))[::-1] if permutation is None else _axes(permutation, ndim)


def transpose(operand, *, permutation=None):
    """``lax.transpose``: result axis ``i`` is operand axis ``permutation[i]``; without a
    permutation the axes reversed (``x.T``, the seed's ``transpose(x)``)."""
    operand = jnp.asarray(operand)
    return lax.transpose(operand, _permutation(permutation, operand.ndim))


def transpose_vjp(operand, dret, *, permutation=None):
    """The inverse permutation."""
    perm = _permutation(permutation, jnp.ndim(operand))
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


# --- reductions ---------------------------------------------------------------------------


def reduce_sum(operand, *, axes=None, out_sharding=None):
    """``jnp.sum(operand, axis=axes)`` (``jnp.mean`` is this and a ``div``); without axes the
    sum of all elements, a scalar (``nl.reduce(values, "sum")``)."""
    if axes is None:
        return jnp.sum(operand)
    return lax.reduce_sum(operand, _axes(axes, operand.ndim))


def reduce_sum_vjp(operand, dret, *, axes=None, out_sharding=None):
    """``dret`` broadcast back along the summed axes."""
    if axes is None:
        return jnp.broadcast_to(dret, operand.shape).astype(operand.dtype)
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


# --- shard_map: a replicated value meeting a device-varying one ---------------------------


def pvary(operand, *, axes):
    """``lax.pcast(x, axes, to="varying")``: a replicated value used where values differ
    per device (inside ``shard_map``, JAX inserts it when ``tok + pos`` mixes the two)."""
    return lax.pcast(operand, tuple(axes), to="varying")


def pvary_vjp(operand, dret, *, axes):
    """Every device's cotangent adds up to the replicated value's: a ``psum``."""
    return lax.psum(dret, tuple(axes))
