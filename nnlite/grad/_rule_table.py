"""The one table of nnlite's rules: ``name -> (f, f_vjp)``, filled where each rule is defined.

``@hand_rule`` registers every rule a module of nnlite declares with it (the layers',
losses' and activations' rules); the modules of plain pairs (the primitives' rules, the
small composable rules) register theirs with ``register_pairs``. ``nnlite.rules`` is
generated from this table, and ``show_grad`` reads it to import a rule by its public name.
A name means one rule: registering another pair under a taken name raises, except for a
``hand_rule`` wrapper of the very pair already there (``nl.add`` of the ``add`` primitive's
rule), which takes its place.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._custom_vjp import custom_vjp

__all__ = [
    "RULE_TABLE",
    "hand_functions",
    "public_name",
    "register",
    "register_pairs",
    "rule_table",
    "same_function",
]

#: ``name -> (f, f_vjp)``: every rule nnlite defines, in registration order.
RULE_TABLE: dict[str, tuple[Callable, Callable]] = {}


def _plain(f: Callable) -> Callable:
    """The function a ``hand_rule`` / ``custom_vjp`` wrapper calls (``f`` itself if none)."""
    return getattr(f, "f", f)


def register(f: Callable, f_vjp: Callable, name: str | None = None) -> None:
    """Enter the rule ``(f, f_vjp)`` in the table under ``name`` (default ``f.__name__``).

    Raises:
        ValueError: another rule has that name (one name, one rule).
    """
    name = name or f.__name__
    old = RULE_TABLE.get(name)
    if old is not None and old != (f, f_vjp):
        g, g_vjp = old
        same_pair = g_vjp is f_vjp and _plain(g) is _plain(f)
        rerun = _code(g) is _code(f) and _code(g_vjp) is _code(f_vjp)  # a doctest, a reload
        if not (same_pair or rerun):
            raise ValueError(
                f"two rules named {name}: {g.__module__}.{g.__qualname__} and "
                f"{f.__module__}.{f.__qualname__}; a name means one rule in nnlite.rules"
            )
        if hasattr(g, "f") and not hasattr(f, "f"):
            return  # the hand_rule wrapper stays: it records the call in manual mode
    RULE_TABLE[name] = (f, f_vjp)


def _code(f: Callable) -> Any:
    return getattr(_plain(f), "__code__", None)


def rule_table(
    namespace: Mapping[str, Any], names: Iterable[str] | None = None
) -> dict[str, tuple[Callable, Callable]]:
    """``{name: (f, f_vjp)}`` for every function ``name`` whose rule ``name + "_vjp"`` is
    there too.

    Args:
        namespace: where to look up the names (a module's ``vars()``, ``globals()``).
        names: the names to consider (a module's ``__all__``); default: all of
            ``namespace``. A rule counts only when both names are among them.

    Returns:
        The pairs, in the order of ``names``.

    Example:
        >>> def cube(x):
        ...     return x**3
        >>> def cube_vjp(x, dret):
        ...     return 3 * x * x * dret
        >>> list(rule_table({"cube": cube, "cube_vjp": cube_vjp, "helper": len}))
        ['cube']
    """
    names = list(namespace if names is None else names)
    present = set(names)
    return {
        name: (namespace[name], namespace[name + "_vjp"])
        for name in names
        if not name.endswith("_vjp") and name + "_vjp" in present and callable(namespace[name])
    }


def register_pairs(namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """``register`` every pair of ``rule_table(namespace, names)`` under its name."""
    for name, (f, f_vjp) in rule_table(namespace, names).items():
        register(f, f_vjp, name)


def public_name(fn: Callable) -> str | None:
    """The name ``nnlite.rules`` gives ``fn`` (a rule's function, its plain function, or its
    VJP), or ``None`` when ``fn`` is none of the table's."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return None
    pair = RULE_TABLE.get(name)
    if pair is not None and same_function(pair[0], fn):
        return name
    pair = RULE_TABLE.get(name.removesuffix("_vjp")) if name.endswith("_vjp") else None
    return name if pair is not None and pair[1] is fn else None


def same_function(a: Any, b: Any) -> bool:
    """``a`` and ``b`` compute the same when called plainly: one object, or one is the
    other's plug-in (``hand_rule`` / ``custom_vjp`` keep the plain function as ``.f``)."""
    if a is None or b is None:
        return False
    fa, fb = getattr(a, "f", None), getattr(b, "f", None)
    return a is b or fa is b or fb is a or (fa is not None and fa is fb)


def hand_functions(rules: Mapping[str, tuple[Callable, Callable]]) -> types.SimpleNamespace:
    """Every rule of a ``rule_table`` as a ``custom_vjp`` function: ``plugged.mm`` computes
    ``mm`` and ``jax.grad`` differentiates it with ``mm_vjp``."""
    return types.SimpleNamespace(
        **{name: custom_vjp(f, f_vjp) for name, (f, f_vjp) in rules.items()}
    )
