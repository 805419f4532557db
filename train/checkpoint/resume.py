"""Where a run starts: the checkpoint metadata that makes a resume exact, the checks that
a checkpoint belongs to this config, and the processes' agreement on the starting state."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..data.dataset import Dataset, Sampler
from ..errors import ConfigError
from ..model.registry import MODEL_SOURCE_KEY, model_source
from ..parallel import distributed as dist
from ..schema import to_dict
from . import store as ckpt
from .rundir import check_run_dir

# Config sections that must match a checkpoint being resumed (train.steps may grow).
RESUME_MUST_MATCH = ("seed", "model", "data", "loss", "optimizer")
# Keys of those sections that may change: where the data lives, or how many validation
# windows an evaluation runs (a run from before data.eval_windows defaulted to null wrote
# 2400), does not change the training data or its order.
RESUME_MAY_CHANGE = {"data": ("placement", "eval_windows")}


@dataclass(frozen=True)
class Start:
    """The state a run starts from: init (step 0) or a checkpoint."""

    step: int
    p_leaves: list  # params and optimizer state leaves (host)
    o_leaves: list
    skipped: int  # non-finite steps skipped before it (train.nonfinite=skip)
    checkpoint: Path | None  # the checkpoint it came from
    log_window: dict | None = None  # the train metrics' partial sums since the last log
    s_leaves: list = field(default_factory=list)  # a stateful model's state leaves (host)
    meta: dict = field(default_factory=dict)  # the checkpoint's metadata (process 0's read)
    stopped: bool = False  # the run was stopped early (a callback): nothing left to train


def metadata(
    cfg,
    data: Dataset,
    step: int,
    sampler: Sampler,
    skipped: int,
    model=None,
    grad: str | None = None,
) -> dict:
    """What a checkpoint records besides the state: data position, RNG, config, vocabulary,
    where a user's model module was imported from (for ``train.load_run``), and ``grad``,
    the mode the step ran (``loss.grad: auto`` resolved, see :func:`check_resumable`)."""
    order = "[seed, step]" if data.window else "[seed, epoch]"
    meta = {
        "data_position": sampler.position(step),
        "rng": {"init_seed": cfg.seed, "data_order": f"numpy default_rng({order})"},
        "config": to_dict(cfg),
        "skipped_steps": str(skipped),
    }
    if data.preprocess:  # what predicting on raw inputs must apply (train.load_run)
        meta["preprocess"] = json.dumps(data.preprocess)
    if data.vocab is not None:  # what sampling needs to turn ids back into text
        meta["vocab"] = json.dumps(data.vocab)
    if (
        data.tokenizer is not None
    ):  # prepared tokens: the whole tokenizer (train/data/text/tokenizer.py)
        meta["tokenizer"] = data.tokenizer
    source = model_source(model) if model is not None else None
    if source is not None:
        meta[MODEL_SOURCE_KEY] = source
    if grad is not None:
        meta["grad_mode"] = grad
    own = getattr(model, "checkpoint_metadata", None)
    if callable(own):  # a LoRA run's base: its directory and content hash
        meta.update(own())
    return meta


def check_resumable(cfg, meta: dict, path: Path, grad: str | None = None) -> None:
    """Refuse a checkpoint written with another seed, model, data, loss or optimizer.

    ``grad``: what ``loss.grad`` resolves to now (``auto``: train/model/gradmode.py). A resolved
    ``auto`` matches the mode it resolves to, on either side (each checkpoint records its
    ``grad_mode``): the step computes the same thing, so the resume stays exact.
    """
    try:
        saved = json.loads(meta.get("config", "{}"))
    except json.JSONDecodeError:
        raise ConfigError(f"checkpoint {path}: its config metadata is not valid JSON") from None
    now = to_dict(cfg)
    was_grad, is_grad = (saved.get("loss") or {}).get("grad"), now["loss"]["grad"]
    ran, runs = _as_run(was_grad, meta.get("grad_mode")), _as_run(is_grad, grad)
    if was_grad != is_grad and ran is not None and ran == runs:
        saved = {**saved, "loss": {**saved["loss"], "grad": is_grad}}
    defaults = to_dict(type(cfg)())
    # train.overfit_batches changes the data order (train.steps, in the same section, may grow)
    was_n = (saved.get("train") or {}).get("overfit_batches", 0)
    if was_n != cfg.train.overfit_batches:
        raise ConfigError(
            f"checkpoint {path} was written with train.overfit_batches={was_n!r} but the config "
            f"has train.overfit_batches={cfg.train.overfit_batches!r}; use --fresh to start "
            "over, or another run name"
        )
    for section in RESUME_MUST_MATCH:
        was, is_ = saved.get(section), now[section]
        if isinstance(was, dict) and isinstance(defaults.get(section), dict) and section != "model":
            # a key the checkpoint predates (a config key added since) counts as its default
            was = {**{k: v for k, v in defaults[section].items() if k in is_}, **was}
        for key in RESUME_MAY_CHANGE.get(section, ()):
            if isinstance(was, dict):
                was = {k: v for k, v in was.items() if k != key}
            is_ = {k: v for k, v in is_.items() if k != key}
        if section == "model" and isinstance(was, dict):
            was, is_ = _comparable_model(cfg.model.cls, was, is_)
        if was == is_:
            continue
        key, was_v, is_v = section, was, is_
        if isinstance(was, dict):
            key = next(f"{section}.{k}" for k in {**was, **is_} if was.get(k) != is_.get(k))
            was_v, is_v = was.get(key.split(".")[1]), is_.get(key.split(".")[1])
        auto = ""
        if key == "loss.grad" and is_v == "auto" and grad:
            auto = f" (auto is {grad} for this model)"
        raise ConfigError(
            f"checkpoint {path} was written with {key}={was_v!r} but the config has "
            f"{key}={is_v!r}{auto}; use --fresh to start over, or another run name"
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


def _as_run(grad: str | None, resolved: str | None) -> str | None:
    """``loss.grad`` as the step ran it: ``auto`` is what it resolved to (None: unknown)."""
    return resolved if grad == "auto" else grad


def load_checkpoint(cfg, path: Path, params0, opt0, grad: str | None = None, state0=None) -> Start:
    """The state saved in ``path``, checked against ``cfg`` (``grad``: see
    :func:`check_resumable`) and the templates (``state0``: a stateful model's initial
    state, None for a stateless one)."""
    check_resumable(cfg, ckpt.read_metadata(path), path, grad)  # a changed config says so first
    try:
        model = cfg.model.cls(**cfg.model.options)
    except Exception:  # noqa: BLE001 -- no model, no layout conversion: restore reports it
        model = None
    params_h, opt_h, state_h, meta = ckpt.restore_model(model, path, params0, opt0, state0)
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
    return Start(
        start, *leaves, skipped, path, window, jax.tree.leaves(state_h), meta, "stopped" in meta
    )


def agree_on_start(
    cfg,
    resume: str,
    ckpt_dir: Path,
    params0,
    opt0,
    strategy=None,
    grad: str | None = None,
    state0=None,
) -> Start:
    """Process 0 picks the starting state (latest checkpoint or init); all processes get it.

    Only process 0 reads the run directory, so hosts need no shared file system. A bad
    checkpoint or an unwritable run directory raises ConfigError on every process
    (process 0 says why).

    A ``strategy`` whose state is sharded (``Strategy.sharded_state``) restores otherwise:
    process 0 picks the checkpoint, then every process reads the parts its own devices
    hold, placed by ``strategy.state_shardings`` (checkpoints written on any mesh, sharded
    or whole); its leaves are then ``jax.Array`` s already placed.
    """
    if strategy is not None and strategy.sharded_state:
        return _agree_on_sharded_start(cfg, resume, ckpt_dir, params0, opt0, strategy, grad, state0)
    start = Start(
        0, jax.tree.leaves(params0), jax.tree.leaves(opt0), 0, None, None, jax.tree.leaves(state0)
    )
    error = None
    if dist.is_main():
        try:
            chosen = ckpt.newest_intact(_existing(resume, ckpt_dir))
            if chosen is not None:
                start = load_checkpoint(cfg, chosen, params0, opt0, grad, state0)
        except ConfigError as e:
            error = e
    if not dist.is_multiprocess():
        if error is not None:
            raise error
        return start
    head = dist.broadcast(
        np.array([start.step, start.skipped, error is not None, start.stopped], np.int32)
    )
    if head[2]:
        raise error or ConfigError("process 0 could not resume this run (see its output)")
    p_leaves, o_leaves, s_leaves = dist.broadcast((start.p_leaves, start.o_leaves, start.s_leaves))
    # (the log window and the metadata matter on process 0 only: it alone writes
    # metrics.jsonl and runs the callbacks)
    return Start(
        int(head[0]),
        p_leaves,
        o_leaves,
        int(head[1]),
        start.checkpoint,
        start.log_window,
        s_leaves,
        start.meta,
        bool(head[3]),
    )


def _existing(resume: str, ckpt_dir: Path) -> list[Path]:
    """Process 0: the checkpoints to resume from, newest last (none for ``--fresh``)."""
    check_run_dir(ckpt_dir.parent)  # before anything is written
    existing = [] if resume == "fresh" else ckpt.list_checkpoints(ckpt_dir)
    if resume == "require" and not existing:
        raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}")
    return existing


def _agree_on_sharded_start(
    cfg,
    resume: str,
    ckpt_dir: Path,
    params0,
    opt0,
    strategy,
    grad: str | None = None,
    state0=None,
):
    """:func:`agree_on_start` for a sharded state: process 0 picks, all processes read
    their own parts (with several processes the checkpoint directory must be shared)."""
    chosen, error = None, None
    if dist.is_main():
        try:
            chosen = ckpt.newest_intact(_existing(resume, ckpt_dir))
        except ConfigError as e:
            error = e
    if dist.is_multiprocess():
        step, sharded = (ckpt.step_of(chosen), ckpt.is_sharded(chosen)) if chosen else (-1, 0)
        head = dist.broadcast(np.array([step, sharded, error is not None], np.int32))
        if head[2]:
            raise error or ConfigError("process 0 could not resume this run (see its output)")
        chosen = (
            None if head[0] < 0 else ckpt.path_of(ckpt_dir, int(head[0]), sharded=bool(head[1]))
        )
    elif error is not None:
        raise error
    if chosen is None:
        return Start(
            0,
            jax.tree.leaves(params0),
            jax.tree.leaves(opt0),
            0,
            None,
            None,
            jax.tree.leaves(state0),
        )

    def placed(tree):  # templates: host arrays, placed arrays or ShapeDtypeStructs
        leaves, treedef = jax.tree.flatten(tree)
        avals = [
            jax.ShapeDtypeStruct(np.shape(a), getattr(a, "dtype", None) or np.result_type(a))
            for a in leaves
        ]
        # per leaf of the tree: fsdp places a leaf by its layer's logical axes, not its shape
        shardings = strategy.state_shardings(avals)
        return treedef.unflatten(
            [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(avals, shardings)]
        )

    return load_checkpoint(
        cfg, chosen, placed(params0), placed(opt0), grad, None if state0 is None else placed(state0)
    )
