"""The non-finite guard's diagnosis: replay from the last good state and name the first
non-finite value (``train.nonfinite: stop``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

import nnlite as nl

from ..checkpoint.resume import load_checkpoint
from ..data.dataset import host_batch
from ..data.feed import call_batch
from ..parallel import distributed as dist
from ..step.backward import replay_first_bad_layer
from ..step.step import step_flags


def first_nonfinite(loss_fn, optimizer, params, opt_state, x, y, state=None) -> str | None:
    """Name the first non-finite value of one step: ``loss``, ``grads/<path>``, ``params/<path>``.

    Runs the step once more on one device on the host's copy of the state before the bad
    step; None if everything comes out finite there.
    """
    kw = {} if state is None else {"state": state}  # a stateful model's, in train mode

    @jax.jit
    def step(params, opt_state, x, y, kw):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x, y, **kw)[0])(params)
        updates, _ = optimizer.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates)

    loss, grads, new_params = jax.device_get(step(params, opt_state, x, y, kw))
    if not np.isfinite(loss):
        return "loss"
    for prefix, tree in (("grads", grads), ("params", new_params)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not np.all(np.isfinite(leaf)):
                return prefix + nl.format_path(path)
    return None


def explain_nonfinite(
    r, sampler, checker, loss_fn, params0, opt0, flagged, good_step, good_ckpt, state0=None
) -> str:
    """The message for a run stopped at step ``flagged``: replay from the last good state
    with ``checker`` (a stepper whose flag covers the new params as well as the loss), find
    the first bad step (``flagged`` or one before: bad params show in the next loss), and
    name the first non-finite value that step produces.

    ``r`` is the ``train.loop.build.Run``; ``params0``/``opt0`` the initial state (the replay's
    start when no checkpoint was written); ``good_ckpt`` the checkpoint at ``good_step``;
    ``state0`` a stateful model's initial state (None: stateless).
    """
    p_host, o_host = jax.tree.leaves(params0), jax.tree.leaves(opt0)
    s_host = jax.tree.leaves(state0)
    if good_step > 0:  # process 0 wrote (or resumed from) a checkpoint at good_step
        if dist.is_main():
            saved = load_checkpoint(r.cfg, good_ckpt, params0, opt0, r.grad_mode, state0=state0)
            p_host, o_host, s_host = saved.p_leaves, saved.o_leaves, saved.s_leaves
        p_host, o_host, s_host = dist.broadcast((p_host, o_host, s_host))
    if checker.streamed:
        X = Y = ()
    else:
        X, Y = checker.put_data(r.data.x), checker.put_data(r.data.y)

    def replay(upto: int):
        """State after steps good_step..upto-1, and the first flagged step on the way."""
        p, o, st = checker.put_state(p_host), checker.put_state(o_host), checker.put_state(s_host)
        for s in range(good_step, upto):
            if checker.streamed:
                batch = checker.put_batch(*call_batch(r.data, sampler, s, 1), s)
            else:
                batch = checker.put_indices(dist.process_share(sampler.batches(s, 1)), s)
            p, o, st, m = checker.run(p, o, st, X, Y, batch)
            if step_flags(m).any():
                return p, o, st, s + 1
        return p, o, st, None

    bad = replay(flagged)[3] or flagged
    p_leaves, o_leaves, s_leaves, _ = replay(bad - 1)
    p_def, o_def = jax.tree.structure(params0), jax.tree.structure(opt0)
    params = jax.tree.unflatten(p_def, [np.asarray(v) for v in checker.get_state(p_leaves)])
    opt_state = jax.tree.unflatten(o_def, [np.asarray(v) for v in checker.get_state(o_leaves)])
    state = jax.tree.unflatten(
        jax.tree.structure(state0), [np.asarray(v) for v in checker.get_state(s_leaves)]
    )
    x, y = host_batch(r.data, sampler.batch(bad - 1))
    what = first_nonfinite(loss_fn, r.optimizer, params, opt_state, x, y, state)
    where = f"first in {what}" if what else "not reproducible on one device to name the leaf"
    layer = ""
    if what is not None and what.startswith("grads"):  # which layer's backward, first
        kw = {} if state is None else {"state": state}
        found = replay_first_bad_layer(r.model, r.grad_mode, r.backward, params, x, y, **kw)
        if found is not None:
            layer = f"; first non-finite {found} at step {bad}"
    kept = (
        f"the last good checkpoint is {good_ckpt} (step {good_step})"
        if good_ckpt is not None
        else "no checkpoint was written"
    )
    return (
        f"non-finite values at step {bad} ({where}){layer}; training stopped and {kept}. "
        "Lower optimizer.learning_rate, check the data, or set train.nonfinite=skip "
        "to skip such steps"
    )


def all_finite(tree: Any) -> bool:
    """Whether every leaf of a tree of host arrays is finite."""
    return all(np.all(np.isfinite(v)) for v in jax.tree.leaves(tree))
