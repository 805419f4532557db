"""Run configuration: YAML validated into frozen dataclasses.

``Config`` composes the sections, each defined (with its own checks) in the room that uses
it: ``model`` (train/model/section.py), ``data`` (train/data/section.py), ``loss``
(train/step/backward_config.py), ``optimizer`` (train/optim/section.py), ``train`` and
``eval`` (train/step/section.py), ``callbacks`` (train/callbacks.py), ``parallel``
and ``distributed`` (train/parallel/section.py), ``checkpoint``
(train/checkpoint/section.py), ``log`` (train/report/section.py). This module reads YAML,
applies ``--set`` overrides, resolves the paths a file names, runs the checks that span
sections, and writes a config back. Unknown keys, wrong types and bad choices raise
``ConfigError`` with one line naming the key, the file and what is valid
(train/schema.py).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .callbacks import CallbackConfig, callbacks_section
from .checkpoint.section import CheckpointConfig
from .data.section import EVAL_TOKENS as EVAL_TOKENS
from .data.section import DataConfig
from .errors import ConfigError, relative_to
from .model.section import ModelConfig
from .model.section import check_model_round_trip as check_model_round_trip
from .optim.section import OptimizerConfig
from .parallel.section import STRATEGIES as STRATEGIES
from .parallel.section import DistributedConfig, ParallelConfig
from .report.section import LogConfig
from .schema import MAX_SEED as MAX_SEED
from .schema import Where, build
from .schema import dump_yaml as dump_yaml
from .schema import to_dict as to_dict
from .step.backward_config import GRAD_MODES as GRAD_MODES
from .step.backward_config import LossConfig
from .step.section import EvalConfig, TrainConfig


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the ``nnlite-train COMMAND`` commands: a bad argument raises ConfigError
    (one line, exit 2, like every other bad input) instead of printing usage."""

    def error(self, message):
        raise ConfigError(message)


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
    # Callbacks run at the loop's boundaries (train/callbacks.py): a list of names or
    # {name: "module:Class", ...its constructor's arguments}
    callbacks: tuple[CallbackConfig, ...] = field(default=(), metadata={"build": callbacks_section})
    # nnlite-train only: JAX's persistent compilation cache, so a second run of a config
    # compiles nothing. "auto": $NNLITE_CACHE/jax, else ~/.cache/nnlite/jax; a directory;
    # or null (off). Library calls (train.loop.trainer.train) never touch JAX's global cache.
    compile_cache: str | None = "auto"


#: The sections that check themselves, in the order they are checked.
SECTIONS = ("model", "data", "loss", "optimizer", "train", "eval", "parallel", "distributed",
            "checkpoint", "log")  # fmt: skip
# A run name is one directory under log.dir: no separators, no leading dot ("..", hidden).
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,127}")


def _check(cfg: Config, where: Where) -> None:
    """The top-level keys, each section's own rules, then the rules that span sections; an
    error names where the key was set (the file or its ``--set``)."""
    if not _RUN_NAME.fullmatch(cfg.name):
        raise where.bad(
            "name",
            "must be one directory name (letters, digits, '_', then also '.', '-', '+', '=', "
            f"'@'; at most 128, no '/' and no leading '.'), got {cfg.name!r}",
        )
    if not 0 <= cfg.seed <= MAX_SEED:
        raise where.bad("seed", f"must be in [0, {MAX_SEED}], got {cfg.seed}")
    if cfg.compile_cache is not None and not cfg.compile_cache.strip():
        raise where.bad("compile_cache", "must be 'auto', a directory or null (off), got ''")
    for name in SECTIONS:
        section = getattr(cfg, name)
        if hasattr(section, "check"):
            section.check(where)
    _check_across(cfg, where)


def _check_across(cfg: Config, where: Where) -> None:
    """The rules where one section's value constrains another's."""
    span = cfg.log.profile_span(where)
    if span is not None and span[1] > cfg.train.steps:
        raise where.bad(
            "log.profile",
            f"{cfg.log.profile!r} ends after train.steps={cfg.train.steps}; "
            f"use STOP <= {cfg.train.steps}",
        )
    model_context = cfg.model.get("context")
    if cfg.data.context is not None and model_context not in (None, cfg.data.context):
        raise where.bad(
            "data.context",
            f"({cfg.data.context}) differs from model.context ({model_context}); set one of them",
        )
    opt = cfg.optimizer
    if (
        not opt.is_factory
        and opt.schedule == "warmup_cosine"
        and opt.warmup_steps >= cfg.train.steps
    ):
        raise where.bad(
            "optimizer.warmup_steps",
            f"({opt.warmup_steps}) must be below train.steps ({cfg.train.steps})",
        )
    if cfg.eval.use_ema and cfg.train.ema_decay is None:
        raise where.bad(
            "eval.use_ema", "needs train.ema_decay (the average to evaluate), which is unset"
        )


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
    where = Where(source, sources, search, model_class)
    cfg = build(Config, raw, "", where)
    _check(cfg, where)
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
