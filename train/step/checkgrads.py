"""``train.check_grads: true`` / ``--check-grads``: before step 0, every hand rule the model
runs is checked against ``jax.vjp`` where it runs -- at the batch one device's objective
sees in the step (a data-parallel strategy's share, an fsdp/tensor run's whole batch with
the params and batch sharded as the step has them), in the params' dtype, with the run's
backward policies and random key -- by ``nl.check_rules``. The run prints one row per
rule call (the layer, the rule, the dtype, the error in roundings of that dtype) and
refuses to train, in one line, when a rule is wrong.

``loss.check_rules`` (on by default): under ``loss.grad: manual`` or ``auto -> manual``,
the same check, run by default on the user's own hand rules only (``GradMode.rules``: a
``@nl.hand_rule`` or ``nl.rules.custom_vjp`` not defined in nnlite), with no table: nnlite's
rules are tested with the library and never rechecked, so a model of nnlite's layers costs
nothing here. A set of rules that passed is remembered by its code and shapes
(``rulecache.py``), so a rerun of unchanged rules is not checked again. A wrong rule
stops the run before step 1 with one line naming it and its error; the banner says which
rules were checked, or that they were not.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re

import jax
import numpy as np

import nnlite as nl

from ..data.dataset import host_batch
from ..errors import ConfigError
from ..model import contract
from ..parallel import distributed as dist
from . import precision, rulecache
from .step import policy_loss_fn, step_key

#: The largest error a rule may have, in roundings of its dtype (``nl.check_rules``'s).
MAX_ROUNDINGS = 1000.0


def _inputs(r, params0, state0, sampler) -> tuple:
    """``(loss_fn, params, (x, y), kwargs, where)``: the objective in manual mode with the
    run's dtype policy and backward policies, and its arguments as one device's objective
    sees them at step 0, placed as the compiled step has them."""
    cfg, strategy = r.cfg, r.strategy
    local = strategy.axis is not None  # the objective sees one device's share
    devices = len(strategy.devices) if local else 1
    micro = max(cfg.train.batch_size // devices // cfg.train.grad_accum_steps, 1)
    x, y = host_batch(r.data, sampler.batch(0)[:micro])
    params = jax.device_put(params0, strategy.eval_device)  # arrays: rows named by layer
    where = f"batch {micro} on one device"
    if not local and len(strategy.devices) > 1:  # placed as the compiled step has them
        leaves = strategy.put_state(jax.tree.leaves(params0))
        params = jax.tree.unflatten(jax.tree.structure(params0), leaves)
        x, y = jax.tree.map(lambda a: a[0], strategy.put_batch((x[None], y[None])))
        where = f"batch {micro} over {len(strategy.devices)} devices ({strategy.describe()})"
    kw = {}
    if contract.uses_key(r.model):
        kw["key"] = step_key(cfg.seed, 0, None)
    if state0 is not None:
        kw["state"] = state0
    model = precision.apply(r.model, cfg.train.precision)  # the step's dtype policy
    return policy_loss_fn(model, "manual", r.backward), params, (x, y), kw, where


def check_grads(r, params0, state0, sampler, echo) -> list:
    """Check the run's hand rules at step 0's batch (see the module docstring); print the
    table with ``echo``; raise ConfigError naming the first wrong rule. Returns the rows."""
    cfg = r.cfg
    if r.grad_mode != "manual":
        echo(
            f"check_grads: loss.grad={r.grad.describe() if r.grad else r.grad_mode} runs no "
            "hand rules (JAX's autodiff differentiates the model): nothing to check"
        )
        return []
    loss_fn, params, (x, y), kw, where = _inputs(r, params0, state0, sampler)
    rows = nl.check_rules(loss_fn, params, x, y, max_roundings=MAX_ROUNDINGS, **kw)
    dtype = jax.tree.leaves(params0)[0].dtype if jax.tree.leaves(params0) else np.float32
    echo(
        f"check_grads: {len(rows)} hand-rule calls checked against jax.vjp at {where}, "
        f"params {np.dtype(dtype).name}, train.precision {cfg.train.precision}; error in roundings of each dtype (eps x the "
        f"cotangent's largest magnitude), at most {MAX_ROUNDINGS:g}:"
    )
    echo(f"  {'layer':<28} {'rule':<26} {'dtype':<9} {'roundings':>10}")
    for row in rows:
        echo(f"  {row}")
    wrong = [row for row in rows if not row.ok]
    if wrong:
        w = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ConfigError(
            f"train.check_grads: the hand rule {w.rule} of {w.layer} disagrees with jax.vjp by "
            f"{w.roundings:.3g} roundings of {w.dtype} (at most {MAX_ROUNDINGS:g}){more}; fix "
            "the rule, or train with loss.grad=autodiff"
        )
    return rows


def rule_name(rule) -> str:
    """``gain_vjp (of gain, gtmodels.py:12)``: a user's rule as the banner and the error
    name it (the line is the rule's own)."""
    f, f_vjp = getattr(rule, "f", None), getattr(rule, "f_vjp", None)
    code = getattr(getattr(f_vjp, "__wrapped__", f_vjp), "__code__", None)
    at = f", {os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else ""
    name = getattr(f_vjp, "__name__", "rule")
    return f"{name} (of {getattr(f, '__name__', 'a function')}{at})"


def _argument(rule, k: int | None) -> str:
    if k is None:
        return "its cotangents"
    try:
        params = list(inspect.signature(rule.f).parameters)
    except (TypeError, ValueError):
        params = []
    name = f" ({params[k]})" if k < len(params) else ""
    return f"the cotangent of argument {k}{name}"


def _wrong_line(row, more: int) -> str:
    """The one line a wrong rule of the user's stops the run with."""
    rule = row.fn
    also = f" (and {more} more wrong)" if more else ""
    return (
        f"loss.check_rules: your hand rule {rule_name(rule)} disagrees with jax.vjp at "
        f"{row.layer}: relative error {row.relative:.3g} in "
        f"{_argument(rule, row.argument)}, {row.roundings:.3g} roundings of {row.dtype} "
        f"(at most {MAX_ROUNDINGS:g}){also}; fix the rule, train with loss.grad=autodiff, "
        "or set loss.check_rules=false to train it unchecked"
    )


def check_user_rules(r, params0, state0, sampler) -> None:
    """``loss.check_rules`` (see the module docstring): check the user's hand rules the
    step runs (``r.grad.rules``) at step 0's batch, unless the same code passed at the same
    shapes before; raise ConfigError with one line for a wrong one. Sets
    ``r.grad.rules_note``, the banner's line on them; does nothing without such rules."""
    grad = r.grad
    if grad is None or grad.mode != "manual" or not grad.rules:
        return  # no rule of the user's runs: nothing checked, nothing said
    names = ", ".join(rule_name(rule) for rule in grad.rules)
    if not r.cfg.loss.check_rules:
        note = f"hand rules of yours NOT checked against jax.vjp (loss.check_rules=false): {names}"
        r.grad = dataclasses.replace(grad, rules_note=note)
        return
    loss_fn, params, batch, kw, where = _inputs(r, params0, state0, sampler)
    cfg = r.cfg
    model = re.sub(r" at 0x[0-9a-f]+", "", repr(r.model))  # a field's object: no address
    context = f"{model}|{cfg.train.precision}|{cfg.loss.backward_policies!r}|{where}"
    try:
        key = rulecache.key(grad.rules, (params, batch, kw), context)
    except Exception:  # noqa: BLE001 -- something of the user's the hash cannot read:
        key = None  # no cache for these rules, checked at every run
    multi = dist.is_multiprocess()  # every process checks alike: no cache to disagree on
    if key is not None and not multi and rulecache.seen(key):
        note = (
            f"hand rules of yours checked against jax.vjp by an earlier run (same code, same "
            f"shapes; {rulecache.path()}): {names}"
        )
        r.grad = dataclasses.replace(grad, rules_note=note)
        return
    picked = set(grad.rules)
    rows = nl.check_rules(
        loss_fn, params, *batch, max_roundings=MAX_ROUNDINGS, select=picked.__contains__, **kw
    )
    wrong = [row for row in rows if not row.ok]
    if wrong:
        raise ConfigError(_wrong_line(wrong[0], len(wrong) - 1))
    reached = {row.fn for row in rows}
    checked = [rule_name(rule) for rule in grad.rules if rule in reached]
    missed = [rule_name(rule) for rule in grad.rules if rule not in reached]
    if key is not None and not missed and dist.is_main():
        rulecache.store(key, checked)
    note = f"hand rules of yours checked against jax.vjp at {where}: {', '.join(checked)}"
    if missed:  # traced apart from the loss: the check's tape does not hold their calls
        note = (
            (note + "; " if checked else "")
            + "hand rules of yours NOT checked (called only inside nl.Remat / jax.checkpoint "
            f"or a float32 backward policy, which the check does not enter): {', '.join(missed)}"
        )
    r.grad = dataclasses.replace(grad, rules_note=note)
