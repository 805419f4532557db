"""Run configuration: YAML validated into frozen dataclasses.

Every field has a typed default with a comment; unknown keys, wrong types and bad choices
raise ``ConfigError`` with one line naming the key, the file and what is valid.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import enum
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import parallel
from .data.registry import DATA_SETS, NEEDS_PATH
from .data.registry import check as check_data
from .errors import ConfigError, relative_to


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the ``nnlite-train COMMAND`` commands: a bad argument raises ConfigError
    (one line, exit 2, like every other bad input) instead of printing usage."""

    def error(self, message):
        raise ConfigError(message)


def choice(default: Any, choices: tuple) -> Any:
    """A dataclass field whose value must be one of ``choices``."""
    return field(default=default, metadata={"choices": choices})


DATA_NAMES = DATA_SETS.names  # the registry in train/data/registry.py
PLACEMENTS = ("auto", "device", "host")
# auto resolves to one of the others at build time (train/model/gradmode.py); each model's
# grad_modes are a subset (tested)
GRAD_MODES = ("auto", "autodiff", "manual", "fused")
STRATEGIES = parallel.NAMES  # the registry in train/parallel/__init__.py
NONFINITE = ("stop", "skip")
# data.eval_windows: null evaluates this many tokens of windows (train/data/feed.py's
# EVAL_TOKENS_PER_CHUNK: one compiled chunk)
EVAL_TOKENS = 2**15
PRECISIONS = ("float32", "bfloat16", "float16")  # train.precision (train/loop/precision.py)


@dataclass(frozen=True)
class ModelConfig:
    """``model.name`` is a shipped model (mlp, linreg, cnn, gpt: see models/) or your own,
    ``module:Class``; every other key of the section is one of that model's dataclass fields
    (``options``), checked against the field's type. Fields the data determines
    (``in_features``, ``in_shape``, ``num_classes``, ``out_features``, ``vocab_size``,
    ``context``) are filled from the data set when left out."""

    name: str = "mlp"
    options: dict = field(default_factory=dict)  # the model's own fields, by name
    # the class ``name`` resolved to (not part of the config's text)
    cls: type | None = field(default=None, compare=False, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)


@dataclass(frozen=True)
class DataConfig:
    # A built-in data set (train/data/registry.py), or your factory "module:function"
    # returning a data source (train/data/source.py), called with `options` as keywords
    name: str = "digits"
    options: dict = field(default_factory=dict)  # data.name module:function: its arguments
    # npz: file with arrays x, y (x_test, y_test); text: a UTF-8 file; tokens: a directory
    # written by nnlite-train prepare; arrays: a directory of x.npy, y.npy (x_test.npy,
    # y_test.npy), memory-mapped
    path: str | None = None
    # Where the training set lives: "device" (whole, each step gathers its batch there),
    # "host" (each batch read on the host and sent a call ahead, streamed), or "auto"
    # (device when the training set takes at most 256 MiB there, else host)
    placement: str = choice("auto", PLACEMENTS)
    # digits/npz without x_test: held-out share, stratified; arrays without x_test.npy: the
    # last rows
    test_fraction: float = 0.2
    split_seed: int = 0  # seed of the fixed train/test split
    num_samples: int = 5000  # mnist1d: total examples generated (80% train)
    val_fraction: float = 0.1  # text, shakespeare_char: the tail of the text held out
    # text, shakespeare_char, tokens: the fixed validation windows each evaluation runs;
    # null: as many as hold EVAL_TOKENS tokens (one compiled evaluation chunk: 512 windows
    # of 64, 128 of 256), so a short run does not spend most of its time evaluating
    eval_windows: int | None = None
    # text, shakespeare_char, tokens: tokens per training window; null: the model's context field
    # when the config sets it, else 64. Fills the model's `context`.
    context: int | None = None
    # chat: the Hugging Face directory whose tokenizer and chat template render the
    # conversations; null: the model's (model.name "hf:DIR")
    tokenizer: str | None = None
    # chat: which tokens take a loss: the assistant's (assistant) or every token (all)
    train_on: str = choice("assistant", ("assistant", "all"))
    # chat: several conversations in one window, each attending only to itself
    pack: bool = True

    def eval_windows_for(self, context: int) -> int:
        """The validation windows of ``context`` tokens evaluated (``eval_windows``)."""
        if self.eval_windows is not None:
            return self.eval_windows
        return max(1, EVAL_TOKENS // context)


@dataclass(frozen=True)
class LossConfig:
    # How gradients are computed: jax.value_and_grad (autodiff), every layer's hand VJP
    # composed (manual: any model built from layers with hand rules), or a model's own
    # hand-written pass (fused: models that list it in grad_modes, the mlp). auto: manual
    # when hand rules cover the model's objective, else autodiff (resolved once, at build).
    grad: str = choice("auto", GRAD_MODES)
    # issue 34: per-layer backward policies by layer path glob, applied to the hand rules
    # (forward unchanged; needs manual gradients): a list of {layers: "blocks/*/attn",
    # stop: true | scale: S | clip: C | float32: true} (train/loop/backward_config.py)
    backward_policies: tuple[dict, ...] = ()
    # issue 46: under manual (or auto -> manual) each hand rule of yours -- not nnlite's --
    # is checked against jax.vjp at the step's shapes before step 1, once per code
    # (train/loop/checkgrads.py); false trains it unchecked (the banner says so)
    check_rules: bool = True
    # What training minimises: the model's task loss (task: cross-entropy, ...), or dpo
    # (direct preference optimisation on data.name: chat preference pairs, train/model/dpo.py)
    name: str = choice("task", ("task", "dpo"))
    beta: float = 0.1  # dpo: the strength of the pull towards the reference model
    # dpo: the frozen reference, a Hugging Face directory; null: the model's base (a LoRA
    # run: its weights without the adapters; else its directory as it was before training)
    reference: str | None = None


@dataclass(frozen=True)
class OptimizerConfig:
    """A named optimizer (train/optim/__init__.py), whose keys are the fields below; or a
    user's factory ``"module:function"`` returning an optax.GradientTransformation, whose
    other keys are its keyword arguments (``options``); or ``given``: the object passed to
    ``train.fit(optimizer=...)``."""

    name: str = "adam"  # sgd, momentum, adam, adamw, lion, or "module:function"
    learning_rate: float = 1e-3  # peak learning rate
    # learning-rate schedule over train.steps: constant, cosine, warmup_cosine, exponential,
    # or "module:function" called with learning_rate and total_steps (those it takes)
    schedule: str = "constant"
    warmup_steps: int = 0  # warmup_cosine: linear warmup length
    end_lr_fraction: float = 0.0  # cosine/warmup_cosine: final lr as a fraction of peak
    decay_rate: float = 0.1  # exponential: lr multiplier reached after train.steps
    momentum: float = 0.9  # name=momentum: the momentum coefficient
    weight_decay: float = 0.0  # decoupled for adamw/lion; added to the gradient otherwise
    # Which params weight decay applies to: "all", or "matrices" (ndim >= 2: weights and
    # embeddings, not biases or norm scales, as nanoGPT decays)
    decay: str = choice("all", ("all", "matrices"))
    b1: float = 0.9  # adam/adamw/lion: first-moment decay
    b2: float | None = None  # adam/adamw/lion: second-moment decay (unset: 0.999; lion 0.99)
    clip_norm: float | None = None  # clip gradients to this global norm first
    options: dict = field(default_factory=dict)  # name "module:function": its arguments
    # Params never trained: globs over ParamsDict paths ("embed/*", "blocks/0/*"); no
    # update, no optimizer state, and no weight gradient computed (train/optim/params.py)
    frozen: tuple[str, ...] = ()
    # Per-glob settings: [{params: "glob" or [globs], lr_scale: 0.1, weight_decay: 0.0}];
    # a param takes the first group that matches it, the others the section's settings
    param_groups: tuple[dict, ...] = ()


@dataclass(frozen=True)
class CallbackConfig:
    """One entry of ``callbacks:``: a built-in callback's name or a user's
    ``"module:Class"``; every other key is an argument of its constructor."""

    name: str
    options: dict = field(default_factory=dict)
    cls: Any = field(default=None, compare=False, repr=False)  # what ``name`` resolved to


@dataclass(frozen=True)
class EarlyStoppingConfig:
    """``train.early_stopping``: the built-in ``early_stopping`` callback's arguments."""

    monitor: str = "loss"  # a metric the evaluation logs (loss, accuracy, bits_per_char...)
    mode: str = choice("min", ("min", "max"))  # min: lower is better; max: higher is better
    patience: int = 3  # evaluations without an improvement before the run stops
    min_delta: float = 0.0  # the smallest change that counts as an improvement


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 128  # global batch (split over devices)
    steps: int = 1000  # optimizer steps in total
    eval_every: int = 200  # evaluate on the test set every N steps (and at the end)
    log_every: int = 50  # write train metrics every N steps
    steps_per_call: int = 1  # optimizer steps per compiled call (lax.scan) when > 1
    grad_accum_steps: int = 1  # microbatches summed into one update (divides per-device batch)
    # A step whose loss, gradients or new params are not finite: "stop" the run (exit 4,
    # naming the step and the first bad leaf) or "skip" its update and count it.
    nonfinite: str = choice("stop", NONFINITE)
    # Seconds within which every compiled call must finish, else every process ends with
    # exit 5 naming the step (a stuck collective, a hung peer). null: automatic (the first
    # call may take STARTUP_TIMEOUT_S, later ones max(STEP_TIMEOUT_FLOOR_S, 20 x the first
    # call's time)); 0: no watchdog.
    step_timeout: float | None = None
    # Debugging: train on the same N batches (the first N of the data order) again and
    # again, and evaluate on them; the loss of a model that can learn goes to ~0. 0: off.
    overfit_batches: int = 0
    # Stop when an evaluation metric stops improving: {monitor: loss, mode: min, patience: 3,
    # min_delta: 0.0} (the built-in early_stopping callback); null: off
    early_stopping: EarlyStoppingConfig | None = None
    # Compute dtype of the step and evaluation: params, optimizer state and loss stay
    # float32; float16 adds dynamic loss scaling starting at loss_scale (train/loop/precision.py).
    precision: str = choice("float32", PRECISIONS)
    loss_scale: float = 32768.0  # float16: the initial dynamic loss scale (>= 1)
    # An exponential moving average of the params, kept in float32 in the optimizer state
    # (checkpointed, sharded like the params) and updated inside the step; null: none
    ema_decay: float | None = None
    # issue 34: before step 0, check every hand rule the model runs against jax.vjp at the
    # run's shapes, dtype and strategy, print a per-layer table, refuse a wrong rule
    check_grads: bool = False


@dataclass(frozen=True)
class EvalConfig:
    # Your metrics, each "module:function" with function(outputs, labels) -> a value per
    # example or one for the batch, computed in the compiled evaluation and logged under
    # the function's name (train/model/metrics.py)
    metrics: tuple[str, ...] = ()
    use_ema: bool = False  # evaluate the params' moving average (needs train.ema_decay)


@dataclass(frozen=True)
class ParallelConfig:
    # none (one device), pmap / shard_map (data parallel), tensor (jit over a 2-D mesh,
    # params replicated over its data axis), fsdp (params and optimizer state sharded too)
    strategy: str = choice("none", STRATEGIES)
    devices: int | str = "all"  # per process: "all" local devices or a count
    # devices per tensor-parallel group (the mesh's "model" axis, Megatron layout); the
    # other devices / tensor form the data axis. > 1 needs strategy tensor or fsdp.
    tensor: int = 1
    # fsdp: params smaller than this many bytes stay whole on every device (their
    # all-gather would cost more time than they save memory)
    fsdp_min_bytes: int = 16384


CLUSTERS = ("auto", "slurm", "mpi", "k8s", "env", "none")


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process training with ``jax.distributed`` (see docs/distributed.md).

    Unset fields are read from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID; with no coordinator address anywhere the run is a single process.
    ``cluster`` picks who says how many processes there are: ``env`` (those fields and
    variables), ``slurm`` / ``mpi`` (Open MPI's mpirun) / ``k8s`` (an indexed Job), read by
    ``jax.distributed.initialize``'s own cluster detection, ``none`` (one process whatever
    the environment says), or ``auto``: ``env`` when a coordinator address is set, else
    the cluster whose environment is present, else one process.
    """

    cluster: str = choice("auto", CLUSTERS)  # see train/distributed.py
    coordinator_address: str | None = None  # host:port of process 0 (all processes agree)
    num_processes: int | None = None  # how many processes take part
    process_id: int | None = None  # this process: 0 .. num_processes - 1
    initialization_timeout: int = 300  # seconds to wait for every process to connect
    heartbeat_timeout: int = 100  # seconds of silence after which a process counts as dead


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # write a checkpoint every N steps (0: only at the end)
    keep: int = 3  # keep the newest N checkpoints
    # Also keep the best k checkpoints by an evaluation metric (never removed by the
    # newest-N rotation; train.load_run(dir, which="best")); 0: off
    keep_best: int = 0
    monitor: str = "loss"  # keep_best: the evaluation metric that ranks checkpoints
    mode: str = choice("min", ("min", "max"))  # keep_best: min (lower is better) or max
    # Also checkpoint when this many minutes passed since the last checkpoint (checked at
    # the loop's boundaries; the clock restarts when a run resumes); 0: off
    every_minutes: float = 0.0
    # Write checkpoints on a thread while training goes on (the YAML key is `async`, a
    # Python keyword): at most one write in flight, the end of the run waits for the last
    async_: bool = field(default=False, metadata={"key": "async"})


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs"  # run directories are <dir>/<name>/
    progress: bool = True  # show a tqdm progress bar
    plot: bool = True  # draw curves.png at the end
    # where records go besides metrics.jsonl (always written): jsonl, tensorboard, csv,
    # wandb, mlflow, a "module:Class" of your own, or {name: ..., its arguments}
    # (train/report/loggers.py, docs/loggers.md)
    loggers: tuple[str | dict, ...] = ("jsonl",)
    # the same as listing tensorboard in loggers: TensorBoard event files in
    # <run dir>/tensorboard (needs tensorboardX: pip install 'nnlite[tensorboard]')
    tensorboard: bool = False
    # "START:STOP": a jax.profiler trace of those steps in <run dir>/profile (--profile)
    profile: str | None = None
    # grad_norm, update_norm and param_norm in every train record (computed in the step)
    norms: bool = True
    # issue 34: log each layer's cotangent norm (leaving its input) and params' gradient
    # norm, computed inside the compiled step (cotangent_norm/<layer>, grad_norm/<layer>)
    grad_by_layer: bool = False


@dataclass(frozen=True)
class Config:
    name: str = "run"  # run name: the run directory is log.dir/name
    seed: int = 0  # seeds parameter init and the data order
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    parallel: ParallelConfig = ParallelConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    # Callbacks run at the loop's boundaries (train/loop/callbacks.py): a list of names or
    # {name: "module:Class", ...its constructor's arguments}
    callbacks: tuple[CallbackConfig, ...] = ()
    # nnlite-train only: JAX's persistent compilation cache, so a second run of a config
    # compiles nothing. "auto": $NNLITE_CACHE/jax, else ~/.cache/nnlite/jax; a directory;
    # or null (off). Library calls (train.loop.trainer.train) never touch JAX's global cache.
    compile_cache: str | None = "auto"


# -- conversion and validation -------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp) or (tp if tp in _SEQUENCES + _MAPPINGS else None)
    if origin in _SEQUENCES:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in _MAPPINGS and typing.get_args(tp):
        k_tp, v_tp = typing.get_args(tp)
        return f"mapping of {_type_name(k_tp)} to {_type_name(v_tp)}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


# YAML 1.1 (PyYAML) floats need a dot: 1.0e-4 is a float, 1e-4 a string. Users write 1e-4.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
MAX_INT = 2**63 - 1  # what numpy and XLA can hold


def _finite(value: int | float, where: str, shown: str | None = None) -> float:
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"{where}: expected a finite number, got {shown or value}")
    return out


# Unparametrized annotations YAML spells as a list / a mapping (``hidden: tuple = (8,)``)
_SEQUENCES = (tuple, list, collections.abc.Sequence)
_MAPPINGS = (dict, collections.abc.Mapping)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (lists -> tuples,
    an Enum's value -> its member)."""
    origin = typing.get_origin(tp)
    if origin is None and tp in _SEQUENCES + _MAPPINGS:
        origin = tp  # bare ``tuple``, ``list``, ``dict``: of anything
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, float) and float in typing.get_args(tp):
            _finite(value, where)  # say "finite", not "expected float or null"
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin in _SEQUENCES:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [Any]
        if origin is tuple and len(args) > 1:  # tuple[int, str]: one type per position
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(v, a, where) for v, a in zip(value, args, strict=True))
        return tuple(_coerce(v, args[0], where) for v in value)
    if origin in _MAPPINGS:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        k_tp, v_tp = typing.get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, where): _coerce(v, v_tp, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(
            f"{where}: {value!r} is not one of {', '.join(map(repr, typing.get_args(tp)))}"
        )
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -MAX_INT <= value <= MAX_INT:
                raise ConfigError(f"{where}: {value} is out of range (at most {MAX_INT})")
            return value
    elif tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            # YAML 1.1 reads 1e-4 (no dot) as a string
            return _finite(float(value), where, shown=value.strip())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(value, where)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):  # a type YAML cannot spell otherwise
        return value
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):  # written as its value
        try:
            return tp(value)
        except (ValueError, TypeError):
            values = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{where}: {value!r} is not one of {values}") from None
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _build(
    cls: type,
    raw: Any,
    prefix: str,
    source: str,
    sources: dict[str, str],
    search: tuple = (),
    model_class: type | None = None,
) -> Any:
    """``sources`` maps a dotted key to where its value came from (``--set ...``); every
    other key came from ``source`` (the file). ``search``: where a user's model module is
    imported from (see :func:`_build_model`)."""
    where_section = prefix.rstrip(".") or "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        src = sources.get(prefix.rstrip("."), source)
        raise ConfigError(f"{src}: {where_section} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {_key_of(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        src = sources.get(f"{prefix}{key}", source)
        if key not in fields:
            raise ConfigError(
                f"{src}: unknown key '{prefix}{key}'; valid keys in {where_section}: "
                f"{', '.join(fields)}"
            )
        tp = hints[fields[key].name]
        where = f"{src}: {prefix}{key}"
        inner = _optional_dataclass(tp)
        if inner is not None and value is not None:  # e.g. train.early_stopping
            if not isinstance(value, dict):
                keys = ", ".join(f"{_key_of(f)}: ..." for f in dataclasses.fields(inner))
                raise ConfigError(f"{where}: expected a mapping {{{keys}}} or null, got {value!r}")
            kwargs[key] = _build(inner, value, f"{prefix}{key}.", source, sources, search)
            continue
        if tp is ModelConfig:
            kwargs[key] = _build_model(value, source, sources, search, model_class)
            continue
        if tp is OptimizerConfig:
            kwargs[key] = _build_optimizer(value, source, sources, search)
            continue
        if key == "callbacks" and cls is Config:
            kwargs[key] = _build_callbacks(value, source, sources, search)
            continue
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.", source, sources, search)
            continue
        value = _coerce(value, tp, where)
        choices = fields[key].metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        kwargs[key] = value
    return cls(**{fields[k].name: v for k, v in kwargs.items()})


def _key_of(f: dataclasses.Field) -> str:
    """A field's key in YAML (``checkpoint.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


def _optional_dataclass(tp: Any) -> type | None:
    """``X`` for an annotation ``X | None`` where X is a dataclass, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _build_model(
    raw: Any, source: str, sources: dict[str, str], search: tuple, cls: type | None = None
) -> ModelConfig:
    """The ``model`` section: its ``name`` resolved to a class (a shipped model or a user's
    ``module:Class``, imported from ``search`` first), every other key checked against that
    class's fields and types, and the fields the config leaves out that have defaults
    filled in (those the data determines stay out until the data set is loaded). ``cls``:
    the class itself (``train.fit``), instead of resolving the name."""
    from .model.contract import DATA_FIELDS, check_model_class, field_types, fields, has_default
    from .model.registry import ModelError, resolve

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{sources.get('model', source)}: model must be a mapping, got {raw!r}")
    raw = dict(raw)
    name = raw.pop("name", ModelConfig.name)
    src = sources.get("model.name", source)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{src}: model.name: expected a model name or 'module:Class', got {name!r}"
        )
    try:
        if cls is None:
            cls = resolve(name.strip(), search)
        else:
            check_model_class(cls, f"model {cls.__name__}")
    except ModelError as e:
        raise ConfigError(f"{src}: {e}") from None
    own, types_ = fields(cls), field_types(cls)
    if name.strip().startswith("hf:"):  # model.name: "hf:DIR" -> nl.hf.Pretrained(path=DIR)
        directory = name.strip()[3:]
        if raw.setdefault("path", directory) != directory:
            raise ConfigError(
                f"{sources.get('model.path', source)}: model.path={raw['path']!r} differs from "
                f"model.name={name.strip()}; leave model.path out"
            )
    options = {}
    for key, value in raw.items():
        src = sources.get(f"model.{key}", source)
        if key not in own:
            raise ConfigError(
                f"{src}: unknown key 'model.{key}'; model.name={name} ({cls.__name__}) takes "
                f"{', '.join(own) or 'no fields'}"
            )
        options[key] = _model_value(value, types_[key], own[key], f"{src}: model.{key}")
    for key, f in own.items():
        if key in options:
            continue
        if has_default(f):
            options[key] = _frozen(_default(f))
        elif key not in DATA_FIELDS:
            raise ConfigError(
                f"{source}: model.{key} is required by model.name={name} ({cls.__name__}.{key}: "
                f"{_type_name(types_[key])}); add it under model:"
            )
    options = {k: options[k] for k in own if k in options}  # in the class's field order
    return ModelConfig(name.strip(), options, cls)


def _model_value(value: Any, tp: Any, f: dataclasses.Field, where: str) -> Any:
    """A model field's value from YAML: checked against its annotation, lists as tuples (a
    model is hashable), and the field's own default accepted whatever the annotation says
    (``x: int = None``, ``clip: float = math.inf``: what a run's config.yaml writes back)."""
    try:
        return _frozen(_coerce(value, tp, where))
    except ConfigError:
        default = _frozen(_default(f))
        if default is not dataclasses.MISSING and _same(_frozen(value), default):
            return default
        raise


def _default(f: dataclasses.Field) -> Any:
    """A field's default (``dataclasses.MISSING``: none)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _frozen(value: Any) -> Any:
    """Lists as tuples, at any depth (in mappings too)."""
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal as the model's own ``==`` sees it (``1 == 1.0``), NaN equal to NaN, but a
    bool never equal to a number (``true`` is no ``1``)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == is not a bool
        return False


def check_model_round_trip(spec: ModelConfig, model: Any) -> None:
    """Raise ConfigError (one line, naming the field) unless the model section a run writes
    to its config.yaml (``spec``: every field, resolved) reads back as ``model`` itself: a
    field whose value YAML cannot hold (a function, an object), or one that its class
    changes so that the value written is not accepted or not equal when read back, would
    make a run that ``train.load_run``, ``train.sample`` or resuming cannot load."""
    cls = spec.cls
    name = cls.__name__
    for key, value in spec.options.items():
        try:
            yaml.safe_dump(to_dict(ModelConfig(spec.name, {key: value})))
        except yaml.YAMLError:
            named = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
            shown = f"{named} (a {type(value).__name__})" if named else repr(value)
            raise ConfigError(
                f"model.{key}: {name}.{key} = {shown} cannot be written to the run's "
                "config.yaml (a model field holds YAML data: numbers, strings, booleans, "
                "null, lists, mappings or an Enum), so the run could not be loaded back; "
                "make it, e.g., a name that __call__ looks up"
            ) from None
    text = yaml.safe_dump(to_dict(spec), sort_keys=False)
    where = f"model.name={spec.name} ({name})"
    try:
        back = _build_model(yaml.safe_load(text), "its config.yaml", {}, (), cls)
        again = cls(**back.options)
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{where}: the run's config.yaml would not load back: {e}; keep each field's "
            "value one that its annotation accepts"
        ) from None
    for key, value in spec.options.items():
        if not _same(_frozen(getattr(again, key, None)), _frozen(value)):
            raise ConfigError(
                f"{where}: model.{key} = {value!r} reads back from the run's config.yaml as "
                f"{getattr(again, key, None)!r}, so the run would not load back as it trained; "
                f"make {name}.{key} hold the value it was given"
            )


def _build_optimizer(
    raw: Any, source: str, sources: dict[str, str], search: tuple
) -> OptimizerConfig:
    """The ``optimizer`` section: a named optimizer's fields, or a user's factory
    (``module:function``, imported now) with the other keys as its arguments."""
    from .optim import GIVEN, OPTIMIZERS, SCHEDULES
    from .optim.groups import PARAM_KEYS, check_param_settings
    from .registry import check_kwargs

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        src = sources.get("optimizer", source)
        raise ConfigError(f"{src}: optimizer must be a mapping, got {raw!r}")
    name = raw.get("name", OptimizerConfig.name)
    src = sources.get("optimizer.name", source)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{src}: optimizer.name: expected an optimizer name or 'module:function', got {name!r}"
        )
    name = name.strip()
    if name == GIVEN or ":" in name:
        ours = {k: raw[k] for k in PARAM_KEYS if k in raw}  # the trainer's, not the factory's
        options = {k: v for k, v in raw.items() if k != "name" and k not in ours}
        if ":" in name:
            factory = OPTIMIZERS.get(name, f"{src}: optimizer.name={name}", search)
            if not callable(factory):
                raise ConfigError(f"{src}: optimizer.name={name} is not callable")
            if "learning_rate" not in options and _requires(factory, "learning_rate"):
                options["learning_rate"] = OptimizerConfig.learning_rate  # the key's default
            check_kwargs(factory, options, f"{src}: optimizer.name={name}", "optimizer.")
        cfg = _build(OptimizerConfig, ours, "optimizer.", source, sources, search)
        cfg = dataclasses.replace(cfg, name=name, options=options)
        check_param_settings(cfg, sources, source)
        return cfg
    if name not in OPTIMIZERS:
        OPTIMIZERS.get(name, f"{src}: optimizer.name={name}")  # raises, listing the names
    cfg = _build(OptimizerConfig, raw, "optimizer.", source, sources, search)
    if cfg.options:
        raise ConfigError(
            f"{sources.get('optimizer.options', source)}: optimizer.options is for a factory "
            f"optimizer ('module:function'); optimizer.name={name} takes the section's own keys"
        )
    if ":" in cfg.schedule or cfg.schedule not in SCHEDULES:  # names: no import (start-up)
        src = sources.get("optimizer.schedule", source)
        SCHEDULES.get(cfg.schedule, f"{src}: optimizer.schedule={cfg.schedule}", search)
    check_param_settings(cfg, sources, source)
    return cfg


def _requires(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` without a default."""
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return p is not None and p.kind in keyword and p.default is inspect.Parameter.empty


def _build_callbacks(
    raw: Any, source: str, sources: dict[str, str], search: tuple
) -> tuple[CallbackConfig, ...]:
    """The ``callbacks`` list: each a name or ``{name: ..., constructor arguments}``,
    resolved (a user's class imported now) and its arguments checked."""
    from .loop.callbacks import CALLBACKS
    from .registry import check_kwargs

    src = sources.get("callbacks", source)
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise ConfigError(
            f"{src}: callbacks must be a list of names or {{name: 'module:Class', ...}}, "
            f"got {raw!r}"
        )
    out = []
    for i, entry in enumerate(raw):
        where = f"{src}: callbacks[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(
                f"{where}: expected a name or a mapping with a 'name' key, got {entry!r}"
            )
        options = {k: v for k, v in entry.items() if k != "name"}
        cls = CALLBACKS.get(entry["name"], f"{where}.name={entry['name']}", search)
        if not callable(cls):
            raise ConfigError(f"{where}.name={entry['name']} is not a class or factory")
        check_kwargs(cls, options, f"{where}.name={entry['name']}", f"callbacks[{i}].")
        out.append(CallbackConfig(entry["name"], options, cls))
    return tuple(out)


MAX_SEED = 2**31 - 1
# optax counts steps in int32 (schedules go wrong past it); at 10^5 steps/s that is 6 hours.
MAX_STEPS = 2**31 - 1
MAX_TIMEOUT_S = 2**31 - 1  # jax.distributed passes these to C++ as int32 seconds
# A run name is one directory under log.dir: no separators, no leading dot ("..", hidden).
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,127}")


def _check(cfg: Config, source: str, sources: dict[str, str] | None = None) -> None:
    """Cross-field rules that types alone cannot express; an error names where the key
    was set (``source`` or its ``--set``)."""
    sources = sources or {}

    def bad(key: str, rule: str) -> ConfigError:
        return ConfigError(f"{sources.get(key, source)}: {key} {rule}")

    if not _RUN_NAME.fullmatch(cfg.name):
        raise bad(
            "name",
            "must be one directory name (letters, digits, '_', then also '.', '-', '+', '=', "
            f"'@'; at most 128, no '/' and no leading '.'), got {cfg.name!r}",
        )
    positive = {
        "train.batch_size": cfg.train.batch_size,
        "train.steps": cfg.train.steps,
        "train.eval_every": cfg.train.eval_every,
        "train.log_every": cfg.train.log_every,
        "train.steps_per_call": cfg.train.steps_per_call,
        "train.grad_accum_steps": cfg.train.grad_accum_steps,
        "checkpoint.keep": cfg.checkpoint.keep,
        "data.num_samples": cfg.data.num_samples,
        "data.eval_windows": cfg.data.eval_windows,
        "distributed.initialization_timeout": cfg.distributed.initialization_timeout,
        "distributed.heartbeat_timeout": cfg.distributed.heartbeat_timeout,
    }
    for key, v in positive.items():
        if v is not None and v < 1:  # data.eval_windows: null is the default
            raise bad(key, f"must be >= 1, got {v}")
    if cfg.train.steps > MAX_STEPS:
        raise bad(
            "train.steps",
            f"must be at most {MAX_STEPS} (the optimizer counts steps in int32), "
            f"got {cfg.train.steps}",
        )
    for key in ("distributed.initialization_timeout", "distributed.heartbeat_timeout"):
        if positive[key] > MAX_TIMEOUT_S:
            raise bad(key, f"must be at most {MAX_TIMEOUT_S} seconds, got {positive[key]}")
    if cfg.checkpoint.every < 0:
        raise bad("checkpoint.every", f"must be >= 0, got {cfg.checkpoint.every}")
    if cfg.train.overfit_batches < 0:
        raise bad(
            "train.overfit_batches", f"must be >= 0 (0: off), got {cfg.train.overfit_batches}"
        )
    _check_checkpoints(cfg, bad)
    if cfg.train.step_timeout is not None and cfg.train.step_timeout < 0:
        raise bad(
            "train.step_timeout",
            f"must be >= 0 seconds (0: no watchdog, null: automatic), got {cfg.train.step_timeout}",
        )
    if cfg.log.profile is not None:
        from .report.profile import parse as parse_profile

        try:
            _, stop = parse_profile(cfg.log.profile)
        except ValueError as e:
            raise bad("log.profile", str(e)) from None
        if stop > cfg.train.steps:
            raise bad(
                "log.profile",
                f"{cfg.log.profile!r} ends after train.steps={cfg.train.steps}; "
                f"use STOP <= {cfg.train.steps}",
            )
    if not 1.0 <= cfg.train.loss_scale <= 2.0**100:
        raise bad(
            "train.loss_scale",
            f"must be between 1 and 2**100 (float16's initial loss scale), got {cfg.train.loss_scale}",
        )
    for key, v in {"seed": cfg.seed, "data.split_seed": cfg.data.split_seed}.items():
        if not 0 <= v <= MAX_SEED:  # numpy's generators want >= 0; the init key takes int32
            raise bad(key, f"must be in [0, {MAX_SEED}], got {v}")
    if not 0.0 < cfg.data.test_fraction < 1.0:
        raise bad("data.test_fraction", f"must be in (0, 1), got {cfg.data.test_fraction}")
    if cfg.optimizer.learning_rate <= 0:
        raise bad("optimizer.learning_rate", f"must be > 0, got {cfg.optimizer.learning_rate}")
    if cfg.data.context is not None and cfg.data.context < 1:
        raise bad("data.context", f"must be >= 1, got {cfg.data.context}")
    model_context = cfg.model.get("context")
    if cfg.data.context is not None and model_context not in (None, cfg.data.context):
        raise bad(
            "data.context",
            f"({cfg.data.context}) differs from model.context ({model_context}); set one of them",
        )
    for key in ("b1", "b2"):
        v = getattr(cfg.optimizer, key)
        if v is not None and not 0.0 <= v < 1.0:
            raise bad(f"optimizer.{key}", f"must be in [0, 1), got {v}")
    d = cfg.parallel.devices
    if isinstance(d, str) and d != "all" or isinstance(d, int) and d < 1:
        raise bad("parallel.devices", f"must be 'all' or a positive int, got {d!r}")
    if cfg.parallel.tensor < 1:
        raise bad("parallel.tensor", f"must be a positive int, got {cfg.parallel.tensor}")
    if cfg.parallel.fsdp_min_bytes < 0:
        raise bad("parallel.fsdp_min_bytes", f"must be >= 0, got {cfg.parallel.fsdp_min_bytes}")
    dc = cfg.distributed
    if dc.num_processes is not None and dc.num_processes < 1:
        raise bad("distributed.num_processes", f"must be >= 1, got {dc.num_processes}")
    if dc.process_id is not None and dc.process_id < 0:
        raise bad("distributed.process_id", f"must be >= 0, got {dc.process_id}")
    if cfg.loss.beta <= 0:
        raise bad("loss.beta", f"must be > 0, got {cfg.loss.beta}")
    if cfg.loss.reference is not None and cfg.loss.name != "dpo":
        raise bad("loss.reference", f"is the reference of loss.name: dpo, not {cfg.loss.name}")
    if cfg.data.name in NEEDS_PATH and not cfg.data.path:
        raise bad("data.path", f"is required when data.name is {cfg.data.name}")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise bad("data.val_fraction", f"must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.optimizer.options or cfg.optimizer.name == "given" or ":" in cfg.optimizer.name:
        pass  # a factory's own arguments: its signature was checked
    elif (
        cfg.optimizer.schedule == "warmup_cosine" and cfg.optimizer.warmup_steps >= cfg.train.steps
    ):
        raise bad(
            "optimizer.warmup_steps",
            f"({cfg.optimizer.warmup_steps}) must be below train.steps ({cfg.train.steps})",
        )
    if cfg.train.ema_decay is not None and not 0.0 < cfg.train.ema_decay < 1.0:
        raise bad("train.ema_decay", f"must be in (0, 1) (e.g. 0.999), got {cfg.train.ema_decay}")
    if cfg.eval.use_ema and cfg.train.ema_decay is None:
        raise bad("eval.use_ema", "needs train.ema_decay (the average to evaluate), which is unset")
    from .loop.backward_config import parse_policies  # issue 34: each entry checked

    parse_policies(cfg.loss.backward_policies, sources.get("loss.backward_policies", source))
    if cfg.compile_cache is not None and not cfg.compile_cache.strip():
        raise bad("compile_cache", "must be 'auto', a directory or null (off), got ''")


def _check_checkpoints(cfg: Config, bad) -> None:
    """The rules of train.early_stopping and checkpoint.keep_best / every_minutes."""
    ck, es = cfg.checkpoint, cfg.train.early_stopping
    if ck.keep_best < 0:
        raise bad("checkpoint.keep_best", f"must be >= 0 (0: off), got {ck.keep_best}")
    if ck.every_minutes < 0:
        raise bad("checkpoint.every_minutes", f"must be >= 0 (0: off), got {ck.every_minutes}")
    if ck.keep_best == 0:  # nothing set silently without effect
        for key, v in (("monitor", "loss"), ("mode", "min")):
            if getattr(ck, key) != v:
                raise bad(
                    f"checkpoint.{key}",
                    f"ranks the best checkpoints, but checkpoint.keep_best is 0; set "
                    f"checkpoint.keep_best: k (got checkpoint.{key}={getattr(ck, key)!r})",
                )
    if not ck.monitor.strip():
        raise bad("checkpoint.monitor", "must name an evaluation metric, got ''")
    if es is not None:
        if es.patience < 1:
            raise bad("train.early_stopping.patience", f"must be >= 1, got {es.patience}")
        if es.min_delta < 0:
            raise bad("train.early_stopping.min_delta", f"must be >= 0, got {es.min_delta}")
        if not es.monitor.strip():
            raise bad("train.early_stopping.monitor", "must name an evaluation metric, got ''")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.steps=10"`` -> (["train", "steps"], 10), the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, _, raw = text.partition("=")
    if not key.strip():
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def read_text(path: Path) -> str:
    """The text of config file ``path``: UTF-8 (a BOM is allowed), else a ConfigError that
    says what the file looks like."""
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{path}: the file is UTF-16 text; save it as UTF-8")
    if b"\x00" in data:
        raise ConfigError(f"{path}: not a text file (it contains NUL bytes); expected YAML")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}); save it as UTF-8"
        ) from None


def load_config(
    path: str | Path, overrides: list[str] = (), *, resolve_paths: bool = True
) -> Config:
    """Read ``path`` (YAML), apply ``--set`` overrides, validate, return a ``Config``.
    ``resolve_paths``: find the relative paths the file names (:func:`input_path`); off for
    a run's own ``config.yaml``, a record whose paths were resolved when it trained."""
    path = Path(path)
    raw = read_yaml(path)
    if raw in (None, {}) and not overrides:  # not every default trained without a word
        raise ConfigError(
            f"{path}: the config is empty (no keys, or only comments); name at least a model "
            "or data section (see configs/digits_mlp.yaml), or give --set overrides"
        )
    base_dir = path.resolve().parent
    return config_from_dict(
        raw, overrides, source=str(path), base_dir=base_dir, resolve_paths=resolve_paths
    )


def read_yaml(path: Path) -> Any:
    """The parsed YAML of config file ``path`` (ConfigError for a file that is not)."""
    source = str(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {source}{relative_to(path)}")
    try:
        text = read_text(path)
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    return raw


def config_from_dict(
    raw: dict | None,
    overrides: list[str] = (),
    *,
    source: str = "the config",
    base_dir: Path | None = None,
    model_class: type | None = None,
    resolve_paths: bool = True,
) -> Config:
    """A ``Config`` from a dict of sections (as a YAML file holds them) and ``--set``
    overrides, validated; ``source`` names it in messages. A user's model module is
    imported from ``base_dir`` (the config file's directory), then the current directory,
    then sys.path; so are the files the config names (:func:`input_path`; ``resolve_paths``
    False: left as written). ``model_class`` is the model's class itself (``train.fit``)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    raw = _copy_sections(raw)
    sources = _apply_overrides(raw, overrides)
    if resolve_paths and base_dir is not None:
        _resolve_paths(raw, sources, Path(base_dir), source)
    search = tuple(dict.fromkeys([*([base_dir] if base_dir else []), Path.cwd()]))
    cfg = _build(Config, raw, "", source, sources, search, model_class)
    _check(cfg, source, sources)
    from .report import loggers  # a user's logger class is imported now, like a model

    loggers.check(cfg.log.loggers, cfg.log.tensorboard, sources.get("log.loggers", source), search)
    where = sources.get("data.options", sources.get("data.name", source))
    check_data(cfg.data.name, cfg.data.options, search, where)
    from .model.metrics import check_specs  # a user's metric is imported now, like a model

    check_specs(cfg.eval.metrics, search, sources.get("eval.metrics", source))
    return cfg


#: The rule for the files a config names, stated in every message about one not found.
PATH_RULE = (
    "a relative path in a config file is read from the file's directory, then the current "
    "directory; one given with --set, from the current directory"
)


def input_path(value: str, key: str, base_dir: Path, source: str) -> str:
    """``value``, a path the config file ``source`` names for the trainer to read, as the
    trainer opens it (relative to the current directory, or absolute).

    The rule (``PATH_RULE``), as for a ``module:Class``: a relative path in a config file is
    found from the file's directory (``base_dir``) first, then from the current directory
    (where earlier versions looked, and where a path given with ``--set`` is read). One
    found in neither is a ConfigError naming both.
    """
    path = Path(value).expanduser()
    if path.is_absolute():
        return value
    cwd = Path.cwd()
    for base in dict.fromkeys([base_dir.resolve(), cwd.resolve()]):
        if (base / path).exists():
            return value if base == cwd.resolve() else os.path.relpath(base / path)
    bases = f"the config file's directory {base_dir}"
    if base_dir.resolve() != cwd.resolve():
        bases += f" nor in the current directory {cwd}"
    raise ConfigError(f"{source}: {key}={value!r}: not found in {bases} ({PATH_RULE})")


def _resolve_paths(raw: dict, sources: dict[str, str], base_dir: Path, source: str) -> None:
    """The relative paths the config file names (``data.path``, ``model.name: hf:DIR``), as
    :func:`input_path` finds them; those that ``--set`` gave are the current directory's."""

    def from_file(section: str, key: str) -> bool:
        whole = sources.get(section, "")
        return f"{section}.{key}" not in sources and not whole.startswith(f"--set {section}=")

    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str) and from_file("data", "path"):
        data["path"] = input_path(data["path"], "data.path", base_dir, source)
    model = raw.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if isinstance(name, str) and name.strip().startswith("hf:") and from_file("model", "name"):
        directory = name.strip()[3:]
        found = input_path(directory, "model.name: hf:DIR", base_dir, source)
        model["name"] = f"hf:{found}"
        if model.get("path") == directory:
            model["path"] = found


def _apply_overrides(raw: dict, overrides) -> dict[str, str]:
    """Apply ``--set`` overrides to ``raw`` in place; return the dotted keys they set (and
    their sections), each mapped to the ``--set`` that set it."""
    sources: dict[str, str] = {}
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {text!r}: '{k}' is not a section")
            node = child
        node[keys[-1]] = value
        for i in range(1, len(keys) + 1):
            sources[".".join(keys[:i])] = f"--set {text}"
    return sources


def peek(path: str | Path, overrides: list[str], *dotted: str) -> tuple:
    """The values of the ``dotted`` keys (``"log.plot"``) as :func:`load_config` will read
    them (the file, then the overrides), unvalidated: for start-up work that can begin
    before the config is built, which imports the model's module and with it JAX. None for
    a key that is not set, all None where the file does not read (:func:`load_config` then
    says why)."""
    try:
        raw = read_yaml(Path(path))
        if not isinstance(raw, dict):
            raw = {}
        _apply_overrides(raw, overrides)
    except ConfigError:
        return (None,) * len(dotted)

    def value(key: str) -> Any:
        node: Any = raw
        for k in key.split("."):
            if not isinstance(node, dict) or k not in node:
                return None
            node = node[k]
        return node

    return tuple(value(key) for key in dotted)


def _copy_sections(raw: dict) -> dict:
    """A copy of nested dicts, so overrides never change the caller's."""
    return {k: _copy_sections(v) if isinstance(v, dict) else v for k, v in raw.items()}


def to_dict(cfg: Any) -> dict:
    """The config as plain YAML/JSON-able data (tuples become lists)."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, enum.Enum):  # a model field's Enum: its value (read back by _coerce)
            return plain(v.value)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, ModelConfig | CallbackConfig):  # flat, as written: name and fields
            return {"name": v.name, **plain(v.options)}
        if isinstance(v, OptimizerConfig) and (v.options or ":" in v.name or v.name == "given"):
            ours = {k: plain(getattr(v, k)) for k in ("frozen", "param_groups") if getattr(v, k)}
            return {"name": v.name, **plain(v.options), **ours}
        if dataclasses.is_dataclass(v):
            return {_key_of(f): plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return v

    return plain(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
