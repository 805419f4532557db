"""Module: a frozen dataclass of static hyperparameters with ``init`` and ``__call__``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ._params import ParamsDict

__all__ = ["Module"]


class Module:
    """Base class for layers: hyperparameters only, parameters live in a ParamsDict.

    Subclasses are turned into frozen dataclasses automatically, so they are hashable and
    can be closed over or passed as static arguments to ``jax.jit``. Lists given for fields
    are stored as tuples; arrays are refused (they belong in the ParamsDict).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> class Scale(Module):
        ...     features: int
        ...     def init(self, key):
        ...         return ParamsDict(s=jnp.ones(self.features))
        ...     def __call__(self, params, x, *, key=None):
        ...         self.check_input(x, self.features)
        ...         return x * jnp.broadcast_to(params.s, x.shape)  # no implicit rank promotion
        >>> layer = Scale(3)
        >>> p = layer.init(jax.random.key(0))
        >>> layer(p, jnp.ones((2, 3))).shape
        (2, 3)
    """

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, list):
                object.__setattr__(self, f.name, tuple(v))
            elif isinstance(v, (jax.Array, np.ndarray)):
                raise TypeError(
                    f"{type(self).__name__}.{f.name}: modules hold hyperparameters, not arrays; "
                    "put arrays in the ParamsDict returned by init()"
                )

    def init(self, key: jax.Array) -> ParamsDict:
        """Fresh parameters for this module."""
        raise NotImplementedError(f"{type(self).__name__} does not define init(key)")

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        raise NotImplementedError(f"{type(self).__name__} does not define __call__(params, x)")

    def check_input(self, x: Any, features: int) -> None:
        """Raise a ValueError naming this module unless ``x``'s last axis is ``features``."""
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) == 0 or shape[-1] != features:
            raise ValueError(
                f"{self._short_repr()}: expected input with last axis {features}, got shape "
                f"{tuple(shape) if shape is not None else type(x).__name__}"
            )

    def _short_repr(self) -> str:
        fields = [f for f in dataclasses.fields(self) if f.name in ("in_features", "features")]
        inner = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields)
        return f"{type(self).__name__}({inner})"
