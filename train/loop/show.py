"""Debugging views of a config: its loss or train step decompiled to Python
(``--show-jaxpr loss|step``) and its backward pass as hand rule calls (``grad``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl

from ..config import Config
from ..data.dataset import host_batch
from ..model import contract
from ..step.step import mean_loss_fn, uses_key
from .build import build, make_stepper


def show_jaxpr(cfg: Config, what: str) -> str:
    """Decompiled Python of the config's mean loss (``what="loss"``) or its compiled train step."""
    if what == "grad":
        return show_grad(cfg)
    fn, args = traced_function(cfg, what)
    return nl.show_jaxpr(fn, *args, name=what)


def model_summary(cfg: Config) -> str:
    """``nl.summary`` of the config's model on one device's share of a batch (``--summary``)."""
    r = build(cfg)
    b = max(1, cfg.train.batch_size // len(r.devices))
    x, _ = host_batch(r.data, np.arange(b) % r.data.num_indices)
    head = f"{cfg.model.name} on a batch of {b} ({type(r.model).__name__}, float32)"
    return f"{head}\n{nl.summary(r.model, jnp.asarray(x))}"


def show_grad(cfg: Config) -> str:
    """The config's backward pass as Python: each layer's hand rule call, in reverse order
    (``nnlite.show_grad``), traced on a batch of up to 4 examples; sizes that follow the
    batch print in terms of the input's batch size, so the code runs at any batch."""
    r = build(cfg)
    params = r.model.init(jax.random.key(cfg.seed))
    b = min(cfg.train.batch_size, 4)
    x, y = host_batch(r.data, np.arange(b) % r.data.num_indices)
    objective = contract.objective_fn(r.model, "manual")
    key = jax.random.key(cfg.seed) if uses_key(r.model) else None
    state = contract.init_state(r.model)
    kw = {} if state is None else {"state": state}

    def loss(params, x, y):
        return objective(params, x, y, key=key, **kw)[0]

    return nl.show_grad(loss, params, jnp.asarray(x), jnp.asarray(y))


def traced_function(cfg: Config, what: str) -> tuple:
    """``(fn, args)``: what ``show_jaxpr(cfg, what)`` decompiles, and its example arguments.

    For ``what="step"``, ``fn`` is the compiled multi-step function of the config's
    strategy and ``args`` are placed as training places them (its params and optimizer
    state are donated: pass copies to call it more than once).
    """
    r = build(cfg)
    params = r.model.init(jax.random.key(cfg.seed))
    loss_fn = mean_loss_fn(r.model, r.grad_mode)
    state = contract.init_state(r.model)
    b = cfg.train.batch_size
    if what == "loss":
        x, y = host_batch(r.data, np.arange(b) % r.data.num_indices)
        kw = {} if state is None else {"state": state}
        return (lambda p, x, y: loss_fn(p, x, y, **kw)[0]), (params, x, y)
    opt_state = r.optimizer.init(params)
    p_leaves, p_def = jax.tree.flatten(params)
    o_leaves, o_def = jax.tree.flatten(opt_state)
    s_leaves, s_def = jax.tree.flatten(state)
    stepper = make_stepper(r, p_def, o_def, cfg.train.nonfinite, s_def)
    idx = np.zeros((cfg.train.steps_per_call, b), np.int32)
    placed = [stepper.put_state(leaves) for leaves in (p_leaves, o_leaves, s_leaves)]
    if r.data.streamed:  # the step takes the batch itself (train/data/feed.py)
        return stepper.run, (*placed, (), (), stepper.put_batch(*host_batch(r.data, idx), 0))
    return stepper.run, (
        *placed,
        stepper.put_data(r.data.x),
        stepper.put_data(r.data.y),
        stepper.put_indices(idx, 0),
    )
