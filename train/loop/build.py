"""Building a run: the config's data, model, optimizer and parallel strategy, then its
initial state, train step and evaluation compiled side by side (:func:`prepare`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

import nnlite as nl

from .. import parallel
from ..config import Config, ModelConfig, check_model_round_trip
from ..data import overfit
from ..data.builtin import data_section, load_dataset, text_context
from ..data.dataset import Dataset, batch_dtype, host_batch
from ..data.feed import EVAL_TOKENS_PER_CHUNK, device_chunks, eval_chunk
from ..data.registry import TASK_FROM_DTYPE
from ..errors import ConfigError
from ..model import contract, gradmode
from ..model import metrics as user_metrics
from ..model import registry as models
from ..model.contract import Model
from ..model.dpo import with_loss
from ..optim.params import ParamPlan, make_optimizer
from ..parallel.base import Strategy
from ..report import loggers
from ..report.timings import Timings
from ..step import precision
from ..step.backward import build_backward
from ..step.step import (
    AfterCompile,
    Stepper,
    batch_grads_fn,
    build_chunk_eval,
    build_split_eval,
    build_stepper,
    compile_async,
    uses_key,
)
from . import memory

# Examples evaluated per chunk of a windowed (text) split: 32k tokens, e.g. 512 windows of
# 64, so evaluating thousands of windows never holds all their activations at once.


@dataclass
class Run:
    """What the loop built from the config (also handy in tests and benchmarks)."""

    cfg: Config
    data: Dataset
    model: Model  # see train/model/contract.py
    optimizer: optax.GradientTransformation
    strategy: Strategy
    run_dir: Path
    params: nl.ParamsDict | None = None  # final params (host numpy leaves)
    opt_state: Any = None  # final optimizer state (host numpy leaves)
    state: nl.ParamsDict | None = None  # a stateful model's final state (None: stateless)
    step: int = 0
    summary: dict = field(default_factory=dict)
    grad: gradmode.GradMode | None = None  # loss.grad resolved (auto); None: on first use
    metrics: tuple = ()  # eval.metrics: (name, function) pairs (train/model/metrics.py)
    plan: ParamPlan | None = None  # frozen params and param groups (None: all train alike)
    backward: Any = None  # issue 34: per-layer policies and norms (train/step/backward.py)

    @property
    def devices(self) -> list[jax.Device]:
        return self.strategy.devices

    @property
    def grad_mode(self) -> str:
        """What the step differentiates with: ``loss.grad``, ``auto`` resolved."""
        if self.grad is None:
            self.grad = gradmode.resolve(self.cfg, self.model, self.data, self.strategy)
        return self.grad.mode


def build(
    cfg: Config,
    data: Dataset | Future | None = None,
    timings: Timings | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> Run:
    """Data, model, optimizer and strategy for ``cfg``; raises ConfigError on bad input.

    ``data``: the data set if already loaded, or a Future of it (``nnlite-train`` loads
    it while JAX imports); None loads it here. ``optimizer``: the object that
    ``optimizer.name: given`` stands for (``train.fit(optimizer=...)``).
    """
    timings = timings or Timings()
    strategy = parallel.from_config(cfg.parallel, cfg.train.batch_size)
    devices = strategy.devices
    timings.lap("backend")
    if data is None:
        data = load_dataset(data_section(cfg), context=text_context(cfg))
    elif isinstance(data, Future):
        data = data.result()
    data = overfit.eval_on_batches(cfg, data)  # train.overfit_batches: evaluate on them
    timings.lap("data")
    model, cfg = make_model(cfg, data)
    if cfg.loss.grad != gradmode.AUTO and cfg.loss.grad not in contract.grad_modes(model):
        having = [
            n for n in models.MODELS if cfg.loss.grad in contract.grad_modes(models.resolve(n))
        ]
        why = ""
        if cfg.loss.grad in contract.BASE_GRAD_MODES:
            why = " (its grad_modes leave it out)"
        elif having:
            why = f" ({cfg.loss.grad} is a hand-written pass of model.name={'/'.join(having)})"
        raise ConfigError(
            f"loss.grad={cfg.loss.grad} is not available for model.name={cfg.model.name}; "
            f"it supports {', '.join(contract.grad_modes(model))}{why}"
        )
    local_batch = cfg.train.batch_size // len(devices)
    if local_batch % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} does not divide the per-device "
            f"batch of {local_batch} (train.batch_size={cfg.train.batch_size} over {len(devices)} "
            f"device(s)); use a divisor of {local_batch}"
        )
    loggers.check(cfg.log.loggers, cfg.log.tensorboard)  # a Config made in code, too
    loggers.check_installed(cfg.log.loggers, cfg.log.tensorboard)
    precision.check_model_dtype(model, cfg.train.precision)  # e.g. the GPT's own model.dtype
    # Before anything is allocated: refuse what cannot fit, naming the key.
    try:
        _check_init(cfg, model)
        # frozen params (LoRA: all but the adapters), param groups, the params' EMA
        optimizer, plan = make_optimizer(cfg, model, optimizer)
        optimizer = precision.with_loss_scaling(
            optimizer, cfg.train.precision, cfg.train.loss_scale
        )  # float16: outermost, so the step finds the scale
        strategy.plan(model, optimizer)  # where each leaf goes (shapes only)
        memory.check_fits(cfg, model, optimizer, data, strategy)  # traces init and the loss
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        # The model refuses its own hyperparameters or the data's shapes (the layers name
        # the expected and actual shapes): bad input, one line.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model.name={cfg.model.name} does not run on data.name={cfg.data.name}: {first}"
        ) from None
    if data.window is None and data.stream is None and cfg.train.batch_size > len(data.x):
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is larger than the training set "
            f"({len(data.x)} examples of data.name={cfg.data.name}): every batch would hold "
            f"examples several times; use at most {len(data.x)}"
        )
    run_dir = Path(cfg.log.dir) / cfg.name
    run = Run(cfg, data, model, optimizer, strategy, run_dir, plan=plan)
    run.grad = gradmode.resolve(cfg, model, data, strategy)  # loss.grad: auto, decided once
    run.metrics = user_metrics.prepare(cfg.eval.metrics, model, data)  # checked on its outputs
    run.backward = build_backward(cfg, model, data, strategy, run.grad)
    return run


def _check_init(cfg: Config, model) -> None:
    """A model's ``init`` returns an ``nl.ParamsDict`` (the trainer prints, checkpoints and
    shards it by its paths): anything else is the user's mistake, named in one line."""
    params = contract.param_shapes(model)
    if not isinstance(params, nl.ParamsDict):
        kind = type(params).__name__
        raise ConfigError(
            f"model.name={cfg.model.name}: {type(model).__name__}.init returned a {kind}, "
            f"expected an nl.ParamsDict; return nl.ParamsDict(W=..., ...)"
            + (" or nl.ParamsDict(your_dict)" if isinstance(params, dict) else "")
        )


def make_model(cfg: Config, data: Dataset) -> tuple[Model, Config]:
    """The model ``cfg.model`` names with the fields the data determines filled in, and the
    config with the model section complete (what the run directory records)."""
    spec = cfg.model
    cls = spec.cls or models.resolve(spec.name)
    where = f"model.name={spec.name}"
    if cls.task != data.task:
        raise ConfigError(
            f"{where} is a {cls.task} model but data.name={cfg.data.name} is a {data.task} "
            f"data set{_task_hint(cls.task, data)}"
        )
    options = dict(spec.options)
    for key, value in data_fields(data).items():
        if key not in contract.fields(cls):
            continue
        given = options.get(key)
        if value is None:
            if given is None:
                raise ConfigError(f"{where}: model.{key} is required: {DATA_UNKNOWN[key](data)}")
            continue
        if given is None:
            options[key] = value
        elif not _fits(key, given, value):
            raise ConfigError(
                f"{where}: model.{key}={given!r} does not fit the data, which has "
                f"{key}={value!r}; leave model.{key} out to take it from the data"
            )
    try:
        model = cls(**options)
    except (TypeError, ValueError) as e:  # the model's own checks of its hyperparameters
        raise ConfigError(f"{where} ({cls.__name__}): {_name_keys(str(e), cls)}") from None
    resolved = ModelConfig(spec.name, {f: getattr(model, f) for f in contract.fields(cls)}, cls)
    check_model_round_trip(resolved, model)  # what config.yaml will hold loads back
    model = with_loss(cfg.loss, model, data)  # loss.name: dpo wraps the model's objective
    return model, dataclasses.replace(cfg, model=resolved)


def _name_keys(message: str, cls: type) -> str:
    """A model's message as config keys: its leading field names (``channels must ...``,
    ``kernel_size/strides ...``) become ``model.channels``, ``model.kernel_size/...``."""
    head, sep, rest = message.partition(" ")
    names = head.split("/")
    if names and all(n in contract.fields(cls) for n in names):
        head = "/".join(f"model.{n}" for n in names)
    elif head == "unknown" and rest.split(" ")[0] in contract.fields(cls):
        # nnlite's "unknown activation 'x'; valid: ...": the key is the field of that name
        return f"model.{rest.split(' ')[0]}: {message}"
    return head + sep + rest


def _task_hint(task: str, data: Dataset) -> str:
    """Why an npz file reads as the other task, and the fix."""
    if data.name not in TASK_FROM_DTYPE:
        return ""
    if task == "classification" and data.task == "regression":
        return (
            f" (its y is {data.y.dtype.name}: float labels are read as regression targets; "
            "to classify, save integer class labels, e.g. y.astype(np.int64))"
        )
    if task == "regression" and data.task == "classification":
        return (
            " (its y holds integers: integer labels are read as classes; to regress, save "
            "float targets, e.g. y.astype(np.float32))"
        )
    return ""


def data_fields(data: Dataset) -> dict[str, Any]:
    """What the data set determines of a model's fields (None: not determined by it)."""
    flat = data.window is None and data.x.ndim == 2
    return {
        "in_features": data.x.shape[1] if flat else None,
        "in_shape": tuple(data.x.shape[1:]) if data.task != "language_model" else None,
        "num_classes": data.num_classes if data.task == "classification" else None,
        "out_features": data.y.shape[1] if data.task == "regression" else None,
        "vocab_size": data.num_classes if data.task == "language_model" else None,
        "context": data.window or data.token_rows,
    }


DATA_UNKNOWN = {
    "in_features": lambda d: (
        f"the inputs are not flat (x of shape {list(d.x.shape)}); use in_shape or give in_features"
    ),
    "in_shape": lambda d: "text data has token windows, not input shapes",
    "num_classes": lambda d: f"data.name={d.name} is a {d.task} data set, not classification",
    "out_features": lambda d: f"data.name={d.name} is a {d.task} data set, not regression",
    "vocab_size": lambda d: f"data.name={d.name} is not text",
    "context": lambda d: f"data.name={d.name} is not text",
}


def _fits(key: str, given: Any, value: Any) -> bool:
    if key == "num_classes":  # a wider head than the labels need is allowed
        return given >= value
    return tuple(given) == tuple(value) if isinstance(value, tuple) else given == value


def make_stepper(r: Run, p_def, o_def, nonfinite: str, s_def=None) -> Stepper:
    """The compiled train step that ``r.cfg`` describes (strategy, grad mode, accumulation);
    ``s_def``: the structure of a stateful model's state (None: stateless)."""
    cfg = r.cfg
    try:
        model = precision.apply(r.model, cfg.train.precision)  # train.precision's casts
        trainable = (
            None
            if r.plan is None
            else r.plan.trainable(jax.tree.unflatten(p_def, [0] * p_def.num_leaves))
        )
        grads_fn = batch_grads_fn(
            model,
            r.grad_mode,
            cfg.train.grad_accum_steps,
            r.strategy,
            trainable,
            backward=r.backward,
        )
    except contract.ModelError as e:
        raise ConfigError(f"model.name={cfg.model.name}: {e}") from None
    return build_stepper(
        grads_fn,
        r.optimizer,
        p_def,
        o_def,
        r.strategy,
        nonfinite,
        window=r.data.window,
        key_seed=cfg.seed if uses_key(r.model) else None,
        streamed=r.data.streamed,
        state_def=s_def,
        norms=cfg.log.norms,
    )


def init_state(model, optimizer, key):
    """Initial ``(params, opt_state)``."""
    params = model.init(key)
    return params, optimizer.init(params)


# Init runs once, so compile it fast rather than well: threefry and erf_inv make LLVM's
# default optimisation cost ~1.1 s for the digits MLP's init, 0.2 s at level 0, and 0.1 s
# without XLA's fusion emitters as well (the same values, bit for bit, as level 0 alone).
# The options are XLA:CPU's (another backend refuses an option it does not know, so there
# init compiles with the defaults).
_CPU_FAST = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def init_compiler_options() -> dict:
    """Compiler options for a run-once program (init): fast to compile on the CPU backend,
    XLA's defaults elsewhere."""
    return dict(_CPU_FAST) if jax.default_backend() == "cpu" else {}


def init_program(model, optimizer, out_shardings=None):
    """``init_state`` as one jitted program, ``seed -> (params, opt_state)`` with the key
    ``jax.random.key(seed)``. Run eagerly, each random/initializer op (the key's creation
    too) compiles a tiny XLA program of its own (2.5 s in all for the digits MLP, vs 0.1 s).
    ``out_shardings``: ``(params, opt_state)`` trees of shardings (a sharded strategy's
    ``init_shardings``): each device computes only its own shards."""

    def init(seed):
        return init_state(model, optimizer, jax.random.key(seed))

    return jax.jit(init, out_shardings=out_shardings, compiler_options=init_compiler_options())


def init_state_compiled(model, optimizer, seed: int):
    """``init_state`` for ``jax.random.key(seed)``, run as one compiled program."""
    return init_program(model, optimizer)(seed)


def model_state_program(model):
    """A stateful model's ``init_state`` as one jitted program (None: stateless)."""
    if not contract.is_stateful(model):
        return None
    return jax.jit(model.init_state, compiler_options=init_compiler_options())


@dataclass
class Prepared:
    """What a run computes with, compiled and placed (see :func:`prepare`)."""

    params0: nl.ParamsDict  # initial params and optimizer state, host copies
    opt0: Any
    stepper: Stepper
    # jitted (params, X, Y) -> {metric: mean}; streamed: (params, x, y, n) -> (sums, count)
    # of one chunk (train.data.feed.evaluate)
    evaluate: Callable
    X: Any  # the train split, placed for the stepper (streamed: ())
    Y: Any
    X_test: Any  # the test split, on eval_device (streamed: None, read a chunk at a time;
    Y_test: Any  # a text split: a list of (x, y, valid) chunks, Y_test None: device_eval)
    eval_device: jax.Device
    state0: nl.ParamsDict | None = None  # a stateful model's initial state (host copy)
    step_cost: dict | None = None  # nl.flops of one step (step_cost; train/report/perf.py)

    @property
    def p_def(self):
        return jax.tree.structure(self.params0)

    @property
    def o_def(self):
        return jax.tree.structure(self.opt0)

    @property
    def s_def(self):
        return jax.tree.structure(self.state0)


def prepare(r: Run, nonfinite: str, first_indices: np.ndarray) -> Prepared:
    """:func:`compile_run`, with a model that ``loss.grad=manual`` cannot differentiate
    (an operation without a hand rule) reported as bad input (one line, naming the layer)."""
    try:
        return compile_run(r, nonfinite, first_indices)
    except nl.ManualGradError as e:
        asked = r.grad.describe() if r.grad else r.cfg.loss.grad
        raise ConfigError(f"loss.grad={asked}: {e} (in the trainer: loss.grad=autodiff)") from None
    except contract.ModelError as e:  # a stateful model's state that breaks the contract
        raise ConfigError(f"model.name={r.cfg.model.name}: {e}") from None


def compile_run(r: Run, nonfinite: str, first_indices: np.ndarray) -> Prepared:
    """The initial state, the train step and the evaluation, compiled side by side.

    A small model's cold start is compile time: for the digits MLP ~0.8 s of XLA for the
    step, ~0.3 s each for init and eval (CPU, this 2-core VM), against ~15 ms of training
    per 50 steps. XLA
    compiles with the GIL released, so each program is traced and lowered here and
    compiled on a worker thread: the step compiles while init is traced, compiled and run
    and the eval is traced, and the eval may go on compiling while the first steps run
    (``Prepared.evaluate`` waits for it at its first call). The step is traced for init's output *types* placed as
    ``put_state`` places them (the key of jit's caches) and for ``first_indices`` (this
    process's ``[K, batch]`` indices of the first call), so the loop's first call finds it
    compiled (other call sizes compile on first use).
    """
    cfg = r.cfg
    seed = np.int32(cfg.seed)
    init_shardings = r.strategy.init_shardings()
    init = init_program(r.model, r.optimizer, init_shardings).trace(seed)
    p_avals, o_avals = init.out_info
    p_def, o_def = jax.tree.structure(p_avals), jax.tree.structure(o_avals)
    state_init = model_state_program(r.model)
    s_avals = None if state_init is None else jax.eval_shape(state_init)
    stepper = make_stepper(r, p_def, o_def, nonfinite, jax.tree.structure(s_avals))
    eval_dev = r.strategy.eval_device
    on_eval_dev = jax.sharding.SingleDeviceSharding(eval_dev)
    first_batch = None

    if r.data.streamed:  # batches come from the host (train/data/feed.py): nothing placed whole
        X = Y = ()
        first_batch = stepper.put_batch(*host_batch(r.data, first_indices), 0)
        X_test = Y_test = None
        chunk = eval_chunk(r.data)
        evaluate = build_chunk_eval(precision.apply(r.model, cfg.train.precision), r.metrics)
        eval_args = [
            jax.ShapeDtypeStruct((chunk, *a.shape[1:]), batch_dtype(a), sharding=on_eval_dev)
            for a in (r.data.x_test, r.data.y_test)
        ] + [jax.ShapeDtypeStruct((), np.int32, sharding=on_eval_dev)]
    else:
        X, Y = stepper.put_data(r.data.x), stepper.put_data(r.data.y)
        X_test, Y_test, evaluate = device_eval(r, eval_dev)
        eval_args = [*X_test[0]] if Y_test is None else [X_test, Y_test]
    eval_params, eval_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_eval_dev), (p_avals, s_avals)
    )
    # The evaluation is first needed at the first eval boundary: it may still compile while
    # the first steps run (on a 2-core machine a small model's three programs otherwise take
    # turns on the cores before the first step). Its first call waits for it.
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="nnlite-compile")
    try:
        jobs, step_job = [], None
        p_abs = stepper.abstract_state(jax.tree.leaves(p_avals))
        if p_abs is not None:  # pmap compiles on its first call
            o_abs = stepper.abstract_state(jax.tree.leaves(o_avals))
            s_abs = stepper.abstract_state(jax.tree.leaves(s_avals))
            batch = first_batch if r.data.streamed else stepper.put_indices(first_indices, 0)
            step_job = compile_async(pool, stepper.compiled, p_abs, (o_abs, s_abs), X, Y, batch)
            jobs.append(step_job)
        init_job = compile_async(pool, init)
        state_args = () if s_avals is None else (eval_state,)
        evaluate = AfterCompile(
            evaluate, compile_async(pool, evaluate, eval_params, *eval_args, *state_args)
        )
        # Host copies: the step donates its inputs, and these are needed again (resume, replay).
        state = init_job.result()(seed)
        if init_shardings is not None:  # created sharded: the strategy gathers the shards
            state = [
                jax.tree.unflatten(
                    d, [np.asarray(v) for v in r.strategy.get_state(jax.tree.leaves(s))]
                )
                for d, s in zip((p_def, o_def), state, strict=True)
            ]
        params0, opt0 = jax.device_get(state)
        state0 = None if state_init is None else jax.device_get(state_init())
        for job in jobs:
            job.result()  # the first calls must find them compiled, not compile them again
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=False)  # the evaluation's compile goes on; its first call waits
    cost = None if step_job is None else step_cost(step_job.traced, len(first_indices))
    return Prepared(params0, opt0, stepper, evaluate, X, Y, X_test, Y_test, eval_dev, state0, cost)


def device_eval(r: Run, eval_dev) -> tuple:
    """``(X_test, Y_test, evaluate)`` of a held-out split kept on the devices: the example
    data sets' whole split, one compiled call; a text split of more windows than one chunk
    of ``EVAL_TOKENS_PER_CHUNK`` tokens, a list of chunks (``Y_test`` None) evaluated one
    call each, so that a SIGTERM/SIGINT stops an evaluation after a chunk, not the split."""
    model = precision.apply(r.model, r.cfg.train.precision)
    x_test, y_test = r.data.x_test, r.data.y_test
    chunk = len(x_test)  # example data sets: one pass over the whole split
    if r.data.window is not None:
        chunk = max(1, EVAL_TOKENS_PER_CHUNK // r.data.window)
    if chunk < len(x_test):
        return (
            device_chunks(x_test, y_test, chunk, eval_dev),
            None,
            build_chunk_eval(model, r.metrics),
        )
    placed = jax.device_put(x_test, eval_dev), jax.device_put(y_test, eval_dev)
    return *placed, build_split_eval(model, chunk, r.metrics)


def step_cost(traced, steps: int = 1) -> dict | None:
    """``nl.flops`` of one step: the traced call (a ``jax.stages.Traced``) counted from its
    jaxpr, every loop by its trip count (the call's ``steps`` steps, the microbatches of
    ``train.grad_accum_steps``, scanned blocks, the chunked LM head; a ``shard_map`` body
    once per device: the total over the devices), divided by ``steps``. None where it
    cannot be counted."""
    try:
        cost = nl.flops(traced)
    except Exception:  # noqa: BLE001 - a program that cannot be counted: no MFU, no failure
        return None
    per_step = {k: cost[k] / steps for k in ("flops", "matmul_flops", "transcendentals")}
    return {**cost, **per_step}
