"""Where a run starts: the checkpoint metadata that makes a resume exact, the checks that
a checkpoint belongs to this config, and the processes' agreement on the starting state."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import checkpoint as ckpt
from . import distributed as dist
from .config import Config, ConfigError, to_dict
from .data import Dataset, Sampler
from .rundir import check_run_dir

# Config sections that must match a checkpoint being resumed (train.steps may grow).
RESUME_MUST_MATCH = ("seed", "model", "data", "loss", "optimizer")


@dataclass(frozen=True)
class Start:
    """The state a run starts from: init (step 0) or a checkpoint."""

    step: int
    p_leaves: list  # params and optimizer state leaves (host)
    o_leaves: list
    skipped: int  # non-finite steps skipped before it (train.nonfinite=skip)
    checkpoint: Path | None  # the checkpoint it came from
    log_window: dict | None = None  # the train metrics' partial sums since the last log


def metadata(
    cfg: Config, data: Dataset, step: int, sampler: Sampler, skipped: int, model=None
) -> dict:
    """What a checkpoint records besides the state: data position, RNG, config, vocabulary,
    and where a user's model module was imported from (for ``train.load_run``)."""
    from .inference import MODEL_SOURCE_KEY, model_source

    order = "[seed, step]" if data.window else "[seed, epoch]"
    meta = {
        "data_position": sampler.position(step),
        "rng": {"init_seed": cfg.seed, "data_order": f"numpy default_rng({order})"},
        "config": to_dict(cfg),
        "skipped_steps": str(skipped),
    }
    if data.vocab is not None:  # what sampling needs to turn ids back into text
        meta["vocab"] = json.dumps(data.vocab)
    source = model_source(model) if model is not None else None
    if source is not None:
        meta[MODEL_SOURCE_KEY] = source
    return meta


def check_resumable(cfg: Config, meta: dict, path: Path) -> None:
    """Refuse a checkpoint written with another seed, model, data, loss or optimizer."""
    try:
        saved = json.loads(meta.get("config", "{}"))
    except json.JSONDecodeError:
        raise ConfigError(f"checkpoint {path}: its config metadata is not valid JSON") from None
    now = to_dict(cfg)
    for section in RESUME_MUST_MATCH:
        was, is_ = saved.get(section), now[section]
        if section == "model" and isinstance(was, dict):
            was, is_ = _comparable_model(cfg.model.cls, was, is_)
        if was == is_:
            continue
        key, was_v, is_v = section, was, is_
        if isinstance(was, dict):
            key = next(f"{section}.{k}" for k in is_ if was.get(k) != is_[k])
            was_v, is_v = was.get(key.split(".")[1]), is_[key.split(".")[1]]
        raise ConfigError(
            f"checkpoint {path} was written with {key}={was_v!r} but the config has {key}={is_v!r}; "
            "use --fresh to start over, or another run name"
        )


def _comparable_model(cls: Any, was: dict, is_: dict) -> tuple[dict, dict]:
    """The saved and current model sections as resuming compares them: a field the
    checkpoint predates counts as its default (a model option added since), and the
    fields the model lists in ``resume_may_change`` (a layout or memory option, such as
    the GPT's ``scan_layers`` and ``remat``: the checkpoint's params are converted) are
    left out."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    was = dict(was)
    for k in is_:
        f = fields.get(k)
        if k not in was and f is not None and f.default is not dataclasses.MISSING:
            was[k] = f.default
    free = set(getattr(cls, "resume_may_change", ()))
    return (
        {k: v for k, v in was.items() if k not in free},
        {k: v for k, v in is_.items() if k not in free},
    )


def load_checkpoint(cfg: Config, path: Path, params0, opt0) -> Start:
    """The state saved in ``path``, checked against ``cfg`` and the templates."""
    check_resumable(cfg, ckpt.read_metadata(path), path)  # a changed config says so first
    try:
        model = cfg.model.cls(**cfg.model.options)
    except Exception:  # noqa: BLE001 -- no model, no layout conversion: restore reports it
        model = None
    params_h, opt_h, meta = ckpt.restore_model(model, path, params0, opt0)
    start = int(meta["step"])
    if start > cfg.train.steps:
        raise ConfigError(
            f"checkpoint {path} is at step {start}, past train.steps={cfg.train.steps}"
        )
    skipped = int(meta.get("skipped_steps", "0"))
    try:
        window = json.loads(meta.get("log_window", "null"))
    except json.JSONDecodeError:
        raise ConfigError(f"checkpoint {path}: its log_window metadata is not valid JSON") from None
    leaves = jax.tree.leaves(params_h), jax.tree.leaves(opt_h)
    return Start(start, *leaves, skipped, path, window)


def agree_on_start(cfg: Config, resume: str, ckpt_dir: Path, params0, opt0) -> Start:
    """Process 0 picks the starting state (latest checkpoint or init); all processes get it.

    Only process 0 reads the run directory, so hosts need no shared file system. A bad
    checkpoint or an unwritable run directory raises ConfigError on every process
    (process 0 says why).
    """
    start = Start(0, jax.tree.leaves(params0), jax.tree.leaves(opt0), 0, None)
    error = None
    if dist.is_main():
        try:
            check_run_dir(ckpt_dir.parent)  # before anything is written
            existing = [] if resume == "fresh" else ckpt.list_checkpoints(ckpt_dir)
            if resume == "require" and not existing:
                raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}")
            if existing:
                start = load_checkpoint(cfg, existing[-1], params0, opt0)
        except ConfigError as e:
            error = e
    if not dist.is_multiprocess():
        if error is not None:
            raise error
        return start
    head = dist.broadcast(np.array([start.step, start.skipped, error is not None], np.int32))
    if head[2]:
        raise error or ConfigError("process 0 could not resume this run (see its output)")
    p_leaves, o_leaves = dist.broadcast((start.p_leaves, start.o_leaves))
    # (the log window matters on process 0 only: it alone writes metrics.jsonl)
    return Start(int(head[0]), p_leaves, o_leaves, int(head[1]), start.checkpoint, start.log_window)
