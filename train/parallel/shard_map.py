"""``parallel.strategy: shard_map``: ``jax.shard_map`` over a 1-D ``batch`` mesh.

Params and optimizer state are replicated (``P()``), the indices split along the batch.
With ``check_vma=True`` the gradient of a replicated parameter comes out summed over the
mesh by autodiff, so the step differentiates ``pmean(local_loss)`` (:meth:`global_loss`)
rather than pmean-ing local gradients.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl

from .base import place_by_batch
from .data_parallel import AXIS, DataParallel


class ShardMap(DataParallel):
    name = "shard_map"

    def __init__(self, devices):
        super().__init__(devices)
        self.mesh = jax.make_mesh(
            (len(self.devices),), (AXIS,), (jax.sharding.AxisType.Auto,), devices=self.devices
        )
        self.replicated = NamedSharding(self.mesh, P())
        self.by_batch = NamedSharding(self.mesh, P(None, AXIS))

    def global_loss(self, loss):
        return jax.lax.pmean(loss, AXIS)

    def local_accumulator(self, acc):
        return jax.lax.pcast(acc, AXIS, to="varying")  # local sums until the pmean

    def reduce(self, loss, metrics, grads, *, local_grads=False):
        if local_grads:
            loss, grads = jax.lax.pmean((loss, grads), AXIS)
        return loss, jax.lax.pmean(metrics, AXIS), grads

    def compile(self, multi_step, *, keyed):
        batch_spec = (P(None, AXIS), P()) if keyed else P(None, AXIS)
        sharded = jax.shard_map(
            multi_step,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), P(), batch_spec),
            out_specs=(P(), P(), P()),
        )
        return nl.jit(sharded, donate_argnums=(0, 1))

    def put_state(self, leaves):
        return [jax.device_put(v, self.replicated) for v in leaves]

    def put_data(self, array):
        return jax.device_put(array, self.replicated)

    def put_indices(self, idx):
        return place_by_batch(self.by_batch, idx)  # this process's share, each device its slice

    def put_batch(self, batch):
        return place_by_batch(self.by_batch, batch)

    def put_steps(self, steps):
        return jax.device_put(steps, self.replicated)

    def get_state(self, leaves):
        return [v.addressable_data(0) for v in leaves]

    def leaf_sharding(self, aval):
        return self.replicated
