"""``parallel.strategy: none``: the step is one ``jax.jit`` on one device."""

from __future__ import annotations

import jax
import numpy as np

import nnlite as nl

from ..errors import ConfigError
from .base import Strategy


class Single(Strategy):
    name = "none"
    one_device = True

    @classmethod
    def select_devices(cls, parallel, batch_size: int) -> list[jax.Device]:
        if jax.process_count() > 1:
            raise ConfigError(
                f"parallel.strategy=none trains on one device, but this run has "
                f"{jax.process_count()} processes; use pmap or shard_map"
            )
        return jax.local_devices()[:1]

    @property
    def device(self) -> jax.Device:
        return self.devices[0]

    def compile(self, multi_step, *, keyed):
        return nl.jit(multi_step, donate_argnums=(0, 1))

    def put_state(self, leaves):
        return [jax.device_put(v, self.device) for v in leaves]

    def put_data(self, array):
        return jax.device_put(array, self.device)

    def put_indices(self, idx):
        # Hand the numpy indices to the jitted call as they are: its C++ dispatch copies
        # them to the device of the (committed) state, where jax.device_put's Python path
        # costs tens of microseconds per call, as much as a whole small step.
        return np.asarray(idx)

    def put_batch(self, batch):
        return jax.device_put(batch, self.device)  # asynchronous: the copy overlaps the step

    def put_steps(self, steps):
        return np.asarray(steps)

    def get_state(self, leaves):
        return leaves

    def leaf_sharding(self, aval):
        return jax.sharding.SingleDeviceSharding(self.device)
