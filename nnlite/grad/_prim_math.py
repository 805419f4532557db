"""Hand rules of JAX's elementwise math primitives: ``exp``, ``log``, ``sin``, ``pow``,
``max``, ``clamp``, ``atan2``, ... -- what ``jnp`` and ``jax.nn`` emit for a model's
ordinary math.

Each rule is named after its primitive and takes its parameters as keywords (see
``_structural.py``). A rule reads the forward's operands only (it recomputes what it
needs: ``exp_vjp`` computes ``exp(x)`` again, which XLA merges with the forward's). Where
JAX's own derivative makes a choice at a point where the function has no derivative
(``max`` at a tie splits the cotangent in two, ``abs`` at 0 gives 0, ``clamp`` at its
bounds gives 0), the rule makes the same one, so manual and autodiff gradients agree
everywhere.

Example:
    >>> import jax.numpy as jnp
    >>> sin_vjp(jnp.array([0.0, 1.0]), jnp.ones(2)).tolist()  # dret * cos(x)
    [1.0, 0.5403022766113281]
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._prim_layout import _broadcast, _sum_to

# Note: this module defines ``abs``, ``max``, ``min``, ``pow`` and ``round`` (JAX's
# primitive names); the builtins are not used here.

__all__ = ['abs', 'abs_vjp', 'acos', 'acos_vjp', 'acosh', 'acosh_vjp', 'asin', 'asin_vjp', 'asinh', 'asinh_vjp', 'atan', 'atan2', 'atan2_vjp', 'atan_vjp', 'atanh', 'atanh_vjp', 'cbrt', 'cbrt_vjp', 'ceil', 'ceil_vjp', 'clamp', 'clamp_vjp', 'cos', 'cos_vjp', 'cosh', 'cosh_vjp', 'erf', 'erf_inv', 'erf_inv_vjp', 'erf_vjp', 'erfc', 'erfc_vjp', 'exp', 'exp2', 'exp2_vjp', 'exp_vjp', 'expm1', 'expm1_vjp', 'floor', 'floor_vjp', 'integer_pow', 'integer_pow_vjp', 'log', 'log1p', 'log1p_vjp', 'log_vjp', 'logistic', 'logistic_vjp', 'max', 'max_vjp', 'min', 'min_vjp', 'pow', 'pow_vjp', 'reduce_precision', 'reduce_precision_vjp', 'rem', 'rem_vjp', 'round', 'round_vjp', 'rsqrt', 'rsqrt_vjp', 'sign', 'sign_vjp', 'sin', 'sin_vjp', 'sinh', 'sinh_vjp', 'sqrt', 'sqrt_vjp', 'square', 'square_vjp', 'tan', 'tan_vjp']  # fmt: skip


def _c(x, value):
    """``value`` as a scalar of ``x``'s dtype (no rank promotion, no dtype promotion)."""
    return jnp.asarray(value, jnp.result_type(x))


# --- exponentials and logarithms ------------------------------------------------------------


def exp(x, *, accuracy=None):
    """``lax.exp`` (``jnp.exp``)."""
    return lax.exp(x, accuracy=accuracy)


def exp_vjp(x, dret, *, accuracy=None):
    """``dret * exp(x)``."""
    return dret * lax.exp(x, accuracy=accuracy)


def exp2(x, *, accuracy=None):
    """``lax.exp2`` (``jnp.exp2``, ``2 ** x``)."""
    return lax.exp2(x, accuracy=accuracy)


def exp2_vjp(x, dret, *, accuracy=None):
    """``dret * 2**x * log(2)``."""
    return dret * lax.exp2(x, accuracy=accuracy) * _c(x, math.log(2.0))


def log(x, *, accuracy=None):
    """``lax.log`` (``jnp.log``)."""
    return lax.log(x, accuracy=accuracy)


def log_vjp(x, dret, *, accuracy=None):
    """``dret / x``."""
    return dret / x


def log1p(x, *, accuracy=None):
    """``lax.log1p`` (``jnp.log1p``)."""
    return lax.log1p(x, accuracy=accuracy)


def log1p_vjp(x, dret, *, accuracy=None):
    """``dret / (1 + x)``."""
    return dret / (x + _c(x, 1))


def expm1(x, *, accuracy=None):
    """``lax.expm1`` (``jnp.expm1``)."""
    return lax.expm1(x, accuracy=accuracy)


def expm1_vjp(x, dret, *, accuracy=None):
    """``dret * exp(x)`` (``expm1(x) + 1``)."""
    return dret * (lax.expm1(x, accuracy=accuracy) + _c(x, 1))


def logistic(x, *, accuracy=None):
    """``lax.logistic`` (``jax.nn.sigmoid``)."""
    return lax.logistic(x, accuracy=accuracy)


def logistic_vjp(x, dret, *, accuracy=None):
    """``dret * s * (1 - s)`` with ``s = logistic(x)``."""
    s = lax.logistic(x, accuracy=accuracy)
    return dret * s * (_c(x, 1) - s)


# --- powers and roots -----------------------------------------------------------------------


def sqrt(x, *, accuracy=None):
    """``lax.sqrt`` (``jnp.sqrt``)."""
    return lax.sqrt(x, accuracy=accuracy)


def sqrt_vjp(x, dret, *, accuracy=None):
    """``dret / (2 sqrt(x))``."""
    return dret * _c(x, 0.5) / lax.sqrt(x, accuracy=accuracy)


def rsqrt(x, *, accuracy=None):
    """``lax.rsqrt``: ``1 / sqrt(x)``."""
    return lax.rsqrt(x, accuracy=accuracy)


def rsqrt_vjp(x, dret, *, accuracy=None):
    """``-dret * rsqrt(x) / (2 x)``."""
    return dret * _c(x, -0.5) * lax.rsqrt(x, accuracy=accuracy) / x


def cbrt(x, *, accuracy=None):
    """``lax.cbrt`` (``jnp.cbrt``)."""
    return lax.cbrt(x, accuracy=accuracy)


def cbrt_vjp(x, dret, *, accuracy=None):
    """``dret / (3 cbrt(x)**2)``."""
    return dret * _c(x, 1 / 3) * lax.integer_pow(lax.cbrt(x, accuracy=accuracy), -2)


def square(x):
    """``lax.square`` (``jnp.square``)."""
    return lax.square(x)


def square_vjp(x, dret):
    """``2 x dret``."""
    return dret * _c(x, 2) * x


def integer_pow(x, *, y):
    """``lax.integer_pow`` (``x ** 3`` with a Python int exponent)."""
    return lax.integer_pow(x, y)


def integer_pow_vjp(x, dret, *, y):
    """``dret * y * x**(y - 1)`` (zero for ``y == 0``)."""
    if y == 0:
        return jnp.zeros_like(dret)
    return dret * _c(x, y) * (lax.integer_pow(x, y - 1) if y != 1 else jnp.ones_like(x))


def pow(x, y):  # noqa: A001
    """``lax.pow`` (``x ** y`` elementwise, NumPy broadcasting); ``y`` a float array or
    scalar (differentiable), or an integer one (the seed's ``pow(x, 3)``: no cotangent)."""
    return lax.pow(*_broadcast(x, y))


def pow_vjp(x, y, dret):
    """``dx = dret * y * x**(y - 1)`` (zero where ``y == 0``), ``dy = dret * log(x) * x**y``
    (zero where ``x == 0``), as JAX's own derivative; each summed to its operand's shape.
    ``dy`` is ``None`` for an integer exponent (not differentiable)."""
    xb, yb = _broadcast(x, y)
    ans = lax.pow(xb, yb)
    dx = jnp.where(yb == 0, jnp.zeros_like(ans), yb * lax.pow(xb, yb - _c(yb, 1)))
    dx = _sum_to((dret * dx).astype(jnp.result_type(x)), np.shape(x))
    if np.issubdtype(jnp.result_type(y), np.integer):
        return dx, None
    safe_x = jnp.where(xb == 0, jnp.ones_like(xb), xb)
    dy = lax.log(safe_x) * ans
    return dx, _sum_to(dret * dy.astype(dret.dtype), np.shape(y))


# --- trigonometric and hyperbolic -----------------------------------------------------------


def sin(x, *, accuracy=None):
    """``lax.sin`` (``jnp.sin``)."""
    return lax.sin(x, accuracy=accuracy)


def sin_vjp(x, dret, *, accuracy=None):
    """``dret * cos(x)``."""
    return dret * lax.cos(x, accuracy=accuracy)


def cos(x, *, accuracy=None):
    """``lax.cos`` (``jnp.cos``)."""
    return lax.cos(x, accuracy=accuracy)


def cos_vjp(x, dret, *, accuracy=None):
    """``-dret * sin(x)``."""
    return -dret * lax.sin(x, accuracy=accuracy)


def tan(x, *, accuracy=None):
    """``lax.tan`` (``jnp.tan``)."""
    return lax.tan(x, accuracy=accuracy)


def tan_vjp(x, dret, *, accuracy=None):
    """``dret * (1 + tan(x)**2)``."""
    t = lax.tan(x, accuracy=accuracy)
    return dret * (_c(x, 1) + t * t)


def asin(x):
    """``lax.asin`` (``jnp.arcsin``)."""
    return lax.asin(x)


def asin_vjp(x, dret):
    """``dret / sqrt(1 - x**2)``."""
    return dret * lax.rsqrt(_c(x, 1) - x * x)


def acos(x):
    """``lax.acos`` (``jnp.arccos``)."""
    return lax.acos(x)


def acos_vjp(x, dret):
    """``-dret / sqrt(1 - x**2)``."""
    return -dret * lax.rsqrt(_c(x, 1) - x * x)


def atan(x):
    """``lax.atan`` (``jnp.arctan``)."""
    return lax.atan(x)


def atan_vjp(x, dret):
    """``dret / (1 + x**2)``."""
    return dret / (_c(x, 1) + x * x)


def atan2(x, y):
    """``lax.atan2(x, y)``: the angle of ``(y, x)`` (``jnp.arctan2``)."""
    return lax.atan2(x, y)


def atan2_vjp(x, y, dret):
    """``dx = dret * y / (x**2 + y**2)``, ``dy = -dret * x / (x**2 + y**2)``."""
    xb, yb = _broadcast(x, y)
    r2 = xb * xb + yb * yb
    return _sum_to(dret * yb / r2, np.shape(x)), _sum_to(-dret * xb / r2, np.shape(y))


def sinh(x):
    """``lax.sinh`` (``jnp.sinh``)."""
    return lax.sinh(x)


def sinh_vjp(x, dret):
    """``dret * cosh(x)``."""
    return dret * lax.cosh(x)


def cosh(x):
    """``lax.cosh`` (``jnp.cosh``)."""
    return lax.cosh(x)


def cosh_vjp(x, dret):
    """``dret * sinh(x)``."""
    return dret * lax.sinh(x)


def asinh(x):
    """``lax.asinh`` (``jnp.arcsinh``)."""
    return lax.asinh(x)


def asinh_vjp(x, dret):
    """``dret / sqrt(x**2 + 1)``."""
    return dret * lax.rsqrt(x * x + _c(x, 1))


def acosh(x):
    """``lax.acosh`` (``jnp.arccosh``)."""
    return lax.acosh(x)


def acosh_vjp(x, dret):
    """``dret / sqrt((x - 1)(x + 1))``."""
    return dret * lax.rsqrt((x - _c(x, 1)) * (x + _c(x, 1)))


def atanh(x):
    """``lax.atanh`` (``jnp.arctanh``)."""
    return lax.atanh(x)


def atanh_vjp(x, dret):
    """``dret / (1 - x**2)``."""
    return dret / (_c(x, 1) - x * x)


# --- special functions ----------------------------------------------------------------------


def erf(x):
    """``lax.erf`` (``jax.scipy.special.erf``; the exact ``jax.nn.gelu``)."""
    return lax.erf(x)


def erf_vjp(x, dret):
    """``dret * 2 / sqrt(pi) * exp(-x**2)``."""
    return dret * _c(x, 2 / math.sqrt(math.pi)) * lax.exp(-x * x)


def erfc(x):
    """``lax.erfc``: ``1 - erf(x)``."""
    return lax.erfc(x)


def erfc_vjp(x, dret):
    """``-dret * 2 / sqrt(pi) * exp(-x**2)``."""
    return dret * _c(x, -2 / math.sqrt(math.pi)) * lax.exp(-x * x)


def erf_inv(x):
    """``lax.erf_inv`` (``jax.scipy.special.erfinv``)."""
    return lax.erf_inv(x)


def erf_inv_vjp(x, dret):
    """``dret * sqrt(pi) / 2 * exp(erf_inv(x)**2)``."""
    y = lax.erf_inv(x)
    return dret * _c(x, math.sqrt(math.pi) / 2) * lax.exp(y * y)


# --- piecewise: abs, sign, rounding, max, min, clamp, rem -----------------------------------


def abs(x):  # noqa: A001
    """``lax.abs`` (``jnp.abs``)."""
    return lax.abs(x)


def abs_vjp(x, dret):
    """``dret`` where ``x >= 0`` (at 0 too, as JAX), ``-dret`` elsewhere."""
    return jnp.where(x >= 0, dret, -dret)


def sign(x):
    """``lax.sign``: piecewise constant, so its cotangent is zero."""
    return lax.sign(x)


def sign_vjp(x, dret):
    return jnp.zeros_like(dret)


def floor(x):
    """``lax.floor``: piecewise constant, zero cotangent."""
    return lax.floor(x)


def floor_vjp(x, dret):
    return jnp.zeros_like(dret)


def ceil(x):
    """``lax.ceil``: piecewise constant, zero cotangent."""
    return lax.ceil(x)


def ceil_vjp(x, dret):
    return jnp.zeros_like(dret)


def round(x, *, rounding_method=0):  # noqa: A001
    """``lax.round``: piecewise constant, zero cotangent."""
    return lax.round(x, rounding_method)


def round_vjp(x, dret, *, rounding_method=0):
    return jnp.zeros_like(dret)


def reduce_precision(x, *, exponent_bits, mantissa_bits):
    """``lax.reduce_precision`` (rounding to a narrower float)."""
    return lax.reduce_precision(x, exponent_bits, mantissa_bits)


def reduce_precision_vjp(x, dret, *, exponent_bits, mantissa_bits):
    """The cotangent rounded the same way (as JAX's own derivative does)."""
    return lax.reduce_precision(dret, exponent_bits, mantissa_bits)


def _tie_split(x, y):
    """The share of the cotangent ``x`` gets in ``max(x, y)``: 1 where it wins, 1/2 at a
    tie (JAX's convention), 0 where it loses."""
    one = jnp.ones_like(x)
    return jnp.where(x > y, one, jnp.where(x == y, one * _c(x, 0.5), jnp.zeros_like(x)))


def max(x, y):  # noqa: A001
    """``lax.max`` (``jnp.maximum``, ``jax.nn.relu``'s body)."""
    return lax.max(x, y)


def max_vjp(x, y, dret):
    """``dret`` to the larger operand, split in two at a tie."""
    xb, yb = _broadcast(x, y)
    return (
        _sum_to(dret * _tie_split(xb, yb), np.shape(x)),
        _sum_to(dret * _tie_split(yb, xb), np.shape(y)),
    )


def min(x, y):  # noqa: A001
    """``lax.min`` (``jnp.minimum``)."""
    return lax.min(x, y)


def min_vjp(x, y, dret):
    """``dret`` to the smaller operand, split in two at a tie."""
    xb, yb = _broadcast(x, y)
    return (
        _sum_to(dret * _tie_split(-xb, -yb), np.shape(x)),
        _sum_to(dret * _tie_split(-yb, -xb), np.shape(y)),
    )


def clamp(lo, x, hi):
    """``lax.clamp(lo, x, hi)`` (``jnp.clip``)."""
    return lax.clamp(lo, x, hi)


def clamp_vjp(lo, x, hi, dret):
    """``x`` gets ``dret`` strictly inside the bounds, ``lo`` where it clips from below,
    ``hi`` where it clips from above (JAX's convention at the bounds)."""
    lob, xb, hib = _broadcast(lo, x, hi)
    zero = jnp.zeros_like(dret)
    dlo = jnp.where((lob > xb) & (lob < hib), dret, zero)
    dx = jnp.where((xb > lob) & (xb < hib), dret, zero)
    dhi = jnp.where(hib < xb, dret, zero)
    return _sum_to(dlo, np.shape(lo)), dx, _sum_to(dhi, np.shape(hi))


def rem(x, y):
    """``lax.rem``: the remainder with the sign of ``x`` (``jnp.fmod``; ``%`` builds on it)."""
    return lax.rem(x, y)


def rem_vjp(x, y, dret):
    """``dx = dret``, ``dy = -dret * trunc(x / y)``."""
    xb, yb = _broadcast(x, y)
    q = xb / yb
    return _sum_to(dret, np.shape(x)), _sum_to(
        -dret * lax.sign(q) * lax.floor(lax.abs(q)), np.shape(y)
    )
