"""What the data-parallel strategies share: devices, reductions and keys over one axis."""

from __future__ import annotations

import jax

from ..errors import ConfigError
from . import distributed as dist
from .base import Strategy

AXIS = "batch"  # the pmap / mesh axis that splits the batch


class DataParallel(Strategy):
    """Params and optimizer state replicated on every device, the batch split over the
    :data:`AXIS` axis, gradients and metrics averaged over it."""

    axis = AXIS

    @classmethod
    def select_devices(cls, parallel, batch_size: int) -> list[jax.Device]:
        local = jax.local_devices()
        want = len(local) if parallel.devices == "all" else parallel.devices
        if want > len(local):
            raise ConfigError(f"parallel.devices={want} but only {len(local)} local devices exist")
        n = want * jax.process_count()
        if batch_size % n:
            lo = batch_size // n * n
            options = [b for b in (lo, lo + n) if b > 0]
            raise ConfigError(
                f"train.batch_size={batch_size} does not split across {n} devices; "
                f"use a multiple of {n}, e.g. {' or '.join(map(str, options))}"
            )
        return dist.global_devices(want)

    def device_key(self, key):
        return jax.random.fold_in(key, jax.lax.axis_index(AXIS))
