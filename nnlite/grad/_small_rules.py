"""The small composable rules: the seed's library (awf-jaxutils) and the layers' own, one.

Every rule has the form ``f_vjp(*args, dret) -> dargs``: the forward function's arguments
and the cotangent ``dret`` of its result (one cotangent per output when the function
returns a tuple: ``dup_vjp(x, dx1, dx2)``), and one cotangent per argument -- a bare value
when ``f`` takes one argument, a tuple otherwise; an integer argument (labels, indices) has
none (``None``, or left out: ``index_vjp(x, i, dret) -> dx``).

One function serves both layouts where the math is one: ``mm(A, B)`` is ``A @ B`` for the
seed's column vectors (``mm(W, x)``, ``W: [out, in]``, ``x: [in]``) and for nnlite's row-
vector batches (``mm(x, W)``, ``x: [..., in]``, ``W: [in, out]``), and so are ``axpy``,
``mm_scaled`` and ``xpyzt``. ``add``, ``mul``, ``exp``, ``log``, ``pow``, ``transpose`` and
``neg`` (the seed's ``negate``) are the rules of JAX's primitives (``_prim_*.py``). Where the
seed's convention is not the layers', a keyword says which: ``softmax(x)`` normalises axis
0 (the seed's column), ``softmax(x, axis=-1)`` the class axis; ``sum`` adds a list of arrays
(the seed's) and ``reduce_sum(x)`` an array's elements.

The functions nnlite's layers and losses call (the activations, ``softmax``,
``log_softmax``, ``mean``, ``softmax_cross_entropy_values``) are declared with their rule by
``@hand_rule``: in manual-gradient mode ``nl.relu`` is differentiated by ``relu_vjp``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ._manual import hand_rule
from ._prim_arith import add, neg, neg_vjp
from ._prim_layout import _sum_to, reduce_sum_vjp
from ._prim_layout import reduce_sum as _reduce_sum
from ._rule_table import register_pairs
from ._structural import CUSTOM_JVP_RULES, PRIMITIVE_RULES, PrimitiveRule

__all__ = [
    "axpy", "axpy_vjp", "bias_add", "bias_add_vjp", "dotall", "dotall_vjp", "dup", "dup_vjp",
    "gelu", "gelu_grad", "gelu_vjp", "identity", "identity_vjp", "index", "index_vjp",
    "log_softmax", "log_softmax_vjp", "logaddexp", "logaddexp2", "logaddexp2_vjp",
    "logaddexp_vjp", "mean", "mean_vjp", "mm", "mm_scaled", "mm_scaled_vjp",
    "mm_scaled_vjp_simple", "mm_vjp", "negate", "negate_vjp", "pair", "pair_vjp", "range_vjp",
    "recip", "recip_vjp", "reduce_sum", "reduce_sum_vjp", "relu", "relu_vjp", "scale",
    "scale_vjp", "sigmoid", "sigmoid_vjp", "softmax", "softmax_cross_entropy_values",
    "softmax_cross_entropy_values_vjp", "softmax_vjp", "softplus", "softplus_vjp", "sum",
    "sum_vjp", "tanh", "tanh_vjp", "xpyzt", "xpyzt_vjp",
]  # fmt: skip

# Note: this module defines ``sum`` (the seed's name); the builtin is not used here.


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` with leading unit axes up to rank ``ndim`` (explicit: rank promotion raises)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


# --- structure: dup, pair; negate is the neg primitive's rule -------------------------------


def dup(x):
    """``(x, x)``: a value used twice. Its VJP adds the two cotangents."""
    return (x, x)


def dup_vjp(x, *dret):
    return add(*dret)


def pair(x, y):
    """``(x, y)``: build a tuple. Its VJP splits the tuple's cotangent."""
    return (x, y)


def pair_vjp(x, y, *dret):
    return dret


negate, negate_vjp = neg, neg_vjp  # the seed's name for -x


# --- linear algebra -----------------------------------------------------------------------


def scale(s, x):
    """``s * x`` for a scalar ``s`` and an array ``x``."""
    if jnp.ndim(s) != 0:
        raise ValueError(f"scale: s must be a scalar, got shape {jnp.shape(s)}")
    return s * x


def scale_vjp(s, x, dret):
    return (dotall(x, dret), scale(s, dret))


def dotall(A, B):
    """``sum(A * B)``: the dot product of ``vec(A)`` and ``vec(B)``, a scalar."""
    return jnp.sum(A * B)


def dotall_vjp(A, B, dret):
    return (B * dret, A * dret)


def _mm_shapes_ok(a: tuple, b: tuple) -> bool:
    if not a or not b or len(a) + len(b) == 2 or a[-1] != b[0 if len(b) == 1 else -2]:
        return False
    if len(a) == 1:
        return len(b) == 2  # a row vector @ a matrix
    return len(b) in (1, 2) or len(b) == len(a)  # B shared by A's batch, or batched alike


def mm(A, B):
    """``A @ B``, serving both layouts: a matrix @ a column vector (``[n, k] @ [k]``, the
    seed's ``mm(W, x)``), a row vector @ a matrix (``[k] @ [k, m]``), and a batch of rows @
    a matrix (``[..., n, k] @ [k, m]``, a layer's ``mm(x, W)``) or @ a batch of matrices
    (``[..., n, k] @ [..., k, m]``).

    Example:
        >>> import jax.numpy as jnp
        >>> mm(jnp.ones((2, 3)), jnp.arange(3.0))
        Array([3., 3.], dtype=float32)
        >>> mm(jnp.ones((5, 2, 3)), jnp.ones((3, 4))).shape
        (5, 2, 4)
    """
    if not _mm_shapes_ok(jnp.shape(A), jnp.shape(B)):
        raise ValueError(
            f"mm: expected A [n, k] with B [k] or [k, m], or A [k] with B [k, m] (A may carry "
            f"leading batch axes [..., n, k], B then [k, m] or [..., k, m]); got shapes "
            f"{jnp.shape(A)} and {jnp.shape(B)} (for vector . vector use dotall)"
        )
    return jnp.matmul(A, B)


def mm_vjp(A, B, dret):
    # dA = dret B^T, dB = A^T dret; a vector operand turns its product into an outer
    # product, and a B shared by A's batch sums over it (one matmul [k, rows] @ [rows, m]).
    A, B, dret = jnp.asarray(A), jnp.asarray(B), jnp.asarray(dret)
    if A.ndim == 1:
        return (B @ dret, jnp.outer(A, dret))
    if B.ndim == 1:
        dA = dret[..., None] * _lead(B, A.ndim)
        return (dA, A.reshape(-1, A.shape[-1]).T @ dret.reshape(-1))
    dA = jnp.matmul(dret, jnp.swapaxes(B, -1, -2))
    if B.ndim == 2:
        dB = jnp.matmul(A.reshape(-1, A.shape[-1]).T, dret.reshape(-1, dret.shape[-1]))
    else:
        dB = jnp.matmul(jnp.swapaxes(A, -1, -2), dret)
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
    """``mm_scaled``'s rule composed from the small rules (``scale_vjp``, ``mm_vjp``)."""
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


def bias_add(x, b):
    """``x + b`` with ``x: [..., n]`` and a bias ``b: [n]`` broadcast over the batch axes.

    Example:
        >>> import jax.numpy as jnp
        >>> bias_add(jnp.zeros((2, 3)), jnp.arange(3.0))
        Array([[0., 1., 2.],
               [0., 1., 2.]], dtype=float32)
    """
    if jnp.ndim(b) != 1 or jnp.shape(x)[-1:] != jnp.shape(b):
        raise ValueError(f"bias_add: expected b of shape ({jnp.shape(x)[-1:]}), got {jnp.shape(b)}")
    return x + _lead(b, x.ndim)


def bias_add_vjp(x, b, dret):
    return (dret, dret.reshape(-1, dret.shape[-1]).sum(axis=0))


def xpyzt(x, y, z):
    """``x + y z^T``: add the outer product of ``y`` and ``z`` to ``x`` (gradient accumulation).

    With vectors ``y: [m]``, ``z: [n]`` this is exactly ``x + outer(y, z)``. With a leading
    batch axis, ``y: [B, m]``, ``z: [B, n]``, the B outer products are summed -- computed
    as one matmul ``x + y.T @ z``, never example by example. This is how a Linear layer's
    weight gradient ``sum_b h_b dz_b^T`` is accumulated into an existing buffer.

    Example:
        >>> import jax.numpy as jnp
        >>> xpyzt(jnp.ones((2, 2)), jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]))
        Array([[4., 5.],
               [7., 9.]], dtype=float32)
    """
    y_shape, z_shape = jnp.shape(y), jnp.shape(z)
    batched = len(y_shape) == 2 and len(z_shape) == 2 and y_shape[0] == z_shape[0]
    vectors = len(y_shape) == 1 and len(z_shape) == 1
    if not (vectors or batched) or jnp.shape(x) != (y_shape[-1], z_shape[-1]):
        raise ValueError(
            f"xpyzt: expected x [m, n], y [m], z [n] (or a batch: y [B, m], z [B, n]); got "
            f"shapes {jnp.shape(x)}, {y_shape}, {z_shape}"
        )
    return x + (jnp.outer(y, z) if vectors else y.T @ z)


def xpyzt_vjp(x, y, z, dret):
    if y.ndim == 1:
        return (dret, dret @ z, dret.T @ y)
    return (dret, z @ dret.T, y @ dret)


# --- lists, reductions, indexing ----------------------------------------------------------


def sum(xs):
    """Elementwise sum of a list (or tuple) of same-shaped arrays, as the builtin does (the
    seed's ``sum``; an array's elements are ``reduce_sum(x)``'s).

    Example:
        >>> import jax.numpy as jnp
        >>> sum([jnp.ones(2), jnp.ones(2), jnp.ones(2)])
        Array([3., 3.], dtype=float32)
    """
    if not isinstance(xs, (list, tuple)) or not xs:
        raise TypeError(
            f"sum: expected a non-empty list of arrays, got {type(xs).__name__}"
            + (
                " (to add an array's elements use jnp.sum, or nnlite.rules.reduce_sum)"
                if hasattr(xs, "shape")
                else ""
            )
        )
    return functools.reduce(add, xs)


def sum_vjp(xs, dret):
    return type(xs)(dret for _ in xs)  # a list for a list, a tuple for a tuple


# The reduce_sum primitive's rule, declared with hand_rule: ``nl.reduce(values, "sum")`` is
# one named step in manual mode (``reduce_sum(x)``: all elements).
reduce_sum = hand_rule(reduce_sum_vjp)(_reduce_sum)


def mean_vjp(x, dret):
    return jnp.broadcast_to(dret / x.size, x.shape).astype(x.dtype)


@hand_rule(mean_vjp)
def mean(x):
    """Mean of all elements, a scalar (e.g. of a per-example loss); its VJP spreads
    ``dret / size``."""
    return jnp.mean(x)


def index(x, i):
    """``x[i]`` for an integer (or integer array) index ``i``: an entry of a column vector,
    a row of a matrix."""
    return x[i]


def index_vjp(x, i, dret):
    """``dx`` alone: the index ``i`` is an integer, it has no cotangent."""
    return jnp.zeros_like(x).at[i].add(dret)


def range_vjp(*args):
    """The VJP of Python's ``range(start, stop, step)``: integers, so one ``None`` per
    argument (the last argument is the cotangent of the sequence)."""
    return (None,) * (len(args) - 1)


# --- elementwise --------------------------------------------------------------------------


def identity_vjp(x, dret):
    return dret


@hand_rule(identity_vjp)
def identity(x):
    """``x`` (the activation that is none)."""
    return x


def recip(x):
    """``1 / x``."""
    return 1 / x


def recip_vjp(x, dret):
    r = 1 / x
    return -dret * r * r


def relu_vjp(x, dret):
    return jnp.where(x > 0, dret, 0)


@hand_rule(relu_vjp)
def relu(x):
    """``max(x, 0)``; the VJP passes the cotangent where ``x > 0`` (0 at the kink, as JAX)."""
    return jax.nn.relu(x)


def tanh_vjp(x, dret):
    t = jnp.tanh(x)
    return dret * (1 - t * t)


@hand_rule(tanh_vjp)
def tanh(x):
    """Hyperbolic tangent."""
    return jnp.tanh(x)


def sigmoid_vjp(x, dret):
    s = jax.nn.sigmoid(x)
    return dret * s * (1 - s)


@hand_rule(sigmoid_vjp)
def sigmoid(x):
    """Logistic sigmoid ``1 / (1 + exp(-x))``."""
    return jax.nn.sigmoid(x)


def softplus_vjp(x, dret):
    return dret * jax.nn.sigmoid(x)


@hand_rule(softplus_vjp)
def softplus(x):
    """``log(1 + exp(x))``."""
    return jax.nn.softplus(x)


_GELU_C = math.sqrt(2 / math.pi)
_GELU_A = 0.044715


def gelu_grad(x):
    """``d gelu / dx`` (tanh approximation), elementwise."""
    t = jnp.tanh(_GELU_C * (x + _GELU_A * x * x * x))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _GELU_C * (1 + 3 * _GELU_A * x * x)


def gelu_vjp(x, dret):
    return dret * gelu_grad(x)


@hand_rule(gelu_vjp)
def gelu(x):
    """GELU, tanh approximation (as in GPT-2): ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))``."""
    return jax.nn.gelu(x, approximate=True)


# --- softmax family -----------------------------------------------------------------------


def softmax_vjp(x, dret, *, axis=0):
    s = jax.nn.softmax(x, axis=axis)
    return s * (dret - jnp.sum(s * dret, axis=axis, keepdims=True))


@hand_rule(softmax_vjp)
def softmax(x, *, axis=0):
    """Softmax along ``axis``: by default axis 0, the seed's column softmax (a column
    vector, or each column of a matrix); a layer's class axis is ``axis=-1``.

    Example:
        >>> import jax.numpy as jnp
        >>> softmax(jnp.zeros((2, 1)))
        Array([[0.5],
               [0.5]], dtype=float32)
        >>> softmax(jnp.zeros((1, 2)), axis=-1)
        Array([[0.5, 0.5]], dtype=float32)
    """
    return jax.nn.softmax(x, axis=axis)


def log_softmax_vjp(x, dret):
    return dret - jax.nn.softmax(x, axis=-1) * jnp.sum(dret, axis=-1, keepdims=True)


@hand_rule(log_softmax_vjp)
def log_softmax(x):
    """Log-softmax over the last axis."""
    return jax.nn.log_softmax(x, axis=-1)


def _class_hits(labels, num_classes):
    """``labels[..., None] == [0, ..., num_classes - 1]``: a boolean one-hot.

    A compare against an iota, laid out explicitly (rank promotion raises): XLA fuses it
    into its consumer, so nothing ``[..., num_classes]`` is stored, and its gradient is an
    elementwise select rather than a scatter.
    """
    return labels[..., None] == _lead(jnp.arange(num_classes, dtype=labels.dtype), labels.ndim + 1)


def softmax_cross_entropy_values_vjp(logits, labels, dret):
    """``(softmax(logits) - onehot(labels)) * dret``; ``None`` for the labels."""
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    hit = _class_hits(labels, logits.shape[-1])
    return (probs - hit.astype(probs.dtype)) * dret[..., None], None


@hand_rule(softmax_cross_entropy_values_vjp)
def softmax_cross_entropy_values(logits, labels):
    """Per-example cross-entropy ``logsumexp(logits) - logits[label]`` (class axis last):
    the rule of ``nl.softmax_cross_entropy``, which checks its arguments and reduces.

    The max is subtracted first, so logits of magnitude 1e4 give exact, finite values; a
    label out of range gives NaN.

    Args:
        logits: ``[..., num_classes]`` scores.
        labels: ``[...]`` integer class indices (cotangent ``None``).

    Returns:
        ``[...]`` per-example losses; reduce with ``mean`` or ``reduce_sum``.

    Example:
        >>> import jax.numpy as jnp
        >>> softmax_cross_entropy_values(jnp.zeros((1, 2)), jnp.array([0]))
        Array([0.6931472], dtype=float32)
    """
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    # The label's logit by a one-hot select rather than a gather: it fuses with the
    # logsumexp pass (in a small train step each gather/scatter is a kernel of its own).
    picked = jnp.sum(jnp.where(_class_hits(labels, logits.shape[-1]), shifted, 0.0), axis=-1)
    in_range = (labels >= 0) & (labels < logits.shape[-1])
    return jnp.where(in_range, lse - picked, jnp.nan)


def _posinf_to_zero(x):
    return jnp.where(jnp.isposinf(x), jnp.zeros_like(x), x)


def _logaddexp_vjp_with(exp, x1, x2, out, dret):
    # JAX's custom JVP of logaddexp: each operand's share of the sum, exp(x - out), with
    # +inf read as 0 (so inf - inf is no nan); 1/2 each at a tie, where the body's
    # max/abs derivatives would give 0
    s1 = exp(_posinf_to_zero(x1) - _posinf_to_zero(out))
    s2 = exp(_posinf_to_zero(x2) - _posinf_to_zero(out))
    return _sum_to(dret * s1, jnp.shape(x1)), _sum_to(dret * s2, jnp.shape(x2))


def logaddexp_vjp(x1, x2, dret):
    return _logaddexp_vjp_with(jnp.exp, x1, x2, jnp.logaddexp(x1, x2), dret)


@hand_rule(logaddexp_vjp)
def logaddexp(x1, x2):
    """``log(exp(x1) + exp(x2))``; the VJP is JAX's own rule for ``jnp.logaddexp`` (each
    operand's share, 1/2 each at a tie: ``jax.nn.softplus`` and ``log_sigmoid`` at 0)."""
    return jnp.logaddexp(x1, x2)


def logaddexp2_vjp(x1, x2, dret):
    return _logaddexp_vjp_with(jnp.exp2, x1, x2, jnp.logaddexp2(x1, x2), dret)


@hand_rule(logaddexp2_vjp)
def logaddexp2(x1, x2):
    """``log2(2**x1 + 2**x2)``; the VJP is JAX's own rule for ``jnp.logaddexp2``."""
    return jnp.logaddexp2(x1, x2)


# The table: the plain pairs here (the hand_rule ones registered themselves; ``negate`` is
# the neg primitive's rule under the seed's name).
register_pairs(globals(), __all__)

# The primitives and jax.custom_jvp functions these rules differentiate when a model calls
# JAX directly (``jnp.tanh``, ``jax.nn.relu``): manual mode uses the same rules for them.
PRIMITIVE_RULES["tanh"] = PrimitiveRule(tanh, tanh_vjp)
CUSTOM_JVP_RULES["relu"] = PrimitiveRule(relu, relu_vjp)
# jax.custom_jvp functions whose rule differs from their body's derivative at some points
# (a tie): walking into the body would give another gradient than jax.grad there
CUSTOM_JVP_RULES["logaddexp"] = PrimitiveRule(logaddexp, logaddexp_vjp)
CUSTOM_JVP_RULES["logaddexp2"] = PrimitiveRule(logaddexp2, logaddexp2_vjp)
