"""The rule contract: what a rule's VJP takes and returns, stated and enforced once.

``hand_rule``, ``custom_vjp``, ``manual_grads``, ``check_rule`` and ``show_grad`` all read a
rule's result through ``cotangents`` (or its layout, ``rule_layout``), so one rule means the
same thing to every tool; a rule that breaks the contract is refused with one line, by
``check_rule_signature`` when it is declared and by ``cotangents`` at its first use (trace
time: nothing of this runs in a compiled step).

The contract (also in ``docs/gradients.md`` and ``nl.hand_rule``'s docstring)::

    f_vjp(*args, *drets, **hyperparameters) -> dargs

* ``args``: ``f``'s positional arguments, in ``f``'s order (defaults filled in);
  ``drets``: the cotangent of ``f``'s result, one per output when ``f`` returns a tuple,
  always arrays (zeros for an output nothing depends on, never ``None``);
  ``hyperparameters``: ``f``'s keyword-only arguments, as keywords.
* An argument *has a cotangent* when it is a float array (or a pytree holding one).
  Python scalars (``bool``, ``int``, ``float``, ``str``, ``None``) are hyperparameters and
  integer/bool arrays (labels, indices) are not differentiable: they have none.
* ``dargs`` is one of:
    - one cotangent per argument: a tuple ``(dx, dy, ...)``, or for a one-argument ``f``
      the bare ``dx`` (``(dx,)`` is accepted too);
    - the short form, when some arguments have no cotangent: the cotangents of the others
      only, in order -- a bare ``dx`` when there is one (the seed's
      ``index_vjp(x, i, dret) -> dx``).
* Each cotangent has its argument's shape (its dtype is cast to the argument's);
  ``None`` means zero, for any argument. What a rule returns for an argument without a
  cotangent is ignored; for an integer array it must be ``None`` (or float0), so that a
  slip is not hidden.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "RuleContractError",
    "VJPCheckError",
    "check_rule_signature",
    "cotangents",
    "has_cotangent",
    "is_hyperparameter",
    "rule_layout",
]


class VJPCheckError(AssertionError):
    """A rule disagrees with ``jax.vjp`` (values, shapes or tree structure).

    Subclasses ``AssertionError`` so that a failed check reads as a failed test.
    """


VJPCheckError.__module__ = "nnlite.rules"  # its public home


class RuleContractError(VJPCheckError, TypeError):
    """A rule breaks the rule contract (its signature, or what it returns).

    A ``TypeError`` (the rule is called or written wrongly) and a ``VJPCheckError`` (so a
    check of the rule fails as a test).
    """


RuleContractError.__module__ = "nnlite"  # its public home

_PY_SCALARS = (bool, int, float, complex, str, type(None))


def is_hyperparameter(a: Any) -> bool:
    """A Python scalar (or a pytree of them, a slice, a string): closed over, never traced."""
    leaves = jax.tree.leaves(a)
    return all(
        not isinstance(leaf, (np.ndarray, np.generic, jax.Array)) and not hasattr(leaf, "aval")
        for leaf in leaves
    )


def is_constant(a: Any) -> bool:
    """A numpy integer or boolean array (rotary's static positions): known at trace time and
    without a cotangent, so a hand rule's call closes over it, as over a hyperparameter."""
    return isinstance(a, np.ndarray | np.generic) and not np.issubdtype(a.dtype, np.inexact)


def _leaf_has_cotangent(leaf: Any) -> bool:
    # JAX's typed literals (a float subclass with a dtype: a weakly typed scalar that was
    # traced) are values, not hyperparameters: only the plain Python types are closed over
    if type(leaf) in _PY_SCALARS or not hasattr(leaf, "dtype"):
        return False
    return bool(jnp.issubdtype(leaf.dtype, jnp.inexact))


def has_cotangent(a: Any) -> bool:
    """Whether argument ``a`` gets a cotangent: a float array, or a pytree holding one."""
    return any(_leaf_has_cotangent(leaf) for leaf in jax.tree.leaves(a))


def _describe(d: Any) -> str:
    if d is None:
        return "None"
    if isinstance(d, tuple):
        return f"a tuple of {len(d)}"
    if isinstance(d, list):
        return f"a list of {len(d)}"
    if hasattr(d, "shape") and hasattr(d, "dtype"):
        return f"an array of shape {tuple(d.shape)}"
    return type(d).__name__


def rule_layout(dargs: Any, args: Sequence[Any], who: str) -> tuple[bool, list[int]]:
    """How a rule's result maps onto the arguments: ``(bare, positions)``.

    ``bare``: the result is one cotangent, not a tuple; ``positions[k]``: the argument the
    ``k``-th returned value belongs to. Raises ``RuleContractError`` for a result that fits
    no form of the contract.
    """
    n = len(args)
    if n == 0:
        raise RuleContractError(
            f"{who}: a rule of a function without arguments has nothing to return"
        )
    if isinstance(dargs, list) and n > 1:
        dargs = tuple(dargs)
    if n == 1:
        if isinstance(dargs, tuple) and len(dargs) == 1 and not isinstance(args[0], tuple):
            return False, [0]  # (dx,)
        return True, [0]
    if isinstance(dargs, tuple) and len(dargs) == n:
        return False, list(range(n))
    diff = [i for i, a in enumerate(args) if has_cotangent(a)]
    if isinstance(dargs, tuple) and len(dargs) == len(diff) and len(diff) < n:
        return False, diff
    if not isinstance(dargs, tuple) and len(diff) == 1:
        return True, diff
    also = f" (or {len(diff)}, one per differentiable argument)" if len(diff) < n else ""
    got = "a single array" if hasattr(dargs, "shape") else _describe(dargs)
    raise RuleContractError(
        f"{who}: a VJP rule returns one cotangent per argument, a tuple of {n} here{also}; "
        f"got {got}"
    )


def cotangents(dargs: Any, args: Sequence[Any], who: str) -> tuple:
    """The rule's result ``dargs`` as one cotangent per argument (``None`` where it gave
    none), its shapes checked against the arguments'.

    Raises ``RuleContractError`` naming the rule, what it returned and what is expected.
    """
    bare, positions = rule_layout(dargs, args, who)
    got = (dargs,) if bare else tuple(dargs)
    out: list[Any] = [None] * len(args)
    for p, d in zip(positions, got, strict=True):
        out[p] = d
    for i, (a, d) in enumerate(zip(args, out, strict=True)):
        if d is None or not hasattr(a, "shape") or not hasattr(a, "dtype"):
            continue
        if not has_cotangent(a):
            continue  # ignored (check_vjp insists on None for integer arrays)
        if isinstance(d, (tuple, list, dict)) or not (
            hasattr(d, "shape") or isinstance(d, (int, float, np.generic))
        ):
            raise RuleContractError(
                f"{who}: the cotangent of argument {i} must be an array of shape "
                f"{tuple(a.shape)} (or None), got {_describe(d)}"
            )
        if tuple(np.shape(d)) != tuple(a.shape):
            raise RuleContractError(
                f"{who}: cotangent of argument {i} has shape {tuple(np.shape(d))}, expected "
                f"{tuple(a.shape)} (the argument's shape)"
            )
    return tuple(out)


def _positional(sig: inspect.Signature) -> tuple[list[str], bool]:
    names = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    star = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    return names, star


def check_rule_signature(f: Callable, f_vjp: Callable) -> None:
    """Refuse, at declaration, a rule that cannot be called as the contract calls it:
    ``f_vjp(*args, dret, **hyperparameters)`` for ``f(*args, **hyperparameters)``."""
    if not callable(f_vjp):
        raise RuleContractError(
            f"hand_rule: the rule of {_name(f)} must be a function "
            f"f_vjp(*args, dret) -> dargs, got {type(f_vjp).__name__}"
        )
    try:
        sig_f, sig_r = inspect.signature(f), inspect.signature(f_vjp)
    except (TypeError, ValueError):
        return  # builtins, C functions: nothing to read; checked at first use
    pos_f, star_f = _positional(sig_f)
    pos_r, star_r = _positional(sig_r)
    who = f"hand_rule({_name(f_vjp)}) on {_name(f)}"
    if not star_f and not star_r and len(pos_r) < len(pos_f) + 1:
        raise RuleContractError(
            f"{who}: the rule takes {len(pos_r)} positional arguments ({', '.join(pos_r)}); it "
            f"must take {_name(f)}'s {len(pos_f)} ({', '.join(pos_f)}) and then the cotangent "
            "of the result: f_vjp(*args, dret)"
        )
    kw_f = [p.name for p in sig_f.parameters.values() if p.kind is p.KEYWORD_ONLY]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig_r.parameters.values())
    accepted = {
        p.name
        for p in sig_r.parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    missing = [k for k in kw_f if k not in accepted]
    if missing and not takes_any:
        raise RuleContractError(
            f"{who}: {_name(f)}'s keyword-only arguments are passed to the rule as keywords; "
            f"the rule does not take {', '.join(missing)}"
        )


def _name(f: Callable) -> str:
    return getattr(f, "__name__", None) or type(f).__name__
