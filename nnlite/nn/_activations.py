"""More activations with hand rules: silu, leaky_relu, elu, softcap.

The first six (relu, gelu, tanh, sigmoid, softplus, identity) live with the batched VJP
library; these are layer-side additions, each beside its hand rule and named in
``nl.ACTIVATIONS``. Each gives the gradient JAX's own ``jax.nn`` function gives, kinks
included (leaky_relu passes ``dret`` at 0, elu scales it by ``alpha`` there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..grad._manual import hand_rule

__all__ = [
    "elu", "elu_vjp", "leaky_relu", "leaky_relu_vjp", "silu", "silu_vjp", "softcap", "softcap_vjp",
]  # fmt: skip


def silu_vjp(x, dret):
    """``d silu = sigmoid(x) (1 + x (1 - sigmoid(x)))``."""
    s = jax.nn.sigmoid(x)
    return dret * s * (1 + x * (1 - s))


@hand_rule(silu_vjp)
def silu(x: jax.Array) -> jax.Array:
    """SiLU (swish): ``x * sigmoid(x)``.

    Example:
        >>> import jax.numpy as jnp
        >>> [round(v, 3) for v in silu(jnp.array([-1.0, 0.0, 2.0])).tolist()]
        [-0.269, 0.0, 1.762]
    """
    return jax.nn.silu(x)


def leaky_relu_vjp(x, dret, *, negative_slope: float = 0.01):
    """``dret`` where ``x >= 0``, ``negative_slope * dret`` elsewhere (as ``jax.nn``)."""
    return jnp.where(x >= 0, dret, negative_slope * dret)


@hand_rule(leaky_relu_vjp)
def leaky_relu(x: jax.Array, *, negative_slope: float = 0.01) -> jax.Array:
    """``x`` where ``x >= 0``, ``negative_slope * x`` elsewhere (PyTorch's default slope).

    Example:
        >>> import jax.numpy as jnp
        >>> print(leaky_relu(jnp.array([-2.0, 3.0])))
        [-0.02  3.  ]
        >>> print(leaky_relu(jnp.array([-2.0, 3.0]), negative_slope=0.5))
        [-1.  3.]
    """
    return jax.nn.leaky_relu(x, negative_slope)


def elu_vjp(x, dret, *, alpha: float = 1.0):
    """``dret`` where ``x > 0``, ``alpha * exp(x) * dret`` elsewhere (as ``jax.nn``)."""
    neg = jnp.minimum(x, 0)  # exp of a large positive x would overflow in the unused branch
    return jnp.where(x > 0, dret, alpha * jnp.exp(neg) * dret)


@hand_rule(elu_vjp)
def elu(x: jax.Array, *, alpha: float = 1.0) -> jax.Array:
    """ELU: ``x`` where ``x > 0``, ``alpha * (exp(x) - 1)`` elsewhere.

    Example:
        >>> import jax.numpy as jnp
        >>> print(elu(jnp.array([-1.0, 2.0])).round(4))
        [-0.6321  2.    ]
    """
    return jax.nn.elu(x, alpha)


def softcap_vjp(x, dret, *, cap: float):
    """``d softcap = 1 - tanh(x / cap)^2``."""
    t = jnp.tanh(x / jnp.asarray(cap, x.dtype))
    return dret * (1 - t * t)


@hand_rule(softcap_vjp)
def softcap(x: jax.Array, *, cap: float) -> jax.Array:
    """Soft capping (Gemma 2's logits): ``cap * tanh(x / cap)``, smooth, odd, within ``(-cap,
    cap)`` and close to ``x`` where ``|x|`` is small against ``cap``.

    Example:
        >>> import jax.numpy as jnp
        >>> [round(v, 3) for v in softcap(jnp.array([0.5, 30.0, -1e4]), cap=30.0).tolist()]
        [0.5, 22.848, -30.0]
    """
    c = jnp.asarray(cap, x.dtype)
    return c * jnp.tanh(x / c)
