"""Convolution: N-dimensional, channels-last, on ``lax.conv_general_dilated``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._axes import Axes
from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ._names import get_initializer

__all__ = [
    "Conv",
    "conv",
    "conv_input_grad",
    "conv_kernel_grad",
    "conv_vjp",
    "check_int_rank",
    "normalize_padding",
    "to_tuple",
]

PADDING_HELP = (
    "'SAME', 'VALID', an int (the same padding on both sides of every spatial axis), or one "
    "(low, high) pair of ints per spatial axis"
)


def to_tuple(owner: str, name: str, value: Any, n: int) -> tuple[int, ...]:
    """``value`` as an ``n``-tuple of positive ints: an int is repeated, a sequence must
    have length ``n``."""
    given = value
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,) * n
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != n:
        raise ValueError(
            f"{owner}: {name} must be a positive int or {n} positive ints (one per spatial "
            f"axis), got {given!r}"
        )
    out = tuple(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in out):
        raise ValueError(f"{owner}: {name} must hold positive ints, got {given!r}")
    return out


def check_int_rank(layer: Any, name: str, x: Any) -> None:
    """An int ``name`` (window, kernel_size, output_size) means one spatial axis. Input of
    rank 4 or more is then most likely images (``[B, H, W, C]``), which would be pooled or
    convolved over W alone: refused, naming the tuple to give. (``int_size`` is set by the
    layer's ``__post_init__`` when it was given an int: an attribute, not a field.)"""
    ndim = getattr(x, "ndim", 0)
    if not getattr(layer, "int_size", False) or ndim <= 3:
        return
    size = getattr(layer, name)[0]
    raise ValueError(
        f"{layer._short_repr()}: an int {name} ({size}) means one spatial axis, but the "
        f"input has shape {tuple(x.shape)}, rank {ndim}; give one size per spatial axis: "
        f"{name}={(size,) * (ndim - 2)} for {ndim - 2}-d inputs [batch, *spatial, channels] "
        f"(or {name}={(size,)} for 1-d inputs with several batch axes)"
    )


def normalize_padding(owner: str, padding: Any, n: int) -> str | tuple[tuple[int, int], ...]:
    """``"SAME"``/``"VALID"`` as is, an int or ``n`` ``(low, high)`` pairs as pairs."""
    if isinstance(padding, str):
        if padding.upper() in ("SAME", "VALID"):
            return padding.upper()
    elif isinstance(padding, int) and not isinstance(padding, bool):
        if padding >= 0:
            return ((padding, padding),) * n
    elif isinstance(padding, Sequence) and len(padding) == n:
        pairs = tuple(tuple(p) if isinstance(p, Sequence) else p for p in padding)
        if all(
            isinstance(p, tuple)
            and len(p) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in p)
            for p in pairs
        ):
            return pairs
    raise ValueError(f"{owner}: padding must be {PADDING_HELP} ({n} spatial axes), got {padding!r}")


def explicit_padding(
    padding: str | tuple[tuple[int, int], ...],
    in_shape: Sequence[int],
    window: Sequence[int],
    strides: Sequence[int],
    dilation: Sequence[int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Padding as ``(low, high)`` pairs per spatial axis (``"SAME"``/``"VALID"`` resolved
    for these sizes; a dilated window spans ``(k - 1) * d + 1`` inputs)."""
    if not isinstance(padding, str):
        return padding
    if dilation is not None:
        window = [(k - 1) * d + 1 for k, d in zip(window, dilation, strict=True)]
    return tuple(lax.padtype_to_pads(in_shape, window, strides, padding))


def _conv_dims(n: int) -> lax.ConvDimensionNumbers:
    spatial = tuple(range(1, n + 1))
    return lax.ConvDimensionNumbers(
        lhs_spec=(0, n + 1, *spatial),  # N, C, spatial...
        rhs_spec=(n + 1, n, *range(n)),  # O, I, spatial...
        out_spec=(0, n + 1, *spatial),
    )


def conv_input_grad(dret, W, in_spatial, *, strides, pads, dilation, groups=1):
    """``dx`` of ``conv``, the transposed convolution of ``dret: [B, *out, C_out]`` with
    ``W: [*k, C_in // groups, C_out]`` back to ``[B, *in_spatial, C_in]``, for explicit
    ``pads``.

    Per spatial axis (input length ``L``, kernel span ``K' = (K - 1) d + 1``, stride ``s``,
    padding ``(lo, hi)``, output length ``M``): ``dy`` dilated by ``s`` (``lhs_dilation``),
    padded by ``K' - 1 - lo`` below and whatever gives length ``L`` above, cross-correlated
    with the kernel flipped in space and transposed in/out per group (``rhs_dilation =
    d``). ``ConvTranspose`` is this map as a layer.
    """
    n = W.ndim - 2
    ks = W.shape[:n]
    span = [(k - 1) * d + 1 for k, d in zip(ks, dilation, strict=True)]
    c_in_g, c_out = W.shape[-2], W.shape[-1]
    Wt = W.reshape(*ks, c_in_g, groups, c_out // groups)
    Wt = jnp.transpose(Wt, (*range(n), n + 2, n + 1, n)).reshape(*ks, c_out // groups, -1)
    Wt = jnp.flip(Wt, axis=tuple(range(n)))
    dx_pads = []
    out_len = dret.shape[1:-1]
    for L, M, K, s, (lo, _) in zip(in_spatial, out_len, span, strides, pads, strict=True):
        plo = K - 1 - lo
        dx_pads.append((plo, L + K - 2 - (M - 1) * s - plo))
    return lax.conv_general_dilated(
        dret,
        Wt.astype(dret.dtype),
        window_strides=(1,) * n,
        padding=dx_pads,
        lhs_dilation=tuple(strides),
        rhs_dilation=tuple(dilation),
        dimension_numbers=_conv_dims(n),
        feature_group_count=groups,
    )


def conv_kernel_grad(x, dret, kernel_size, *, strides, pads, dilation, groups=1):
    """``dW`` of ``conv``: ``x: [B, *in, C_in]`` cross-correlated with ``dret: [B, *out,
    C_out]`` as the kernel, giving ``[*kernel_size, C_in // groups, C_out]``, for explicit
    ``pads``: the batch axis is the contracted feature axis, ``dy`` dilated by ``s``
    (``rhs_dilation``), window stride ``d``; groups become ``batch_group_count``."""
    n = len(kernel_size)
    span = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation, strict=True)]
    in_len, out_len = x.shape[1:-1], dret.shape[1:-1]
    dw_pads = []
    for L, M, K, s, (lo, _) in zip(in_len, out_len, span, strides, pads, strict=True):
        dw_pads.append((lo, K + (M - 1) * s - L - lo))
    spatial = tuple(range(1, n + 1))
    return lax.conv_general_dilated(
        x,
        dret.astype(x.dtype),
        window_strides=tuple(dilation),
        padding=dw_pads,
        rhs_dilation=tuple(strides),
        dimension_numbers=lax.ConvDimensionNumbers(
            lhs_spec=(n + 1, 0, *spatial),  # the channel axis is the "batch"
            rhs_spec=(n + 1, 0, *spatial),  # dy: out channels, contracted batch, spatial
            out_spec=(n, n + 1, *range(n)),  # [*k, C_in // groups, C_out]
        ),
        batch_group_count=groups,
    )


def conv_vjp(x, W, b=None, dret=None, *, strides, padding, dilation, groups=1):
    """Hand rule of ``conv``: ``(dx, dW, db)``, each cotangent a convolution itself:
    ``dx`` the transposed convolution (``conv_input_grad``), ``dW`` the correlation of
    ``x`` with ``dy`` (``conv_kernel_grad``), ``db`` ``dy`` summed over batch and space."""
    n = W.ndim - 2
    ks = W.shape[:n]
    pads = explicit_padding(padding, x.shape[1:-1], ks, strides, dilation)
    geometry = dict(strides=strides, pads=pads, dilation=dilation, groups=groups)
    dx = conv_input_grad(dret, W, x.shape[1:-1], **geometry).astype(x.dtype)
    dW = conv_kernel_grad(x, dret, ks, **geometry).astype(W.dtype)
    db = None if b is None else jnp.sum(dret, axis=tuple(range(n + 1))).astype(b.dtype)
    return dx, dW, db


@hand_rule(conv_vjp)
def conv(
    x: jax.Array,
    W: jax.Array,
    b: jax.Array | None = None,
    *,
    strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    dilation: Sequence[int],
    groups: int = 1,
) -> jax.Array:
    """Cross-correlation of ``x: [B, *spatial, C_in]`` with ``W: [*k, C_in // groups, C_out]``
    plus ``b: [C_out]``, giving ``[B, *spatial_out, C_out]``. One batch axis exactly."""
    n = W.ndim - 2
    spatial = tuple(range(1, n + 1))
    dims = lax.ConvDimensionNumbers(
        lhs_spec=(0, n + 1, *spatial),  # N, C, spatial...
        rhs_spec=(n + 1, n, *range(n)),  # O, I, spatial...
        out_spec=(0, n + 1, *spatial),
    )
    pads = explicit_padding(padding, x.shape[1:-1], W.shape[:n], strides, dilation)
    y = lax.conv_general_dilated(
        x,
        W,
        window_strides=tuple(strides),
        padding=pads,
        rhs_dilation=tuple(dilation),
        dimension_numbers=dims,
        feature_group_count=groups,
    )
    if b is None:
        return y
    return y + jnp.broadcast_to(b, y.shape)


class Conv(Module):
    """N-dimensional convolution (cross-correlation), channels-last, as Flax ``nn.Conv``
    (Equinox: ``eqx.nn.Conv``, channels-first and unbatched).

    The number of spatial axes N is ``len(kernel_size)``; an int ``kernel_size`` means 1-d
    (and input of rank 4 or more, images, is then refused: give ``(3, 3)``).
    Input ``[..., *spatial, in_features]``: rank N + 1 is one unbatched example, any further
    leading axes are batch axes (``jax.vmap`` works too).

    Initialisers (as Flax): ``W`` LeCun normal with fan-in ``prod(kernel_size) *
    in_features // groups`` (the receptive field counts), ``b`` zeros. (Equinox draws
    both from ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``; ``w_init="lecun_uniform"`` is close.)

    Args:
        in_features: input channels (the input's last axis).
        out_features: output channels.
        kernel_size: int (1-d) or a tuple of N ints.
        strides: int or N ints.
        padding: ``"SAME"`` (output size ``ceil(size / stride)``), ``"VALID"`` (no padding),
            an int (both sides of every spatial axis) or N ``(low, high)`` pairs.
        dilation: int or N ints (kernel dilation, "atrous").
        groups: feature groups; must divide ``in_features`` and ``out_features``
            (``groups == in_features`` is a depthwise convolution).
        use_bias: whether to add ``b: [out_features]``.
        w_init, b_init: initializer names (see ``nnlite.INITIALIZERS``).
        param_dtype: dtype of ``W`` and ``b``.
        dtype: compute dtype (``None``: what input and params promote to).

    Params: ``W: [*kernel_size, in_features // groups, out_features]``, ``b: [out_features]``.

    Returns:
        ``[..., *spatial_out, out_features]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> conv = Conv(3, 8, kernel_size=(3, 3), strides=2)
        >>> p = jax.jit(conv.init)(jax.random.key(0))
        >>> p.print()
        /W: f32[3,3,3,8]
        /b: f32[8]
        >>> jax.jit(conv)(p, jnp.ones((4, 32, 32, 3))).shape  # batched, SAME padding, stride 2
        (4, 16, 16, 8)
        >>> conv1d = Conv(1, 25, 5, padding="VALID")
        >>> p1 = jax.jit(conv1d.init)(jax.random.key(1))
        >>> jax.jit(conv1d)(p1, jnp.ones((40, 1))).shape  # unbatched 1-d
        (36, 25)
    """

    in_features: int
    out_features: int
    kernel_size: int | tuple[int, ...]
    strides: int | tuple[int, ...] = 1
    padding: Any = "SAME"
    dilation: int | tuple[int, ...] = 1
    groups: int = 1
    use_bias: bool = True
    w_init: str = "lecun_normal"
    b_init: str = "zeros"
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        owner = "Conv"
        self._check_positive_ints("in_features", "out_features", "groups")
        k = self.kernel_size
        if isinstance(k, int) and not isinstance(k, bool):
            n = 1
            object.__setattr__(self, "int_size", True)
        elif isinstance(k, tuple) and k:
            n = len(k)
        else:
            raise ValueError(f"{owner}: kernel_size must be a positive int or a tuple, got {k!r}")
        object.__setattr__(self, "kernel_size", to_tuple(owner, "kernel_size", k, n))
        object.__setattr__(self, "strides", to_tuple(owner, "strides", self.strides, n))
        object.__setattr__(self, "dilation", to_tuple(owner, "dilation", self.dilation, n))
        object.__setattr__(self, "padding", normalize_padding(owner, self.padding, n))
        for name in ("in_features", "out_features"):
            if getattr(self, name) % self.groups:
                raise ValueError(
                    f"{owner}: groups={self.groups} must divide {name}={getattr(self, name)}"
                )
        self._check_dtypes()
        get_initializer(self.w_init)
        get_initializer(self.b_init)

    @property
    def num_spatial_axes(self) -> int:
        return len(self.kernel_size)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"W": (*self.kernel_size, self.in_features // self.groups, self.out_features)}
        if self.use_bias:
            shapes["b"] = (self.out_features,)
        return shapes

    def param_axes(self) -> ParamsDict:
        """``W: ("kernel", ..., "in", "out")``, ``b: ("out",)``."""
        p = ParamsDict(W=Axes(("kernel",) * self.num_spatial_axes + ("in", "out")))
        if self.use_bias:
            p.b = Axes(("out",))
        return p

    def init(self, key: jax.Array) -> ParamsDict:
        shapes = self.param_shapes()
        # The initializers read fan-in from axis -2 and fan-out from -1 and multiply both by
        # the receptive field (the product of the other axes): right for [*k, in, out].
        p = ParamsDict(W=get_initializer(self.w_init)(key, shapes["W"], self.param_dtype))
        if self.use_bias:
            b_key = jax.random.fold_in(key, 1)
            p.b = get_initializer(self.b_init)(b_key, shapes["b"], self.param_dtype)
        return p

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        n = self.num_spatial_axes
        self.check_input(x, self.in_features, min_rank=n + 1)
        check_int_rank(self, "kernel_size", x)
        self.check_params(params)
        spatial = x.shape[-n - 1 : -1]
        window = [(k - 1) * d + 1 for k, d in zip(self.kernel_size, self.dilation, strict=True)]
        pads = explicit_padding(
            self.padding, spatial, self.kernel_size, self.strides, self.dilation
        )
        too_small = [i for i in range(n) if spatial[i] + pads[i][0] + pads[i][1] < window[i]]
        if too_small:
            raise ValueError(
                f"{self._short_repr()}: input of shape {tuple(x.shape)} has spatial size "
                f"{tuple(spatial)}, smaller (with padding {pads}) than the kernel's span "
                f"{tuple(window)}"
            )
        arrays = [params["W"], params["b"]] if self.use_bias else [params["W"]]
        dtype = self.compute_dtype(x, *arrays)
        batch = x.shape[: -n - 1]
        flat = x.reshape(-1, *x.shape[-n - 1 :]).astype(dtype)
        y = conv(
            flat,
            *(a.astype(dtype) for a in arrays),
            strides=self.strides,
            padding=pads,
            dilation=self.dilation,
            groups=self.groups,
        )
        return y.reshape(*batch, *y.shape[1:])
