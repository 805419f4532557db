"""Per-layer backward policies: ``nl.backward_policy(layer, ...)`` changes what flows back
through one layer -- stop it, scale or clip the cotangent arriving at its output, compute
its backward in float32 under a low-precision forward -- and never its forward.

Stop, scale and clip are hand rules on the layer's output (identity forward, the policy in
the VJP: ``scale_cotangent`` / ``scale_cotangent_vjp``, ...), plugged into JAX, so
``jax.grad`` and ``manual_grads`` both apply them and ``show_grad`` prints them in place,
where the layer's cotangent enters its rules. A float32 backward recomputes the layer's forward in float32 inside the
backward pass and runs its hand rules there, casting the cotangents back to the params'
and input's dtypes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..core._mode import manual_scope
from ..core._module import Module
from ._custom_vjp import custom_vjp
from ._rule_table import register

__all__ = [
    "BackwardPolicy",
    "backward_policy",
    "clip_cotangent",
    "clip_cotangent_vjp",
    "scale_cotangent",
    "scale_cotangent_vjp",
    "stop_cotangent",
    "stop_cotangent_vjp",
]


def stop_cotangent_vjp(y, dret):
    """Nothing flows back into the layer."""
    return jnp.zeros_like(dret)


def _stop(y):
    """``y``; its VJP stops the cotangent (the layer before it gets none)."""
    return y


def scale_cotangent_vjp(y, scale, dret):
    """``scale * dret``."""
    return dret * jnp.asarray(scale, dret.dtype)


def _scale(y, scale):
    """``y``; its VJP multiplies the cotangent by ``scale``."""
    return y


def clip_cotangent_vjp(y, max_norm, dret):
    """``dret`` rescaled to global norm at most ``max_norm``."""
    norm = jnp.sqrt(jnp.sum(jnp.square(dret.astype(jnp.float32))))
    factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
    return dret * factor.astype(dret.dtype)


def _clip(y, max_norm):
    """``y``; its VJP clips the cotangent's global norm to ``max_norm``."""
    return y


# Plug-ins (jax.custom_vjp), so the policy holds under jax.grad and manual_grads alike.
# Marked as policies: their VJP differs from their function's on purpose, so
# nl.check_rules (a trainer's --check-grads) leaves them out.
_stop._backward_policy = _scale._backward_policy = _clip._backward_policy = True
_stop.__name__, _scale.__name__, _clip.__name__ = (
    "stop_cotangent",
    "scale_cotangent",
    "clip_cotangent",
)
stop_cotangent = custom_vjp(_stop, stop_cotangent_vjp)
scale_cotangent = custom_vjp(_scale, scale_cotangent_vjp)
clip_cotangent = custom_vjp(_clip, clip_cotangent_vjp)
register(stop_cotangent, stop_cotangent_vjp)
register(scale_cotangent, scale_cotangent_vjp)
register(clip_cotangent, clip_cotangent_vjp)


def _with_param_dtype(m, dtype: str):
    """``m`` (and the Modules inside it) built for params of ``dtype``."""
    if not isinstance(m, Module):
        if isinstance(m, tuple):
            return tuple(_with_param_dtype(v, dtype) for v in m)
        return m
    changes = {}
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        if f.name == "param_dtype" and v is not None:
            changes[f.name] = dtype
        elif isinstance(v, (Module, tuple)):
            new = _with_param_dtype(v, dtype)
            if new is not v:
                changes[f.name] = new
    return dataclasses.replace(m, **changes) if changes else m


def _backward_in(layer, dtype):
    """``layer(params, x)`` whose backward runs in ``dtype`` (forward as it is)."""
    wide = _with_param_dtype(layer, jnp.dtype(dtype).name)

    def call(params, x):
        return layer(params, x)

    def call_vjp(params, x, dret):
        up = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else a,
                          (params, x))  # fmt: skip
        with manual_scope(True):  # the layer's own hand rules, in dtype
            _, pullback = jax.vjp(lambda p, h: wide(p, h), *up)
            dp, dx = pullback(dret.astype(dtype))
        cast = jax.tree.map(lambda d, a: d.astype(a.dtype), (dp, dx), (params, x))
        return cast

    call.__name__ = f"{type(layer).__name__}_forward"
    call_vjp.__name__ = f"{type(layer).__name__}_backward_in_{jnp.dtype(dtype).name}"
    return custom_vjp(call, call_vjp)


class BackwardPolicy(Module):
    """``layer`` with a backward policy; see ``backward_policy``."""

    layer: Any
    stop: bool = False
    scale: float | None = None
    clip_norm: float | None = None
    backward_dtype: str | None = None

    def init(self, key):
        return self.layer.init(key)

    def __call__(self, params, x, *, key=None):
        return self.around(lambda p, h, **kw: self.layer(p, h, **kw), params, x, key=key)

    def around(self, call, params, x, *, key=None, **kwargs):
        """The policy around ``call(params, x, key=key, **kwargs)``, the layer's call as
        made elsewhere (a trainer applying policies by path calls this from a
        ``nl.layer_hook``). A float32 backward needs the plain call (no key, no kwargs)."""
        if self.backward_dtype is not None and key is None and not kwargs:
            y = _backward_in(self.layer, jnp.dtype(self.backward_dtype))(params, x)
        else:
            y = call(params, x, key=key, **kwargs)
        if self.stop:
            return stop_cotangent(y)
        if self.scale is not None:
            y = scale_cotangent(y, float(self.scale))
        if self.clip_norm is not None:
            y = clip_cotangent(y, float(self.clip_norm))
        return y


def backward_policy(
    layer,
    *,
    stop: bool = False,
    scale: float | None = None,
    clip_norm: float | None = None,
    backward_dtype: str | None = None,
) -> BackwardPolicy:
    """``layer`` with the same forward and params, and a changed backward pass.

    Args:
        layer: an nnlite Module.
        stop: no gradient into the layer (its params get zero, and so does what feeds it).
        scale: multiply the cotangent arriving at the layer's output by this.
        clip_norm: clip that cotangent's global norm (over the batch) to this.
        backward_dtype: compute the layer's backward in this dtype (``"float32"`` under a
            bfloat16 forward): its forward is recomputed in that dtype inside the backward
            pass and its hand rules run there; the cotangents come back in the params' and
            input's dtypes. (Layers called with a random key keep their own backward.)

    Returns:
        A Module; ``init`` is the layer's, so its params are unchanged.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> lin = nl.Linear(3, 2)
        >>> half = nl.backward_policy(lin, scale=0.5)
        >>> p = lin.init(jax.random.key(0))
        >>> x = jnp.ones((4, 3))
        >>> bool(jnp.allclose(half(p, x), lin(p, x)))  # the forward is the layer's
        True
        >>> g = jax.grad(nl.manual_grads(lambda p: jnp.sum(half(p, x))))(p)
        >>> float(g.b[0])  # 4 examples, each cotangent halved
        2.0
    """
    if not isinstance(layer, Module):
        raise TypeError(f"backward_policy: expected an nnlite Module, got {type(layer).__name__}")
    for name, v in (("scale", scale), ("clip_norm", clip_norm)):
        if v is not None and not isinstance(v, (int, float)):
            raise TypeError(f"backward_policy: {name} must be a number, got {v!r}")
    if clip_norm is not None and clip_norm <= 0:
        raise ValueError(f"backward_policy: clip_norm must be positive, got {clip_norm}")
    if backward_dtype is not None:
        try:
            ok = jnp.issubdtype(jnp.dtype(backward_dtype), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(
                f"backward_policy: backward_dtype must be a float dtype name (float32, "
                f"float64, bfloat16, float16), got {backward_dtype!r}"
            )
        backward_dtype = jnp.dtype(backward_dtype).name
    return BackwardPolicy(layer, stop, scale, clip_norm, backward_dtype)
