"""Optimizers by name: an optax chain of clipping, weight decay and the update rule."""

from __future__ import annotations

import jax
import optax

from .config import OptimizerConfig


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    lr = cfg.learning_rate
    if cfg.schedule == "constant":
        return optax.constant_schedule(lr)
    if cfg.schedule == "cosine":
        return optax.cosine_decay_schedule(lr, total_steps, alpha=cfg.end_lr_fraction)
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, cfg.warmup_steps, total_steps, end_value=lr * cfg.end_lr_fraction
        )
    if cfg.schedule == "exponential":
        return optax.exponential_decay(lr, transition_steps=total_steps, decay_rate=cfg.decay_rate)
    raise ValueError(f"unknown schedule {cfg.schedule!r}")  # config validation prevents this


def decay_mask(params):
    """Weight decay for matrices only (ndim >= 2), not biases or normalisation params."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax optimizer described by ``cfg`` over ``total_steps`` steps."""
    lr = schedule(cfg, total_steps)
    wd = cfg.weight_decay
    mask = decay_mask if cfg.decay == "matrices" else None
    b1, b2 = cfg.b1, cfg.b2
    parts = []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    if cfg.name == "adamw":
        parts.append(
            optax.adamw(lr, b1=b1, b2=0.999 if b2 is None else b2, weight_decay=wd, mask=mask)
        )
    elif cfg.name == "lion":
        parts.append(
            optax.lion(lr, b1=b1, b2=0.99 if b2 is None else b2, weight_decay=wd, mask=mask)
        )
    else:
        if wd:
            parts.append(optax.add_decayed_weights(wd, mask=mask))  # L2 added to the gradient
        if cfg.name == "sgd":
            parts.append(optax.sgd(lr))
        elif cfg.name == "momentum":
            parts.append(optax.sgd(lr, momentum=cfg.momentum))
        elif cfg.name == "adam":
            parts.append(optax.adam(lr, b1=b1, b2=0.999 if b2 is None else b2))
        else:
            raise ValueError(f"unknown optimizer {cfg.name!r}")  # config validation prevents this
    return parts[0] if len(parts) == 1 else optax.chain(*parts)
