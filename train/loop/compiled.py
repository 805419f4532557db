"""``train.compile_fit(model, config)``: what ``train.fit`` would train with, built and
compiled, before its first step: the public seam for benchmarks and tools that time or
inspect the trainer's own compiled step without running its loop (docs/benchmarks.md).

Example::

    import jax
    import train

    c = train.compile_fit(None, "configs/digits_mlp.yaml")
    st = c.stepper
    p, o = st.put_state(jax.tree.leaves(c.params0)), st.put_state(jax.tree.leaves(c.opt0))
    p, o, _, metrics = st.run(p, o, [], c.X, c.Y, st.put_indices(c.indices(0, 1), 0))
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data import overfit
from ..data.dataset import Dataset
from ..data.user import with_source
from ..errors import ConfigError
from ..optim import GIVEN
from ..optim.named import check_transformation
from .build import Prepared, Run, build, prepare
from .fitting import _config
from .trainer import _flops_and_peak, boundaries, steps_in_call


def _prepared(name: str) -> property:
    """``CompiledFit.<name>``: the compiled run's ``prepared.<name>``."""
    return property(lambda self: getattr(self.prepared, name))


@dataclass
class CompiledFit:
    """A run built and compiled as ``train.fit`` builds it (:func:`compile_fit`).

    ``run``: the config resolved (``run.cfg``), the model, optimizer, parallel strategy and
    ``run.grad_mode`` (``loss.grad``, auto resolved); ``prepared``: the compiled pieces,
    also reachable here: ``stepper`` (the compiled train step: ``put_state(leaves)``,
    ``put_indices(idx, first_step)``, ``run(p_leaves, o_leaves, s_leaves, X, Y, indices)
    -> (p_leaves, o_leaves, s_leaves, metrics)``, ``get_state(leaves)``, ``compiled``: the
    jitted function), ``params0``/``opt0`` (the initial state, host copies), ``X``/``Y``
    (the training split, placed), ``evaluate(params, X_test, Y_test)`` and
    ``step_cost`` (``nl.flops`` of one step)."""

    run: Run
    prepared: Prepared
    sampler: Any

    stepper = _prepared("stepper")
    params0 = _prepared("params0")
    opt0 = _prepared("opt0")
    X = _prepared("X")
    Y = _prepared("Y")
    evaluate = _prepared("evaluate")
    X_test = _prepared("X_test")
    Y_test = _prepared("Y_test")
    step_cost = _prepared("step_cost")

    def indices(self, step: int, count: int) -> np.ndarray:
        """The loop's ``[count, batch]`` indices (window starts for text) of steps
        ``step .. step+count-1``: the run's data order, a function of (seed, step)."""
        return self.sampler.batches(step, count)

    def steps_in_call(self, step: int) -> int:
        """How many steps the loop's call starting at ``step`` runs (``train.steps_per_call``,
        cut at the next log, eval or checkpoint boundary and at ``train.steps``)."""
        return steps_in_call(self.run.cfg, step, boundaries(self.run.cfg))

    def flops_and_peak(self) -> tuple[float | None, float | None]:
        """The trainer's MFU inputs: model FLOPs per step (nl.flops of the traced step) and the
        devices' peak FLOP/s in ``train.precision`` (None where unknown)."""
        return _flops_and_peak(self.run, self.prepared)


def compile_fit(
    model: Any = None,
    config: Any = None,
    *,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    optimizer: Any = None,
    data: Any = None,
    tokens: np.ndarray | None = None,
) -> CompiledFit:
    """Build and compile what ``train.fit(model, config, overrides=..., optimizer=...,
    data=...)`` would train (same arguments, same checks, the same compiled step), without
    running the loop or writing anything. ``tokens``: instead of ``data``, a 1-D int token
    stream a language model trains on in windows of ``model.context`` (the text data sets'
    layout: an index is a window's start; its first windows are the test split).

    Raises ``ConfigError`` for bad input, as ``train.fit`` does."""
    if isinstance(overrides, Mapping):
        overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    overrides = list(overrides)
    if optimizer is not None:
        check_transformation(optimizer, "train.compile_fit(optimizer=...)")
        overrides.append(f"optimizer.name={GIVEN}")
    cfg = _config(model, config, overrides)
    dataset = None
    if data is not None and tokens is not None:
        raise ConfigError("train.compile_fit: give data or tokens, not both")
    if data is not None:
        cfg, dataset = with_source(cfg, data)
    elif tokens is not None:
        cfg, dataset = _token_stream(cfg, tokens)
    r = build(cfg, dataset, optimizer=optimizer)
    sampler = overfit.run_sampler(r.cfg, r.data)
    first = sampler.batches(0, steps_in_call(r.cfg, 0, boundaries(r.cfg)))
    return CompiledFit(r, prepare(r, r.cfg.train.nonfinite, first), sampler)


def _token_stream(cfg, tokens) -> tuple[Any, Dataset]:
    """``tokens`` as a text data set: inputs the stream, targets it shifted by one,
    windows of the model's ``context``; up to 8 of its first windows the test split."""
    tokens = np.asarray(tokens)
    context, vocab = cfg.model.get("context"), cfg.model.get("vocab_size")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(
            f"train.compile_fit: tokens must be a 1-D int array, got {tokens.dtype}"
            f"{list(tokens.shape)}"
        )
    if context is None or vocab is None or len(tokens) < context + 2:
        raise ConfigError(
            "train.compile_fit: tokens need a language model with context and vocab_size "
            f"set and more than context+1 tokens (got context={context}, {len(tokens)} tokens)"
        )
    tokens = tokens.astype(np.int32)
    m = min(8, len(tokens) - context - 1)
    pos = np.arange(m)[:, None] + np.arange(context)
    dataset = Dataset(
        "tokens", tokens[:-1], tokens[1:], tokens[pos], tokens[pos + 1], vocab, window=context
    )
    section = dataclasses.replace(cfg.data, name="<tokens>", options={})
    return dataclasses.replace(cfg, data=section), dataset
