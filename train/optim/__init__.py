"""Optimizers and learning-rate schedules: named ones (one function each in ``named.py``,
one line each in the tables below), a user's function by import path (or registered here,
``@OPTIMIZERS.register("name")``), or any ``optax.GradientTransformation`` given to
``train.fit``. Every optimizer is a function of keyword arguments returning an optax
transformation (or a list of them); every schedule one returning an ``optax.Schedule``.

Importing this package does not import optax or JAX (the config reads the names).
"""

from __future__ import annotations

from ..registry import Registry

#: ``optimizer.name`` -> ``f(learning_rate, **the section's keys it names)`` -> transformation(s)
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

#: ``optimizer.schedule`` -> ``f(learning_rate, total_steps, **section keys)`` -> optax.Schedule
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
