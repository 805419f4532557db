"""Pooling (``lax.reduce_window``) and Flatten: parameter-free, channels-last."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._jax_private import select_and_scatter_add
from ..core._module import Module
from ..grad._manual import hand_rule
from ._conv import check_int_rank, explicit_padding, normalize_padding, to_tuple

__all__ = [
    "AvgPool",
    "Flatten",
    "MaxPool",
    "avg_pool",
    "avg_pool_vjp",
    "flatten",
    "flatten_vjp",
    "max_pool",
    "max_pool_vjp",
]


def _window_args(x, window, strides, padding):
    """Full-rank window, strides and padding for ``x: [..., *spatial, C]``."""
    n = len(window)
    lead = x.ndim - n - 1
    pads = explicit_padding(padding, x.shape[lead:-1], window, strides)
    return (
        (1,) * lead + tuple(window) + (1,),
        (1,) * lead + tuple(strides) + (1,),
        ((0, 0),) * lead + tuple(pads) + ((0, 0),),
    )


def max_pool_vjp(x, dret, *, window, strides, padding):
    """Hand rule of ``max_pool``: each window's cotangent goes to its maximum (the first on
    ties), XLA's select-and-scatter."""
    dims, strides_, pads = _window_args(x, window, strides, padding)
    return select_and_scatter_add(dret, x, dims, strides_, pads)


def _window_sum_vjp(dret, in_shape, dims, strides, pads):
    """Cotangent of ``reduce_window(x, 0, add, dims, strides, pads)``: every input gets the
    sum of the cotangents of the windows covering it -- ``dret`` dilated by the strides,
    padded, and summed over a stride-1 window."""
    cfg = []
    for L, M, k, s, (lo, _) in zip(in_shape, dret.shape, dims, strides, pads, strict=True):
        plo = k - 1 - lo
        cfg.append((plo, L + k - 2 - (M - 1) * s - plo, s - 1))
    padded = lax.pad(dret, jnp.zeros((), dret.dtype), cfg)
    return lax.reduce_window(padded, 0.0, lax.add, dims, (1,) * len(dims), ((0, 0),) * len(dims))


def avg_pool_vjp(x, dret, *, window, strides, padding, count_include_pad=True):
    """Hand rule of ``avg_pool``: ``dret / count`` spread back over each window."""
    dims, strides_, pads = _window_args(x, window, strides, padding)
    if count_include_pad or all(p == (0, 0) for p in pads):
        scaled = dret / jnp.array(math.prod(window), dret.dtype)
    else:
        ones = jnp.ones(x.shape[-len(window) - 1 : -1] + (1,), x.dtype)
        n = len(window)
        counts = lax.reduce_window(
            ones, 0.0, lax.add, dims[-n - 1 :], strides_[-n - 1 :], pads[-n - 1 :]
        )
        scaled = dret / jnp.broadcast_to(counts, dret.shape)
    return _window_sum_vjp(scaled, x.shape, dims, strides_, pads).astype(x.dtype)


@hand_rule(max_pool_vjp)
def max_pool(x: jax.Array, *, window: Sequence[int], strides: Sequence[int], padding) -> jax.Array:
    """Maximum over windows of the spatial axes of ``x: [..., *spatial, C]`` (padding
    counts as ``-inf``)."""
    dims, strides_, pads = _window_args(x, window, strides, padding)
    # A Python scalar init: reduce_window then recognises the max monoid, which has a
    # gradient rule (a traced init would not).
    if jnp.issubdtype(x.dtype, jnp.floating):
        init = -float("inf")
    elif jnp.issubdtype(x.dtype, jnp.bool_):
        init = False
    else:
        init = int(jnp.iinfo(x.dtype).min)
    return lax.reduce_window(x, init, lax.max, dims, strides_, pads)


@hand_rule(avg_pool_vjp)
def avg_pool(
    x: jax.Array,
    *,
    window: Sequence[int],
    strides: Sequence[int],
    padding,
    count_include_pad: bool = True,
) -> jax.Array:
    """Mean over windows of the spatial axes of ``x: [..., *spatial, C]``; padded positions
    count as zeros (``count_include_pad``) or are left out of the mean."""
    dims, strides_, pads = _window_args(x, window, strides, padding)
    total = lax.reduce_window(x, 0.0, lax.add, dims, strides_, pads)
    if count_include_pad or all(p == (0, 0) for p in pads):
        return total / jnp.array(math.prod(window), x.dtype)
    ones = jnp.ones(x.shape[-len(window) - 1 : -1] + (1,), x.dtype)
    n = len(window)
    counts = lax.reduce_window(
        ones, 0.0, lax.add, dims[-n - 1 :], strides_[-n - 1 :], pads[-n - 1 :]
    )
    return total / jnp.broadcast_to(counts, total.shape)


class _Pool(Module):
    window: int | tuple[int, ...]
    strides: int | tuple[int, ...] | None = None
    padding: Any = "VALID"

    has_params = False

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        w = self.window
        if isinstance(w, int) and not isinstance(w, bool):
            w = (w,)
            object.__setattr__(self, "int_size", True)
        if not isinstance(w, tuple) or not w:
            raise ValueError(f"{name}: window must be a positive int or a tuple, got {w!r}")
        n = len(w)
        object.__setattr__(self, "window", to_tuple(name, "window", self.window, n))
        strides = self.window if self.strides is None else self.strides
        object.__setattr__(self, "strides", to_tuple(name, "strides", strides, n))
        object.__setattr__(self, "padding", normalize_padding(name, self.padding, n))

    def _short_repr(self) -> str:
        return f"{type(self).__name__}(window={self.window})"

    _args_repr = _short_repr

    def _check(self, x: Any) -> None:
        n = len(self.window)
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < n + 1:
            raise ValueError(
                f"{self._short_repr()}: expected input [..., *spatial ({n} axes), channels] of "
                f"rank >= {n + 1}, got shape "
                f"{tuple(shape) if shape is not None else type(x).__name__}"
            )
        self.check_numeric(x)
        check_int_rank(self, "window", x)
        spatial = shape[-n - 1 : -1]
        pads = explicit_padding(self.padding, spatial, self.window, self.strides)
        if any(s + lo + hi < w for s, (lo, hi), w in zip(spatial, pads, self.window, strict=True)):
            raise ValueError(
                f"{self._short_repr()}: input of shape {tuple(shape)} has spatial size "
                f"{tuple(spatial)}, smaller (with padding {pads}) than the window"
            )


_POOL_ARGS = """
    N-dimensional: N = ``len(window)`` (an int window means 1-d, and input of rank 4 or
    more, images, is then refused: give ``(2, 2)``). Input
    ``[..., *spatial, channels]``: rank N + 1 is one unbatched example, further leading
    axes are batch axes. No params (``init`` returns an empty ParamsDict).

    Args:
        window: window size, int or N ints.
        strides: int or N ints; ``None`` (default) means ``window`` (non-overlapping
            windows, as PyTorch and Keras; Flax's ``max_pool`` defaults to stride 1).
        padding: ``"VALID"`` (default), ``"SAME"``, an int, or N ``(low, high)`` pairs."""


class MaxPool(_Pool):
    __doc__ = (
        """Max pooling over the spatial axes, channels-last (Flax ``nn.max_pool``, Equinox
    ``eqx.nn.MaxPool1d/2d/3d``). Padded positions count as ``-inf``.
"""
        + _POOL_ARGS
        + """

    Returns:
        ``[..., *spatial_out, channels]``.

    Example:
        >>> import jax.numpy as jnp
        >>> pool = MaxPool(2)
        >>> pool(jnp.array([[1.0], [3.0], [2.0], [0.0]]))[:, 0]
        Array([3., 2.], dtype=float32)
        >>> MaxPool((2, 2))(jnp.ones((8, 28, 28, 3))).shape
        (8, 14, 14, 3)
    """
    )

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        self._check(x)
        return max_pool(x, window=self.window, strides=self.strides, padding=self.padding)


class AvgPool(_Pool):
    __doc__ = (
        """Average pooling over the spatial axes, channels-last (Flax ``nn.avg_pool``, Equinox
    ``eqx.nn.AvgPool1d/2d/3d``).
"""
        + _POOL_ARGS
        + """
        count_include_pad: padded positions count as zeros in the mean (default, as Flax);
            ``False`` averages over the real inputs of each window only.

    Returns:
        ``[..., *spatial_out, channels]``.

    Example:
        >>> import jax.numpy as jnp
        >>> pool = AvgPool(2)
        >>> pool(jnp.array([[1.0], [3.0], [2.0], [0.0]]))[:, 0]
        Array([2., 1.], dtype=float32)
    """
    )

    count_include_pad: bool = True

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        self._check(x)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            x = x.astype(jnp.result_type(float))
        return avg_pool(
            x,
            window=self.window,
            strides=self.strides,
            padding=self.padding,
            count_include_pad=self.count_include_pad,
        )


def flatten_vjp(x, dret, *, num_axes):
    """Hand rule of ``flatten``: the cotangent reshaped back."""
    return dret.reshape(x.shape)


@hand_rule(flatten_vjp)
def flatten(x: jax.Array, *, num_axes: int) -> jax.Array:
    """Merge the last ``num_axes`` axes of ``x`` into one."""
    return x.reshape(*x.shape[: x.ndim - num_axes], -1)


class Flatten(Module):
    """Merge the last ``num_axes`` axes into one (Equinox: ``jnp.ravel`` on one example;
    Flax: ``x.reshape(x.shape[0], -1)``).

    Counting from the end makes batched and unbatched input mean the same thing: for a
    1-d CNN's ``[..., length, channels]`` features, ``Flatten(2)`` gives
    ``[..., length * channels]`` with or without leading batch axes (and under ``vmap``).
    For 2-d images ``[..., H, W, C]`` use ``Flatten(3)``. No params.

    Args:
        num_axes: how many trailing axes to merge (default 2; 1 leaves ``x`` unchanged).

    Returns:
        ``[..., prod(last num_axes sizes)]``.

    Example:
        >>> import jax.numpy as jnp
        >>> Flatten(2)(jnp.ones((8, 10, 25))).shape
        (8, 250)
        >>> Flatten(2)(jnp.ones((10, 25))).shape
        (250,)
    """

    num_axes: int = 2

    has_params = False

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("num_axes")

    def _short_repr(self) -> str:
        return f"Flatten(num_axes={self.num_axes})"

    _args_repr = _short_repr

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < self.num_axes:
            raise ValueError(
                f"{self._short_repr()}: expected input of rank >= {self.num_axes}, got shape "
                f"{tuple(shape) if shape is not None else type(x).__name__}"
            )
        return flatten(x, num_axes=self.num_axes)
