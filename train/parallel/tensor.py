"""``parallel.strategy: tensor``: data parallelism plus tensor parallelism with ``jax.jit``.

A ``(data, model)`` mesh of ``devices / parallel.tensor`` x ``parallel.tensor`` devices:
params and optimizer state are split over ``model`` by the layers' logical axes
(Megatron's layout: see ``mesh.py``) and whole along ``data``, which splits the batch.
With ``parallel.tensor: 1`` it is plain data parallelism compiled by ``jax.jit`` (XLA
all-reduces the gradients), the GSPMD counterpart of ``shard_map``.
"""

from __future__ import annotations

from .mesh import Sharded


class Tensor(Sharded):
    name = "tensor"
    shard_data = False
