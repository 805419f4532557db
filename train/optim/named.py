"""The named optimizers and schedules, and building the one a config describes.

A named optimizer is an optax chain of clipping, weight decay and the update rule; a
user's ``optimizer.name: "module:function"`` is a factory whose keyword arguments are the
section's other keys (``optimizer.options``) and which returns any
``optax.GradientTransformation`` (a chain, ``MultiSteps``, ``masked``,
``inject_hyperparams``...). Schedules likewise: ``optimizer.schedule: "module:function"``
is called with the keyword arguments ``learning_rate`` and ``total_steps`` that its
signature names and returns an ``optax.Schedule``.
"""

from __future__ import annotations

import inspect

import jax
import optax

from ..errors import ConfigError, users_code, users_error
from . import GIVEN, OPTIMIZERS, SCHEDULES
from .section import OptimizerConfig


# -- schedules: (cfg, total_steps) -> optax.Schedule ---------------------------------------
def constant(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    return optax.constant_schedule(cfg.learning_rate)


def cosine(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    return optax.cosine_decay_schedule(cfg.learning_rate, total_steps, alpha=cfg.end_lr_fraction)


def warmup_cosine(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    lr = cfg.learning_rate
    return optax.warmup_cosine_decay_schedule(
        0.0, lr, cfg.warmup_steps, total_steps, end_value=lr * cfg.end_lr_fraction
    )


def exponential(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    return optax.exponential_decay(
        cfg.learning_rate, transition_steps=total_steps, decay_rate=cfg.decay_rate
    )


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule | None:
    """The learning rate per step that ``cfg`` describes (None: a user's optimizer factory
    or a given optimizer, whose schedule is its own)."""
    if cfg.name == GIVEN or ":" in cfg.name:
        return None
    where = f"optimizer.schedule={cfg.schedule}"
    if ":" not in cfg.schedule:
        return SCHEDULES.get(cfg.schedule, where)(cfg, total_steps)
    factory = SCHEDULES.get(cfg.schedule, where)
    offered = {"learning_rate": cfg.learning_rate, "total_steps": total_steps}
    with users_code("schedule factory"):
        return factory(**_accepted(factory, offered, where))


# -- named optimizers: (cfg, lr) -> the chain's parts (chained flat, so the optimizer
# state's tree, and so a checkpoint's keys, are those of one optax.chain) -----------------
def decay_mask(params):
    """Weight decay for matrices only (ndim >= 2), not biases or normalisation params."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _mask(cfg: OptimizerConfig):
    return decay_mask if cfg.decay == "matrices" else None


Parts = list[optax.GradientTransformation]


def _l2(cfg: OptimizerConfig, rule: optax.GradientTransformation) -> Parts:
    """Weight decay added to the gradient (L2) before ``rule``, when asked for."""
    if not cfg.weight_decay:
        return [rule]
    return [optax.add_decayed_weights(cfg.weight_decay, mask=_mask(cfg)), rule]


def sgd(cfg: OptimizerConfig, lr) -> Parts:
    return _l2(cfg, optax.sgd(lr))


def momentum(cfg: OptimizerConfig, lr) -> Parts:
    return _l2(cfg, optax.sgd(lr, momentum=cfg.momentum))


def adam(cfg: OptimizerConfig, lr) -> Parts:
    return _l2(cfg, optax.adam(lr, b1=cfg.b1, b2=0.999 if cfg.b2 is None else cfg.b2))


def adamw(cfg: OptimizerConfig, lr) -> Parts:
    b2 = 0.999 if cfg.b2 is None else cfg.b2
    return [optax.adamw(lr, b1=cfg.b1, b2=b2, weight_decay=cfg.weight_decay, mask=_mask(cfg))]


def lion(cfg: OptimizerConfig, lr) -> Parts:
    b2 = 0.99 if cfg.b2 is None else cfg.b2
    return [optax.lion(lr, b1=cfg.b1, b2=b2, weight_decay=cfg.weight_decay, mask=_mask(cfg))]


def build_optimizer(
    cfg: OptimizerConfig, total_steps: int, given: optax.GradientTransformation | None = None
) -> optax.GradientTransformation:
    """The optax optimizer described by ``cfg`` over ``total_steps`` steps (``given``: the
    object passed to ``train.fit(optimizer=...)``, which ``cfg.name == "given"`` stands for)."""
    where = f"optimizer.name={cfg.name}"
    if cfg.name == GIVEN:
        if given is None:
            raise ConfigError(
                f"{where}: this run's optimizer was an object passed to "
                "train.fit(optimizer=...); pass the same object again (train.fit or "
                "train.load_run(..., optimizer=...))"
            )
        return check_transformation(given, "train.fit(optimizer=...)")
    if ":" in cfg.name:
        factory = OPTIMIZERS.get(cfg.name, where)
        if not callable(factory):
            raise ConfigError(f"{where}: {factory!r} is not callable")
        try:
            made = factory(**dict(cfg.options))
        except Exception as e:
            err = users_error("optimizer factory", e)  # raised inside it: its file and line
            if err is not None:
                raise err from e
            if not isinstance(e, TypeError):
                raise
            raise ConfigError(f"{where}: calling it with {dict(cfg.options)} failed: {e}") from None
        parts = [check_transformation(made, where)]
    else:
        parts = OPTIMIZERS.get(cfg.name, where)(cfg, schedule(cfg, total_steps))
    if cfg.clip_norm is not None:
        parts = [optax.clip_by_global_norm(cfg.clip_norm), *parts]
    return parts[0] if len(parts) == 1 else optax.chain(*parts)


def check_transformation(opt, where: str) -> optax.GradientTransformation:
    """``opt`` if it is an optax GradientTransformation (an ``init``/``update`` pair)."""
    if not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
        raise ConfigError(
            f"{where}: expected an optax.GradientTransformation (init and update), got "
            f"{type(opt).__name__}"
        )
    return opt


def _accepted(fn, offered: dict, where: str) -> dict:
    """The arguments of ``offered`` that ``fn``'s signature takes."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return offered
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}
