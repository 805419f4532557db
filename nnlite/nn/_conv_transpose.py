"""Transposed convolution: N-dimensional, channels-last, the adjoint of ``conv``.

``ConvTranspose(in, out, k, strides, padding)`` maps ``[..., *M, in]`` to ``[..., *L, out]``
as the input-gradient of ``Conv(out, in, k, strides, padding)`` from ``L`` to ``M`` would
(PyTorch's ``ConvTranspose``, "fractionally strided" convolution): per spatial axis
``L = M * s`` for ``"SAME"``, ``(M - 1) * s + K'`` for ``"VALID"`` (the full output,
``K' = (K - 1) d + 1`` the kernel's span) and ``(M - 1) * s + K' - lo - hi`` for explicit
padding, which crops ``lo``/``hi`` outputs off the full one (PyTorch's ``padding``).
Its hand rule reuses ``conv``'s: the input cotangent is a strided convolution of the
output cotangent with the kernel, the kernel cotangent a correlation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ._conv import (
    check_int_rank,
    conv,
    conv_input_grad,
    conv_kernel_grad,
    normalize_padding,
    to_tuple,
)
from ._names import get_initializer

__all__ = ["ConvTranspose", "conv_transpose", "conv_transpose_vjp", "transpose_geometry"]


def transpose_geometry(
    in_spatial: Sequence[int],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    dilation: Sequence[int],
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """``(out_spatial, pads)``: the output size of a transposed convolution of input size
    ``in_spatial``, and the explicit padding of the convolution it is the adjoint of."""
    span = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation, strict=True)]
    if padding == "SAME":
        out = tuple(m * s for m, s in zip(in_spatial, strides, strict=True))
        pads = tuple(lax.padtype_to_pads(out, span, strides, "SAME"))
    elif padding == "VALID":
        out = tuple((m - 1) * s + k for m, s, k in zip(in_spatial, strides, span, strict=True))
        pads = ((0, 0),) * len(out)
    else:
        pads = tuple(tuple(p) for p in padding)
        out = tuple(
            (m - 1) * s + k - lo - hi
            for m, s, k, (lo, hi) in zip(in_spatial, strides, span, pads, strict=True)
        )
    return out, tuple((int(lo), int(hi)) for lo, hi in pads)


def _adjoint_kernel(W: jax.Array) -> jax.Array:
    """``[*k, in, out] -> [*k, out, in]``: the kernel of the convolution being transposed."""
    return jnp.swapaxes(W, -1, -2)


def conv_transpose_vjp(x, W, b=None, dret=None, *, strides, padding, dilation):
    """Hand rule of ``conv_transpose``: ``(dx, dW, db)``.

    With ``y = conv(., W')^T x`` (``W'`` the adjoint kernel): ``dx = conv(dy, W')``, the
    strided convolution of the cotangent; ``dW' = conv_kernel_grad(dy, x)``, the correlation
    of ``dy`` with ``x`` (the kernel cotangent of that convolution), transposed back to
    ``[*k, in, out]``; ``db`` ``dy`` summed over batch and space.
    """
    n = W.ndim - 2
    _, pads = transpose_geometry(x.shape[1:-1], W.shape[:n], strides, padding, dilation)
    Wa = _adjoint_kernel(W).astype(dret.dtype)
    dx = conv.f(dret, Wa, strides=strides, padding=pads, dilation=dilation).astype(x.dtype)
    dWa = conv_kernel_grad(dret, x, W.shape[:n], strides=strides, pads=pads, dilation=dilation)
    dW = _adjoint_kernel(dWa).astype(W.dtype)
    db = None if b is None else jnp.sum(dret, axis=tuple(range(n + 1))).astype(b.dtype)
    return dx, dW, db


@hand_rule(conv_transpose_vjp)
def conv_transpose(
    x: jax.Array,
    W: jax.Array,
    b: jax.Array | None = None,
    *,
    strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    dilation: Sequence[int],
) -> jax.Array:
    """Transposed convolution of ``x: [B, *M, C_in]`` with ``W: [*k, C_in, C_out]`` plus
    ``b: [C_out]``, giving ``[B, *L, C_out]`` (sizes: see the module docstring). One batch
    axis exactly."""
    n = W.ndim - 2
    out, pads = transpose_geometry(x.shape[1:-1], W.shape[:n], strides, padding, dilation)
    y = conv_input_grad(x, _adjoint_kernel(W), out, strides=strides, pads=pads, dilation=dilation)
    if b is None:
        return y
    return y + jnp.broadcast_to(b, y.shape)


class ConvTranspose(Module):
    """N-dimensional transposed convolution, channels-last (Flax ``nn.ConvTranspose``,
    Equinox ``eqx.nn.ConvTranspose``, channels-first and unbatched; sizes and padding as
    PyTorch's ``nn.ConvTranspose``).

    The adjoint of ``Conv(out_features, in_features, kernel_size, strides, padding,
    dilation)``: with ``"SAME"`` a stride-2 layer doubles every spatial size (the
    decoder half of a U-Net or an autoencoder). Per spatial axis, input size ``M``,
    kernel span ``K' = (kernel_size - 1) * dilation + 1``, the output size is ``M *
    strides`` (``"SAME"``), ``(M - 1) * strides + K'`` (``"VALID"``, the full output) or
    ``(M - 1) * strides + K' - lo - hi`` (explicit ``(lo, hi)`` padding crops the full
    output; an int ``p`` is PyTorch's ``padding=p``).

    Initialisers (as Flax): ``W`` LeCun normal with fan-in ``prod(kernel_size) *
    in_features``, ``b`` zeros.

    Args:
        in_features: input channels (the input's last axis).
        out_features: output channels.
        kernel_size: int (1-d) or a tuple of N ints.
        strides: int or N ints (the upsampling factor).
        padding: ``"SAME"`` (default), ``"VALID"``, an int, or N ``(low, high)`` pairs.
        dilation: int or N ints (kernel dilation).
        use_bias: whether to add ``b: [out_features]``.
        w_init, b_init: initializer names (see ``nnlite.INITIALIZERS``).
        param_dtype, dtype: parameter and compute dtypes, as in ``Conv``.

    Params: ``W: [*kernel_size, in_features, out_features]`` (PyTorch's ``weight [in, out,
    *k]`` moved to channels-last), ``b: [out_features]``.

    Returns:
        ``[..., *spatial_out, out_features]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> up = ConvTranspose(8, 3, kernel_size=(4, 4), strides=2)
        >>> p = jax.jit(up.init)(jax.random.key(0))
        >>> p.print()
        /W: f32[4,4,8,3]
        /b: f32[3]
        >>> jax.jit(up)(p, jnp.ones((2, 16, 16, 8))).shape  # SAME, stride 2: twice the size
        (2, 32, 32, 3)
        >>> up1d = ConvTranspose(1, 1, 3, strides=2, padding=1)
        >>> jax.jit(up1d)(jax.jit(up1d.init)(jax.random.key(1)), jnp.ones((5, 1))).shape
        (9, 1)
    """

    in_features: int
    out_features: int
    kernel_size: int | tuple[int, ...]
    strides: int | tuple[int, ...] = 1
    padding: Any = "SAME"
    dilation: int | tuple[int, ...] = 1
    use_bias: bool = True
    w_init: str = "lecun_normal"
    b_init: str = "zeros"
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        owner = "ConvTranspose"
        self._check_positive_ints("in_features", "out_features")
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
        self._check_dtypes()
        get_initializer(self.w_init)
        get_initializer(self.b_init)

    @property
    def num_spatial_axes(self) -> int:
        return len(self.kernel_size)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"W": (*self.kernel_size, self.in_features, self.out_features)}
        if self.use_bias:
            shapes["b"] = (self.out_features,)
        return shapes

    def init(self, key: jax.Array) -> ParamsDict:
        shapes = self.param_shapes()
        p = ParamsDict(W=get_initializer(self.w_init)(key, shapes["W"], self.param_dtype))
        if self.use_bias:
            b_key = jax.random.fold_in(key, 1)
            p.b = get_initializer(self.b_init)(b_key, shapes["b"], self.param_dtype)
        return p

    def output_shape(self, spatial: Sequence[int]) -> tuple[int, ...]:
        """The spatial output size for input spatial size ``spatial``."""
        geometry = (self.kernel_size, self.strides, self.padding, self.dilation)
        return transpose_geometry(tuple(spatial), *geometry)[0]

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        n = self.num_spatial_axes
        self.check_input(x, self.in_features, min_rank=n + 1)
        check_int_rank(self, "kernel_size", x)
        self.check_params(params)
        spatial = x.shape[-n - 1 : -1]
        out = self.output_shape(spatial)
        if any(s < 1 for s in out):
            raise ValueError(
                f"{self._short_repr()}: input of shape {tuple(x.shape)} gives spatial output "
                f"size {out}: padding {self.padding} crops more than the full output "
                f"(M - 1) * strides + kernel span"
            )
        arrays = [params["W"], params["b"]] if self.use_bias else [params["W"]]
        dtype = self.compute_dtype(x, *arrays)
        batch = x.shape[: -n - 1]
        flat = x.reshape(-1, *x.shape[-n - 1 :]).astype(dtype)
        y = conv_transpose(
            flat,
            *(a.astype(dtype) for a in arrays),
            strides=self.strides,
            padding=self.padding,
            dilation=self.dilation,
        )
        return y.reshape(*batch, *y.shape[1:])
