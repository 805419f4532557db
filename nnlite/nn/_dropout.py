"""Dropout: identity without a key (inference), inverted dropout with one (training)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._module import Module
from ..grad._manual import hand_rule

__all__ = ["Dropout", "check_rate", "dropout", "dropout_vjp"]


def dropout_vjp(x, key, rate, dret):
    """Hand rule of ``dropout``: the same mask (redrawn from the same key) and scale on the
    cotangent; the key and rate get none."""
    return dropout.f(dret, key, rate), None, None


@hand_rule(dropout_vjp)
def dropout(x: jax.Array, key: jax.Array | None, rate: float) -> jax.Array:
    """Zero each element of ``x`` with probability ``rate`` and scale the rest by
    ``1 / (1 - rate)``, so the expectation is unchanged. ``key=None`` or ``rate == 0``
    returns ``x``."""
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def check_rate(owner: str, name: str, rate: object) -> None:
    """Raise a ValueError unless ``0 <= rate < 1``."""
    if (
        not isinstance(rate, int | float)
        or isinstance(rate, bool)
        or not 0 <= rate < 1  # NaN fails this too
    ):
        raise ValueError(f"{owner}: {name} must be a float in [0, 1), got {rate!r}")


class Dropout(Module):
    """Inverted dropout (Srivastava et al. 2014; Flax ``nn.Dropout``, Equinox
    ``eqx.nn.Dropout``).

    ``key=None`` means inference: the input comes back unchanged. With a key, each element
    is zeroed with probability ``rate`` and the survivors are scaled by ``1 / (1 - rate)``,
    so the mean is preserved; the same key gives the same mask. Layers that contain
    dropout take ``dropout_rate`` and split their key once per random child.

    Args:
        rate: drop probability, ``0 <= rate < 1`` (0: always the identity).

    ``__call__(x, *, key=None)``: any ``x`` -> same shape and dtype. No params. Inside a
    module called with a key, a Dropout child called without ``key=`` draws its own from
    the caller's (``uses_key`` is true for ``rate > 0``, and so for every parent).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> drop = Dropout(0.5)
        >>> x = jnp.ones(6)
        >>> drop(x).tolist()  # no key: inference
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        >>> set(drop(x, key=jax.random.key(0)).tolist()) <= {0.0, 2.0}
        True
    """

    rate: float = 0.5

    has_params = False

    def __post_init__(self):
        super().__post_init__()
        check_rate("Dropout", "rate", self.rate)

    def _short_repr(self) -> str:
        return f"Dropout(rate={self.rate})"

    _args_repr = _short_repr

    @property
    def uses_key(self) -> bool:
        return self.rate > 0

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        self.check_numeric(x)
        return dropout(x, key, self.rate)
