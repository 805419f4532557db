"""Run configuration: YAML validated into frozen dataclasses.

Every field has a typed default with a comment; unknown keys, wrong types and bad choices
raise ``ConfigError`` with one line naming the key, the file and what is valid.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import parallel


class ConfigError(ValueError):
    """Bad user input (config, CLI, data, checkpoint): the CLI prints it and exits 2."""


def choice(default: Any, choices: tuple) -> Any:
    """A dataclass field whose value must be one of ``choices``."""
    return field(default=default, metadata={"choices": choices})


MODEL_NAMES = ("mlp", "linreg", "cnn", "gpt")  # kept in sync with models.MODELS by a test
DATA_NAMES = ("digits", "mnist1d", "linreg", "npz", "text", "shakespeare_char")
GRAD_MODES = ("autodiff", "manual", "fused")  # each model's grad_modes: a subset (tested)
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "lion")
SCHEDULES = ("constant", "cosine", "warmup_cosine", "exponential")
STRATEGIES = parallel.NAMES  # the registry in train/parallel/__init__.py
NONFINITE = ("stop", "skip")


@dataclass(frozen=True)
class ModelConfig:
    name: str = choice("mlp", MODEL_NAMES)  # which entry of models.MODELS to build
    hidden_sizes: tuple[int, ...] = (64,)  # mlp: width of each hidden layer
    activation: str = choice("relu", ("relu", "gelu", "tanh", "sigmoid", "softplus"))  # mlp, cnn
    # cnn: a stack of 1-D convolutions over the input sequence (x [n, length] is one channel,
    # npz x [n, length, channels] several), then a linear head on the flattened features.
    channels: tuple[int, ...] = (25, 25, 25)  # cnn: output channels of each conv layer
    kernel_size: int | tuple[int, ...] = (5, 3, 3)  # cnn: one for all layers, or one per layer
    strides: int | tuple[int, ...] = 2  # cnn: one for all layers, or one per layer
    # cnn: zeros added at each end of the sequence (one int for all layers, or one per
    # layer), or "SAME" (output length = ceil(length / stride)) or "VALID" (no padding)
    padding: int | str | tuple[int, ...] = 1
    context: int = 64  # (gpt) tokens of context: the training window and the sampling limit
    n_layer: int = 4  # (gpt) transformer blocks
    n_head: int = 4  # (gpt) attention heads per block (divides n_embd)
    n_embd: int = 128  # (gpt) width of the residual stream
    dropout: float = 0.0  # (gpt) dropout rate after the embeddings and inside each block
    tie_head: bool = True  # (gpt) the output head is the token embedding transposed


@dataclass(frozen=True)
class DataConfig:
    name: str = choice("digits", DATA_NAMES)  # data set (see train/data.py)
    path: str | None = None  # npz: file with arrays x, y (x_test, y_test); text: a UTF-8 file
    test_fraction: float = 0.2  # digits/npz without x_test: held-out share, stratified
    split_seed: int = 0  # seed of the fixed train/test split
    num_samples: int = 5000  # mnist1d: total examples generated (80% train)
    val_fraction: float = 0.1  # text, shakespeare_char: the tail of the text held out
    eval_windows: int = 2400  # text, shakespeare_char: fixed validation windows evaluated


@dataclass(frozen=True)
class LossConfig:
    # How gradients are computed: jax.value_and_grad, composed hand VJPs, or one fused
    # hand-derived backward pass (manual/fused: mlp only).
    grad: str = choice("autodiff", GRAD_MODES)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = choice("adam", OPTIMIZERS)  # optax optimizer
    learning_rate: float = 1e-3  # peak learning rate
    schedule: str = choice("constant", SCHEDULES)  # learning-rate schedule over train.steps
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


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = choice("none", STRATEGIES)  # data parallelism
    devices: int | str = "all"  # per process: "all" local devices or a count


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process training with ``jax.distributed`` (see docs/distributed.md).

    Unset fields are read from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID; with no coordinator address anywhere the run is a single process.
    """

    coordinator_address: str | None = None  # host:port of process 0 (all processes agree)
    num_processes: int | None = None  # how many processes take part
    process_id: int | None = None  # this process: 0 .. num_processes - 1
    initialization_timeout: int = 300  # seconds to wait for every process to connect
    heartbeat_timeout: int = 100  # seconds of silence after which a process counts as dead


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # write a checkpoint every N steps (0: only at the end)
    keep: int = 3  # keep the newest N checkpoints


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs"  # run directories are <dir>/<name>/
    progress: bool = True  # show a tqdm progress bar
    plot: bool = True  # draw curves.png at the end


@dataclass(frozen=True)
class Config:
    name: str = "run"  # run name: the run directory is log.dir/name
    seed: int = 0  # seeds parameter init and the data order
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    distributed: DistributedConfig = DistributedConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    # python -m train only: JAX's persistent compilation cache, so a second run of a config
    # compiles nothing. "auto": $NNLITE_CACHE/jax, else ~/.cache/nnlite/jax; a directory;
    # or null (off). Library calls (train.loop.train) never touch JAX's global cache.
    compile_cache: str | None = "auto"


# -- conversion and validation -------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
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


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (lists -> tuples)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, float) and float in typing.get_args(tp):
            _finite(value, where)  # say "finite", not "expected float or null"
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
        elem = typing.get_args(tp)[0]
        return tuple(_coerce(v, elem, where) for v in value)
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
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, raw: Any, prefix: str, source: str, sources: dict[str, str]) -> Any:
    """``sources`` maps a dotted key to where its value came from (``--set ...``); every
    other key came from ``source`` (the file)."""
    where_section = prefix.rstrip(".") or "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        src = sources.get(prefix.rstrip("."), source)
        raise ConfigError(f"{src}: {where_section} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        src = sources.get(f"{prefix}{key}", source)
        if key not in fields:
            raise ConfigError(
                f"{src}: unknown key '{prefix}{key}'; valid keys in {where_section}: "
                f"{', '.join(fields)}"
            )
        tp = hints[key]
        where = f"{src}: {prefix}{key}"
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.", source, sources)
            continue
        value = _coerce(value, tp, where)
        choices = fields[key].metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        kwargs[key] = value
    return cls(**kwargs)


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
        if v < 1:
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
    if cfg.train.step_timeout is not None and cfg.train.step_timeout < 0:
        raise bad(
            "train.step_timeout",
            f"must be >= 0 seconds (0: no watchdog, null: automatic), got {cfg.train.step_timeout}",
        )
    for key, v in {"seed": cfg.seed, "data.split_seed": cfg.data.split_seed}.items():
        if not 0 <= v <= MAX_SEED:  # numpy's generators want >= 0; the init key takes int32
            raise bad(key, f"must be in [0, {MAX_SEED}], got {v}")
    if not 0.0 < cfg.data.test_fraction < 1.0:
        raise bad("data.test_fraction", f"must be in (0, 1), got {cfg.data.test_fraction}")
    if cfg.optimizer.learning_rate <= 0:
        raise bad("optimizer.learning_rate", f"must be > 0, got {cfg.optimizer.learning_rate}")
    m = cfg.model
    if m.name == "gpt":
        for key in ("context", "n_layer", "n_head", "n_embd"):
            if getattr(m, key) < 1:
                raise bad(f"model.{key}", f"must be >= 1, got {getattr(m, key)}")
        if m.n_embd % m.n_head:
            raise bad(
                "model.n_embd", f"({m.n_embd}) must be a multiple of model.n_head ({m.n_head})"
            )
        if not 0.0 <= m.dropout < 1.0:
            raise bad("model.dropout", f"must be in [0, 1), got {m.dropout}")
    for key in ("b1", "b2"):
        v = getattr(cfg.optimizer, key)
        if v is not None and not 0.0 <= v < 1.0:
            raise bad(f"optimizer.{key}", f"must be in [0, 1), got {v}")
    if cfg.model.name == "mlp" and (not cfg.model.hidden_sizes or min(cfg.model.hidden_sizes) < 1):
        raise bad(
            "model.hidden_sizes",
            f"must be a non-empty list of positive ints, got {list(cfg.model.hidden_sizes)}",
        )
    if cfg.model.name == "cnn":
        _check_cnn(cfg.model, source)
    d = cfg.parallel.devices
    if isinstance(d, str) and d != "all" or isinstance(d, int) and d < 1:
        raise bad("parallel.devices", f"must be 'all' or a positive int, got {d!r}")
    dc = cfg.distributed
    if dc.num_processes is not None and dc.num_processes < 1:
        raise bad("distributed.num_processes", f"must be >= 1, got {dc.num_processes}")
    if dc.process_id is not None and dc.process_id < 0:
        raise bad("distributed.process_id", f"must be >= 0, got {dc.process_id}")
    if cfg.data.name in ("npz", "text") and not cfg.data.path:
        raise bad("data.path", f"is required when data.name is {cfg.data.name}")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise bad("data.val_fraction", f"must be in (0, 1), got {cfg.data.val_fraction}")
    if cfg.optimizer.schedule == "warmup_cosine" and cfg.optimizer.warmup_steps >= cfg.train.steps:
        raise bad(
            "optimizer.warmup_steps",
            f"({cfg.optimizer.warmup_steps}) must be below train.steps ({cfg.train.steps})",
        )
    if cfg.compile_cache is not None and not cfg.compile_cache.strip():
        raise bad("compile_cache", "must be 'auto', a directory or null (off), got ''")


CNN_PADDINGS = ("SAME", "VALID")


def _check_cnn(m: ModelConfig, source: str) -> None:
    if not m.channels or min(m.channels) < 1:
        raise ConfigError(
            f"{source}: model.channels must be a non-empty list of positive ints, got "
            f"{list(m.channels)}"
        )
    n = len(m.channels)
    for key in ("kernel_size", "strides", "padding"):
        v = getattr(m, key)
        if isinstance(v, tuple) and len(v) != n:
            raise ConfigError(
                f"{source}: model.{key} has {len(v)} entries but model.channels has {n} "
                f"layers; give one value for all layers or one per layer"
            )
    per_layer = [
        v if isinstance(v, tuple) else (v,) * n for v in (m.kernel_size, m.strides, m.padding)
    ]
    for i, (k, s, p) in enumerate(zip(*per_layer)):
        if k < 1:
            raise ConfigError(f"{source}: model.kernel_size must be >= 1, got {k} (layer {i})")
        if s < 1:
            raise ConfigError(f"{source}: model.strides must be >= 1, got {s} (layer {i})")
        if isinstance(p, str) and p not in CNN_PADDINGS:
            raise ConfigError(
                f"{source}: model.padding {p!r} is not one of {', '.join(CNN_PADDINGS)} "
                f"or a non-negative int (layer {i})"
            )
        if isinstance(p, int) and p < 0:
            raise ConfigError(f"{source}: model.padding must be >= 0, got {p} (layer {i})")


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


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read ``path`` (YAML), apply ``--set`` overrides, validate, return a ``Config``."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {source}")
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
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    sources: dict[str, str] = {}  # dotted key (and its sections) -> the --set that set it
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
    cfg = _build(Config, raw, "", source, sources)
    _check(cfg, source, sources)
    return cfg


def to_dict(cfg: Any) -> dict:
    """The config as plain YAML/JSON-able data (tuples become lists)."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
