"""The seed's VJP library (``nnlite.vjp``): column vectors, one example at a time.

The awf-jaxutils conventions, kept so that its examples run unchanged: a layer is
``mm(W, x)`` with ``W: [out, in]`` and a column vector ``x: [in]``; ``softmax`` normalises
axis 0 (a column, or each column of a matrix); ``sum`` adds a list of arrays;
``index_vjp(x, i, dret)`` returns ``dx`` alone. Every rule is ``f_vjp(*args, dret)``; a
function returning a tuple gets one cotangent per output (``dup_vjp(x, dx1, dx2)``).

The rules that do not depend on a layout (``add``, ``scale``, ``relu``, ``log``, ...) are the
same functions as in ``nnlite.vjp.batched``, the row-vector, batched library the layers use.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._vjp_batched import (
    add,
    add_vjp,
    dotall,
    dotall_vjp,
    dup,
    dup_vjp,
    exp,
    exp_vjp,
    gelu,
    gelu_vjp,
    identity,
    identity_vjp,
    log,
    log_vjp,
    mul,
    mul_vjp,
    negate,
    negate_vjp,
    pair,
    pair_vjp,
    recip,
    recip_vjp,
    relu,
    relu_vjp,
    scale,
    scale_vjp,
    sigmoid,
    sigmoid_vjp,
    softplus,
    softplus_vjp,
    tanh,
    tanh_vjp,
)

__all__ = [
    "add", "add_vjp", "axpy", "axpy_vjp", "dotall", "dotall_vjp", "dup", "dup_vjp", "exp",
    "exp_vjp", "gelu", "gelu_vjp", "identity", "identity_vjp", "index", "index_vjp", "log",
    "log_vjp", "mm", "mm_scaled", "mm_scaled_vjp", "mm_scaled_vjp_simple", "mm_vjp", "mul",
    "mul_vjp", "negate", "negate_vjp", "pair", "pair_vjp", "pow", "pow_vjp", "range_vjp",
    "recip", "recip_vjp", "relu", "relu_vjp", "scale", "scale_vjp", "sigmoid", "sigmoid_vjp",
    "softmax", "softmax_vjp", "softplus", "softplus_vjp", "sum", "sum_vjp", "tanh", "tanh_vjp",
    "transpose", "transpose_vjp", "xpyzt", "xpyzt_vjp",
]  # fmt: skip

# Note: this module defines ``sum`` and ``pow`` (the seed's names) and does not use the
# builtins.


# --- matrix products, column vectors ------------------------------------------------------


def mm(A, B):
    """``A @ B``: matrix @ column vector (``[n, k] @ [k]``), matrix @ matrix, or a row vector
    @ matrix (``[k] @ [k, m]``).

    Example:
        >>> import jax.numpy as jnp
        >>> mm(jnp.ones((2, 3)), jnp.arange(3.0))
        Array([3., 3.], dtype=float32)
    """
    a, b = jnp.ndim(A), jnp.ndim(B)
    if a not in (1, 2) or b not in (1, 2) or a + b == 2 or jnp.shape(A)[-1] != jnp.shape(B)[0]:
        raise ValueError(
            f"mm: expected A [n, k] with B [k] or [k, m], or A [k] with B [k, m]; got shapes "
            f"{jnp.shape(A)} and {jnp.shape(B)} (for vector . vector use dotall)"
        )
    return A @ B


def mm_vjp(A, B, dret):
    # A [n, k], B [k, m], dret [n, m]: dA = dret B^T, dB = A^T dret. A vector operand turns
    # its product into an outer product.
    A, B, dret = jnp.asarray(A), jnp.asarray(B), jnp.asarray(dret)
    dA = jnp.outer(dret, B) if B.ndim == 1 else (B @ dret if A.ndim == 1 else dret @ B.T)
    dB = jnp.outer(A, dret) if A.ndim == 1 else A.T @ dret
    return (dA, dB)


def axpy(A, x, y):
    """``A @ x + y``: ``A: [m, n]``, ``x: [n]`` (or ``[n, k]``), ``y`` the result's shape."""
    return mm(A, x) + y


def axpy_vjp(A, x, y, dret):
    dA, dx = mm_vjp(A, x, dret)
    return (dA, dx, dret)


def mm_scaled(A, B, sA, sB):
    """``(sA * A) @ (sB * B)``, computed as ``(sA * sB) * (A @ B)``; ``sA``, ``sB`` scalars.

    Example:
        >>> import jax.numpy as jnp
        >>> mm_scaled(jnp.eye(2), jnp.ones(2), 2.0, 3.0)
        Array([6., 6.], dtype=float32)
    """
    return scale(sA * sB, mm(A, B))


def mm_scaled_vjp_simple(A, B, sA, sB, dC):
    """``mm_scaled``'s VJP composed from the small rules (``scale_vjp``, ``mm_vjp``)."""
    AB = mm(A, B)
    sC = sA * sB
    dsC, dAB = scale_vjp(sC, AB, dC)
    dA, dB = mm_vjp(A, B, dAB)
    return (dA, dB, sB * dsC, sA * dsC)


def mm_scaled_vjp(A, B, sA, sB, dC):
    # The hand-optimised form: the scaling rides on each product instead of on A @ B.
    dA, dB = mm_vjp(A, B, scale(sA * sB, dC))
    dsC = dotall(mm(A, B), dC)
    return (dA, dB, sB * dsC, sA * dsC)


def xpyzt(x, y, z):
    """``x + y z^T`` for vectors ``y: [m]``, ``z: [n]``: accumulate an outer product.

    Example:
        >>> import jax.numpy as jnp
        >>> xpyzt(jnp.zeros((2, 2)), jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]))
        Array([[3., 4.],
               [6., 8.]], dtype=float32)
    """
    if jnp.ndim(y) != 1 or jnp.ndim(z) != 1 or jnp.shape(x) != (jnp.size(y), jnp.size(z)):
        raise ValueError(
            f"xpyzt: expected x [m, n], y [m], z [n]; got shapes {jnp.shape(x)}, "
            f"{jnp.shape(y)}, {jnp.shape(z)}"
        )
    return x + jnp.outer(y, z)


def xpyzt_vjp(x, y, z, dret):
    return (dret, dret @ z, dret.T @ y)


def transpose(x):
    """``x`` with its axes reversed (``x.T``)."""
    return jnp.transpose(x)


def transpose_vjp(x, dret):
    return jnp.transpose(dret)  # reversing the axes is its own inverse


# --- lists, columns, indexing -------------------------------------------------------------


def sum(xs):
    """Elementwise sum of a list (or tuple) of same-shaped arrays, as the builtin does.

    Example:
        >>> import jax.numpy as jnp
        >>> sum([jnp.ones(2), jnp.ones(2), jnp.ones(2)])
        Array([3., 3.], dtype=float32)
    """
    if not isinstance(xs, (list, tuple)) or not xs:
        raise TypeError(
            f"sum: expected a non-empty list of arrays, got {type(xs).__name__}"
            + (" (to add an array's elements use jnp.sum)" if hasattr(xs, "shape") else "")
        )
    return functools.reduce(add, xs)


def sum_vjp(xs, dret):
    return type(xs)(dret for _ in xs)  # a list for a list, a tuple for a tuple


def softmax(x):
    """Column softmax: normalises axis 0 (a column vector, or each column of a matrix).

    Example:
        >>> import jax.numpy as jnp
        >>> softmax(jnp.zeros((2, 1)))
        Array([[0.5],
               [0.5]], dtype=float32)
    """
    return jax.nn.softmax(x, axis=0)


def softmax_vjp(x, dret):
    s = softmax(x)
    return s * (dret - jnp.sum(s * dret, axis=0, keepdims=True))


def index(x, i):
    """``x[i]``: an entry of a column vector (or a row of a matrix)."""
    return x[i]


def index_vjp(x, i, dret):
    """``dx`` alone: the index ``i`` is an integer, it has no cotangent."""
    return jnp.zeros_like(x).at[i].add(dret)


# --- powers and ranges --------------------------------------------------------------------


def pow(x, p):
    """``x ** p`` elementwise; ``p`` an integer or a float (scalar or ``x``'s shape)."""
    return x**p


def pow_vjp(x, p, dret):
    """``(dx, dp)``: ``dp`` is ``None`` for an integer exponent (not differentiable); for a
    float exponent it is ``sum(dret * log(x) * x**p)`` over the axes ``p`` was broadcast on.
    """
    dx = dret * p * x ** (p - 1)
    if np.issubdtype(jnp.result_type(p), np.integer):
        return (dx, None)
    dp = dret * jnp.log(x) * x**p
    extra = dp.ndim - jnp.ndim(p)
    dp = jnp.sum(dp, axis=tuple(range(extra))) if extra else dp
    keep = tuple(k for k, n in enumerate(jnp.shape(p)) if n == 1 and dp.shape[k] != 1)
    return (dx, jnp.sum(dp, axis=keep, keepdims=True) if keep else dp)


def range_vjp(*args):
    """VJP of Python's ``range(start, stop, step)``: integers, so one ``None`` per argument
    (the last argument is the cotangent of the sequence)."""
    return (None,) * (len(args) - 1)
