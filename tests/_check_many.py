"""``check_rule`` of several rules at once: one compiled program instead of one per rule.

Each ``check_rule`` call traces, lowers and compiles its own program (``jax.vjp`` and the
rule side by side); for the tests' tiny shapes the compile's fixed cost is most of a
check (~60 ms of ~100 ms). ``check_many`` hands ``check_rule`` one function that returns
every case's result and one rule that returns every case's cotangents -- each case's rule
called as the contract calls it (its own cotangent(s), its result read by
``nnlite.grad._contract.cotangents``, the function ``check_rule`` reads rules with) -- so
every argument of every case is compared with ``jax.vjp``'s cotangent, at its own dtype's
tolerance, exactly as alone. When the bundle fails, each case is checked alone, so the
error names the rule.
"""

from __future__ import annotations

import functools

from nnlite.grad._check import ensure_tuple
from nnlite.grad._contract import cotangents
from nnlite.rules import VJPCheckError, check_rule


def case(f, f_vjp, *args, **static):
    """One check: ``f`` and ``f_vjp`` with the keyword hyperparameters ``static`` bound."""
    if static:
        name, rule_name = f.__name__, f_vjp.__name__
        f, f_vjp = functools.partial(f, **static), functools.partial(f_vjp, **static)
        f.__name__, f_vjp.__name__ = name, rule_name
    return f, f_vjp, args


def rule_case(rule, *args, **static):
    """One check of an ``@nl.hand_rule`` function's plain pair (``_tolerance.check_rule``'s)."""
    return case(rule.f, rule.f_vjp, *args, **static)


def check_many(cases, **kw) -> None:
    """``check_rule`` of every ``(f, f_vjp, args)`` in ``cases`` in one call (``kw``: its
    keywords); on a failure, the failing case's own ``check_rule`` error."""
    cases = list(cases)
    spans, flat = [], []
    for _, _, args in cases:
        spans.append((len(flat), len(flat) + len(args)))
        flat.extend(args)

    def all_f(*xs):
        return tuple(f(*xs[i:j]) for (f, _, _), (i, j) in zip(cases, spans, strict=True))

    def all_vjp(*xs_and_drets):
        xs, drets = xs_and_drets[: len(flat)], xs_and_drets[len(flat) :]
        out = []
        for (f, f_vjp, _), (i, j), dret in zip(cases, spans, drets, strict=True):
            args = xs[i:j]
            who = f"check_rule({f.__name__}, {f_vjp.__name__})"
            out.extend(cotangents(f_vjp(*args, *ensure_tuple(dret)), args, who))
        return tuple(out)

    try:
        check_rule(all_f, all_vjp, *flat, **kw)
    except VJPCheckError:
        for f, f_vjp, args in cases:
            check_rule(f, f_vjp, *args, **kw)  # raises with the rule's name
        raise
