"""Adaptive pooling: average or maximum over bins that tile the input to a fixed output size.

PyTorch's bin rule, per spatial axis of input size ``L`` and output size ``O``: output ``i``
pools inputs ``floor(i L / O) <= j < ceil((i + 1) L / O)``, so the bins cover the input,
overlap by at most one position when ``O`` does not divide ``L``, and every bin is
non-empty (``O > L`` repeats inputs). An N-d bin is the product of the per-axis bins.

Both pools gather each bin into a padded window axis (``[..., O, K, ...]``, ``K`` the
longest bin, short bins padded by repeating their last index), reduce over it, and send
cotangents back with the scatter-add that transposes the gather. The maximum is taken as
``take_along_axis(window, argmax(window))``: the first maximum in each bin (row-major) gets
the cotangent, in the hand rule and under JAX's autodiff alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._module import Module
from ..grad._manual import hand_rule
from ._conv import check_int_rank, to_tuple

__all__ = [
    "AdaptiveAvgPool",
    "AdaptiveMaxPool",
    "adaptive_avg_pool",
    "adaptive_avg_pool_vjp",
    "adaptive_bins",
    "adaptive_max_pool",
    "adaptive_max_pool_vjp",
]


def adaptive_bins(size: int, out: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the ``out`` bins of an axis of ``size`` inputs (PyTorch's).

    Example:
        >>> adaptive_bins(5, 3)
        [(0, 2), (1, 4), (3, 5)]
    """
    return [((i * size) // out, -(-((i + 1) * size) // out)) for i in range(out)]


def _windows(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """``(index [out, K], valid [out, K])``: each bin's inputs, padded to the longest bin
    ``K`` by repeating its last index (``valid`` is False on the repeats)."""
    bins = adaptive_bins(size, out)
    k = max(e - s for s, e in bins)
    offsets = np.arange(k)
    starts = np.array([s for s, _ in bins])[:, None]
    ends = np.array([e for _, e in bins])[:, None]
    return np.minimum(starts + offsets, ends - 1), starts + offsets < ends


def _at(ndim: int, axis: int, index: Any) -> tuple:
    """An index selecting ``index`` on ``axis`` of an array of rank ``ndim``."""
    return (slice(None),) * axis + (index,) + (slice(None),) * (ndim - axis - 1)


def _first_spatial(x: jax.Array, n: int) -> int:
    return x.ndim - n - 1


def _gather(x, output_size):
    """``x [..., L_1, ..., L_n, C] -> [..., O_1, K_1, ..., O_n, K_n, C]``, each bin's inputs
    on its window axis ``K_i``. The last axis is done first, so earlier axes keep their
    positions."""
    n = len(output_size)
    base = _first_spatial(x, n)
    sizes = x.shape[base:-1]
    for i in reversed(range(n)):
        index, _ = _windows(sizes[i], output_size[i])
        x = x[_at(x.ndim, base + i, jnp.asarray(index))]
    return x


def _scatter(g, in_shape, output_size):
    """The transpose of ``_gather``: window cotangents added back onto their inputs."""
    n = len(output_size)
    base = len(in_shape) - n - 1
    for i in reversed(range(n)):  # pair i sits at base + 2i, base + 2i + 1
        axis = base + 2 * i
        index, _ = _windows(in_shape[base + i], output_size[i])
        shape = g.shape[:axis] + (in_shape[base + i],) + g.shape[axis + 2 :]
        g = jnp.zeros(shape, g.dtype).at[_at(len(shape), axis, jnp.asarray(index))].add(g)
    return g


def _window_weights(x_shape, output_size, dtype):
    """``1 / count`` on each real entry of every bin's window, 0 on the padding: one
    ``[O_i, K_i]`` factor per axis, laid out to broadcast against the gathered windows."""
    n = len(output_size)
    base = len(x_shape) - n - 1
    w = np.ones((), np.float64)
    for i in range(n):
        _, valid = _windows(x_shape[base + i], output_size[i])
        per = valid / valid.sum(axis=1, keepdims=True)
        w = np.multiply.outer(w, per)  # [O_1, K_1, ..., O_i, K_i]
    full = (1,) * base + w.shape + (1,)
    return jnp.asarray(w.reshape(full), dtype)


def _window_axes(ndim_gathered: int, n: int) -> tuple[int, ...]:
    base = ndim_gathered - 2 * n - 1
    return tuple(base + 2 * i + 1 for i in range(n))


def adaptive_avg_pool_vjp(x, dret, *, output_size):
    """Hand rule of ``adaptive_avg_pool``: each output's cotangent spread evenly over its
    bin (``dret / count`` to every input of the bin; overlapping bins add up)."""
    n = len(output_size)
    w = _window_weights(x.shape, output_size, dret.dtype)
    base = dret.ndim - n - 1
    full = dret.shape[:base] + w.shape[base:-1] + dret.shape[-1:]
    g = jnp.expand_dims(dret, _window_axes(len(full), n))  # [..., O_1, 1, ..., O_n, 1, C]
    g = jnp.broadcast_to(g, full) * jnp.broadcast_to(w, full)
    return _scatter(g, x.shape, output_size).astype(x.dtype)


@hand_rule(adaptive_avg_pool_vjp)
def adaptive_avg_pool(x: jax.Array, *, output_size: Sequence[int]) -> jax.Array:
    """Mean of ``x: [..., *spatial, C]`` over each of the ``output_size`` bins of its last
    ``len(output_size)`` spatial axes: ``[..., *output_size, C]``."""
    n = len(output_size)
    windows = _gather(x, output_size)
    w = jnp.broadcast_to(_window_weights(x.shape, output_size, x.dtype), windows.shape)
    return jnp.sum(windows * w, axis=_window_axes(windows.ndim, n))


def _flat_windows(windows: jax.Array, n: int) -> jax.Array:
    """``[..., O_1, K_1, ..., O_n, K_n, C] -> [..., O_1, ..., O_n, C, K_1 ... K_n]``."""
    k_axes = _window_axes(windows.ndim, n)
    rest = [a for a in range(windows.ndim) if a not in k_axes]
    moved = jnp.transpose(windows, (*rest, *k_axes))
    return moved.reshape(*moved.shape[: windows.ndim - n], -1)


def adaptive_max_pool_vjp(x, dret, *, output_size):
    """Hand rule of ``adaptive_max_pool``: each output's cotangent to the (first) maximum of
    its bin; an input that is the maximum of overlapping bins gets their sum."""
    n = len(output_size)
    windows = _gather(x, output_size)
    flat = _flat_windows(windows, n)
    hit = jax.nn.one_hot(jnp.argmax(flat, axis=-1), flat.shape[-1], dtype=dret.dtype)
    k_axes = _window_axes(windows.ndim, n)
    g = (hit * dret[..., None]).reshape(*flat.shape[:-1], *(windows.shape[a] for a in k_axes))
    # Back to [..., O_1, K_1, ..., O_n, K_n, C]: undo _flat_windows's transpose.
    rest = [a for a in range(windows.ndim) if a not in k_axes]
    g = jnp.transpose(g, np.argsort((*rest, *k_axes)))
    return _scatter(g, x.shape, output_size).astype(x.dtype)


@hand_rule(adaptive_max_pool_vjp)
def adaptive_max_pool(x: jax.Array, *, output_size: Sequence[int]) -> jax.Array:
    """Maximum of ``x: [..., *spatial, C]`` over each of the ``output_size`` bins of its
    last ``len(output_size)`` spatial axes: ``[..., *output_size, C]``."""
    flat = _flat_windows(_gather(x, output_size), len(output_size))
    first = jnp.argmax(flat, axis=-1)[..., None]  # padding repeats come after their original
    return jnp.take_along_axis(flat, first, axis=-1)[..., 0]


class _AdaptivePool(Module):
    output_size: int | tuple[int, ...]

    has_params = False

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        o = self.output_size
        if isinstance(o, int) and not isinstance(o, bool):
            o = (o,)
            object.__setattr__(self, "int_size", True)
        if not isinstance(o, tuple) or not o:
            raise ValueError(f"{name}: output_size must be a positive int or a tuple, got {o!r}")
        object.__setattr__(self, "output_size", to_tuple(name, "output_size", o, len(o)))

    def _short_repr(self) -> str:
        return f"{type(self).__name__}(output_size={self.output_size})"

    _args_repr = _short_repr

    def _check(self, x: Any) -> None:
        n = len(self.output_size)
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < n + 1 or 0 in shape[-n - 1 : -1]:
            raise ValueError(
                f"{self._short_repr()}: expected input [..., *spatial ({n} non-empty axes), "
                f"channels] of rank >= {n + 1}, got shape "
                f"{tuple(shape) if shape is not None else type(x).__name__}"
            )
        self.check_numeric(x)
        check_int_rank(self, "output_size", x)


_ADAPTIVE_ARGS = """
    N-dimensional: N = ``len(output_size)`` (an int means 1-d, and input of rank 4 or more
    is then refused: give a tuple). Input
    ``[..., *spatial, channels]``: rank N + 1 is one unbatched example, further leading
    axes are batch axes. Any spatial size works, smaller than the output too. Output
    ``i`` of an axis of size ``L`` pools inputs ``floor(i L / O) <= j < ceil((i + 1) L /
    O)`` (PyTorch's bins). No params.

    Args:
        output_size: int or N ints, the spatial size of the output.

    Returns:
        ``[..., *output_size, channels]``."""


class AdaptiveAvgPool(_AdaptivePool):
    __doc__ = (
        """Adaptive average pooling over the spatial axes, channels-last (PyTorch's
    ``AdaptiveAvgPool1d/2d/3d``; Equinox ``eqx.nn.AdaptiveAvgPool1d/2d/3d``, Flax: none).
    ``AdaptiveAvgPool((1, 1))`` is global average pooling.
"""
        + _ADAPTIVE_ARGS
        + """

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pool = AdaptiveAvgPool(3)
        >>> x = jnp.arange(5.0)[:, None]  # 5 positions, 1 channel; bins [0,2) [1,4) [3,5)
        >>> jax.jit(pool)(x)[:, 0].tolist()
        [0.5, 2.0, 3.5]
        >>> jax.jit(AdaptiveAvgPool((1, 1)))(jnp.ones((8, 7, 9, 16))).shape
        (8, 1, 1, 16)
    """
    )

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        self._check(x)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            x = x.astype(jnp.result_type(float))
        return adaptive_avg_pool(x, output_size=self.output_size)


class AdaptiveMaxPool(_AdaptivePool):
    __doc__ = (
        """Adaptive max pooling over the spatial axes, channels-last (PyTorch's
    ``AdaptiveMaxPool1d/2d/3d``; Equinox ``eqx.nn.AdaptiveMaxPool1d/2d/3d``, Flax: none).
"""
        + _ADAPTIVE_ARGS
        + """

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pool = AdaptiveMaxPool(2)
        >>> x = jnp.array([1.0, 5.0, 2.0, 0.0, 3.0])[:, None]  # bins [0,3) [2,5)
        >>> jax.jit(pool)(x)[:, 0].tolist()
        [5.0, 3.0]
    """
    )

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None):
        self._check(x)
        return adaptive_max_pool(x, output_size=self.output_size)
