"""Plug a rule into JAX: ``custom_vjp(f, f_vjp)`` and ``@with_vjp(f_vjp)``.

The rule ``f_vjp(*args, dret) -> dargs`` becomes the backward pass of a
``jax.custom_vjp`` function, so ``jax.grad``, ``jit``, ``vmap``, ``pmap`` and ``shard_map``
run it. ``match_primal`` gives a cotangent its primal's dtype and ``shard_map`` varying
axes, as JAX's autodiff would; a hand-written ``jax.custom_vjp`` backward pass needs it too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ..core._jax_private import dce_call
from ..core._mode import manual_active, manual_tape, note_rule
from ._check import _dret_args, _is_none, _name
from ._contract import check_rule_signature, cotangents, has_cotangent, is_hyperparameter

__all__ = ["custom_vjp", "match_primal", "with_vjp"]


def _varying(x: Any) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def match_primal(ct: Any, primal: Any) -> Any:
    """Make a cotangent's type match its primal's: dtype, and shard_map varying axes.

    Inside ``shard_map`` a rule computing ``dW = x.T @ dy`` from a device-varying ``x``
    gives a varying ``dW`` for a replicated ``W``; the transpose of that implicit broadcast
    is a ``psum`` over the extra axes -- what JAX's own autodiff inserts. ``custom_vjp``
    applies it to every cotangent a rule returns; a backward pass written directly for
    ``jax.custom_vjp`` applies it itself.

    Example:
        >>> import jax.numpy as jnp
        >>> match_primal(jnp.ones(2), jnp.zeros(2, jnp.bfloat16)).dtype
        dtype(bfloat16)
    """
    if ct is None:
        return None
    ct = jnp.asarray(ct)
    if ct.dtype != jnp.result_type(primal):
        ct = ct.astype(jnp.result_type(primal))
    extra = tuple(sorted(_varying(ct) - _varying(primal)))
    if extra:
        ct = jax.lax.psum(ct, extra)
    missing = tuple(sorted(_varying(primal) - _varying(ct)))
    if missing:
        ct = jax.lax.pcast(ct, missing, to="varying")
    return ct


def custom_vjp(f: Callable, f_vjp: Callable, *, nondiff: Iterable[int] = ()) -> Callable:
    """``f`` as a ``jax.custom_vjp`` function whose backward pass is ``f_vjp``.

    ``jax.grad``, ``jit``, ``vmap``, ``pmap`` and ``shard_map`` then use the hand rule.
    The rule is called as ``f_vjp(*args, dret)`` with the original arguments (saved as
    residuals by the forward pass); a tuple result's cotangents come one by one
    (``f_vjp(*args, *dret)``), as in ``check_rule``.

    Which arguments get a cotangent (the rule contract, ``docs/gradients.md``):
      * Python scalars (ints, floats, strings, None, slices) are hyperparameters: they
        are closed over, never traced, and the rule's cotangent for them is ignored.
      * Integer/bool arrays (labels, indices) are traced but get a zero cotangent; the
        rule returns ``None`` for them, or leaves them out.
      * Positions in ``nondiff`` are treated the same way (zero cotangent) even if float.

    Inside ``shard_map`` a cotangent that varies over more mesh axes than its primal is
    ``psum``-ed over the extra axes, as JAX's autodiff does for replicated parameters.

    Args:
        f: the forward function.
        f_vjp: ``f_vjp(*args, dret) -> dargs``.
        nondiff: argument positions that must not be differentiated.

    Returns:
        A function with ``f``'s signature (positional arguments).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def cube(x):
        ...     return x ** 3
        >>> def cube_vjp(x, dret):
        ...     return 3 * x * x * dret
        >>> hand_cube = custom_vjp(cube, cube_vjp)
        >>> float(jax.grad(hand_cube)(2.0))
        12.0
    """
    return plug(f, f_vjp, nondiff=nondiff, record=True)


def plug(
    f: Callable, f_vjp: Callable, *, nondiff: Iterable[int] = (), record: bool, prune: bool = False
) -> Callable:
    """``custom_vjp``; ``record``: put each call on show_grad's tape (``hand_rule``
    records its own calls, with their hyperparameters). ``prune``: the backward pass keeps
    only the rule's computations that the wanted cotangents need (not those of the
    ``nondiff`` arguments: a frozen weight's gradient is never in the trace)."""
    check_rule_signature(f, f_vjp)
    nondiff = frozenset(nondiff)
    who = f"{_name(f_vjp)} (the rule of {_name(f)})"

    @functools.wraps(f)
    def wrapped(*args):
        dyn_idx = tuple(i for i, a in enumerate(args) if not is_hyperparameter(a))

        def full(dyn):
            merged = list(args)
            for i, a in zip(dyn_idx, dyn, strict=True):
                merged[i] = a
            return merged

        @jax.custom_vjp
        def g(*dyn):
            return f(*full(dyn))

        def fwd(*dyn):
            return f(*full(dyn)), dyn

        def bwd(dyn, dret):
            merged = full(dyn)
            if prune:
                dargs = dict(zip(wanted(dyn), dce_call(rule_wanted, dyn, dret), strict=True))
            else:
                dargs = dict(enumerate(cotangents(f_vjp(*merged, *_dret_args(dret)), merged, who)))
            out = []
            for i, a in zip(dyn_idx, dyn, strict=True):
                if i in nondiff or not has_cotangent(a) or dargs.get(i) is None:
                    out.append(None)
                else:
                    out.append(jax.tree.map(match_primal, dargs[i], a, is_leaf=_is_none))
            return tuple(out)

        def wanted(dyn):
            return [
                i
                for i, a in zip(dyn_idx, dyn, strict=True)
                if i not in nondiff and has_cotangent(a)
            ]

        def rule_wanted(dyn, dret):
            merged = full(dyn)
            dargs = cotangents(f_vjp(*merged, *_dret_args(dret)), merged, who)
            return [dargs[i] for i in wanted(dyn)]

        g.defvjp(fwd, bwd)
        out = g(*(args[i] for i in dyn_idx))
        if record and manual_active():
            note_rule(wrapped)  # nl.check_manual lists it (a user's plug-in: checked)
            tape = manual_tape()
            if tape is not None:  # show_grad prints this call with the rule
                tape.append((wrapped, args, {}, out))
        return out

    wrapped.f = f
    wrapped.f_vjp = f_vjp
    return wrapped


def with_vjp(f_vjp: Callable, *, nondiff: Iterable[int] = ()) -> Callable[[Callable], Callable]:
    """Decorator form of ``custom_vjp``: ``@with_vjp(f_vjp)`` above ``def f(...)``.

    Example:
        >>> import jax
        >>> def square_vjp(x, dret):
        ...     return 2 * x * dret
        >>> @with_vjp(square_vjp)
        ... def square(x):
        ...     return x * x
        >>> float(jax.grad(square)(3.0))
        6.0
    """
    return lambda f: custom_vjp(f, f_vjp, nondiff=nondiff)
