"""Manual mode at the level of JAX's primitives: which equations of a traced loss need a
rule, and the evaluation of the loss that applies the library's structural rules.

A loss traced in manual mode is a jaxpr in which every nnlite layer and loss is one
``custom_vjp_call`` (its hand rule) and everything the user wrote between layers in plain
``jnp`` (``tok + pos``, ``jnp.mean(h, axis=-2)``, ``h[:, 0]``, ``x.reshape(...)``) is an
equation of its own. Taint marks the float values computed from the params. Each equation
with a tainted input is then:

* ``hand``: a ``custom_vjp`` call (a hand rule) -- JAX runs the rule;
* ``rule``: a primitive with a library rule (``_structural.PRIMITIVE_RULES``: layout,
  arithmetic, elementwise math, reductions, sorting, convolutions; ``jax.nn.relu`` by
  name) -- evaluated as a ``custom_vjp`` whose backward pass is that rule;
* ``nested``: ``jit``, ``jax.checkpoint``, ``lax.scan``, ``lax.cond``, a ``jax.custom_jvp``
  function, a ``while`` with a trip count known at trace time -- walked into; when a body
  needs a rule, the construct is rebuilt around the evaluated body (a checkpoint still
  recomputes its forward for the backward pass, a scan still loops, the counted while
  becomes a scan);
* ``block``: ``stop_gradient`` -- nothing flows back;
* ``refuse``: anything else computing a float (``cholesky``, a data-dependent ``while``, a
  primitive parameter a rule does not know) -- JAX's autodiff would differentiate it;
  ``manual_grads`` refuses it, naming the primitive, the user's source line and the layer.

Why a jaxpr interpreter rather than nnlite wrappers for ``+``, ``jnp.mean``, ...: users
write plain ``jnp``; only the traced program sees every such operation, with its exact
parameters, wherever it is in the user's code.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..core._jax_private import bind_equation, equation_context, user_frames
from ._custom_vjp import match_primal
from ._structural import custom_jvp_name, rule_for

__all__ = ["Evaluator", "Refusal", "analyse", "classify", "refusal_message", "refusal_place"]

CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call")
NESTED = (*CALLS, "remat2", "checkpoint", "scan", "cond", "while")
HAND = ("custom_vjp_call", "custom_vjp_call_jaxpr")
BLOCK = ("stop_gradient",)

_NNLITE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_float(v) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def inner(eqn) -> tuple[Jaxpr, list]:
    """The body of a ``jit`` / ``checkpoint`` equation and its constants; its invars are
    the equation's operands, its outvars the equation's results."""
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, []


def classify(eqn, tainted: Sequence[bool]) -> str:
    """``plain``, ``block``, ``nested``, ``hand``, ``rule`` or ``refuse``."""
    name = eqn.primitive.name
    if not any(tainted):
        return "plain"
    if name in BLOCK:
        return "block"
    rule = rule_for(eqn)
    if name == "custom_jvp_call" and rule is not None:
        return "rule"  # jax.nn.relu: the rule makes JAX's choice at the kink
    if name == "while":
        if not any(is_float(v) for v in eqn.outvars):
            return "plain"
        return "nested" if trip_count(eqn) is not None else "refuse"
    if name in NESTED:
        return "nested"
    if name in HAND:
        return "hand"
    if not any(is_float(v) for v in eqn.outvars):
        return "plain"  # comparisons, argmax, casts to int: no gradient flows
    if rule is not None and rule.refusal(eqn.params, _diff(eqn, tainted)) is None:
        return "rule"
    return "refuse"


def trip_count(eqn) -> int | None:
    """How many times a ``while`` equation runs its body, when that is known at trace
    time: a counter that starts at a constant, goes up by one each iteration and is
    compared (``<``) with a constant (``lax.fori_loop`` with a traced bound, a
    ``while_loop`` written as a counted loop). ``None`` when it depends on data."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    outer = list(eqn.invars)
    carry_init = outer[cn + bn :]
    if len(cond.eqns) != 1 or len(cond.outvars) != 1:
        return None
    test = cond.eqns[0]
    if test.primitive.name == "lt":
        counter, bound = test.invars
    elif test.primitive.name == "gt":
        bound, counter = test.invars
    else:
        return None
    cond_in = list(cond.invars)

    def value(v):
        """The constant a cond operand has throughout the loop, or None."""
        if isinstance(v, Literal):
            return v.val
        if v not in cond_in:
            return None
        i = cond_in.index(v)
        if i < cn:
            o = outer[i]
            return o.val if isinstance(o, Literal) else None
        k = i - cn
        if body.outvars[k] is not body.invars[bn + k]:
            return None  # changes inside the loop
        o = carry_init[k]
        return o.val if isinstance(o, Literal) else None

    if counter not in cond_in or cond_in.index(counter) < cn:
        return None
    k = cond_in.index(counter) - cn
    init = carry_init[k]
    start = init.val if isinstance(init, Literal) else None
    stop = value(bound)
    if start is None or stop is None:
        return None
    step = next((e for e in body.eqns if body.outvars[k] in e.outvars), None)
    if step is None or step.primitive.name != "add":
        return None
    a, b = step.invars
    one = [x for x in (a, b) if isinstance(x, Literal)]
    if body.invars[bn + k] not in (a, b) or len(one) != 1 or int(one[0].val) != 1:
        return None
    try:
        return max(0, int(stop) - int(start))
    except (TypeError, ValueError):
        return None


def _diff(eqn, tainted: Sequence[bool]) -> list[bool]:
    return [t and is_float(v) for v, t in zip(eqn.invars, tainted, strict=True)]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A param-dependent equation without a rule, and the layer it sits in."""

    eqn: Any
    layer: str
    tainted: tuple[bool, ...]
    via: Any = None  # the outermost jit / scan / cond equation it sits in, if any


def _is_t(marks: dict, v) -> bool:
    return not isinstance(v, Literal) and marks.get(v, False)


_TRANSFORM = re.compile(r"^\w+\(.*\)$")  # jvp(...), transpose(...), vmap(): JAX's scopes


def _layer(eqn, outer: str) -> str:
    """The innermost nnlite Module around ``eqn`` (each Module call is a named scope in
    manual mode), JAX's own transformation scopes left out."""
    stack = f"{outer}/{eqn.source_info.name_stack}"
    parts = [p for p in stack.split("/") if p and not _TRANSFORM.match(p)]
    return parts[-1] if parts else ""


@dataclasses.dataclass(frozen=True)
class Nested:
    """A ``jit`` / ``checkpoint`` / ``scan`` / ``cond`` equation with a tainted operand:
    its results' taints, whether a body needs a structural rule, and each body with the
    taints of its inputs (for ``scan``, the carry's taint at its fixed point)."""

    out_tainted: list[bool]
    uses_rules: bool
    bodies: list[tuple[Jaxpr, list, list[bool]]]


class Analysis:
    """What a traced loss needs: the first refusal, and whether any structural rule
    applies (if none does, the loss runs as written: nothing to interpret)."""

    def __init__(self):
        self.refusal: Refusal | None = None
        self.uses_rules = False
        self._nested: dict = {}  # (id(eqn), taints) -> Nested

    def run(self, jaxpr: Jaxpr, tainted: Sequence[bool], scope: str = "") -> list[bool]:
        marks = {v: t and is_float(v) for v, t in zip(jaxpr.invars, tainted, strict=True)}
        for eqn in jaxpr.eqns:
            t_in = [_is_t(marks, v) for v in eqn.invars]
            kind = classify(eqn, t_in)
            if kind == "nested":
                info = self.nested(eqn, t_in, scope)
                out_t = info.out_tainted
                self.uses_rules |= info.uses_rules
            elif kind in ("hand", "rule", "refuse"):
                out_t = [True] * len(eqn.outvars)
                self.uses_rules |= kind == "rule"
                if kind == "refuse" and self.refusal is None:
                    self.refusal = Refusal(eqn, _layer(eqn, scope), tuple(t_in))
            else:
                out_t = [False] * len(eqn.outvars)
            for v, t in zip(eqn.outvars, out_t, strict=True):
                marks[v] = t and is_float(v)
        return [_is_t(marks, v) for v in jaxpr.outvars]

    def _body(self, body: Jaxpr, tainted: Sequence[bool], scope: str) -> tuple[list[bool], bool]:
        sub = Analysis()
        out_t = sub.run(body, tainted, scope)
        if self.refusal is None:
            self.refusal = sub.refusal
        return out_t, sub.uses_rules

    def nested(self, eqn, t_in: Sequence[bool], scope: str) -> Nested:
        key = (id(eqn), tuple(t_in))
        if key in self._nested:
            return self._nested[key]
        name, params = eqn.primitive.name, eqn.params
        scope = f"{scope}/{eqn.source_info.name_stack}"
        if name == "scan":
            nc, nk, closed = params["num_consts"], params["num_carry"], params["jaxpr"]
            carry_t = list(t_in[nc : nc + nk])
            while True:  # a carry is tainted once any iteration makes it so
                body_t = [*t_in[:nc], *carry_t, *t_in[nc + nk :]]
                out_t, uses = self._body(closed.jaxpr, body_t, scope)
                grown = [a or b for a, b in zip(carry_t, out_t[:nk], strict=True)]
                if grown == carry_t:
                    break
                carry_t = grown
            info = Nested(
                [*carry_t, *out_t[nk:]], uses, [(closed.jaxpr, list(closed.consts), body_t)]
            )
        elif name == "while":
            cn, bn, closed = params["cond_nconsts"], params["body_nconsts"], params["body_jaxpr"]
            consts_t = list(t_in[cn : cn + bn])
            carry_t = list(t_in[cn + bn :])
            while True:
                body_t = [*consts_t, *carry_t]
                out_t, uses = self._body(closed.jaxpr, body_t, scope)
                grown = [a or b for a, b in zip(carry_t, out_t, strict=True)]
                if grown == carry_t:
                    break
                carry_t = grown
            info = Nested(carry_t, uses, [(closed.jaxpr, list(closed.consts), body_t)])
        elif name == "cond":
            ops_t, outs, bodies, uses = list(t_in[1:]), [], [], False
            for branch in params["branches"]:
                out_t, u = self._body(branch.jaxpr, ops_t, scope)
                outs.append(out_t)
                uses |= u
                bodies.append((branch.jaxpr, list(branch.consts), ops_t))
            info = Nested([any(ts) for ts in zip(*outs, strict=True)], uses, bodies)
        else:  # jit, checkpoint
            body, consts = inner(eqn)
            out_t, uses = self._body(body, t_in, scope)
            info = Nested(out_t, uses, [(body, consts, list(t_in))])
        if self.refusal is not None and self.refusal.eqn is not eqn:
            # inside a jitted library function (jnp.linalg's): the user's line is the call's
            self.refusal = dataclasses.replace(self.refusal, via=eqn)
        self._nested[key] = info
        return info


def analyse(jaxpr: Jaxpr, tainted: Sequence[bool]) -> Analysis:
    a = Analysis()
    a.run(jaxpr, tainted)
    return a


class Evaluator:
    """Evaluate a traced loss, applying the structural rules (see the module docstring).

    Equations without a tainted input, hand rules and the rest are bound as they are; a
    ``jit``, ``checkpoint``, ``scan`` or ``cond`` whose bodies need no rule stays as it is.
    """

    def __init__(self, analysis: Analysis):
        self.analysis = analysis

    def run(self, jaxpr: Jaxpr, consts: Sequence, args: Sequence, tainted: Sequence[bool]):
        env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        marks = {v: t and is_float(v) for v, t in zip(jaxpr.invars, tainted, strict=True)}

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            t_in = [_is_t(marks, v) for v in eqn.invars]
            kind = classify(eqn, t_in)
            ins = [read(v) for v in eqn.invars]
            out_t = [kind in ("hand", "rule", "refuse")] * len(eqn.outvars)
            if kind == "nested":
                info = self.analysis.nested(eqn, t_in, "")
                out_t = info.out_tainted
                rebuild = info.uses_rules or eqn.primitive.name == "while"
                outs = self.nested(eqn, ins, info) if rebuild else bind_equation(eqn, ins)
            elif kind == "rule":
                outs = apply_rule(eqn, ins)
            else:
                outs = bind_equation(eqn, ins)
            for v, o, t in zip(eqn.outvars, outs, out_t, strict=True):
                env[v] = o
                marks[v] = t and is_float(v)
        return [read(v) for v in jaxpr.outvars]

    def nested(self, eqn, ins: list, info: Nested) -> list:
        """The equation again, with its bodies evaluated by this interpreter."""
        name, params = eqn.primitive.name, eqn.params
        if name in CALLS:  # inlined: only the body's equations need rules
            body, consts, body_t = info.bodies[0]
            return self.run(body, consts, ins, body_t)

        def fn(body, consts, body_t):
            return lambda *xs: self.run(body, consts, xs, body_t)

        with equation_context(eqn):
            if name == "scan":
                nc, nk = params["num_consts"], params["num_carry"]
                step = fn(*info.bodies[0])

                def scan_step(carry, x):
                    outs = step(*ins[:nc], *carry, *x)
                    return outs[:nk], outs[nk:]

                carry, ys = jax.lax.scan(
                    scan_step,
                    list(ins[nc : nc + nk]),
                    list(ins[nc + nk :]),
                    length=params["length"],
                    reverse=params["reverse"],
                    unroll=params["unroll"],
                )
                return [*carry, *ys]
            if name == "while":  # a counted loop: a scan, which JAX can differentiate
                cn, bn = params["cond_nconsts"], params["body_nconsts"]
                step = fn(*info.bodies[0])
                body_consts = list(ins[cn : cn + bn])

                def while_step(carry, _):
                    return list(step(*body_consts, *carry)), None

                carry, _ = jax.lax.scan(
                    while_step, list(ins[cn + bn :]), None, length=trip_count(eqn)
                )
                return list(carry)
            if name == "cond":
                branches = [fn(*b) for b in info.bodies]
                return list(jax.lax.switch(ins[0], branches, *ins[1:]))
            rematted = jax.checkpoint(
                fn(*info.bodies[0]),
                prevent_cse=params.get("prevent_cse", True),
                policy=params.get("policy"),
            )
            return list(rematted(*ins))


def apply_rule(eqn, ins: list) -> list:
    """``eqn`` as a ``custom_vjp``: forward, the primitive itself; backward, its library rule.

    Every operand the user's values flow through is an argument (literals are closed over),
    and every float operand gets the rule's cotangent (the rules are exact in each operand,
    so a gradient with respect to the inputs is right too).
    """
    rule = rule_for(eqn)
    params = rule.params(eqn.params)
    dyn = [i for i, v in enumerate(eqn.invars) if not isinstance(v, Literal)]

    def merge(xs):
        args = list(ins)
        for i, x in zip(dyn, xs, strict=True):
            args[i] = x
        return args

    @jax.custom_vjp
    def prim(*xs):
        return tuple(bind_equation(eqn, merge(xs)))

    def fwd(*xs):
        return prim(*xs), xs

    def bwd(xs, cts):
        args = merge(xs)
        dargs = rule.f_vjp(*args, *cts, **params)
        dargs = (dargs,) if len(args) == 1 else dargs
        out = []
        for i, x in zip(dyn, xs, strict=True):
            float_ = jnp.issubdtype(jnp.result_type(x), jnp.inexact)
            out.append(match_primal(dargs[i], x) if float_ and dargs[i] is not None else None)
        return tuple(out)

    prim.defvjp(fwd, bwd)
    with equation_context(eqn):
        return list(prim(*(ins[i] for i in dyn)))


# --- the refusal, in the user's terms -----------------------------------------------------

STRUCTURAL_SUMMARY = (
    "JAX's differentiable primitives that model code emits (elementwise math, reductions, "
    "sorting, dots and convolutions, indexing, layout, counted loops) carry library rules "
    "(nnlite.rules.PRIMITIVES)"
)

MANUAL_FIX = (
    "compute it in a function declared with its rule, @nl.hand_rule(f_vjp) "
    '(docs/gradients.md, "Your own rule: nl.hand_rule"), or differentiate this model with '
    "jax.grad, without nl.manual_grads"
)

# Nonlinear operations nnlite already has with a rule.
_HINTS = {
    "max": "nl.relu (max(x, 0))",
    "relu": "nl.relu",
    "tanh": "nl.tanh",
    "logistic": "nl.sigmoid",
    "gelu": "nl.gelu",
    "logaddexp": "nl.softplus",
    "dot_general": "nl.Linear or nl.linear (x @ W + b)",
    "reduce_max": "nl.MaxPool (a max over windows)",
}


_custom_jvp_name = custom_jvp_name


def _what(eqn) -> str:
    name = _custom_jvp_name(eqn)
    return f"`{name}` (a jax.custom_jvp function)" if name else f"`{eqn.primitive.name}`"


def source_line(eqn) -> str | None:
    """``file:line (function)`` of the innermost frame of the user's code (not JAX's, not
    nnlite's) that created ``eqn``."""
    for file, line, function in user_frames(eqn):
        path = os.path.abspath(file)
        if path.startswith(_NNLITE_DIR + os.sep):
            continue
        try:
            rel = os.path.relpath(path)
        except ValueError:
            rel = path
        shown = rel if not rel.startswith("..") else path
        return f"{shown}:{line} ({function})"
    return None


def _refusal_line(refusal: Refusal) -> str | None:
    """The user's line for a refusal: its own, or that of the call it sits in."""
    line = source_line(refusal.eqn)
    if line is None and refusal.via is not None:
        line = source_line(refusal.via)
    return line


def refusal_place(refusal: Refusal) -> tuple[str, str | None, str]:
    """``(operation, "file:line" or None, layer or "")`` of a refusal: the primitive (or
    the ``jax.custom_jvp`` function's name), where the user's code computes it, and the
    innermost nnlite Module around it."""
    where = _refusal_line(refusal)
    at = where.rsplit(" (", 1)[0] if where else None
    what = _custom_jvp_name(refusal.eqn) or refusal.eqn.primitive.name
    rule = rule_for(refusal.eqn)
    unknown = rule.unknown(refusal.eqn.params) if rule is not None else []
    if unknown:  # a newer JAX: the rule exists, the primitive changed
        what = f"{what} (parameter {', '.join(unknown)} unknown to its rule)"
    return what, at, refusal.layer


def refusal_message(refusal: Refusal, who: str = "manual gradients") -> str:
    eqn = refusal.eqn
    where = _refusal_line(refusal)
    at = f" at {where}" if where else ""
    layer = (
        f"in layer {refusal.layer}"
        if refusal.layer
        else "in the loss function (outside any nnlite Module)"
    )
    rule = rule_for(eqn)
    reason = ""
    if rule is not None:
        why = rule.refusal(eqn.params, _diff(eqn, refusal.tainted))
        reason = f" Its library rule does not apply: {why}." if why else ""
    elif eqn.primitive.name == "while":
        reason = (
            " It is a while_loop whose trip count depends on data (not a counter from a "
            "constant up to a constant): reverse-mode gradients of it are not defined "
            "(jax.grad refuses it too); use lax.scan, or lax.fori_loop with static bounds."
        )
    hint = _HINTS.get(_custom_jvp_name(eqn) or eqn.primitive.name)
    have = f" nnlite has it with a rule: {hint}." if hint else ""
    return (
        f"{who}: {_what(eqn)}{at}, {layer}, computes on values derived from the params and "
        f"has no rule, so JAX's autodiff would differentiate it.{reason}{have} "
        f"{STRUCTURAL_SUMMARY}, this one none; {MANUAL_FIX}."
    )
