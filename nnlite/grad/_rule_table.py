"""Rule tables: every ``(f, f_vjp)`` pair a namespace defines, and each as a plug-in.

``nnlite.vjp``, ``nnlite.vjp.batched`` and ``nnlite.rules`` build their ``RULES`` with
``rule_table``, and the two VJP libraries their ``hand`` namespaces with ``hand_functions``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._custom_vjp import custom_vjp

__all__ = ["hand_functions", "rule_table"]


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


def hand_functions(rules: Mapping[str, tuple[Callable, Callable]]) -> types.SimpleNamespace:
    """Every rule of a ``rule_table`` as a ``custom_vjp`` function: ``hand.mm`` computes
    ``mm`` and ``jax.grad`` differentiates it with ``mm_vjp``."""
    return types.SimpleNamespace(
        **{name: custom_vjp(f, f_vjp) for name, (f, f_vjp) in rules.items()}
    )
