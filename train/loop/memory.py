"""How much memory a config needs, estimated before anything is allocated.

An absurd size (``train.batch_size=10**12``, ``model.hidden_sizes=[10**10]``, a label of
10**9 that makes a 10**9-way head) must end in one line naming the key, not in memory
that grows silently or an XLA CHECK abort. :func:`check_fits` adds up a *lower bound* of
what a run holds at once, from shapes only (``jax.eval_shape`` of init and of the
optimizer, ``jax.make_jaxpr`` of the loss on a batch of ``ShapeDtypeStruct``): params,
gradients and optimizer state, the data set, the gathered batch and the largest single
intermediate of the loss and its gradient, for every device of this process, plus the
host's copies. If even that exceeds the memory there is, the run cannot fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from ..config import Config
from ..data.dataset import batch_dtype
from ..data.feed import DEPTH
from ..data.registry import size_key
from ..errors import ConfigError
from ..model import contract
from ..report.units import format_bytes, host_memory_bytes


def device_memory_bytes(device) -> int | None:
    """An accelerator's own memory, or None where the device is the host's memory (CPU)."""
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def _nbytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(avals))


def _largest_intermediate(jaxpr) -> int:
    """Bytes of the largest value any equation of ``jaxpr`` (nested ones too) produces."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                best = max(best, math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
        for p in eqn.params.values():
            for inner in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    best = max(best, _largest_intermediate(inner))
    return best


@dataclass(frozen=True)
class Estimate:
    """A lower bound of the bytes a run holds at once, by what they are."""

    state: int  # params + gradients + optimizer state, all devices of this process
    data: int  # the data set: host copy + one per device
    batch: int  # gathered batch + largest intermediate of the step, all devices; indices
    limit: int  # what there is: host memory (CPU) or one accelerator's memory
    where: str  # "this machine" or the device

    @property
    def total(self) -> int:
        return self.state + self.data + self.batch


def estimate(cfg: Config, model, optimizer, data, strategy) -> Estimate:
    """A lower bound of the memory ``cfg`` needs on ``strategy``'s devices (this process's
    share of them); nothing is allocated (shapes only). What one device holds of the
    params, gradients (placed like the params) and optimizer state is the strategy's
    ``bytes_per_device``."""
    n_local, n_global = len(strategy.local_devices), len(strategy.devices)
    p_avals = contract.param_shapes(model)
    o_avals = jax.eval_shape(optimizer.init, p_avals)
    p, o = _nbytes(p_avals), _nbytes(o_avals)
    p_dev, o_dev = strategy.bytes_per_device(p_avals), strategy.bytes_per_device(o_avals)
    local_batch = max(cfg.train.batch_size // n_global, 1)
    micro = max(local_batch // cfg.train.grad_accum_steps, 1)
    # What the step gathers: rows, or text windows of `window` tokens per example.
    lead = (micro,) if getattr(data, "window", None) is None else (micro, data.window)
    x = jax.ShapeDtypeStruct((*lead, *data.x.shape[1:]), batch_dtype(data.x))
    y = jax.ShapeDtypeStruct((*lead, *data.y.shape[1:]), batch_dtype(data.y))

    objective = contract.objective_fn(model)
    s_avals = jax.eval_shape(model.init_state) if contract.is_stateful(model) else None

    def loss(params, x, y, state):
        kw = {} if state is None else {"state": state}
        return objective(params, x, y, **kw)[0]

    # The forward pass's values: the backward pass's cotangents have their shapes, and
    # tracing the forward alone costs a third of tracing it with its gradient (an
    # estimate at every start: 5.9 of a small GPT run's 6.8 s here went to the gradient)
    jaxpr = jax.make_jaxpr(loss)(p_avals, x, y, s_avals).jaxpr
    per_device_batch = _nbytes((x, y)) + _largest_intermediate(jaxpr)
    train_bytes = data.x.nbytes + data.y.nbytes
    data_bytes = train_bytes + data.x_test.nbytes + data.y_test.nbytes
    if getattr(data, "streamed", False):
        # streamed: the training split stays on disk (memory maps) or in host memory, and
        # the devices hold a few calls' batches (train/data/feed.py), never the split itself
        calls = (DEPTH + 2) * cfg.train.steps_per_call
        train_bytes = calls * _nbytes((x, y)) * local_batch // micro
        data_bytes = train_bytes + (data.x_test.nbytes + data.y_test.nbytes) * (
            not isinstance(data.x_test, np.memmap)
        )
    # host: the sampler's [steps_per_call, batch] int32 indices (and an epoch order the
    # size of the batch when the data set is smaller than one)
    indices = 4 * cfg.train.batch_size * (cfg.train.steps_per_call + 2)
    devices = strategy.local_devices
    limit = device_memory_bytes(devices[0]) if devices else None
    snap = cfg.checkpoint.async_  # an async checkpoint copies params + optimizer state
    # (on the devices: train/checkpoint/writer.py)
    if limit is None:  # CPU: every device and the host share this machine's memory
        return Estimate(
            state=(p + o) + n_local * ((2 + snap) * p_dev + (1 + snap) * o_dev),
            data=data_bytes + n_local * train_bytes,
            batch=indices + n_local * per_device_batch,
            limit=host_memory_bytes(),
            where="this machine",
        )
    return Estimate(  # one accelerator's share
        state=(2 + snap) * p_dev + (1 + snap) * o_dev,
        data=train_bytes,
        batch=per_device_batch,
        limit=limit,
        where=f"device {devices[0]}",
    )


def check_fits(cfg: Config, model, optimizer, data, strategy) -> Estimate:
    """Raise ConfigError naming the key to change when ``cfg`` cannot fit in memory."""
    est = estimate(cfg, model, optimizer, data, strategy)
    if est.total <= est.limit:
        return est
    parts = {"state": est.state, "data": est.data, "batch": est.batch}
    worst = max(parts, key=parts.get)
    if worst == "batch":
        fix = f"reduce train.batch_size (now {cfg.train.batch_size})"
        if cfg.train.grad_accum_steps == 1:
            fix += " or raise train.grad_accum_steps"
    elif worst == "data":
        fix = f"use a smaller data set ({size_key(cfg.data.name)})"
    elif data.num_classes is not None and data.num_classes > _widest(cfg.model.options):
        fix = f"the data has {data.num_classes} classes (largest label {data.num_classes - 1})"
    else:
        sizes = {
            k: v
            for k, v in cfg.model.options.items()
            if k not in contract.DATA_FIELDS and _is_size(v) and v != ()
        }
        if sizes:
            k = max(sizes, key=lambda k: max(sizes[k]) if isinstance(sizes[k], tuple) else sizes[k])
            v = list(sizes[k]) if isinstance(sizes[k], tuple) else sizes[k]
            fix = f"reduce model.{k} (now {v})"
        else:
            fix = f"use a smaller model than model.name={cfg.model.name} on this data"
    what = {
        "state": "params, gradients and optimizer state",
        "data": "the data set",
        "batch": "the batch and its activations",
    }[worst]
    raise ConfigError(
        f"this config needs at least {format_bytes(est.total)} of memory ({what}: "
        f"{format_bytes(parts[worst])}) but {est.where} has {format_bytes(est.limit)}; {fix}"
    )


def _is_size(v) -> bool:
    ints = v if isinstance(v, tuple) else (v,)
    return bool(ints) and all(isinstance(i, int) and not isinstance(i, bool) for i in ints)


def _widest(options: dict) -> int:
    """The largest size among a model's own hyperparameters (1 if none)."""
    sizes = [
        max(v) if isinstance(v, tuple) else v
        for k, v in options.items()
        if k not in contract.DATA_FIELDS and _is_size(v) and v != ()
    ]
    return max(sizes, default=1)
