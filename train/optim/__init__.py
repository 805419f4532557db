"""Optimizers and learning-rate schedules: named ones (one builder each in ``named.py``,
one line each in the tables below), a user's factory by import path, or any
``optax.GradientTransformation`` given to ``train.fit``.

Importing this package does not import optax or JAX (the config reads the names).
"""

from __future__ import annotations

from ..registry import Registry

#: ``optimizer.name`` -> builder ``(OptimizerConfig, learning_rate) -> GradientTransformation``
OPTIMIZERS = Registry(
    "named optimizer",
    {
        "sgd": ".optim.named:sgd",
        "momentum": ".optim.named:momentum",
        "adam": ".optim.named:adam",
        "adamw": ".optim.named:adamw",
        "lion": ".optim.named:lion",
    },
)

#: ``optimizer.schedule`` -> builder ``(OptimizerConfig, total_steps) -> optax.Schedule``
SCHEDULES = Registry(
    "named schedule",
    {
        "constant": ".optim.named:constant",
        "cosine": ".optim.named:cosine",
        "warmup_cosine": ".optim.named:warmup_cosine",
        "exponential": ".optim.named:exponential",
    },
)

#: ``optimizer.name`` when the optimizer is an object given to ``train.fit(optimizer=...)``
GIVEN = "given"
