"""Building a run: the config's data, model, optimizer and parallel strategy, then its
initial state, train step and evaluation compiled side by side (:func:`prepare`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
import optax

import models
import nnlite as nl

from . import memory, parallel
from .config import Config, ConfigError
from .data import Dataset, load_dataset
from .optim import build_optimizer
from .parallel.base import Strategy
from .step import Stepper, batch_grads_fn, build_split_eval, build_stepper, compile_async, uses_key
from .timings import Timings

# Examples evaluated per chunk of a windowed (text) split: 32k tokens, e.g. 512 windows of
# 64, so evaluating thousands of windows never holds all their activations at once.
EVAL_TOKENS_PER_CHUNK = 2**15


class Model(Protocol):
    """What the trainer uses of a model (an ``nl.Module``, see ``models/``)."""

    task: str  # "classification", "regression" or "language_model"
    grad_modes: tuple[str, ...]  # the loss.grad modes it supports

    def init(self, key: jax.Array) -> nl.ParamsDict: ...

    def objective(self, params, x, y, *, grad: str = "autodiff", **kw) -> tuple: ...

    def loss(self, params, x, y) -> tuple: ...


@dataclass
class Run:
    """What the loop built from the config (also handy in tests and benchmarks)."""

    cfg: Config
    data: Dataset
    model: Model
    optimizer: optax.GradientTransformation
    strategy: Strategy
    run_dir: Path
    params: nl.ParamsDict | None = None  # final params (host numpy leaves)
    opt_state: Any = None  # final optimizer state (host numpy leaves)
    step: int = 0
    summary: dict = field(default_factory=dict)

    @property
    def devices(self) -> list[jax.Device]:
        return self.strategy.devices


def build(cfg: Config, data: Dataset | Future | None = None, timings: Timings | None = None) -> Run:
    """Data, model, optimizer and strategy for ``cfg``; raises ConfigError on bad input.

    ``data``: the data set if already loaded, or a Future of it (``python -m train`` loads
    it while JAX imports); None loads it here.
    """
    timings = timings or Timings()
    strategy = parallel.from_config(cfg.parallel, cfg.train.batch_size)
    devices = strategy.devices
    timings.lap("backend")
    if data is None:
        data = load_dataset(cfg.data, context=cfg.model.context)
    elif isinstance(data, Future):
        data = data.result()
    timings.lap("data")
    try:
        model = models.MODELS[cfg.model.name](cfg.model, data)
    except ValueError as e:  # a model config that does not fit the data (e.g. cnn lengths)
        raise ConfigError(str(e)) from None
    if model.task != data.task:
        raise ConfigError(
            f"model.name={cfg.model.name} is a {model.task} model but data.name={cfg.data.name} "
            f"is a {data.task} data set"
        )
    if cfg.loss.grad == "fused" and "fused" not in model.grad_modes:
        # manual works for any model built from nnlite layers; fused is one hand-written
        # backward pass for one model shape.
        raise ConfigError(
            f"loss.grad=fused is not available for model.name={cfg.model.name}; it is a "
            f"hand-written pass of model.name={'/'.join(models.FUSED)} only; use loss.grad="
            "manual (every layer's hand-derived VJP) or autodiff"
        )
    local_batch = cfg.train.batch_size // len(devices)
    if local_batch % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} does not divide the per-device "
            f"batch of {local_batch} (train.batch_size={cfg.train.batch_size} over {len(devices)} "
            f"device(s)); use a divisor of {local_batch}"
        )
    optimizer = build_optimizer(cfg.optimizer, cfg.train.steps)
    # Before anything is allocated: refuse what cannot fit, naming the key.
    memory.check_fits(cfg, model, optimizer, data, strategy)
    run_dir = Path(cfg.log.dir) / cfg.name
    return Run(cfg, data, model, optimizer, strategy, run_dir)


def make_stepper(r: Run, p_def, o_def, nonfinite: str) -> Stepper:
    """The compiled train step that ``r.cfg`` describes (strategy, grad mode, accumulation)."""
    cfg = r.cfg
    grads_fn = batch_grads_fn(r.model, cfg.loss.grad, cfg.train.grad_accum_steps, r.strategy)
    return build_stepper(
        grads_fn,
        r.optimizer,
        p_def,
        o_def,
        r.strategy,
        nonfinite,
        window=r.data.window,
        key_seed=cfg.seed if uses_key(r.model) else None,
    )


def init_state(model, optimizer, key):
    """Initial ``(params, opt_state)``."""
    params = model.init(key)
    return params, optimizer.init(params)


# Init runs once, so compile it fast rather than well: threefry and erf_inv make LLVM's
# default optimisation cost ~1.1 s for the digits MLP's init, 0.2 s at level 0, and 0.1 s
# without XLA's fusion emitters as well (the same values, bit for bit, as level 0 alone).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def init_program(model, optimizer):
    """``init_state`` as one jitted program, ``seed -> (params, opt_state)`` with the key
    ``jax.random.key(seed)``. Run eagerly, each random/initializer op (the key's creation
    too) compiles a tiny XLA program of its own (2.5 s in all for the digits MLP, vs 0.1 s)."""

    def init(seed):
        return init_state(model, optimizer, jax.random.key(seed))

    return jax.jit(init, compiler_options=INIT_COMPILER_OPTIONS)


def init_state_compiled(model, optimizer, seed: int):
    """``init_state`` for ``jax.random.key(seed)``, run as one compiled program."""
    return init_program(model, optimizer)(seed)


@dataclass
class Prepared:
    """What a run computes with, compiled and placed (see :func:`prepare`)."""

    params0: nl.ParamsDict  # initial params and optimizer state, host copies
    opt0: Any
    stepper: Stepper
    evaluate: Callable  # jitted (params, X, Y) -> {metric: mean}
    X: jax.Array  # the train split, placed for the stepper
    Y: jax.Array
    X_test: jax.Array  # the test split, on eval_device
    Y_test: jax.Array
    eval_device: jax.Device

    @property
    def p_def(self):
        return jax.tree.structure(self.params0)

    @property
    def o_def(self):
        return jax.tree.structure(self.opt0)


def prepare(r: Run, nonfinite: str, first_indices: np.ndarray) -> Prepared:
    """The initial state, the train step and the evaluation, compiled side by side.

    A small model's cold start is compile time: for the digits MLP ~0.3 s of XLA for the
    step, ~0.1 s each for init and eval, against a few ms of training per 50 steps. XLA
    compiles with the GIL released, so each program is traced and lowered here and
    compiled on a worker thread: the step compiles while init is traced, compiled and run
    and the eval is traced. The step is traced for init's output *types* placed as
    ``put_state`` places them (the key of jit's caches) and for ``first_indices`` (this
    process's ``[K, batch]`` indices of the first call), so the loop's first call finds it
    compiled (other call sizes compile on first use).
    """
    cfg = r.cfg
    seed = np.int32(cfg.seed)
    init = init_program(r.model, r.optimizer).trace(seed)
    p_avals, o_avals = init.out_info
    p_def, o_def = jax.tree.structure(p_avals), jax.tree.structure(o_avals)
    stepper = make_stepper(r, p_def, o_def, nonfinite)
    X, Y = stepper.put_data(r.data.x), stepper.put_data(r.data.y)
    eval_dev = r.strategy.eval_device
    X_test, Y_test = (
        jax.device_put(r.data.x_test, eval_dev),
        jax.device_put(r.data.y_test, eval_dev),
    )
    chunk = len(r.data.x_test)  # example data sets: one pass over the whole split
    if r.data.window is not None:
        chunk = max(1, EVAL_TOKENS_PER_CHUNK // r.data.window)
    evaluate = build_split_eval(r.model, chunk)
    on_eval_dev = jax.sharding.SingleDeviceSharding(eval_dev)
    eval_params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_eval_dev), p_avals
    )
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="nnlite-compile") as pool:
        jobs = []
        p_abs = stepper.abstract_state(jax.tree.leaves(p_avals))
        if p_abs is not None:  # pmap compiles on its first call
            o_abs = stepper.abstract_state(jax.tree.leaves(o_avals))
            idx = stepper.put_indices(first_indices, 0)
            jobs.append(compile_async(pool, stepper.run, p_abs, o_abs, X, Y, idx))
        init_job = compile_async(pool, init)
        jobs.append(compile_async(pool, evaluate, eval_params, X_test, Y_test))
        # Host copies: the step donates its inputs, and these are needed again (resume, replay).
        params0, opt0 = jax.device_get(init_job.result()(seed))
        for job in jobs:
            job.result()  # the first calls must find them compiled, not compile them again
    return Prepared(params0, opt0, stepper, evaluate, X, Y, X_test, Y_test, eval_dev)
