"""``train.check_grads: true`` / ``--check-grads``: before step 0, every hand rule the model
runs is checked against ``jax.vjp`` where it runs -- at the batch one device's objective
sees in the step (a data-parallel strategy's share, an fsdp/tensor run's whole batch with
the params and batch sharded as the step has them), in the params' dtype, with the run's
backward policies and random key -- by ``nl.check_rules``. The run prints one row per
rule call (the layer, the rule, the dtype, the error in roundings of that dtype) and
refuses to train, in one line, when a rule is wrong.
"""

from __future__ import annotations

import jax
import numpy as np

import nnlite as nl

from ..data.dataset import host_batch
from ..errors import ConfigError
from ..model import contract
from . import precision
from .step import policy_loss_fn, step_key

#: The largest error a rule may have, in roundings of its dtype (``nl.check_rules``'s).
MAX_ROUNDINGS = 1000.0


def check_grads(r, params0, state0, sampler, echo) -> list:
    """Check the run's hand rules at step 0's batch (see the module docstring); print the
    table with ``echo``; raise ConfigError naming the first wrong rule. Returns the rows."""
    cfg, strategy = r.cfg, r.strategy
    if r.grad_mode != "manual":
        echo(
            f"check_grads: loss.grad={r.grad.describe() if r.grad else r.grad_mode} runs no "
            "hand rules (JAX's autodiff differentiates the model): nothing to check"
        )
        return []
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
    loss_fn = policy_loss_fn(model, "manual", r.backward)
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
