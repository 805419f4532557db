"""The precision policy (``train.precision``): any model trained in a lower compute dtype.

``float32`` changes nothing. ``bfloat16`` and ``float16``: the params stay float32 (so do
the optimizer state, the gradients and the checkpoints); inside the compiled step the
params and the floating inputs are cast to the compute dtype, the model runs in it, and its
output (logits), the loss and the metrics are cast back to float32 before any reduction.
The model is not edited: :func:`apply` wraps it in a :class:`Policy`, which the step and the
evaluation call in its place. The casts' transposes bring the gradients back to float32,
and under ``loss.grad: manual`` the casts are differentiated by their own hand rules.

``float16`` adds dynamic loss scaling (:func:`dynamic_loss_scale`, an optax wrapper of the
run's optimizer): the loss's cotangent is multiplied by a scale S (so small gradients do not
flush to zero in float16), the float32 gradients are divided by S; a step whose gradients
are not finite is skipped (params and optimizer state unchanged) and halves S; after
``GROWTH_INTERVAL`` finite steps in a row S doubles. S and that count live in the optimizer
state, so they are checkpointed, sharded like any scalar and resumed bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import nnlite as nl

from ..errors import ConfigError
from ..model.contract import accepts
from .section import PRECISIONS as PRECISIONS  # the schema names the choices

GROWTH_INTERVAL = 2000  # finite float16 steps in a row before the loss scale doubles
GROWTH_FACTOR = 2.0  # what the scale is multiplied by when it grows, divided by on overflow


def _cast_floats(tree: Any, dtype) -> Any:
    """Every floating array of ``tree`` in ``dtype`` (integers, keys, None untouched)."""

    def cast(a):
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype:
            return a.astype(dtype)
        return a

    return jax.tree.map(cast, tree)


def _like(new: Any, old: Any) -> Any:
    """``new`` (a model's state after the step) in the dtypes of ``old`` (before it)."""
    return jax.tree.map(lambda n, o: n.astype(o.dtype) if n.dtype != o.dtype else n, new, old)


class Policy:
    """``model`` computed in ``dtype``: params and floating inputs cast on the way in, the
    output (and a model's own loss and metrics) cast to float32 on the way out; a stateful
    model's state keeps its dtypes. Every other attribute is the model's."""

    def __init__(self, model: Any, dtype: str):
        self.model, self.dtype = model, jnp.dtype(dtype)

    def __repr__(self) -> str:
        return f"Policy({self.model!r}, {self.dtype.name})"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.model, name)  # AttributeError as the model's own
        if name in ("objective", "loss", "token_log_probs") and callable(attr):
            return self._wrap(attr)
        if name == "accumulate":  # a hand pass on raw params would skip the casts
            raise AttributeError(name)
        return attr

    def _in(self, params, x):
        return _cast_floats(params, self.dtype), _cast_floats(x, self.dtype)

    def __call__(self, params, x, **kwargs):
        p, x = self._in(params, x)
        state = kwargs.get("state")
        with nl.precision(self.dtype):  # the layers accept their params in this dtype
            out = self.model(p, x, **kwargs)
        if state is not None:  # stateful: (out, new_state)
            out, new_state = out
            return _cast_floats(out, jnp.float32), _like(new_state, state)
        return _cast_floats(out, jnp.float32)

    def _wrap(self, fn):
        pass_grad, pass_key = accepts(fn, "grad"), accepts(fn, "key")

        def wrapped(params, x, y, *, grad=None, key=None, state=None, **kw):
            p, x = self._in(params, x)
            if pass_grad and grad is not None:
                kw["grad"] = grad
            if pass_key and key is not None:
                kw["key"] = key
            if state is not None:
                kw["state"] = state
            with nl.precision(self.dtype):
                result = fn(p, x, y, **kw)
            if state is not None and isinstance(result, tuple) and len(result) == 3:
                loss, metrics, new_state = result
                return (*_cast_floats((loss, metrics), jnp.float32), _like(new_state, state))
            return _cast_floats(result, jnp.float32)

        return wrapped


def check_model_dtype(model: Any, precision: str) -> None:
    """A model with a compute ``dtype`` of its own (the GPT's ``model.dtype``) that is not
    float32 must agree with a policy that is not float32: the two would cast to different
    dtypes. (``model.dtype`` alone keeps the head and logits in float32; the policy casts
    every layer: it is the one that works for any model.)"""
    own = getattr(model, "dtype", None)
    if not isinstance(own, str) or own == "float32" or precision == "float32":
        return
    if own != precision:
        raise ConfigError(
            f"model.dtype={own} and train.precision={precision} disagree: set one of them "
            f"(train.precision={own} casts the whole model; model.dtype only its blocks)"
        )


def apply(model: Any, precision: str) -> Any:
    """``model`` under the precision policy (itself for float32)."""
    return model if precision == "float32" else Policy(model, precision)


# -- float16: dynamic loss scaling ------------------------------------------------------------
class LossScaleState(NamedTuple):
    """The optimizer state of :func:`dynamic_loss_scale`: the scale, the finite steps since
    it last changed, and the wrapped optimizer's state."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar
    inner: Any


def dynamic_loss_scale(
    inner: optax.GradientTransformation, initial_scale: float
) -> optax.GradientTransformation:
    """``inner`` fed gradients computed from the loss times the state's scale: divides them
    by it, skips a step whose gradients are not finite (zero updates, ``inner``'s state
    kept, the scale divided by ``GROWTH_FACTOR``, at least 1) and multiplies the scale by
    ``GROWTH_FACTOR`` after ``GROWTH_INTERVAL`` finite steps in a row."""

    def init(params):
        return LossScaleState(
            jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), inner.init(params)
        )

    def update(grads, state, params=None):
        grads = jax.tree.map(lambda g: g / state.scale.astype(g.dtype), grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, new_inner = inner.update(grads, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        new_inner = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, state.inner)
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= GROWTH_INTERVAL
        scale = jnp.where(
            finite,
            jnp.where(grow, state.scale * GROWTH_FACTOR, state.scale),
            jnp.maximum(state.scale / GROWTH_FACTOR, 1.0),
        )
        return updates, LossScaleState(scale, jnp.where(grow, 0, good).astype(jnp.int32), new_inner)

    return optax.GradientTransformation(init, update)


def with_loss_scaling(optimizer, precision: str, initial_scale: float):
    """The run's optimizer: wrapped by :func:`dynamic_loss_scale` for float16."""
    if precision != "float16":
        return optimizer
    return dynamic_loss_scale(optimizer, initial_scale)


def loss_scale(opt_state: Any) -> jax.Array | None:
    """The current loss scale in ``opt_state`` (None: no loss scaling)."""
    return opt_state.scale if isinstance(opt_state, LossScaleState) else None


def scale_cotangent(loss: jax.Array, scale: jax.Array | None) -> jax.Array:
    """``loss`` unchanged in value, its gradient multiplied by ``scale``: ``x*s - x*s`` is
    exactly 0 for a finite product, so the value is bit-identical."""
    if scale is None:
        return loss
    scaled = loss * jax.lax.stop_gradient(scale)
    return jax.lax.stop_gradient(loss) + (scaled - jax.lax.stop_gradient(scaled))
