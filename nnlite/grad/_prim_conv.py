"""The hand rule of ``lax.conv_general_dilated`` in its general form: any dimension
numbers (``NCHW``, ``NHWC``, 1-3 spatial axes), strides, explicit padding, input
(``lhs``) and kernel (``rhs``) dilation, feature groups (depthwise) and batch groups.

Both cotangents are convolutions themselves. The input's: the cotangent, dilated by the
strides, convolved with the kernel flipped in space and with its feature axes swapped
(per feature group). The kernel's: the input convolved with the cotangent, the batch
axis playing the part of the features (so feature groups become batch groups and the
other way round). The paddings follow from the shapes.

Example:
    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((1, 1, 5)), jnp.ones((1, 1, 3))  # NCW, OIW
    >>> dn = ((0, 1, 2), (0, 1, 2), (0, 1, 2))
    >>> dx, dw = conv_general_dilated_vjp(x, w, jnp.ones((1, 1, 3)), window_strides=(1,),
    ...     padding=((0, 0),), lhs_dilation=(1,), rhs_dilation=(1,), dimension_numbers=dn,
    ...     feature_group_count=1, batch_group_count=1)
    >>> dx.tolist(), dw.tolist()
    ([[[1.0, 2.0, 3.0, 2.0, 1.0]]], [[[3.0, 3.0, 3.0]]])
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["conv_general_dilated", "conv_general_dilated_vjp"]


def _dilate(shape, dilation):
    return tuple(0 if d == 0 else 1 + r * (d - 1) for d, r in zip(shape, dilation, strict=True))


def _specs(dimension_numbers):
    lhs, rhs, out = (tuple(int(i) for i in s) for s in dimension_numbers)
    return lhs, rhs, out


def _swap(spec):
    """A spec with its first two entries (batch/features, out/in features) exchanged."""
    return (spec[1], spec[0], *spec[2:])


def _axis_out_of(src: int, size: int, x):
    shape = list(x.shape)
    shape[src : src + 1] = [size, shape[src] // size]
    return x.reshape(shape)


def _axis_into(src: int, dst: int, x):
    """Merge axis ``src`` into axis ``dst`` (numbered without ``src``), ``src`` major."""
    perm = [i for i in range(x.ndim) if i != src]
    perm.insert(dst, src)
    moved = lax.transpose(x, tuple(perm))
    shape = list(np.delete(np.array(x.shape), src))
    shape[dst] *= x.shape[src]
    return moved.reshape(tuple(int(s) for s in shape))


def conv_general_dilated(
    lhs,
    rhs,
    *,
    window_strides,
    padding,
    lhs_dilation,
    rhs_dilation,
    dimension_numbers,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
):
    """``lax.conv_general_dilated`` with its parameters as keywords (the primitive's)."""
    return lax.conv_general_dilated(
        lhs,
        rhs,
        tuple(window_strides),
        tuple(tuple(p) for p in padding),
        tuple(lhs_dilation),
        tuple(rhs_dilation),
        lax.ConvDimensionNumbers(*_specs(dimension_numbers)),
        feature_group_count,
        batch_group_count,
        precision,
        preferred_element_type,
    )


def conv_general_dilated_vjp(
    lhs,
    rhs,
    dret,
    *,
    window_strides,
    padding,
    lhs_dilation,
    rhs_dilation,
    dimension_numbers,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
):
    """``(dlhs, drhs)``: each a convolution (see the module docstring)."""
    lhs_spec, rhs_spec, out_spec = _specs(dimension_numbers)
    strides, lhs_dil, rhs_dil = tuple(window_strides), tuple(lhs_dilation), tuple(rhs_dilation)
    pads = [(int(lo), int(hi)) for lo, hi in padding]
    in_sp = [lhs.shape[i] for i in lhs_spec[2:]]
    k_sp = [rhs.shape[i] for i in rhs_spec[2:]]
    out_sp = [dret.shape[i] for i in out_spec[2:]]
    lhs_d, k_d, out_d = _dilate(in_sp, lhs_dil), _dilate(k_sp, rhs_dil), _dilate(out_sp, strides)

    # the input's cotangent: dret (dilated by the strides) against the flipped kernel
    w = rhs
    groups = feature_group_count
    if feature_group_count > 1 or batch_group_count > 1:
        g = max(feature_group_count, batch_group_count)
        w = _axis_into(rhs_spec[0], rhs_spec[1], _axis_out_of(rhs_spec[0], g, w))
        groups = g
    before = [k - lo - 1 for k, (lo, _) in zip(k_d, pads, strict=True)]
    after = [a + k - 1 - o - b for a, k, o, b in zip(lhs_d, k_d, out_d, before, strict=True)]
    dlhs = lax.conv_general_dilated(
        dret,
        lax.rev(w, tuple(rhs_spec[2:])),
        lhs_dil,
        list(zip(before, after, strict=True)),
        strides,
        rhs_dil,
        lax.ConvDimensionNumbers(out_spec, _swap(rhs_spec), lhs_spec),
        groups,
        1,
        precision,
        preferred_element_type,
    )
    if batch_group_count > 1:
        dlhs = _axis_into(
            lhs_spec[1], lhs_spec[0], _axis_out_of(lhs_spec[1], batch_group_count, dlhs)
        )

    # the kernel's cotangent: the input against dret, the batch axis as the features
    fg, bg = feature_group_count, batch_group_count
    fg, bg = (bg, 1) if bg > 1 else (1, fg)
    hi = [(o - a) + (k - lo - 1) for o, a, k, (lo, _) in zip(out_d, lhs_d, k_d, pads, strict=True)]
    drhs = lax.conv_general_dilated(
        lhs,
        dret,
        rhs_dil,
        [(lo, h) for (lo, _), h in zip(pads, hi, strict=True)],
        lhs_dil,
        strides,
        lax.ConvDimensionNumbers(_swap(lhs_spec), _swap(out_spec), _swap(rhs_spec)),
        fg,
        bg,
        precision,
        preferred_element_type,
    )
    if 0 in dret.shape:
        drhs = jnp.zeros_like(rhs)
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype)
