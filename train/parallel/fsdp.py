"""``parallel.strategy: fsdp``: ZeRO-3 style sharding with ``jax.jit`` over a device mesh.

Params, gradients and optimizer state are split over the mesh's ``data`` axis (each leaf
along its largest dimension that the axis divides; leaves under ``parallel.fsdp_min_bytes``
and scalars whole on every device; Adam's moments like their params), the batch too. The
step is one ``jax.jit`` with the state's shardings as inputs and outputs and the state
donated: XLA all-gathers a weight where the forward and backward pass need it and
reduce-scatters its gradient, so no device ever holds the whole model between steps.
Init runs with the same output shardings, so the state is created sharded.

With ``parallel.tensor: N`` the mesh has a second axis, ``model``, of N devices: the
layers' logical axes split the transformer's projections over it (Megatron's layout) and
FSDP shards the rest over the ``data`` axis of the remaining devices (see ``mesh.py``).
"""

from __future__ import annotations

from .mesh import Sharded


class FSDP(Sharded):
    name = "fsdp"
    shard_data = True
