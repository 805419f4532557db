"""Manual gradients for any model built from nnlite layers.

Every differentiable array function behind an nnlite layer or loss (``linear``, ``conv``,
``layer_norm``, ``relu``, ``softmax_cross_entropy``, ...) is declared with its hand-derived
VJP by ``@hand_rule(f_vjp)``. Outside manual mode the decorator costs one flag test and
calls the plain function, so autodiff and inference see ordinary JAX code. Inside
``manual_grads(loss_fn)`` each such call goes through ``jax.custom_vjp`` with its rule, so
``jax.grad`` of the loss runs hand rules only; the model's code does not change.

Why a trace-time flag rather than a ``grad=`` argument on every layer: a user's Module
composed of nnlite layers gets manual gradients without forwarding an argument through its
own ``__call__``, and the choice is made once, where the loss is differentiated.

``manual_grads`` also proves the claim: it traces the loss once and walks the jaxpr; any
equation that computes a float from the params outside a ``custom_vjp`` call (a user layer
doing ``x @ params.W`` with no rule) would be differentiated by JAX, and is refused with
one error naming the Module it sits in (each Module call is a ``jax.named_scope`` in manual
mode) and how to fix it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from ..core._mode import manual_active, manual_scope, manual_tape
from ._custom_vjp import custom_vjp

__all__ = ["ManualGradError", "hand_rule", "manual_grads"]


class ManualGradError(TypeError):
    """A loss in manual mode computes on the params outside any hand rule."""


ManualGradError.__module__ = "nnlite"  # its public home, shown in tracebacks


def hand_rule(f_vjp: Callable) -> Callable[[Callable], Callable]:
    """Declare ``f_vjp(*args, dret, **static) -> dargs`` as the hand VJP of the decorated
    array function ``f(*args, **static)``.

    Outside manual mode the function is ``f`` itself. Inside ``manual_grads`` it is
    ``nnlite.vjp.custom_vjp(f, f_vjp)`` with the keyword arguments (hyperparameters:
    strides, eps, ...) bound as static values. ``f.f`` and ``f.f_vjp`` are the plain pair
    (for ``check_vjp``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def cube_vjp(x, dret):
        ...     return 3 * x * x * dret
        >>> @hand_rule(cube_vjp)
        ... def cube(x):
        ...     return x**3
        >>> loss = manual_grads(lambda p: jnp.sum(cube(p)), check=False)
        >>> jax.grad(loss)(jnp.array([1.0, 2.0]))
        Array([ 3., 12.], dtype=float32)
    """

    def decorate(f: Callable) -> Callable:
        sig = inspect.signature(f)
        positional = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

        @functools.wraps(f)
        def wrapped(*args, **static):
            if not manual_active():
                return f(*args, **static)
            # Every positional parameter as an argument (defaults filled in: the rule gets
            # ``(*args, dret)`` in f's order); keyword-only ones are static hyperparameters.
            bound = sig.bind(*args, **static)
            bound.apply_defaults()
            args = tuple(bound.arguments[n] for n in positional)
            static = {k: v for k, v in bound.arguments.items() if k not in positional}
            # Python scalars (a dropout rate) are hyperparameters too: closed over, not traced.
            py = [_is_python_scalar(a) for a in args]
            dyn_idx = [i for i, p in enumerate(py) if not p]

            def full(dyn):
                merged = list(args)
                for i, a in zip(dyn_idx, dyn, strict=True):
                    merged[i] = a
                return merged

            def fn(*dyn):
                with manual_scope(False):  # the rule's own ops are plain JAX
                    return f(*full(dyn), **static)

            def fn_vjp(*dyn_dret):
                *dyn, dret = dyn_dret
                with manual_scope(False):
                    dargs = f_vjp(*full(dyn), dret, **static)
                dargs = dargs if isinstance(dargs, tuple) else (dargs,)
                return tuple(dargs[i] for i in dyn_idx) if len(dyn_idx) > 1 else dargs[dyn_idx[0]]

            fn.__name__ = f.__name__
            fn_vjp.__name__ = f_vjp.__name__
            out = custom_vjp(fn, fn_vjp)(*(args[i] for i in dyn_idx))
            tape = manual_tape()
            if tape is not None:
                tape.append((wrapped, args, static, out))
            return out

        wrapped.f = f  # type: ignore[attr-defined]
        wrapped.f_vjp = f_vjp  # type: ignore[attr-defined]
        return wrapped

    return decorate


# --- the check: nothing param-dependent outside a hand rule ------------------------------

# Equations that may touch param-derived floats outside a rule: calls (walked into), casts
# and pure layout changes (a reshape's cotangent is the same numbers, reshaped back: layers
# fold batch axes around their rule, as Conv does), and stop_gradient (no gradient flows).
_CALLS = ("pjit", "jit", "closed_call", "core_call")
_HAND = ("custom_vjp_call", "custom_vjp_call_jaxpr")
_PASS = ("convert_element_type", "copy", "copy_p", "reshape", "squeeze", "expand_dims")
_BLOCK = ("stop_gradient",)


def _is_float(v) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _first_offender(jaxpr, tainted: list[bool]):
    """The first equation computing a float from tainted inputs outside a hand rule."""
    marks = {v: t for v, t in zip(jaxpr.invars, tainted, strict=True)}

    def is_t(v) -> bool:
        return not isinstance(v, Literal) and marks.get(v, False)

    for eqn in jaxpr.eqns:
        ins = [is_t(v) for v in eqn.invars]
        name = eqn.primitive.name
        if not any(ins):
            continue
        if name in _BLOCK:
            continue
        if name in _CALLS:
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            inner = getattr(inner, "jaxpr", inner)
            bad = _first_offender(inner, ins)
            if bad is not None:
                return bad
            out_t = [True] * len(eqn.outvars)
        elif name in _HAND or name in _PASS:
            out_t = [True] * len(eqn.outvars)
        elif any(_is_float(v) for v in eqn.outvars):
            return eqn
        else:
            out_t = [False] * len(eqn.outvars)
        for v, t in zip(eqn.outvars, out_t, strict=True):
            marks[v] = t and _is_float(v)
    return None


def _where(eqn) -> str:
    stack = str(eqn.source_info.name_stack)
    parts = [p for p in stack.split("/") if p and not p.startswith(("jvp(", "transpose("))]
    return parts[-1] if parts else ""


MANUAL_FIX = (
    "give it hand rules (decorate its array function with @nl.hand_rule(f_vjp), or wrap it "
    "with nl.with_vjp / nl.vjp.custom_vjp) or use loss.grad=autodiff"
)


def check_manual(fn: Callable, params: Any, *args: Any, **kwargs: Any) -> None:
    """Raise ``ManualGradError`` unless every float computed from ``params`` by
    ``fn(params, *args)`` in manual mode comes out of a hand rule (a ``custom_vjp``)."""

    def spec(a):
        return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) if _arrayish(a) else a

    p_spec, a_spec = jax.tree.map(spec, params), jax.tree.map(spec, args)
    with manual_scope(True):
        closed = jax.make_jaxpr(lambda p, a: fn(p, *a, **kwargs))(p_spec, a_spec)
    n_params = len(jax.tree.leaves(p_spec))
    tainted = [i < n_params for i in range(len(closed.jaxpr.invars))]
    eqn = _first_offender(closed.jaxpr, tainted)
    if eqn is None:
        return
    where = _where(eqn)
    who = f"layer {where}" if where else "the loss function (outside any nnlite Module)"
    raise ManualGradError(
        f"manual gradients: {who} computes `{eqn.primitive.name}` on values derived from "
        f"the params without a hand-derived VJP, so JAX autodiff would differentiate it; "
        f"{MANUAL_FIX}"
    )


def _is_python_scalar(a: Any) -> bool:
    return isinstance(a, (bool, int, float, str)) or a is None


def _arrayish(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def manual_grads(fn: Callable, *, check: bool = True) -> Callable:
    """``fn(params, *args)`` differentiated by the hand rules of nnlite's layers and losses.

    Calls ``fn`` in manual mode: every nnlite layer and loss inside it runs through
    ``jax.custom_vjp`` with its hand-derived VJP, so ``jax.grad`` of the result uses no
    autodiff of nnlite code. With ``check`` (default) the first call also traces ``fn``
    once and raises ``ManualGradError`` naming the layer if anything computed from
    ``params`` would still be differentiated by JAX (a user layer without rules).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> net = nl.FFN(3, (4,), 2)
        >>> p = net.init(jax.random.key(0))
        >>> x, y = jnp.ones((5, 3)), jnp.zeros(5, jnp.int32)
        >>> def loss(p, x, y):
        ...     return nl.softmax_cross_entropy(net(p, x), y, reduction="mean")
        >>> g_hand = jax.grad(nl.manual_grads(loss))(p, x, y)
        >>> g_auto = jax.grad(loss)(p, x, y)
        >>> bool(jnp.allclose(g_hand.layers[0].W, g_auto.layers[0].W, atol=1e-6))
        True
    """
    checked: set = set()

    @functools.wraps(fn)
    def wrapped(params, *args, **kwargs):
        if check:
            sig = (
                jax.tree.structure((params, args)),
                tuple(
                    (jnp.shape(a), jnp.result_type(a)) if _arrayish(a) else None
                    for a in jax.tree.leaves((params, args))
                ),
            )
            if sig not in checked:
                check_manual(fn, params, *args, **kwargs)
                checked.add(sig)
        with manual_scope(True, manual_tape()):
            return fn(params, *args, **kwargs)

    return wrapped
