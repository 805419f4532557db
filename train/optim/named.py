"""The built-in optimizers and schedules, and building the optimizer a config describes.

One convention for every optimizer, built-in or yours: a function called with keyword
arguments that returns an ``optax.GradientTransformation`` (or a list of them, chained in
order, so a clipped chain's state is one flat ``optax.chain``). A built-in (or one you
register, ``@OPTIMIZERS.register("name")``) takes ``learning_rate`` (a float or an optax
schedule) and the ``optimizer`` section's keys that its signature names (``b1``,
``weight_decay``, ...); a ``"module:function"`` factory takes the section's other keys
(``optimizer.options``). Schedules likewise: a function of ``learning_rate``,
``total_steps`` and the section's keys it names, returning an ``optax.Schedule``.

``--eject`` writes these functions' own source into its script (train/loop/eject_optax.py),
so a built-in uses only ``jax``, ``optax`` and the functions of this module.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import optax

from ..errors import ConfigError, users_code
from . import GIVEN, OPTIMIZERS, SCHEDULES
from .section import OptimizerConfig


# -- schedules: (learning_rate, total_steps, the section's keys) -> optax.Schedule -----------
def constant(learning_rate):
    return optax.constant_schedule(learning_rate)


def cosine(learning_rate, total_steps, end_lr_fraction=0.0):
    return optax.cosine_decay_schedule(learning_rate, total_steps, alpha=end_lr_fraction)


def warmup_cosine(learning_rate, total_steps, warmup_steps=0, end_lr_fraction=0.0):
    return optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, total_steps, end_value=learning_rate * end_lr_fraction
    )


def exponential(learning_rate, total_steps, decay_rate=0.1):
    return optax.exponential_decay(
        learning_rate, transition_steps=total_steps, decay_rate=decay_rate
    )


# -- optimizers: (learning_rate, the section's keys) -> a transformation or a list of them --
def decay_mask(params):
    """Weight decay for matrices only (ndim >= 2), not biases or normalisation params."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def with_l2(rule, weight_decay=0.0, decay="all"):
    """Weight decay added to the gradient (L2) before ``rule``, when asked for."""
    if not weight_decay:
        return [rule]
    mask = decay_mask if decay == "matrices" else None
    return [optax.add_decayed_weights(weight_decay, mask=mask), rule]


def sgd(learning_rate, weight_decay=0.0, decay="all"):
    return with_l2(optax.sgd(learning_rate), weight_decay, decay)


def momentum(learning_rate, momentum=0.9, weight_decay=0.0, decay="all"):
    return with_l2(optax.sgd(learning_rate, momentum=momentum), weight_decay, decay)


def adam(learning_rate, b1=0.9, b2=None, weight_decay=0.0, decay="all"):
    rule = optax.adam(learning_rate, b1=b1, b2=0.999 if b2 is None else b2)
    return with_l2(rule, weight_decay, decay)


def adamw(learning_rate, b1=0.9, b2=None, weight_decay=0.0, decay="all"):
    mask = decay_mask if decay == "matrices" else None
    b2 = 0.999 if b2 is None else b2
    return optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)


def lion(learning_rate, b1=0.9, b2=None, weight_decay=0.0, decay="all"):
    mask = decay_mask if decay == "matrices" else None
    b2 = 0.99 if b2 is None else b2
    return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)


# -- building ----------------------------------------------------------------------------
#: Section keys that are the trainer's, never an optimizer's or a schedule's argument.
_OURS = ("name", "options", "frozen", "param_groups", "clip_norm", "schedule")


def settings(cfg: OptimizerConfig) -> dict:
    """The keys a built-in optimizer or schedule may take: the section's own."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _OURS}


def schedule_call(cfg: OptimizerConfig, total_steps: int) -> tuple[Any, dict] | None:
    """The schedule function ``cfg`` names and the arguments it is called with (None: a
    user's factory or a given optimizer, whose schedule is its own)."""
    if cfg.is_factory:
        return None
    fn = SCHEDULES.get(cfg.schedule, f"optimizer.schedule={cfg.schedule}")
    return fn, accepted(fn, {**settings(cfg), "total_steps": total_steps})


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule | None:
    """The learning rate per step that ``cfg`` describes (None: see :func:`schedule_call`)."""
    call = schedule_call(cfg, total_steps)
    if call is None:
        return None
    with users_code("schedule factory"):
        return call[0](**call[1])


def rule_call(cfg: OptimizerConfig, learning_rate: Any) -> tuple[Any, dict]:
    """The optimizer function ``cfg`` names and the arguments it is called with: a
    factory's ``options``; a named one's section keys, ``learning_rate`` given."""
    where = f"optimizer.name={cfg.name}"
    fn = OPTIMIZERS.get(cfg.name, where)
    if not callable(fn):
        raise ConfigError(f"{where}: {fn!r} is not callable")
    if ":" in cfg.name:
        return fn, dict(cfg.options)
    return fn, accepted(fn, {**settings(cfg), "learning_rate": learning_rate})


def rule_parts(cfg: OptimizerConfig, learning_rate: Any) -> list[optax.GradientTransformation]:
    """The optimizer's transformations (before clipping), called by the one convention."""
    fn, kwargs = rule_call(cfg, learning_rate)
    where = f"optimizer.name={cfg.name}"
    try:
        with users_code("optimizer factory"):  # raised inside it: its file and line
            made = fn(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: calling it with {kwargs} failed: {e}") from None
    return [check_transformation(p, where) for p in as_parts(made)]


def as_parts(made) -> list:
    """What an optimizer function returned as a list of transformations (an optax
    transformation is a tuple itself: one part)."""
    if isinstance(made, list | tuple) and not hasattr(made, "update"):
        return list(made)
    return [made]


def chained(parts: list) -> optax.GradientTransformation:
    """One transformation of ``parts`` (a single one as itself: its state's tree)."""
    return parts[0] if len(parts) == 1 else optax.chain(*parts)


def build_optimizer(
    cfg: OptimizerConfig, total_steps: int, given: optax.GradientTransformation | None = None
) -> optax.GradientTransformation:
    """The optax optimizer described by ``cfg`` over ``total_steps`` steps (``given``: the
    object passed to ``train.fit(optimizer=...)``, which ``cfg.name == "given"`` stands for)."""
    if cfg.name == GIVEN:
        if given is None:
            raise ConfigError(
                f"optimizer.name={cfg.name}: this run's optimizer was an object passed to "
                "train.fit(optimizer=...); pass the same object again (train.fit or "
                "train.load_run(..., optimizer=...))"
            )
        parts = [check_transformation(given, "train.fit(optimizer=...)")]
    else:
        parts = rule_parts(cfg, schedule(cfg, total_steps))
    if cfg.clip_norm is not None:
        parts = [optax.clip_by_global_norm(cfg.clip_norm), *parts]
    return chained(parts)


def check_transformation(opt, where: str) -> optax.GradientTransformation:
    """``opt`` if it is an optax GradientTransformation (an ``init``/``update`` pair)."""
    if not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
        raise ConfigError(
            f"{where}: expected an optax.GradientTransformation (init and update), got "
            f"{type(opt).__name__}"
        )
    return opt


def accepted(fn, offered: dict) -> dict:
    """The arguments of ``offered`` that ``fn``'s signature takes (all: ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return offered
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}
