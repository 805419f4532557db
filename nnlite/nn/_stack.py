"""Deep models: ``Stack`` (n copies of a layer, scanned) and ``Remat`` (a layer whose
backward pass recomputes its forward).

``Stack(layer, n)`` holds the copies' params as one ParamsDict whose leaves have a leading
axis of size n (the layer's own params, stacked) and applies them with ``lax.scan``: the
compiled program holds the layer once, so compile time does not grow with depth.

The hand rule (``stack_scan_vjp``) is the scan of the layer's own hand rules run in
reverse. Its forward pass (``_stack_fwd``) is a scan whose body takes ``jax.vjp`` of one
copy *in manual mode* -- every nnlite layer inside as its ``custom_vjp`` with its hand
rule, the plain ``jnp`` between them with the library's structural rules, as
``nl.manual_grads`` evaluates a loss -- and emits that copy's residuals; the backward pass
(``_stack_bwd``) is a ``reverse=True`` scan calling each copy's pullback on them. So the
backward pass is a loop too (never unrolled), runs no autodiff of anything a layer
computes, and keeps exactly what the layer's own rules keep: wrap the layer in ``Remat``
and only each copy's input is kept, the rest recomputed copy by copy.

Why not let JAX transpose a scan of the layer's rules: manual mode treats a ``custom_vjp``
as a closed hand rule and does not look into it, while a bare ``lax.scan`` in the loss
would be one more construct to interpret; one rule for the whole stack keeps each copy's
backward hand-derived and the stack a single named step (as ``gru_scan`` does for a
recurrent cell).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax

from ..core._mode import manual_active, manual_scope, manual_tape
from ..core._module import Module
from ..core._params import ParamsDict

__all__ = ["REMAT_POLICIES", "Remat", "Stack", "stack_scan", "stack_scan_vjp"]


def _refuse_state(owner: str, layer: Module) -> None:
    """A layer with state (BatchNorm) would update it inside a scan or a checkpointed
    function, where the new state cannot be handed out: refused by name."""
    if callable(getattr(layer, "init_state", None)):
        raise ValueError(
            f"{owner}: {type(layer).__name__} has state (BatchNorm's running statistics), "
            f"which {owner} does not carry; apply the layers in a Python loop instead"
        )


def _split_copies(tree: Any, n: int) -> list:
    return [jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n)]


def _body(layer: Module, p: Any, h: jax.Array, k: Any) -> jax.Array:
    return layer(p, h, key=k)


def _manual_body(layer: Module):
    """One copy as ``nl.manual_grads`` evaluates a loss: hand rules for the layers,
    structural rules for the ``jnp`` between them; the input ``h`` counts as
    differentiated too (its cotangent is the previous copy's)."""
    from ..grad._manual import manual_grads  # grad builds on nn's core, not the reverse

    grads = manual_grads(lambda ph, k: _body(layer, ph[0], ph[1], k))

    def run(p, h, k):
        with manual_scope(False):  # manual_grads traces and interprets it itself
            return grads((p, h), k)

    return run


def _check_body(layer: Module, params: Any, x: jax.Array, keys: Any) -> None:
    """Raise ``ManualGradError`` when one copy computes on the params outside the rules.
    The stack's ``custom_vjp`` is a closed hand rule to the analysis of the loss around
    it (``nl.check_manual``, ``loss.grad: auto``), so the copy is analysed here, at trace
    time, rather than only when the backward pass is traced."""
    from ..grad._manual import check_manual

    def spec(a):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)

    one = jax.tree.map(spec, params)
    k = None if keys is None else spec(keys)
    with manual_scope(False):
        check_manual(
            lambda ph, k: _body(layer, ph[0], ph[1], k),
            (one, jax.ShapeDtypeStruct(x.shape, x.dtype)),
            k,
        )


def stack_scan(params: Any, x: jax.Array, keys: Any = None, *, layer: Module) -> jax.Array:
    """``layer`` applied ``n`` times: ``params`` are its params with a leading axis n,
    ``keys`` (``None`` or n keys) the copies' random keys; ``x -> x'`` of the same shape
    and dtype."""

    def step(h, pk):
        p, k = pk
        return _body(layer, p, h, k), None

    return lax.scan(step, x, (params, keys))[0]


def _stack_fwd(params, x, keys, layer):
    """The forward scan in manual mode: the output, and each copy's pullback (the
    residuals of its hand rules, stacked along the copies)."""
    body = _manual_body(layer)

    def step(h, pk):
        p, k = pk
        y, pullback = jax.vjp(lambda p, h: body(p, h, k), p, h)
        return y, pullback

    return lax.scan(step, x, (params, keys))


def _stack_bwd(pullbacks, dret):
    """The backward scan: copy n-1 first, each pullback fed the cotangent of its output;
    ``(dparams stacked, dx)``."""

    def step(dh, pullback):
        dp, dh = pullback(dh)
        return dh, dp

    dx, dparams = lax.scan(step, dret, pullbacks, reverse=True)
    return dparams, dx


def stack_scan_vjp(params, x, keys=None, dret=None, *, layer: Module):
    """Hand rule of ``stack_scan``: the reverse scan of the layer's hand rules (see the
    module docstring); ``(dparams, dx, None)``, ``dparams`` stacked as ``params``."""
    _, pullbacks = _stack_fwd(params, x, keys, layer)
    dparams, dx = _stack_bwd(pullbacks, dret)
    return dparams, dx, None


# The pair as every rule carries it (``check_vjp(rule.f, rule.f_vjp, ...)``); the stack
# applies it through ``_manual_stack``, which keeps the residuals instead of recomputing.
stack_scan.f = stack_scan  # type: ignore[attr-defined]
stack_scan.f_vjp = stack_scan_vjp  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=256)
def _manual_stack(layer: Module):
    """``stack_scan`` for ``layer`` as a ``jax.custom_vjp`` whose forward pass keeps the
    copies' pullbacks (rather than recomputing the stack in the backward pass)."""

    @jax.custom_vjp
    def run(params, x, keys):
        with manual_scope(False):
            return stack_scan(params, x, keys, layer=layer)

    def fwd(params, x, keys):
        y, pullbacks = _stack_fwd(params, x, keys, layer)
        return y, (pullbacks, keys)

    def bwd(res, dret):
        pullbacks, keys = res
        dparams, dx = _stack_bwd(pullbacks, dret)
        return dparams, dx, None if keys is None else jax.tree.map(_no_cotangent, keys)

    run.defvjp(fwd, bwd)
    return run


def _no_cotangent(k):
    import numpy as np

    return np.zeros(k.shape, jax.dtypes.float0)


class StackCall:
    """show_grad's tape entry for a stack: the walk prints it as a
    forward ``lax.scan`` and a reverse one, the layer's calls printed once as their body."""

    __name__ = "stack"
    f_vjp = None

    def __init__(self, layer: Module):
        self.layer = layer


class Stack(Module):
    """``n`` copies of ``layer`` applied one after the other, with stacked params and
    ``lax.scan`` (levanter's ``Stacked``, Flax's ``nn.scan``): the compiled program holds
    the layer once, so compile time stays flat as ``n`` grows.

    The layer must map its input to an output of the same shape and dtype (the scan's
    carry), as a transformer block does. ``init`` vmaps the layer's ``init`` over ``n``
    keys, so the params are the layer's with a leading axis ``n`` (``/attn/qkv/W:
    f32[n,8,24]``); :meth:`unstack` and :meth:`stack` convert to and from a list of ``n``
    ParamsDicts (the unrolled layout).

    Randomness: copy ``i`` gets ``jax.random.split(key, n)[i]``; :meth:`scan` takes the
    ``n`` keys directly (to match a loop that splits its keys differently).

    Gradients: ``jax.grad`` differentiates the scan; under ``nl.manual_grads`` the stack
    runs ``stack_scan_vjp``, a reverse scan of the layer's own hand rules. Wrap the layer
    in :class:`Remat` to keep only each copy's input for the backward pass.

    Args:
        layer: the layer to repeat (any Module; ``x -> x`` of the same shape and dtype).
        n: number of copies, >= 1.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> stack = nl.Stack(nl.TransformerBlock(8, num_heads=2, mlp_ratio=2), 3)
        >>> p = jax.jit(stack.init)(jax.random.key(0))
        >>> p.attn.qkv.W.shape
        (3, 8, 24)
        >>> x = jnp.ones((2, 5, 8))
        >>> y = jax.jit(stack)(p, x)
        >>> y.shape
        (2, 5, 8)
        >>> @jax.jit
        ... def unrolled(p, x):  # the same three blocks, one after another
        ...     for p_i in stack.unstack(p):
        ...         x = stack.layer(p_i, x)
        ...     return x
        >>> bool(jnp.allclose(y, unrolled(p, x), atol=1e-5))
        True
    """

    layer: Module
    n: int

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.layer, Module):
            raise TypeError(f"Stack: layer must be an nnlite Module, got {self.layer!r}")
        self._check_positive_ints("n")
        _refuse_state("Stack", self.layer)

    def _args_repr(self) -> str:
        return f"Stack({type(self.layer).__name__}, {self.n})"

    def init(self, key: jax.Array) -> ParamsDict:
        return jax.vmap(self.layer.init)(jax.random.split(key, self.n))

    def param_axes(self) -> Any:
        """The layer's logical axes with an unnamed leading axis (the copies: never
        sharded, each device holds its share of every copy)."""
        from ..core._axes import Axes, param_axes

        inner = param_axes(self.layer)
        is_axes = lambda a: isinstance(a, Axes)  # noqa: E731
        return jax.tree.map(lambda a: Axes((None, *a)), inner, is_leaf=is_axes)

    def stack(self, copies: Any) -> ParamsDict:
        """The stacked params of a list of ``n`` copies' params (the unrolled layout)."""
        copies = list(copies)
        if len(copies) != self.n:
            raise ValueError(
                f"{self._args_repr()}: expected {self.n} copies' params, got {len(copies)}"
            )
        return jax.tree.map(lambda *a: jax.numpy.stack(a), *copies)

    def unstack(self, params: Any) -> list:
        """The list of ``n`` copies' params of stacked ``params``."""
        return _split_copies(params, self.n)

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        keys = None if key is None else jax.random.split(key, self.n)
        return self.scan(params, x, keys)

    def scan(self, params: ParamsDict, x: jax.Array, keys: Any = None) -> jax.Array:
        """The stack with the copies' keys given: ``keys`` is ``None`` or ``n`` keys (a key
        array with leading axis ``n``)."""
        self._check(params, x, keys)
        if not manual_active():
            return stack_scan(params, x, keys, layer=self.layer)
        tape = manual_tape()
        if tape is not None:
            # show_grad prints the stack as a loop: one call, its body traced apart
            out = _manual_stack(self.layer)(params, x, keys)
            tape.append((StackCall(self.layer), (params, x, keys), {}, out))
            return out
        _check_body(self.layer, params, x, keys)
        return _manual_stack(self.layer)(params, x, keys)

    def _check(self, params: Any, x: jax.Array, keys: Any) -> None:
        leaves = jax.tree.leaves(params)
        bad = [a.shape for a in leaves if not a.shape or a.shape[0] != self.n]
        if not leaves or bad:
            got = bad[0] if bad else "no arrays"
            raise ValueError(
                f"{self._args_repr()}: params must be the layer's with a leading axis of "
                f"{self.n} (from Stack.init or Stack.stack), got a leaf of shape {got}"
            )
        if keys is not None and len(keys) != self.n:
            raise ValueError(f"{self._args_repr()}: expected {self.n} keys, got {len(keys)}")
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
        k = None if keys is None else keys[0]
        out = jax.eval_shape(lambda p, h: _body(self.layer, p, h, k), one, x)
        if (out.shape, out.dtype) != (x.shape, x.dtype):
            raise ValueError(
                f"{self._args_repr()}: the layer must return its input's shape and dtype "
                f"(the scan's carry): input {x.dtype}{list(x.shape)}, output "
                f"{out.dtype}{list(out.shape)}"
            )


# Rematerialisation policies by name: jax.checkpoint_policies' plain policies (those
# that take no argument).
REMAT_POLICIES = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)


class Remat(Module):
    """``layer`` under ``jax.checkpoint``: its backward pass recomputes the forward
    instead of keeping the activations inside it (activation checkpointing).

    ``policy`` names what is kept anyway: ``None`` keeps nothing but the inputs (the
    default of ``jax.checkpoint``), or a name of ``jax.checkpoint_policies`` (one of
    ``REMAT_POLICIES``: ``"dots_saveable"`` keeps matmul results and recomputes the
    elementwise work). Works under ``jax.grad`` and ``nl.manual_grads`` (the recomputed
    forward runs the hand rules' forwards, the backward their VJPs), also inside a
    :class:`Stack`. Params are the layer's.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> mlp = nl.FFN(4, (16,), 4)
        >>> p = jax.jit(mlp.init)(jax.random.key(0))
        >>> x = jnp.ones((2, 4))
        >>> g = jax.jit(jax.grad(lambda p: nl.Remat(mlp)(p, x).sum()))(p)
        >>> g0 = jax.jit(jax.grad(lambda p: mlp(p, x).sum()))(p)
        >>> bool(jnp.allclose(g.layers[0].W, g0.layers[0].W))
        True
    """

    layer: Module
    policy: str | None = None

    params_of = "layer"  # Remat adds no params: they are the layer's

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.layer, Module):
            raise TypeError(f"Remat: layer must be an nnlite Module, got {self.layer!r}")
        _refuse_state("Remat", self.layer)
        if self.policy is not None and self.policy not in REMAT_POLICIES:
            raise ValueError(
                f"Remat: policy must be None or one of {', '.join(REMAT_POLICIES)}, got "
                f"{self.policy!r}"
            )

    def _args_repr(self) -> str:
        return f"Remat({type(self.layer).__name__})"

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        policy = None if self.policy is None else getattr(jax.checkpoint_policies, self.policy)
        layer = self.layer
        return jax.checkpoint(lambda p, h, k: layer(p, h, key=k), policy=policy)(params, x, key)
