"""BatchNorm: normalisation over the batch, with running statistics as *state*.

The running mean and variance are not parameters (the optimizer never sees them) but they
change in every training forward pass. nnlite keeps them the way it keeps parameters: in a
ParamsDict, ``state = bn.init_state()``, passed in and returned, never mutated:
``y, state = bn(params, x, state=state, train=True)``. See docs/state.md.

Under a data-parallel ``pmap``/``shard_map`` the batch statistics are averaged over the
axis that splits the batch (``axis_name``, or the trainer's ``nl.batch_axis``), so every
device normalises with the global batch's statistics and keeps the same running ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._batch_axis import current_batch_axis
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ._normalisation import _affine, _affine_vjp, _Norm

__all__ = [
    "BatchNorm",
    "batch_norm_eval",
    "batch_norm_eval_vjp",
    "batch_norm_train",
    "batch_norm_train_vjp",
]


def _pmean(v: jax.Array, axis_name: str | None) -> jax.Array:
    return v if axis_name is None else jax.lax.pmean(v, axis_name)


def _lead(x: jax.Array) -> tuple[int, ...]:
    """The axes statistics are taken over: every axis but the channels (the last)."""
    return tuple(range(x.ndim - 1))


def _stats_dtype(x: jax.Array):
    return jnp.promote_types(x.dtype, jnp.float32)


def _train_parts(x, eps, axis_name):
    """``(mean, var, r, xhat)`` in float32 (or wider), from the global batch's statistics
    (``mean``/``var`` keep their reduced axes, ``r = 1 / sqrt(var + eps)``)."""
    x32 = x.astype(_stats_dtype(x))
    axes = _lead(x)
    mean = _pmean(jnp.mean(x32, axis=axes, keepdims=True), axis_name)
    centred = x32 - mean
    var = _pmean(jnp.mean(centred * centred, axis=axes, keepdims=True), axis_name)
    r = jax.lax.rsqrt(var + eps)
    return mean, var, r, centred * r


# --- hand rules ----------------------------------------------------------------------
# Train mode differentiates through the batch statistics: with xhat = (x - mean) r over the
# batch (every device's share: the means are pmean'd) and g = dy * scale, dx = r (g - mean(g)
# - xhat mean(g xhat)), the layer-norm rule over the batch axes instead of the features.
# The returned statistics feed the running averages only: they are stop_gradient'ed in the
# forward, so their cotangents are ignored exactly. Eval mode is affine in x, mean and var.


def batch_norm_train_vjp(
    x, scale=None, bias=None, dy=None, dmean=None, dvar=None, *, eps=1e-5, axis_name=None
):
    """Hand rule of ``batch_norm_train``: ``(dx, dscale, dbias)`` (the statistics' cotangents
    ``dmean``, ``dvar`` do not flow: the forward stops their gradient)."""
    _, _, r, xhat = _train_parts(x, eps, axis_name)
    g, dscale, dbias = _affine_vjp(xhat.astype(x.dtype), scale, bias, dy)
    g32 = g.astype(xhat.dtype)
    axes = _lead(x)
    mg = _pmean(jnp.mean(g32, axis=axes, keepdims=True), axis_name)
    mgx = _pmean(jnp.mean(g32 * xhat, axis=axes, keepdims=True), axis_name)
    dx = (r * (g32 - mg - xhat * mgx)).astype(x.dtype)
    return dx, dscale, dbias


@hand_rule(batch_norm_train_vjp)
def batch_norm_train(x, scale=None, bias=None, *, eps=1e-5, axis_name=None):
    """Train-mode batch normalisation of ``x: [..., C]`` over every axis but the last (and
    over the devices of the mapped axis ``axis_name``): ``(y, mean [C], var [C])``, ``y =
    (x - mean) / sqrt(var + eps) * scale + bias`` with the batch's mean and (biased)
    variance, computed in float32; the statistics come out with their gradient stopped."""
    mean, var, _, xhat = _train_parts(x, eps, axis_name)
    y = _affine(xhat.astype(x.dtype), scale, bias)
    c = x.shape[-1]
    return y, jax.lax.stop_gradient(mean.reshape(c)), jax.lax.stop_gradient(var.reshape(c))


def batch_norm_eval_vjp(x, mean, var, scale=None, bias=None, dret=None, *, eps=1e-5):
    """Hand rule of ``batch_norm_eval``: ``(dx, dmean, dvar, dscale, dbias)``."""
    x32 = x.astype(_stats_dtype(x))
    r = jax.lax.rsqrt(jnp.broadcast_to(var.astype(x32.dtype), x.shape) + eps)
    centred = x32 - jnp.broadcast_to(mean.astype(x32.dtype), x.shape)
    xhat = centred * r
    g, dscale, dbias = _affine_vjp(xhat.astype(x.dtype), scale, bias, dret)
    g32 = g.astype(x32.dtype)
    axes = _lead(x)
    dx = (g32 * r).astype(x.dtype)
    dmean = (-jnp.sum(g32 * r, axis=axes)).astype(mean.dtype)
    dvar = (-0.5 * jnp.sum(g32 * xhat * r * r, axis=axes)).astype(var.dtype)
    return dx, dmean, dvar, dscale, dbias


@hand_rule(batch_norm_eval_vjp)
def batch_norm_eval(x, mean, var, scale=None, bias=None, *, eps=1e-5):
    """Eval-mode batch normalisation: ``(x - mean) / sqrt(var + eps) * scale + bias`` with
    given (running) statistics ``mean, var: [C]``; computed in float32, ``x``'s dtype out."""
    x32 = x.astype(_stats_dtype(x))
    r = jax.lax.rsqrt(jnp.broadcast_to(var.astype(x32.dtype), x.shape) + eps)
    xhat = (x32 - jnp.broadcast_to(mean.astype(x32.dtype), x.shape)) * r
    return _affine(xhat.astype(x.dtype), scale, bias)


class BatchNorm(_Norm):
    """Batch normalisation (Ioffe & Szegedy 2015; Flax ``nn.BatchNorm``, Equinox
    ``eqx.nn.BatchNorm``), channels-last, with its running statistics as state.

    Training (``train=True``) normalises each channel with the mean and (biased) variance
    of the batch -- over every axis but the last, so ``[batch, C]`` and images ``[batch,
    H, W, C]`` alike -- differentiates through those statistics, and returns the running
    statistics updated as ``momentum * running + (1 - momentum) * batch`` (Flax's
    convention: PyTorch's ``momentum=0.1`` is ``0.9`` here). Evaluation (``train=False``,
    the default) normalises with the running statistics and returns the state unchanged.

    Under data parallelism the batch statistics are averaged over the mapped axis that
    splits the batch: ``axis_name`` if given, else the one ``nl.batch_axis`` sets (the
    trainer sets it for every strategy; under ``jit`` with a sharded batch the mean is
    global already). Statistics are computed in float32.

    Args:
        features: channels (the last axis).
        momentum: decay of the running statistics, in [0, 1].
        eps: added to the variance.
        use_scale, use_bias: learn ``scale: [features]`` (ones) / ``bias: [features]``
            (zeros), the affine part.
        axis_name: a mapped axis to average the batch statistics over (None: the
            ``nl.batch_axis`` in effect, if any).
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote).

    ``init_state()``: ``{mean: zeros [features], var: ones [features]}`` (float32).

    ``__call__(params, x, *, state, train=False)`` -> ``(y, new_state)``; ``x: [..., features]``
    (train mode needs a batch axis), ``y`` the same shape.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> bn = BatchNorm(2, momentum=0.5)
        >>> params, state = bn.init(jax.random.key(0)), bn.init_state()
        >>> state.print()
        /mean: f32[2]
        /var: f32[2]
        >>> x = jnp.array([[1.0, 10.0], [3.0, 30.0]])
        >>> y, state = bn(params, x, state=state, train=True)
        >>> [[round(v, 3) for v in row] for row in y.tolist()]
        [[-1.0, -1.0], [1.0, 1.0]]
        >>> state.mean.tolist(), state.var.tolist()
        ([1.0, 10.0], [1.0, 50.5])
        >>> y, _ = bn(params, x, state=state)  # eval: the running statistics
        >>> [round(v, 3) for v in y[0].tolist()]
        [0.0, 0.0]
    """

    features: int
    momentum: float = 0.9
    eps: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True
    axis_name: str | None = None
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("features")
        self._check_eps()
        m = self.momentum
        if not isinstance(m, int | float) or isinstance(m, bool) or not 0 <= m <= 1:
            raise ValueError(f"BatchNorm: momentum must be a float in [0, 1], got {m!r}")
        if self.axis_name is not None and not isinstance(self.axis_name, str):
            raise ValueError(
                f"BatchNorm: axis_name must be a mapped axis name (str) or None, got "
                f"{self.axis_name!r}"
            )
        self._check_dtypes()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        names = [n for n, on in (("scale", self.use_scale), ("bias", self.use_bias)) if on]
        return {n: (self.features,) for n in names}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"mean": (self.features,), "var": (self.features,)}

    def init_state(self) -> ParamsDict:
        """Running statistics before any training: mean zeros, variance ones."""
        dtype = jnp.promote_types(self.param_dtype, jnp.float32)
        return ParamsDict(mean=jnp.zeros(self.features, dtype), var=jnp.ones(self.features, dtype))

    def check_state(self, state) -> None:
        """A ValueError naming this layer unless ``state`` is its ``init_state()``'s kind."""
        owner = self._args_repr()
        if state is None:
            raise ValueError(
                f"{owner}: needs its state: y, state = bn(params, x, state=state, "
                "train=...) with state from bn.init_state()"
            )
        if not isinstance(state, ParamsDict | dict):
            raise ValueError(
                f"{owner}: state must be the ParamsDict from init_state(), got "
                f"{type(state).__name__}"
            )
        for name, shape in self.state_shapes().items():
            leaf = state[name] if name in state else None
            got = getattr(leaf, "shape", None)
            if got is None or tuple(got) != shape:
                what = "is missing" if leaf is None else f"has shape {tuple(got or ())}"
                raise ValueError(f"{owner}: state /{name} {what}, expected shape {shape}")

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        state: ParamsDict | None = None,
        train: bool = False,
        key: jax.Array | None = None,
    ):
        self.check_input(x, self.features, min_rank=2 if train else 1)
        self.check_params(params)
        self.check_state(state)
        x, arrays = self._cast(x, params, self.param_shapes())
        scale = arrays.pop(0) if self.use_scale else None
        bias = arrays.pop(0) if self.use_bias else None
        if not train:
            y = batch_norm_eval(x, state["mean"], state["var"], scale, bias, eps=self.eps)
            return y, state
        axis = self.axis_name if self.axis_name is not None else current_batch_axis()
        y, mean, var = batch_norm_train(x, scale, bias, eps=self.eps, axis_name=axis)
        m = self.momentum

        def update(old, new):
            return (m * old + (1 - m) * jax.lax.stop_gradient(new)).astype(old.dtype)

        return y, ParamsDict(mean=update(state["mean"], mean), var=update(state["var"], var))
