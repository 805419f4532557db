"""Hand rules of JAX's nonlinear reductions and orderings: ``reduce_max``/``reduce_min``
(``jnp.max``, the max in ``logsumexp`` and ``softmax``), ``reduce_prod``, the cumulative
``cummax``/``cummin``/``cumprod``/``cumlogsumexp``, ``sort`` (with the operands it carries
along) and ``top_k``.

Each rule is named after its primitive and takes its parameters as keywords. Ties follow
JAX's own derivative: a max over several equal elements shares the cotangent equally among
them.

Example:
    >>> import jax.numpy as jnp
    >>> reduce_max_vjp(jnp.array([1.0, 3.0, 3.0]), jnp.array(1.0), axes=(0,)).tolist()
    [0.0, 0.5, 0.5]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ['cumlogsumexp', 'cumlogsumexp_vjp', 'cummax', 'cummax_vjp', 'cummin', 'cummin_vjp', 'cumprod', 'cumprod_vjp', 'reduce_max', 'reduce_max_vjp', 'reduce_min', 'reduce_min_vjp', 'reduce_prod', 'reduce_prod_vjp', 'sort', 'sort_vjp', 'top_k', 'top_k_vjp']  # fmt: skip


def _kept(operand, axes) -> tuple[int, ...]:
    """The axes of ``operand`` a reduction over ``axes`` keeps."""
    gone = {int(a) % operand.ndim for a in axes}
    return tuple(i for i in range(operand.ndim) if i not in gone)


def _back(v, operand, axes):
    """A reduction's result (or cotangent) broadcast back over the reduced axes."""
    return lax.broadcast_in_dim(v, operand.shape, _kept(operand, axes))


# --- max, min, prod over axes ---------------------------------------------------------------


def reduce_max(operand, *, axes, out_sharding=None):
    """``lax.reduce_max`` (``jnp.max``, ``jnp.amax``)."""
    return lax.reduce_max(operand, tuple(axes))


def reduce_max_vjp(operand, dret, *, axes, out_sharding=None):
    """``dret`` to the positions of the maximum, shared equally among ties."""
    ans = lax.reduce_max(operand, tuple(axes))
    hits = (operand == _back(ans, operand, axes)).astype(dret.dtype)
    counts = _back(jnp.sum(hits, axis=tuple(axes)), operand, axes)
    return _back(dret, operand, axes) * hits / counts


def reduce_min(operand, *, axes, out_sharding=None):
    """``lax.reduce_min`` (``jnp.min``)."""
    return lax.reduce_min(operand, tuple(axes))


def reduce_min_vjp(operand, dret, *, axes, out_sharding=None):
    """``dret`` to the positions of the minimum, shared equally among ties."""
    return reduce_max_vjp(-operand, dret, axes=axes)


def _to_last(x, axes):
    """``x`` with ``axes`` moved last and flattened into one: ``(moved, undo)``."""
    axes = tuple(sorted(int(a) % x.ndim for a in axes))
    kept = _kept(x, axes)
    perm = kept + axes
    moved = lax.transpose(x, perm)
    flat = moved.reshape(moved.shape[: len(kept)] + (-1,))

    def undo(v):
        return lax.transpose(v.reshape(moved.shape), tuple(int(i) for i in np.argsort(perm)))

    return flat, undo


def _exclusive_cumprod(x, axis: int, reverse: bool = False):
    """The product of the elements before each one along ``axis`` (1 for the first)."""
    ones = lax.slice_in_dim(jnp.ones_like(x), 0, 1, axis=axis)
    if reverse:
        rest = lax.slice_in_dim(x, 1, x.shape[axis], axis=axis)
        return jnp.concatenate([lax.cumprod(rest, axis, reverse=True), ones], axis=axis)
    rest = lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis)
    return jnp.concatenate([ones, lax.cumprod(rest, axis)], axis=axis)


def reduce_prod(operand, *, axes, out_sharding=None):
    """``lax.reduce_prod`` (``jnp.prod``)."""
    return lax.reduce_prod(operand, tuple(axes))


def reduce_prod_vjp(operand, dret, *, axes, out_sharding=None):
    """``dret`` times the product of the other elements: the products before and after each
    element (no division, so exact where an element is zero)."""
    if not axes or operand.size == 0:
        return _back(dret, operand, axes) * jnp.ones_like(operand)
    flat, undo = _to_last(operand, axes)
    others = _exclusive_cumprod(flat, -1 % flat.ndim) * _exclusive_cumprod(
        flat, -1 % flat.ndim, reverse=True
    )
    return _back(dret, operand, axes) * undo(others)


# --- cumulative reductions ------------------------------------------------------------------


def _along_last(x, axis: int):
    return jnp.moveaxis(x, axis, -1)


def _pairs(n: int, reverse: bool, lead: tuple = ()):
    """``[..., i, j]``: element ``i`` is among those that output ``j`` accumulates."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return jnp.asarray(np.broadcast_to(i >= j if reverse else i <= j, (*lead, n, n)))


def cummax(operand, *, axis, reverse=False):
    """``lax.cummax``: running maximum along ``axis``."""
    return lax.cummax(operand, axis, reverse)


def _cum_extreme_vjp(operand, ans, dret, axis, reverse):
    x, a, d = (_along_last(v, axis) for v in (operand, ans, dret))
    n = x.shape[-1]
    # [..., i, j]: element i is where output j's running extreme sits (ties share it)
    hits = _pairs(n, reverse, x.shape[:-1]) & (x[..., :, None] == a[..., None, :])
    hits = hits.astype(d.dtype)
    share = hits / jnp.maximum(jnp.sum(hits, axis=-2, keepdims=True), jnp.ones((), d.dtype))
    dx = jnp.sum(share * jnp.broadcast_to(d[..., None, :], share.shape), axis=-1)
    return jnp.moveaxis(dx, -1, axis)


def cummax_vjp(operand, dret, *, axis, reverse=False):
    """Each output's cotangent to the element holding its running maximum (shared among
    equal ones)."""
    return _cum_extreme_vjp(operand, lax.cummax(operand, axis, reverse), dret, axis, reverse)


def cummin(operand, *, axis, reverse=False):
    """``lax.cummin``: running minimum along ``axis``."""
    return lax.cummin(operand, axis, reverse)


def cummin_vjp(operand, dret, *, axis, reverse=False):
    """Each output's cotangent to the element holding its running minimum."""
    return _cum_extreme_vjp(operand, lax.cummin(operand, axis, reverse), dret, axis, reverse)


def cumprod(operand, *, axis, reverse=False):
    """``lax.cumprod`` (``jnp.cumprod``)."""
    return lax.cumprod(operand, axis, reverse)


def cumprod_vjp(operand, dret, *, axis, reverse=False):
    """``dx_i = sum_j dret_j * prod(x_k for k in j's prefix, k != i)``; the products without
    ``x_i`` are built by multiplication only (exact where an element is zero)."""
    x, d = _along_last(operand, axis), _along_last(dret, axis)
    n = x.shape[-1]
    lead = x.shape[:-1]
    inside = _pairs(n, reverse, lead)  # [..., i, j]: x_i is in output j's product
    # [..., i, k]: x_k taken into the product without x_i (1 for k == i)
    eye = jnp.asarray(np.broadcast_to(np.eye(n, dtype=bool), (*lead, n, n)))
    spread = jnp.broadcast_to(x[..., None, :], (*lead, n, n))
    without = jnp.where(eye, jnp.ones((), x.dtype), spread)
    # products over k within j's prefix, for every j: a cumulative product over k
    prods = lax.cumprod(without, without.ndim - 1, reverse)  # [..., i, j]
    terms = prods * jnp.broadcast_to(d[..., None, :], (*lead, n, n))
    dx = jnp.sum(jnp.where(inside, terms, jnp.zeros((), d.dtype)), axis=-1)
    return jnp.moveaxis(dx, -1, axis)


def cumlogsumexp(operand, *, axis, reverse=False):
    """``lax.cumlogsumexp``: running ``log(sum(exp(x)))`` along ``axis``."""
    return lax.cumlogsumexp(operand, axis, reverse)


def cumlogsumexp_vjp(operand, dret, *, axis, reverse=False):
    """``dx_i = sum_j dret_j * exp(x_i - out_j)`` over the outputs ``j`` that include
    ``x_i`` (each factor at most 1: no overflow)."""
    ans = lax.cumlogsumexp(operand, axis, reverse)
    x, a, d = (_along_last(v, axis) for v in (operand, ans, dret))
    n = x.shape[-1]
    lead = x.shape[:-1]
    gap = jnp.broadcast_to(x[..., :, None], (*lead, n, n)) - a[..., None, :]
    w = jnp.exp(jnp.where(_pairs(n, reverse, lead), gap, -jnp.inf))
    dx = jnp.sum(w * jnp.broadcast_to(d[..., None, :], (*lead, n, n)), axis=-1)
    return jnp.moveaxis(dx, -1, axis)


# --- orderings: sort, top_k -----------------------------------------------------------------


def sort(*operands, dimension, is_stable=True, num_keys=1):
    """``lax.sort`` of one or several operands (keys first; ``jnp.sort``, ``argsort``)."""
    out = lax.sort(operands, dimension=dimension, is_stable=is_stable, num_keys=num_keys)
    return out[0] if len(operands) == 1 else tuple(out)


def sort_vjp(*operands_and_drets, dimension, is_stable=True, num_keys=1):
    """Each cotangent moved back through the sorting permutation (``None`` for integer
    operands)."""
    n = len(operands_and_drets) // 2
    operands, drets = operands_and_drets[:n], operands_and_drets[n:]
    x = operands[0]
    iota = lax.broadcasted_iota(np.int32, x.shape, dimension)
    perm = lax.sort(
        (*operands[:num_keys], iota), dimension=dimension, is_stable=is_stable, num_keys=num_keys
    )[-1]
    inverse = jnp.argsort(perm, axis=dimension)
    cts = []
    for op, d in zip(operands, drets, strict=True):
        floating = jnp.issubdtype(op.dtype, jnp.inexact)
        cts.append(jnp.take_along_axis(d, inverse, axis=dimension) if floating else None)
    return cts[0] if n == 1 else tuple(cts)


def top_k(operand, *, k, axis=-1):
    """``lax.top_k``: the ``k`` largest along ``axis`` and their indices."""
    values, indices = lax.top_k(operand, k, axis=axis)
    return values, indices


def top_k_vjp(operand, dvalues, dindices, *, k, axis=-1):
    """The values' cotangent added back at the indices they came from."""
    axis = int(axis) % operand.ndim
    _, idx = top_k(operand, k=k, axis=axis)
    x, i, d = (jnp.moveaxis(v, axis, -1) for v in (operand, idx, dvalues))
    full = (*i.shape, x.shape[-1])
    onehot = jnp.broadcast_to(i[..., :, None], full) == lax.broadcasted_iota(i.dtype, full, i.ndim)
    spread = jnp.broadcast_to(d[..., :, None], full)
    dx = jnp.sum(jnp.where(onehot, spread, jnp.zeros((), d.dtype)), axis=-2)
    return jnp.moveaxis(dx, -1, axis)
