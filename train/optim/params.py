"""Which params the optimizer trains, and how: ``optimizer.frozen``, ``optimizer.param_groups``
and the model's own choice (LoRA: the adapters only), as one ``optax.multi_transform``.

Every param gets one label: ``frozen`` (no update, no optimizer state: ``set_to_zero``),
``group<i>`` (the first of ``optimizer.param_groups`` whose glob matches it: the
optimizer with its learning rate scaled and its own weight decay) or ``base`` (the
section's optimizer). Gradient clipping stays global (over every trained param), before
the groups. The step differentiates the trained params only (``train/step/step.py``), so
under ``loss.grad: manual`` no frozen weight gradient is computed at all.

Globs are ``nl.path_mask``'s: over ParamsDict paths (``/blocks[0]/attn/q/W``), ``*``
spans ``/``, and ``blocks/0/*`` is ``/blocks[0]/*``; a glob that matches nothing is an
error listing the params.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax

import nnlite as nl

from ..errors import ConfigError
from ..model.contract import param_shapes
from . import GIVEN
from .ema import with_ema
from .groups import group_globs
from .named import build_optimizer

FROZEN, BASE = "frozen", "base"


@dataclass(frozen=True)
class ParamPlan:
    """Each param's label by path, and whether any is frozen."""

    labels: dict[str, str]  # path -> frozen | base | group<i>

    @property
    def has_frozen(self) -> bool:
        return FROZEN in self.labels.values()

    @property
    def custom(self) -> bool:
        return any(v != BASE for v in self.labels.values())

    def trainable(self, params: Any) -> Any:
        """A tree like ``params`` with True at the params that train."""
        return self._map(params, lambda label: label != FROZEN)

    def num_trained(self, params: Any) -> int:
        """How many scalars of ``params`` train (the banner's count beside the total)."""
        leaves = jax.tree.leaves(params)
        flags = jax.tree.leaves(self.trainable(params))
        return sum(
            int(np.prod(np.shape(x), dtype=np.int64))
            for x, t in zip(leaves, flags, strict=True)
            if t
        )

    def label_tree(self, params: Any) -> Any:
        return self._map(params, lambda label: label)

    def _map(self, params, fn):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        return jax.tree.unflatten(treedef, [fn(self.labels[nl.format_path(p)]) for p, _ in leaves])


def plan_params(ocfg, model, p_avals) -> ParamPlan:
    """Each param's label (see the module docstring); ConfigError for a glob that matches
    nothing, or a config that leaves nothing to train."""
    paths = _paths(p_avals)
    labels = dict.fromkeys(paths, BASE)
    own = getattr(model, "trainable", None)
    mask = own(p_avals) if callable(own) else None
    if mask is not None:
        for path, m in zip(paths, jax.tree.leaves(mask), strict=True):
            if not m:
                labels[path] = FROZEN
    try:
        for hit in nl.match_paths(ocfg.frozen, paths, "optimizer.frozen"):
            for path in hit:
                labels[path] = FROZEN
        for i, group in enumerate(ocfg.param_groups):
            where = f"optimizer.param_groups[{i}].params"
            hit = set().union(*nl.match_paths(group_globs(group), paths, where))
            for path in sorted(hit):
                if labels[path] == BASE:
                    labels[path] = f"group{i}"
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if all(v == FROZEN for v in labels.values()):
        raise ConfigError(
            f"optimizer.frozen={list(ocfg.frozen)} freezes every param of "
            f"model {type(model).__name__}: nothing is left to train"
        )
    return ParamPlan(labels)


def _paths(tree) -> list[str]:
    return [nl.format_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def make_optimizer(cfg, model, given: optax.GradientTransformation | None = None):
    """``(optimizer, plan)``: the run's optax optimizer (the named or given one, with the
    model's and the config's frozen params and param groups, and the EMA of the params
    when ``train.ema_decay`` is set) and the :class:`ParamPlan` the step differentiates
    by (None: every param trains)."""
    ocfg, steps = cfg.optimizer, cfg.train.steps
    p_avals = param_shapes(model)
    plan = plan_params(ocfg, model, p_avals)
    if not plan.custom:
        optimizer = build_optimizer(ocfg, steps, given)
        wrap = getattr(model, "wrap_optimizer", None)
        if callable(wrap) and not callable(getattr(model, "trainable", None)):
            optimizer = wrap(optimizer)  # a model that chooses its params its own way
        plan = None
    else:
        inner = dataclasses.replace(ocfg, clip_norm=None)  # clipped once, over every param
        parts = {BASE: build_optimizer(inner, steps, given)}
        for i, group in enumerate(ocfg.param_groups):
            if f"group{i}" in plan.labels.values():
                parts[f"group{i}"] = _group_optimizer(inner, group, steps, given)
        if plan.has_frozen:
            parts[FROZEN] = optax.set_to_zero()
        optimizer = optax.multi_transform(parts, plan.label_tree)
        if ocfg.clip_norm is not None:
            optimizer = optax.chain(optax.clip_by_global_norm(ocfg.clip_norm), optimizer)
    if cfg.train.ema_decay is not None:
        optimizer = with_ema(
            optimizer, cfg.train.ema_decay, None if plan is None else plan.trainable
        )
    return optimizer, plan


def _group_optimizer(ocfg, group: dict, steps: int, given):
    scale = float(group.get("lr_scale", 1.0))
    if ocfg.name == GIVEN or ":" in ocfg.name:  # its learning rate is its own: scale the step
        base = build_optimizer(ocfg, steps, given)
        return base if scale == 1.0 else optax.chain(base, optax.scale(scale))
    changes = {"learning_rate": ocfg.learning_rate * scale}
    if group.get("weight_decay") is not None:
        changes["weight_decay"] = float(group["weight_decay"])
    return build_optimizer(dataclasses.replace(ocfg, **changes), steps)
