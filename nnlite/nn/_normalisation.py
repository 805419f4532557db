"""Normalisation: LayerNorm, RMSNorm, GroupNorm (statistics always in float32).

These normalise each example on its own, so they need no state. BatchNorm, whose running
statistics are state (``init_state``, passed in and returned), lives in ``_batch_norm.py``
and builds on the helpers here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._axes import Axes
from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule

__all__ = [
    "GroupNorm",
    "LayerNorm",
    "RMSNorm",
    "group_norm",
    "group_norm_vjp",
    "layer_norm",
    "layer_norm_vjp",
    "rms_norm",
    "rms_norm_vjp",
]


def _affine(y: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
    if scale is not None:
        y = y * jnp.broadcast_to(scale, y.shape)
    if bias is not None:
        y = y + jnp.broadcast_to(bias, y.shape)
    return y


def _shifted(scale: jax.Array | None, offset: float) -> jax.Array | None:
    return scale if scale is None or not offset else scale + jnp.asarray(offset, scale.dtype)


# --- hand rules ----------------------------------------------------------------------
# With xhat = (x - mean) * r, r = 1 / sqrt(var + eps), and g = dy * scale (the cotangent
# of xhat), the input cotangent is r * (g - mean(g) - xhat * mean(g * xhat)) over the
# normalised axes; RMSNorm drops the centring terms. scale and bias get sum(dy * xhat) and
# sum(dy) over every axis but the channel axis.


def _affine_vjp(y, scale, bias, dret):
    """Cotangents ``(dy_hat, dscale, dbias)`` of ``_affine(y, scale, bias)``."""
    lead = tuple(range(dret.ndim - 1))
    dscale = None if scale is None else jnp.sum(dret * y, axis=lead).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(dret, axis=lead).astype(bias.dtype)
    g = dret if scale is None else dret * jnp.broadcast_to(scale, dret.shape)
    return g, dscale, dbias


def _normalised_vjp(x32, g32, axes, eps, centre):
    """``d x`` of ``xhat = (x - mean) r`` (or ``x r`` without ``centre``) over ``axes``."""
    if centre:
        c = x32 - jnp.mean(x32, axis=axes, keepdims=True)
        r = jax.lax.rsqrt(jnp.mean(c * c, axis=axes, keepdims=True) + eps)
        xhat = c * r
        mg = jnp.mean(g32, axis=axes, keepdims=True)
        return r * (g32 - mg - xhat * jnp.mean(g32 * xhat, axis=axes, keepdims=True))
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    xhat = x32 * r
    return r * (g32 - xhat * jnp.mean(g32 * xhat, axis=axes, keepdims=True))


def layer_norm_vjp(x, scale=None, bias=None, dret=None, *, eps: float = 1e-5):
    """Hand rule of ``layer_norm``: ``(dx, dscale, dbias)``."""
    y = layer_norm.f(x, None, None, eps=eps)
    g, dscale, dbias = _affine_vjp(y, scale, bias, dret)
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    dx = _normalised_vjp(x32, g.astype(x32.dtype), -1, eps, True).astype(x.dtype)
    return dx, dscale, dbias


def rms_norm_vjp(x, scale=None, dret=None, *, eps: float = 1e-6, offset: float = 0.0):
    """Hand rule of ``rms_norm``: ``(dx, dscale)``; the offset shifts the factor ``g = dy *
    (offset + scale)`` and leaves ``dscale = sum(dy * xhat)`` as it is."""
    y = rms_norm.f(x, None, eps=eps)
    g, dscale, _ = _affine_vjp(y, _shifted(scale, offset), None, dret)
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    dx = _normalised_vjp(x32, g.astype(x32.dtype), -1, eps, False).astype(x.dtype)
    return dx, dscale


def group_norm_vjp(
    x, scale=None, bias=None, dret=None, *, num_groups: int, num_spatial_axes: int, eps=1e-5
):
    """Hand rule of ``group_norm``: ``(dx, dscale, dbias)``; the layer-norm rule applied to
    the ``[..., groups, C // groups]`` view, reduced over spatial axes and group channels."""
    y = group_norm.f(
        x, None, None, num_groups=num_groups, num_spatial_axes=num_spatial_axes, eps=eps
    )
    g, dscale, dbias = _affine_vjp(y, scale, bias, dret)
    n, c = num_spatial_axes, x.shape[-1]
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    shape = (*x.shape[:-1], num_groups, c // num_groups)
    grouped, g32 = x32.reshape(shape), g.astype(x32.dtype).reshape(shape)
    axes = (*range(grouped.ndim - n - 2, grouped.ndim - 2), grouped.ndim - 1)
    dx = _normalised_vjp(grouped, g32, axes, eps, True).reshape(x.shape).astype(x.dtype)
    return dx, dscale, dbias


@hand_rule(layer_norm_vjp)
def layer_norm(x, scale=None, bias=None, *, eps: float = 1e-5) -> jax.Array:
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis; mean and variance
    are computed in float32, the result has ``x``'s dtype."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = (centred * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return _affine(y, scale, bias)


@hand_rule(rms_norm_vjp)
def rms_norm(x, scale=None, *, eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * (offset + scale)`` over the last axis (statistics in
    float32); ``offset`` 1 is Gemma's ``(1 + w)`` norm, whose zero weights are the identity."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    ms = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = (x32 * jax.lax.rsqrt(ms + eps)).astype(x.dtype)
    return _affine(y, _shifted(scale, offset), None)


@hand_rule(group_norm_vjp)
def group_norm(x, scale=None, bias=None, *, num_groups: int, num_spatial_axes: int, eps=1e-5):
    """Normalise ``x: [..., *spatial, C]`` over the spatial axes and the ``C // num_groups``
    channels of each group (statistics in float32), then ``* scale + bias`` per channel."""
    n = num_spatial_axes
    c = x.shape[-1]
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    grouped = x32.reshape(*x.shape[:-1], num_groups, c // num_groups)
    # Reduce over the spatial axes and the channels within a group (not over the groups).
    axes = (*range(grouped.ndim - n - 2, grouped.ndim - 2), grouped.ndim - 1)
    mean = jnp.mean(grouped, axis=axes, keepdims=True)
    centred = grouped - mean
    var = jnp.mean(centred * centred, axis=axes, keepdims=True)
    y = (centred * jax.lax.rsqrt(var + eps)).reshape(x.shape).astype(x.dtype)
    return _affine(y, scale, bias)


class _Norm(Module):
    def init(self, key: jax.Array) -> ParamsDict:
        """``scale`` ones and ``bias`` zeros, for the entries ``param_shapes`` lists."""
        fill = {"scale": jnp.ones, "bias": jnp.zeros}
        shapes = self.param_shapes()
        return ParamsDict(**{n: fill[n](shape, self.param_dtype) for n, shape in shapes.items()})

    def param_axes(self) -> ParamsDict:
        """Every ``scale`` and ``bias`` dimension is ``"norm"`` (small: replicated)."""
        return ParamsDict(
            **{n: Axes(("norm",) * len(shape)) for n, shape in self.param_shapes().items()}
        )

    def _cast(self, x, params, names):
        arrays = [params[n] for n in names]
        dtype = self.compute_dtype(x, *arrays)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.dtype(self.param_dtype)
        return x.astype(dtype), [a.astype(dtype) for a in arrays]

    def _check_eps(self):
        if not isinstance(self.eps, int | float) or isinstance(self.eps, bool) or self.eps < 0:
            raise ValueError(f"{type(self).__name__}: eps must be a float >= 0, got {self.eps!r}")


class LayerNorm(_Norm):
    """Layer normalisation over the last axis (Ba et al. 2016; Flax ``nn.LayerNorm``, Equinox
    ``eqx.nn.LayerNorm``): ``(x - mean) / sqrt(var + eps) * scale + bias``.

    Mean and variance are computed in float32 even when ``dtype`` is bfloat16.
    Initialisers (as Flax and Equinox): ``scale`` ones, ``bias`` zeros.

    Args:
        features: size of the last axis.
        eps: added to the variance (1e-5, as Equinox and PyTorch; Flax uses 1e-6).
        use_scale, use_bias: learn ``scale: [features]`` / ``bias: [features]``.
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote).

    ``__call__(params, x)``: ``x: [..., features]`` -> same shape.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> ln = LayerNorm(4)
        >>> p = ln.init(jax.random.key(0))
        >>> p.print()
        /scale: f32[4]
        /bias: f32[4]
        >>> [round(v, 3) for v in ln(p, jnp.array([1.0, 2.0, 3.0, 4.0])).tolist()]
        [-1.342, -0.447, 0.447, 1.342]
    """

    features: int
    eps: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("features")
        self._check_eps()
        self._check_dtypes()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        names = [n for n, on in (("scale", self.use_scale), ("bias", self.use_bias)) if on]
        return {n: (self.features,) for n in names}

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.check_input(x, self.features)
        self.check_params(params)
        x, arrays = self._cast(x, params, self.param_shapes())
        scale = arrays.pop(0) if self.use_scale else None
        bias = arrays.pop(0) if self.use_bias else None
        return layer_norm(x, scale, bias, eps=self.eps)


class RMSNorm(_Norm):
    """Root-mean-square normalisation over the last axis (Zhang & Sennrich 2019; Flax
    ``nn.RMSNorm``, Equinox ``eqx.nn.RMSNorm``): ``x / sqrt(mean(x^2) + eps) * scale``.

    The mean square is computed in float32. Initialiser: ``scale`` ones (as Flax/Equinox).

    Args:
        features: size of the last axis.
        eps: added to the mean square (1e-6, as Flax).
        use_scale: learn ``scale: [features]``.
        scale_offset: multiply by ``scale_offset + scale`` (1.0: Gemma's ``(1 + w)`` norm;
            ``scale`` then starts at zeros, so a fresh norm still multiplies by one).
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote).

    ``__call__(params, x)``: ``x: [..., features]`` -> same shape.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> RMSNorm(2, scale_offset=1.0).init(None).scale.tolist()  # (1 + 0): the identity
        [0.0, 0.0]
        >>> norm = RMSNorm(2)
        >>> p = norm.init(jax.random.key(0))
        >>> p.print()
        /scale: f32[2]
        >>> [round(v, 4) for v in norm(p, jnp.array([3.0, 4.0])).tolist()]
        [0.8485, 1.1314]
    """

    features: int
    eps: float = 1e-6
    use_scale: bool = True
    scale_offset: float = 0.0
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("features")
        self._check_eps()
        self._check_dtypes()
        if not isinstance(self.scale_offset, int | float) or isinstance(self.scale_offset, bool):
            raise ValueError(f"RMSNorm: scale_offset must be a number, got {self.scale_offset!r}")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"scale": (self.features,)} if self.use_scale else {}

    def init(self, key: jax.Array) -> ParamsDict:
        """``scale`` at ``1 - scale_offset``: the factor ``scale_offset + scale`` starts at 1."""
        p = super().init(key)
        if self.use_scale and self.scale_offset:
            p.scale = jnp.full(self.features, 1.0 - self.scale_offset, self.param_dtype)
        return p

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.check_input(x, self.features)
        self.check_params(params)
        x, arrays = self._cast(x, params, self.param_shapes())
        return rms_norm(x, *arrays, eps=self.eps, offset=float(self.scale_offset))


class GroupNorm(_Norm):
    """Group normalisation (Wu & He 2018; Flax ``nn.GroupNorm``, Equinox ``eqx.nn.GroupNorm``),
    channels-last: each example's channels are split into ``num_groups`` groups, each group
    normalised over the spatial axes and its channels, then ``* scale + bias`` per channel.
    No batch statistics, so it behaves the same in training and inference (a BatchNorm
    substitute). ``num_groups=1`` normalises over everything but the batch axes; ``num_groups
    = features`` is instance normalisation.

    Statistics in float32. Initialisers (as Flax/Equinox): ``scale`` ones, ``bias`` zeros.

    Args:
        num_groups: number of channel groups; must divide ``features``.
        features: channels (the last axis).
        eps: added to the variance (1e-5, as Equinox, Flax and PyTorch).
        use_scale, use_bias: learn ``scale: [features]`` / ``bias: [features]``.
        num_spatial_axes: how many axes before the channels are spatial (default 1, as for
            a 1-d CNN's ``[..., length, channels]``; 2 for images). Axes before those are
            batch axes, so unbatched input has rank ``num_spatial_axes + 1``.
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote).

    ``__call__(params, x)``: ``x: [..., *spatial, features]`` -> same shape.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> gn = GroupNorm(2, 4)
        >>> p = jax.jit(gn.init)(jax.random.key(0))
        >>> p.print()
        /scale: f32[4]
        /bias: f32[4]
        >>> jax.jit(gn)(p, jnp.ones((8, 10, 4))).shape  # batch 8, length 10, 4 channels
        (8, 10, 4)
    """

    num_groups: int
    features: int
    eps: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True
    num_spatial_axes: int = 1
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("num_groups", "features")
        self._check_positive_ints("num_spatial_axes", allow_zero=True)
        if self.features % self.num_groups:
            raise ValueError(
                f"GroupNorm: num_groups={self.num_groups} must divide features={self.features}"
            )
        self._check_eps()
        self._check_dtypes()

    param_shapes = LayerNorm.param_shapes
    init = LayerNorm.init

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.check_input(x, self.features, min_rank=self.num_spatial_axes + 1)
        self.check_params(params)
        x, arrays = self._cast(x, params, self.param_shapes())
        scale = arrays.pop(0) if self.use_scale else None
        bias = arrays.pop(0) if self.use_bias else None
        return group_norm(
            x,
            scale,
            bias,
            num_groups=self.num_groups,
            num_spatial_axes=self.num_spatial_axes,
            eps=self.eps,
        )
