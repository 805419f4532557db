"""Manual-gradient mode's trace-time state: a flag, and show_grad's tape, per thread.

``nl.manual_grads`` and ``nl.show_grad`` (the gradient part) set it; ``Module`` reads it
(each call becomes a named scope, so a missing hand rule is reported with its layer) and
so do layers that pick their path with a hand rule in manual mode. It lives in the core so
that the core reads it without importing the gradient part, which builds on the core.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ._jax_private import manual_trace_state

manual_trace_state()  # registered now, not on first use (see its docstring)

__all__ = [
    "collect_rules",
    "frozen_scope",
    "is_frozen",
    "manual_active",
    "manual_scope",
    "manual_tape",
    "note_rule",
]

_state = threading.local()


def manual_active() -> bool:
    """True while a function wrapped by ``manual_grads`` is being traced or run."""
    return getattr(_state, "on", False)


def manual_tape() -> list | None:
    """The list ``show_grad`` records each hand-rule call on, or None."""
    return getattr(_state, "tape", None)


@contextlib.contextmanager
def manual_scope(on: bool = True, tape: list | None = None) -> Iterator[None]:
    """Turn manual mode ``on`` (or off) with ``tape`` for the block; restores both after.

    The flag is mirrored into JAX's trace context, so that what JAX caches by function
    (a ``jax.checkpoint`` or ``jax.jit`` body) is traced once per mode.
    """
    prev = (manual_active(), manual_tape())
    _state.on, _state.tape = on, tape
    try:
        with manual_trace_state()(on):
            yield
    finally:
        _state.on, _state.tape = prev


def is_frozen(x) -> bool:
    """Whether ``x`` is one of the frozen params of the trace (:func:`frozen_scope`): a
    hand rule then computes no cotangent for it."""
    return any(x is f for f in getattr(_state, "frozen", ()))


@contextlib.contextmanager
def frozen_scope(values) -> Iterator[None]:
    """Mark ``values`` (traced params that are not differentiated: frozen) for the block,
    added to those already marked."""
    prev = getattr(_state, "frozen", ())
    _state.frozen = (*prev, *values)
    try:
        yield
    finally:
        _state.frozen = prev


@contextlib.contextmanager
def collect_rules() -> Iterator[dict]:
    """Collect, in call order, every hand rule called in manual mode in the block (the
    keys of the dict it yields). Unlike the tape it survives ``manual_scope``, so a rule
    called where manual mode is entered anew (an ``nl.Stack``'s body, analysed on its own)
    is collected too; a collection inside another also feeds the outer one."""
    stack = getattr(_state, "collectors", ())
    seen: dict = {}
    _state.collectors = (*stack, seen)
    try:
        yield seen
    finally:
        _state.collectors = stack


def note_rule(rule) -> None:
    """Record ``rule`` (a hand-rule function with ``.f`` and ``.f_vjp``) in every open
    :func:`collect_rules`; nothing when none is open (one attribute test)."""
    for seen in getattr(_state, "collectors", ()):
        seen.setdefault(rule, None)
