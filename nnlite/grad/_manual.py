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

``manual_grads`` also traces the loss once per argument signature and walks the jaxpr
(``_interpret.py``): the plain ``jnp`` between layers that computes on param-derived values
-- ``tok + pos``, ``jnp.mean``, slicing, reshapes, ``jnp.exp``, ``jnp.max``, a hand-written
``lax.scan`` -- gets the library's rule for its primitive (``_structural.py``); an equation
computing a float from the params with no rule (``jnp.linalg.cholesky``, a data-dependent
``while_loop``) would be differentiated by JAX, and is refused with one error naming the
primitive, the user's source line, the Module it sits in (each Module call is a
``jax.named_scope`` in manual mode) and how to fix it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

from ..core._mode import (
    collect_rules,
    frozen_scope,
    is_frozen,
    manual_active,
    manual_scope,
    manual_tape,
    note_rule,
)
from ._contract import check_rule_signature, cotangents, is_constant, is_hyperparameter
from ._custom_vjp import plug
from ._interpret import Evaluator, Refusal, analyse, refusal_message, refusal_place
from ._rule_table import register

__all__ = ["ManualGradError", "check_manual", "hand_rule", "manual_grads"]


class ManualGradError(TypeError):
    """A loss in manual mode computes on the params outside any hand rule.

    ``primitive`` (the operation without a rule), ``where`` (the user's ``file:line``)
    and ``layer`` (the nnlite Module around it) say the same as the message, for a caller
    that reports it in its own words; None where unknown.
    """

    def __init__(self, message: str, *, primitive=None, where=None, layer=None):
        super().__init__(message)
        self.primitive, self.where, self.layer = primitive, where, layer


ManualGradError.__module__ = "nnlite"  # its public home, shown in tracebacks


def hand_rule(f_vjp: Callable) -> Callable[[Callable], Callable]:
    """Declare ``f_vjp`` as the rule of the decorated array function ``f``.

    Outside manual mode the function is ``f`` itself. Inside ``manual_grads`` it is
    ``nnlite.rules.custom_vjp(f, f_vjp)`` with the keyword arguments (hyperparameters:
    strides, eps, ...) bound as static values. ``f.f`` and ``f.f_vjp`` are the plain pair
    (for ``check_rule``); nnlite's own rules enter the rule table (``nnlite.rules``).

    The rule contract (the same for ``hand_rule``, ``custom_vjp``, ``manual_grads``,
    ``check_rule`` and ``show_grad``)::

        f_vjp(*args, *drets, **hyperparameters) -> dargs

    * ``args``: ``f``'s positional arguments in order (defaults filled in); ``drets``: the
      cotangent of the result, one per output when ``f`` returns a tuple, always arrays
      (zeros where nothing flows back, never ``None``); ``f``'s keyword-only arguments
      come as keywords.
    * A float array (or a pytree holding one) has a cotangent; Python scalars are
      hyperparameters and integer/bool arrays are not differentiable: they have none. A
      numpy integer/bool array (known at trace time) is closed over as a constant, so
      ``f`` and the rule see the numpy array itself, as outside manual mode.
    * ``dargs``: one cotangent per argument (a tuple; for one argument the bare ``dx`` or
      ``(dx,)``), or the cotangents of the arguments that have one only, in order (the
      seed's ``index_vjp(x, i, dret) -> dx``). Each has its argument's shape; ``None``
      means zero. An integer array's entry must be ``None``.

    A rule whose signature cannot take that call is refused here; one whose result fits
    no form, at its first use -- by every tool alike, with one line
    (``nl.RuleContractError``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def cube_vjp(x, dret):
        ...     return 3 * x * x * dret
        >>> @hand_rule(cube_vjp)
        ... def cube(x):
        ...     return x**3
        >>> loss = manual_grads(lambda p: jnp.sum(cube(p)), check=False)
        >>> jax.jit(jax.grad(loss))(jnp.array([1.0, 2.0]))
        Array([ 3., 12.], dtype=float32)
    """

    def decorate(f: Callable) -> Callable:
        check_rule_signature(f, f_vjp)
        wrapped = _rule_function(f, f_vjp)
        if _is_library(f):
            register(wrapped, f_vjp)  # nnlite.rules lists it
        return wrapped

    return decorate


def _is_library(f: Callable) -> bool:
    """A public rule of nnlite's own (not a user's, nor one a doctest defines)."""
    code = getattr(f, "__code__", None)
    return (
        (getattr(f, "__module__", None) or "").startswith("nnlite.")
        and not f.__name__.startswith("_")
        and not (code is not None and code.co_filename.startswith("<"))
    )


def _rule_function(f: Callable, f_vjp: Callable) -> Callable:
    """``f`` itself outside manual mode; inside it, ``f`` plugged with ``f_vjp`` (the call
    noted for ``check_manual`` and recorded on show_grad's tape)."""
    who = f"{getattr(f_vjp, '__name__', 'the rule')} (the rule of {f.__name__})"
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
        note_rule(wrapped)
        # Every positional parameter as an argument (defaults filled in: the rule gets
        # ``(*args, dret)`` in f's order); keyword-only ones are static hyperparameters.
        bound = sig.bind(*args, **static)
        bound.apply_defaults()
        args = tuple(bound.arguments[n] for n in positional)
        static = {k: v for k, v in bound.arguments.items() if k not in positional}
        out = _plugged_call(f, f_vjp, who, args, static)
        tape = manual_tape()
        if tape is not None:
            tape.append((wrapped, args, static, out))
        return out

    wrapped.f = f  # type: ignore[attr-defined]
    wrapped.f_vjp = f_vjp  # type: ignore[attr-defined]
    return wrapped


def _plugged_call(f: Callable, f_vjp: Callable, who: str, args: tuple, static: dict):
    """``f(*args, **static)`` through ``jax.custom_vjp`` with the rule ``f_vjp``: the arrays
    differentiated, Python scalars closed over, arrays among ``static`` (a dropout key)
    passed along without a cotangent, frozen params without one either."""
    # Python scalars (a dropout rate) are hyperparameters too: closed over, not traced; so
    # are numpy integer arrays (rotary's static positions), which have no cotangent: f and
    # its rule see the same constants as outside manual mode.
    dyn_idx = [i for i, a in enumerate(args) if not is_hyperparameter(a) and not is_constant(a)]
    # Arrays among the hyperparameters (a dropout key) enter the custom_vjp as arguments
    # without a cotangent rather than closed over: a traced loss is then self-contained,
    # and manual_grads can evaluate its jaxpr in another trace.
    s_leaves, s_tree = jax.tree.flatten(static)
    s_arr = [i for i, leaf in enumerate(s_leaves) if _arrayish(leaf)]
    n_dyn = len(dyn_idx)
    operands = [args[i] for i in dyn_idx] + [s_leaves[i] for i in s_arr]

    def full(dyn):
        merged = list(args)
        for i, a in zip(dyn_idx, dyn[:n_dyn], strict=True):
            merged[i] = a
        leaves = list(s_leaves)
        for i, a in zip(s_arr, dyn[n_dyn:], strict=True):
            leaves[i] = a
        return merged, jax.tree.unflatten(s_tree, leaves)

    def fn(*dyn):
        merged, kw = full(dyn)
        with manual_scope(False):  # the rule's own ops are plain JAX
            return f(*merged, **kw)

    def fn_vjp(*dyn_dret):
        # a tuple result's cotangents come one by one after the operands
        dyn, drets = dyn_dret[: len(operands)], dyn_dret[len(operands) :]
        merged, kw = full(dyn)
        with manual_scope(False):
            dargs = cotangents(f_vjp(*merged, *drets, **kw), merged, who)
        picked = [dargs[i] for i in dyn_idx] + [None] * len(s_arr)
        return tuple(picked) if len(picked) > 1 else picked[0]

    fn.__name__ = f.__name__
    fn_vjp.__name__ = f_vjp.__name__
    # frozen params (the trainer's optimizer.frozen): no cotangent, none computed
    frozen = [k for k, a in enumerate(operands[:n_dyn]) if is_frozen(a)]
    nondiff = [*range(n_dyn, len(operands)), *frozen]
    return plug(fn, fn_vjp, nondiff=nondiff, record=False, prune=bool(frozen))(*operands)


# --- the check and the structural rules: the traced loss, equation by equation ----------


def _flat_call(fn: Callable, params: Any, args: tuple, kwargs: dict):
    """``(leaves, treedef, dyn)``: the loss's arguments as leaves, and which are arrays
    (traced; the others -- Python numbers, strings -- are closed over)."""
    leaves, treedef = jax.tree.flatten((params, args, kwargs))
    dyn = [i for i, leaf in enumerate(leaves) if _arrayish(leaf)]
    return leaves, treedef, dyn


def _trace(fn: Callable, leaves: list, treedef, dyn: list[int], frozen: frozenset = frozenset()):
    """The loss traced in manual mode: ``(closed jaxpr, output treedef)``; ``frozen``: the
    leaves (indices) that are frozen params (:func:`nnlite.core._mode.frozen_scope`)."""
    out_tree = []

    def flat(*xs):
        merged = list(leaves)
        for i, x in zip(dyn, xs, strict=True):
            merged[i] = x
        params, args, kwargs = jax.tree.unflatten(treedef, merged)
        with frozen_scope([merged[i] for i in frozen]):
            out, tree = jax.tree.flatten(fn(params, *args, **kwargs))
        out_tree.append(tree)
        return out

    with manual_scope(True):
        closed = jax.make_jaxpr(flat)(*(leaves[i] for i in dyn))
    return closed, out_tree[0]


def _signature(leaves: list, treedef, dyn: list[int]):
    """What the traced program depends on: the tree, each array's type, each other leaf's
    value. ``None`` when a leaf is unhashable (then the loss is traced at every call)."""
    dyn_set = set(dyn)
    key = (
        treedef,
        tuple(
            jax.typeof(leaf) if i in dyn_set else (type(leaf), leaf)
            for i, leaf in enumerate(leaves)
        ),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def check_manual(fn: Callable, params: Any, *args: Any, **kwargs: Any) -> tuple:
    """Raise ``ManualGradError`` unless every float computed from ``params`` by
    ``fn(params, *args)`` in manual mode comes out of a hand rule (a ``custom_vjp``) or an
    operation with a library rule (structural and linear primitives).

    Traces ``fn`` once and runs nothing, so the arguments may be ``jax.ShapeDtypeStruct``s:
    whether ``manual_grads(fn)`` can differentiate a model is known before any compile
    (the trainer's ``loss.grad: auto`` asks this).

    Returns:
        The hand rules ``fn`` calls (``@nl.hand_rule`` functions and ``nl.rules.custom_vjp``
        plug-ins, each with ``.f`` and ``.f_vjp``), once each, in call order: what a
        caller checks with ``nl.check_rules`` (the trainer checks the user's own).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> net = nl.Linear(3, 2)
        >>> p = jax.eval_shape(net.init, jax.random.key(0))
        >>> x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
        >>> rules = nl.check_manual(lambda p, x: jnp.sum(net(p, x)), p, x)  # covered
        >>> [rule.__name__ for rule in rules]
        ['linear']
        >>> try:
        ...     nl.check_manual(lambda p, x: jnp.sum(jax.lax.lgamma(net(p, x))), p, x)
        ... except nl.ManualGradError as e:
        ...     print(e.primitive, e.where is not None)
        lgamma True
    """
    leaves, treedef, dyn = _flat_call(fn, params, args, kwargs)
    with collect_rules() as rules:
        closed, _ = _trace(fn, leaves, treedef, dyn)
    n_params = len(jax.tree.leaves(params))
    analysis = analyse(closed.jaxpr, [i < n_params for i in dyn])
    if analysis.refusal is not None:
        raise _refused(analysis.refusal)
    return tuple(rules)


def _refused(refusal: Refusal) -> ManualGradError:
    primitive, where, layer = refusal_place(refusal)
    return ManualGradError(
        refusal_message(refusal), primitive=primitive, where=where, layer=layer or None
    )


def _arrayish(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def manual_grads(fn: Callable, *, check: bool = True) -> Callable:
    """``fn(params, *args)`` differentiated by hand rules only.

    Calls ``fn`` in manual mode: every nnlite layer and loss inside it runs through
    ``jax.custom_vjp`` with its hand rule. The first call with given argument types
    also traces ``fn``; the plain ``jnp`` operations between layers that compute on values
    derived from the params (``tok + pos``, ``jnp.mean(h, axis=-2)``, ``h[:, 0]``,
    ``x.reshape``, ``.astype``, a ``jnp.concatenate``) then run with the library's rule for
    their primitive (``nnlite.rules``: ``add``, ``reduce_sum``, ``gather``, ...), so
    ``jax.grad`` of the result uses no autodiff of anything computed from the params. A
    model without such operations runs exactly as written. ``jax.checkpoint`` inside
    ``fn`` keeps recomputing its forward pass, with the hand rules run backward.

    Args:
        fn: ``fn(params, *args, **kwargs)``; params is the first argument.
        check: raise ``ManualGradError`` (naming the primitive, your source line and the
            layer) when a nonlinear operation without a rule computes on the params; with
            ``False`` JAX's autodiff differentiates it silently.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> net = nl.FFN(3, (4,), 2)
        >>> p = jax.jit(net.init)(jax.random.key(0))
        >>> x, y = jnp.ones((5, 3)), jnp.zeros(5, jnp.int32)
        >>> def loss(p, x, y):
        ...     return nl.softmax_cross_entropy(net(p, x), y, reduction="mean")
        >>> g_hand = jax.jit(jax.grad(nl.manual_grads(loss)))(p, x, y)
        >>> g_auto = jax.jit(jax.grad(loss))(p, x, y)
        >>> bool(jnp.allclose(g_hand.layers[0].W, g_auto.layers[0].W, atol=1e-6))
        True
    """
    plans: dict = {}  # argument signature -> whether structural rules apply

    @functools.wraps(fn)
    def wrapped(params, *args, **kwargs):
        if manual_active():  # inside another manual_grads or show_grad: it does the work
            return fn(params, *args, **kwargs)
        leaves, treedef, dyn = _flat_call(fn, params, args, kwargs)
        n_params = len(jax.tree.leaves(params))
        frozen = frozenset(i for i in range(n_params) if is_frozen(leaves[i]))
        sig = _signature(leaves, treedef, dyn)
        sig = sig if sig is None or not frozen else (sig, frozen)
        if plans.get(sig) is False:
            with manual_scope(True):
                return fn(params, *args, **kwargs)
        # The loss is traced at each call that needs the rules (a cached jaxpr could hold
        # tracers that the caller's earlier trace closed over).
        closed, out_tree = _trace(fn, leaves, treedef, dyn, frozen)
        tainted = [i < n_params and i not in frozen for i in dyn]
        analysis = analyse(closed.jaxpr, tainted)
        if sig not in plans:
            if check and analysis.refusal is not None:
                raise _refused(analysis.refusal)
            if sig is not None:
                plans[sig] = analysis.uses_rules
        if not analysis.uses_rules:
            with manual_scope(True):
                return fn(params, *args, **kwargs)
        outs = Evaluator(analysis).run(
            closed.jaxpr, closed.consts, [leaves[i] for i in dyn], tainted
        )
        return jax.tree.unflatten(out_tree, outs)

    return wrapped
