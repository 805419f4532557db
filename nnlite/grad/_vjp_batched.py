"""Batched hand-derived VJPs (``nnlite.vjp.batched``): the rules nnlite's layers use.

Every rule has the form ``f_vjp(*args, dret) -> dargs``: it takes the forward function's
arguments and the cotangent ``dret`` of its result (one cotangent per output when the
function returns a tuple: ``dup_vjp(x, dx1, dx2)``), and returns one cotangent per
argument -- a bare value when ``f`` takes one argument, a tuple otherwise. Integer arguments (labels, indices) are not differentiable:
their cotangent is ``None``.

Batch conventions follow nnlite's: a leading batch axis (or several) on ``x``, the class or
feature axis last, weights ``W: [in, out]`` shared across the batch.

The functions nnlite's layers and losses call (the activations, ``softmax``,
``log_softmax``, ``sum``, ``mean``, ``softmax_cross_entropy``) are declared with their rule
by ``@hand_rule``: ``nl.relu`` is ``relu`` here, and in manual-gradient mode it is
differentiated by ``relu_vjp``. Elsewhere the decorator calls the plain function.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._manual import hand_rule
from ._prim_layout import _sum_to
from ._structural import CUSTOM_JVP_RULES, PRIMITIVE_RULES, PrimitiveRule

__all__ = [
    "add", "add_vjp", "axpy", "axpy_vjp", "bias_add", "bias_add_vjp", "dotall", "dotall_vjp",
    "dup", "dup_vjp", "exp", "exp_vjp", "gelu", "gelu_vjp", "identity", "identity_vjp",
    "index", "index_vjp", "log", "log_softmax",
    "logaddexp", "logaddexp2", "logaddexp2_vjp", "logaddexp_vjp", "log_softmax_vjp", "log_vjp", "mean",
    "mean_vjp", "mm", "mm_scaled", "mm_scaled_vjp", "mm_vjp", "mul", "mul_vjp", "negate",
    "negate_vjp", "pair", "pair_vjp", "recip", "recip_vjp", "relu", "relu_vjp", "scale",
    "scale_vjp", "sigmoid", "sigmoid_vjp", "softmax", "softmax_cross_entropy",
    "softmax_cross_entropy_vjp", "softmax_vjp", "softplus", "softplus_vjp", "sum", "sum_vjp",
    "tanh", "tanh_vjp", "xpyzt", "xpyzt_vjp",
]  # fmt: skip

# Note: this module defines ``sum`` (like ``jnp.sum``); the builtin is not used here.


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` with leading unit axes up to rank ``ndim`` (explicit: rank promotion raises)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


# --- structure: add, dup, pair ------------------------------------------------------------


def add(x, y):
    """``x + y`` for arrays of the same shape (see ``bias_add`` for broadcasting)."""
    return x + y


def add_vjp(x, y, dret):
    return dup(dret)


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


# --- linear algebra -----------------------------------------------------------------------


def mul(x, y):
    """Elementwise ``x * y`` (same shapes)."""
    return x * y


def mul_vjp(x, y, dret):
    return (dret * y, x * dret)


def negate(x):
    """``-x``."""
    return -x


def negate_vjp(x, dret):
    return -dret


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


def mm(A, B):
    """``A @ B`` with ``A: [..., n, k]`` and ``B: [k, m]`` (shared) or ``[..., k, m]`` (batched).

    Example:
        >>> import jax.numpy as jnp
        >>> mm(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
        (2, 4)
    """
    if jnp.ndim(A) < 2 or jnp.ndim(B) not in (2, jnp.ndim(A)):
        raise ValueError(
            f"mm: expected A [..., n, k] and B [k, m] or [..., k, m], got shapes "
            f"{jnp.shape(A)} and {jnp.shape(B)}"
        )
    return jnp.matmul(A, B)


def mm_vjp(A, B, dret):
    dA = jnp.matmul(dret, jnp.swapaxes(B, -1, -2))
    if B.ndim == 2:
        # B is shared by every row of every batch: contract over all of A's leading axes,
        # one matmul [k, rows] @ [rows, m].
        dB = jnp.matmul(A.reshape(-1, A.shape[-1]).T, dret.reshape(-1, dret.shape[-1]))
    else:
        dB = jnp.matmul(jnp.swapaxes(A, -1, -2), dret)
    return (dA, dB)


def axpy(A, x, y):
    """``A @ x + y`` with ``A: [m, n]``, ``x: [n]`` or ``[n, k]``, ``y`` the result's shape."""
    return A @ x + y


def axpy_vjp(A, x, y, dret):
    dA = jnp.outer(dret, x) if x.ndim == 1 else dret @ x.T
    return (dA, A.T @ dret, dret)


def mm_scaled(A, B, sA, sB):
    """``(sA * A) @ (sB * B)``, computed as ``(sA * sB) * (A @ B)``; ``sA``, ``sB`` scalars."""
    return scale(sA * sB, mm(A, B))


def mm_scaled_vjp(A, B, sA, sB, dC):
    # dA = sA sB dC B^T, dB = sA sB A^T dC: reuse mm_scaled so the scaling stays on the
    # small side of each product.
    dA = mm_scaled(dC, B.T, sA, sB)
    dB = mm_scaled(A.T, dC, sA, sB)
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
    if y.ndim == 1 and z.ndim == 1:
        return x + jnp.outer(y, z)
    if y.ndim == 2 and z.ndim == 2 and y.shape[0] == z.shape[0]:
        return x + y.T @ z
    raise ValueError(
        f"xpyzt: expected y, z of shapes [m], [n] or [B, m], [B, n]; got {y.shape}, {z.shape}"
    )


def xpyzt_vjp(x, y, z, dret):
    if y.ndim == 1:
        return (dret, dret @ z, dret.T @ y)
    return (dret, z @ dret.T, y @ dret)


# --- reductions and indexing --------------------------------------------------------------


def sum_vjp(x, dret):
    return jnp.broadcast_to(dret, x.shape).astype(x.dtype)


@hand_rule(sum_vjp)
def sum(x):
    """Sum of all elements, a scalar; its VJP broadcasts ``dret``."""
    return jnp.sum(x)


def mean_vjp(x, dret):
    return jnp.broadcast_to(dret / x.size, x.shape).astype(x.dtype)


@hand_rule(mean_vjp)
def mean(x):
    """Mean of all elements, a scalar (e.g. of a per-example loss); its VJP spreads
    ``dret / size``."""
    return jnp.mean(x)


def index(x, i):
    """``x[i]`` for an integer (or integer array) index ``i``; ``i`` gets a ``None`` cotangent."""
    return x[i]


def index_vjp(x, i, dret):
    return (jnp.zeros_like(x).at[i].add(dret), None)


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


def log(x):
    """Natural logarithm."""
    return jnp.log(x)


def log_vjp(x, dret):
    return dret / x


def exp(x):
    """``e ** x``."""
    return jnp.exp(x)


def exp_vjp(x, dret):
    return dret * jnp.exp(x)


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


# --- softmax family (class axis last) -----------------------------------------------------


def softmax_vjp(x, dret):
    s = jax.nn.softmax(x, axis=-1)
    return s * (dret - jnp.sum(s * dret, axis=-1, keepdims=True))


@hand_rule(softmax_vjp)
def softmax(x):
    """Softmax over the last axis."""
    return jax.nn.softmax(x, axis=-1)


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


def softmax_cross_entropy_vjp(logits, labels, dret):
    """``(softmax(logits) - onehot(labels)) * dret``; ``None`` for the labels."""
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    hit = _class_hits(labels, logits.shape[-1])
    return (probs - hit.astype(probs.dtype)) * dret[..., None], None


@hand_rule(softmax_cross_entropy_vjp)
def softmax_cross_entropy(logits, labels):
    """Per-example cross-entropy ``logsumexp(logits) - logits[label]`` (class axis last).

    The max is subtracted first, so logits of magnitude 1e4 give exact, finite values; a
    label out of range gives NaN. ``nl.softmax_cross_entropy`` checks its arguments and
    reduces, then calls this.

    Args:
        logits: ``[..., num_classes]`` scores.
        labels: ``[...]`` integer class indices (cotangent ``None``).

    Returns:
        ``[...]`` per-example losses; reduce with ``mean`` or ``sum``.

    Example:
        >>> import jax.numpy as jnp
        >>> softmax_cross_entropy(jnp.zeros((1, 2)), jnp.array([0]))
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


# The primitives and jax.custom_jvp functions these rules differentiate when a model calls
# JAX directly (``jnp.tanh``, ``jax.nn.relu``): manual mode uses the same rules for them.
PRIMITIVE_RULES["tanh"] = PrimitiveRule(tanh, tanh_vjp)
CUSTOM_JVP_RULES["relu"] = PrimitiveRule(relu, relu_vjp)
# jax.custom_jvp functions whose rule differs from their body's derivative at some points
# (a tie): walking into the body would give another gradient than jax.grad there
CUSTOM_JVP_RULES["logaddexp"] = PrimitiveRule(logaddexp, logaddexp_vjp)
CUSTOM_JVP_RULES["logaddexp2"] = PrimitiveRule(logaddexp2, logaddexp2_vjp)
