"""``parallel.strategy: pmap``: ``jax.pmap`` over the local devices of every process.

Params and optimizer state carry a leading device axis (one replica each); each device
takes its share of the batch, and its local loss is differentiated, so gradients, the
loss and the metrics are averaged with ``lax.pmean``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .data_parallel import AXIS, DataParallel


class Pmap(DataParallel):
    name = "pmap"

    def __init__(self, devices):
        super().__init__(devices)
        self._replicate = jax.pmap(lambda v: v, devices=self.local_devices)
        # streamed batches: the leading (device) axis split over every process's devices
        mesh = jax.make_mesh(
            (len(self.devices),), (AXIS,), (jax.sharding.AxisType.Auto,), devices=self.devices
        )
        self._by_device = NamedSharding(mesh, P(AXIS))

    def reduce(self, loss, metrics, grads, *, local_grads=False):
        return jax.lax.pmean((loss, metrics, grads), AXIS)

    def reduce_squares(self, tree):
        # each device differentiated its local mean loss: its cotangents are n times the
        # global loss's, their squares n^2 times
        n = jax.lax.psum(1, AXIS)
        return jax.tree.map(lambda s: jax.lax.psum(s, AXIS) / (n * n), tree)

    def compile(self, multi_step, *, keyed):
        return jax.pmap(multi_step, axis_name=AXIS, devices=self.devices, donate_argnums=(0, 1))

    def _on_each(self, a):
        n = len(self.local_devices)
        return self._replicate(np.broadcast_to(np.asarray(a), (n, *np.shape(a))))

    def put_state(self, leaves):
        return [self._on_each(v) for v in leaves]

    def put_data(self, array):
        return self._on_each(array)

    def put_indices(self, idx):
        # this process's [K, B] -> [local devices, K, B / local devices]
        n = len(self.local_devices)
        k, b = idx.shape
        return np.ascontiguousarray(idx.reshape(k, n, b // n).transpose(1, 0, 2))

    def put_batch(self, batch):
        # this process's [K, B, ...] -> [local devices, K, B / local devices, ...], each
        # device's block placed on it alone (pmap takes it without another copy)
        n, count = len(self.local_devices), jax.process_count()

        def put(a):
            k, b = a.shape[:2]
            local = a.reshape(k, n, b // n, *a.shape[2:]).swapaxes(0, 1)
            shape = (n * count, *local.shape[1:])
            return jax.make_array_from_process_local_data(self._by_device, local, shape)

        return jax.tree.map(put, batch)

    def put_steps(self, steps):
        return np.broadcast_to(steps, (len(self.local_devices), *steps.shape))

    def get_state(self, leaves):
        return [v[0] for v in leaves]
