"""Hand rules of JAX's arithmetic primitives that are linear: ``add``, ``sub``, ``neg``, and
``mul``, ``div``, ``dot_general`` in an operand whose partner is not differentiated.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._prim_layout import _broadcast, _sum_to

__all__ = ['add', 'add_vjp', 'div', 'div_vjp', 'dot_general', 'dot_general_vjp', 'mul', 'mul_vjp', 'neg', 'neg_vjp', 'sub', 'sub_vjp']  # fmt: skip


# --- arithmetic: add, sub, neg, and products with a factor that is not differentiated ----


def add(x, y):
    """``x + y`` with NumPy broadcasting (size-1 and missing leading axes), in ``x``'s dtype:
    a residual connection, or ``[T, F]`` position embeddings added to every sequence of a
    ``[B, T, F]`` batch. In manual-gradient mode its hand rule is ``add_vjp``.

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
