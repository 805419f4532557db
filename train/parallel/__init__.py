"""Parallel strategies: one class per way of spreading a training step over devices.

The stepper, the loop, evaluation, checkpoints and the memory estimate ask the strategy
object (:class:`~train.parallel.base.Strategy`) and never compare strategy names. Adding
a strategy is one module with one class here and one line in :data:`REGISTRY`.

Importing this package does not import JAX (the config reads :data:`NAMES` to validate
``parallel.strategy`` before JAX loads); :func:`get` imports the strategy's module.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError

# config name -> "module:Class" within this package
REGISTRY = {
    "none": "single:Single",
    "pmap": "pmap:Pmap",
    "shard_map": "shard_map:ShardMap",
    "tensor": "tensor:Tensor",
    "fsdp": "fsdp:FSDP",
}
NAMES = tuple(REGISTRY)


def strategy_class(name: str):
    """The :class:`Strategy` subclass registered as ``name``."""
    try:
        module, cls = REGISTRY[name].split(":")
    except KeyError:
        raise ValueError(f"unknown parallel strategy {name!r}; choose one of {NAMES}") from None
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def get(name: str, devices: list):
    """The strategy ``name`` over ``devices`` (of every process, in the order that splits
    the global batch: see ``train.parallel.distributed.global_devices``)."""
    return strategy_class(name)(devices)


def from_config(parallel, batch_size: int):
    """The strategy a config's ``parallel`` section asks for, on the devices it selects
    (raises ConfigError when they cannot split ``batch_size`` or do not exist)."""
    cls = strategy_class(parallel.strategy)
    if parallel.tensor > 1 and not cls.tensor_parallel:
        able = [n for n in NAMES if strategy_class(n).tensor_parallel]
        raise ConfigError(
            f"parallel.tensor={parallel.tensor} needs a strategy that shards params over a "
            f"mesh ({' or '.join(able)}); parallel.strategy={parallel.strategy} keeps a whole "
            "copy of the model on every device"
        )
    return cls.from_config(parallel, batch_size)
