"""``loss.grad: auto`` (the default): the hand rules when they cover the model, else autodiff.

Resolved once, in ``build``, before anything compiles: the model's objective (with its
loss) is traced in manual mode on abstract values (``nl.check_manual``: shapes only, no
data, no compile) at the shape one microbatch has inside the step. If every operation
computing on the params has a hand rule or a library rule, ``auto`` is ``manual`` (on the
shipped GPT 28-40% less time per step on a CPU than autodiff); otherwise it is ``autodiff``
and the run says once which operation forced it, where the user's code computes it and in
which layer. A model whose ``grad_modes`` leaves out manual (train/model/contract.py) resolves to
autodiff. ``auto`` never picks a model's own pass (``fused``).

The result is a pure function of the model and the config (a trace is deterministic), so
every process of a run, and a resumed run, resolve alike; the banner shows it
(``grad auto -> manual``) and each checkpoint records it (metadata ``grad_mode``).

The same trace lists the hand rules the objective calls (``nl.check_manual`` returns
them); those that are not nnlite's own (a user's ``@nl.hand_rule`` or ``nl.vjp.custom_vjp``)
are ``GradMode.rules``, which the trainer checks against ``jax.vjp`` before step 1
(``loss.check_rules``, train/step/checkgrads.py). Under ``loss.grad: manual`` the objective
is traced for that list alone (on shapes; what ``auto`` costs).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import jax

import nnlite as nl

from . import contract

AUTO = "auto"
#: Where a user reads how to give an operation its rule.
RULES_DOC = "docs/gradients.md"


@dataclass(frozen=True)
class GradMode:
    """``loss.grad`` as the step uses it."""

    asked: str  # the config's loss.grad (auto, autodiff, manual, fused)
    mode: str  # what the step differentiates with: autodiff, manual or fused
    note: str | None = None  # auto fell back to autodiff because of an operation: one line
    # the user's hand rules the objective calls (manual only; nnlite's own left out)
    rules: tuple = ()
    rules_note: str | None = None  # the banner's line on them: checked, or not (checkgrads)

    def describe(self) -> str:
        """``auto -> manual`` for a resolved auto, else the mode itself."""
        return f"{AUTO} -> {self.mode}" if self.asked == AUTO else self.mode


def resolve(cfg, model, data, strategy) -> GradMode:
    """``cfg.loss.grad`` for ``model`` on ``data`` under ``strategy``: ``auto`` resolved to
    manual or autodiff (see the module docstring), any other mode as it is."""
    asked = cfg.loss.grad
    if asked == AUTO:
        return resolve_auto(model, *microbatch(cfg, data, strategy))
    if asked == "manual":  # which of the user's rules it runs: checked, or named unchecked
        try:
            rules = manual_rules(model, *microbatch(cfg, data, strategy))
        except nl.ManualGradError:  # the step's compile refuses it, in its own words
            rules = ()
        return GradMode(asked, asked, rules=user_rules(rules))
    return GradMode(asked, asked)


def resolve_auto(model, x, y) -> GradMode:
    """``auto`` for ``model`` trained on batches like ``x``, ``y`` (arrays or
    ``jax.ShapeDtypeStruct``s of one device's microbatch): manual if its hand rules cover
    its objective, else autodiff. Traces the objective once; runs and compiles nothing."""
    if "manual" not in contract.grad_modes(model):
        return GradMode(AUTO, "autodiff")
    try:
        rules = manual_rules(model, x, y)
    except nl.ManualGradError as e:
        return GradMode(AUTO, "autodiff", fallback_line(e))
    return GradMode(AUTO, "manual", rules=user_rules(rules))


def manual_rules(model, x, y) -> tuple:
    """The hand rules ``model``'s objective calls in manual mode on batches like ``x``,
    ``y`` (``nl.check_manual``: one trace on shapes); raises ``nl.ManualGradError`` when
    an operation on the params has no rule."""
    params = contract.param_shapes(model)
    objective = contract.objective_fn(model, "manual")
    key = jax.eval_shape(jax.random.key, 0) if contract.uses_key(model) else None
    # a stateful model's state is an argument beside the params, never differentiated
    state = jax.eval_shape(model.init_state) if contract.is_stateful(model) else None

    def fn(p, x, y, key, state):
        kw = {} if key is None else {"key": key}
        return objective(p, x, y, **kw, **({} if state is None else {"state": state}))

    return nl.check_manual(fn, params, x, y, key, state)


#: Where nnlite's own rules live besides the library: the trainer (its taps).
_TRAINER = Path(__file__).resolve().parents[1]


@functools.cache
def _own_module(name: str) -> bool:
    if name == "nnlite" or name.startswith("nnlite."):
        return True
    file = getattr(sys.modules.get(name), "__file__", None)
    return bool(file) and Path(file).resolve().is_relative_to(_TRAINER)


def is_own_rule(rule) -> bool:
    """Whether ``rule`` (a hand-rule function, ``.f`` and ``.f_vjp``) is nnlite's own: both
    functions defined in nnlite or in the trainer. Those are tested with the library and
    never checked at start-up."""
    fns = (getattr(rule, "f", None), getattr(rule, "f_vjp", None))
    return all(_own_module(getattr(fn, "__module__", None) or "") for fn in fns)


def user_rules(rules) -> tuple:
    """The rules of ``rules`` that are not nnlite's own, in order."""
    return tuple(rule for rule in rules if not is_own_rule(rule))


def fallback_line(e: nl.ManualGradError) -> str:
    """The one line a run prints when ``auto`` falls back to autodiff."""
    at = f" at {e.where}" if e.where else ""
    layer = f" in layer {e.layer}" if e.layer else ""
    return (
        f"loss.grad {AUTO}: autodiff (manual needs a rule for {e.primitive!r}{at}{layer}; "
        f"see {RULES_DOC})"
    )


def microbatch(cfg, data, strategy) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """``(x, y)`` as ``ShapeDtypeStruct``s of one device's microbatch inside the step."""
    local = max(cfg.train.batch_size // len(strategy.devices), 1)
    micro = max(local // cfg.train.grad_accum_steps, 1)
    # What the step gathers: rows, or text windows of `window` tokens per example.
    lead = (micro,) if data.window is None else (micro, data.window)
    x = jax.ShapeDtypeStruct((*lead, *data.x.shape[1:]), data.x.dtype)
    y = jax.ShapeDtypeStruct((*lead, *data.y.shape[1:]), data.y.dtype)
    return x, y
