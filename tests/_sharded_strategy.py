"""A test-only strategy whose state is sharded, standing in for fsdp in the checkpoint
tests: params and optimizer state split along their first dimension over the ``batch``
mesh axis (where it divides), the batch split over the same axis, and the step one
``jax.jit`` with ``NamedSharding`` s (XLA inserts the collectives).

``use_sharded_strategy()`` makes ``parallel.strategy: shard_map`` build it (the config
accepts only registered names); ``python tests/_sharded_strategy.py ARGS`` is
``python -m train ARGS`` with it (and the faults of tests/_inject.py its environment names).
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import parallel
from train.parallel.base import nbytes
from train.parallel.data_parallel import AXIS
from train.parallel.shard_map import ShardMap


class ShardedParams(ShardMap):
    sharded_state = True
    axis = None  # one jit over the global batch: batch statistics are global already
    gathered = 0  # calls of get_state (evaluation may gather; checkpoints must not)

    def leaf_sharding(self, aval):
        shape = tuple(np.shape(aval))
        split = bool(shape) and shape[0] % len(self.devices) == 0
        return NamedSharding(self.mesh, P(AXIS) if split else P())

    # The step is one program over the global batch: nothing to reduce by hand.
    def global_loss(self, loss):
        return loss

    def local_accumulator(self, acc):
        return acc

    def reduce(self, loss, metrics, grads, *, local_grads=False):
        return loss, metrics, grads

    def device_key(self, key):
        return key

    def compile(self, multi_step, *, keyed):
        def constrained(p_leaves, o_leaves, X, Y, batch):
            # o_leaves: the optimizer's leaves and the model state's, ([...], [...])
            p_leaves, o_leaves, metrics = multi_step(p_leaves, o_leaves, X, Y, batch)
            keep = lambda v: jax.lax.with_sharding_constraint(v, self.leaf_sharding(v))
            return jax.tree.map(keep, p_leaves), jax.tree.map(keep, o_leaves), metrics

        return jax.jit(constrained, donate_argnums=(0, 1))

    def put_state(self, leaves):
        return [jax.device_put(v, self.leaf_sharding(v)) for v in leaves]

    def get_state(self, leaves):
        type(self).gathered += 1
        if jax.process_count() == 1:
            return jax.device_get(leaves)
        return [np.asarray(multihost_utils.process_allgather(v, tiled=True)) for v in leaves]

    def bytes_per_device(self, avals):
        def per_device(a):
            split = self.leaf_sharding(a).spec != P()
            return nbytes(a) // (len(self.devices) if split else 1)

        return sum(per_device(a) for a in jax.tree.leaves(avals))


def use_sharded_strategy(monkeypatch=None) -> None:
    """``parallel.strategy: shard_map`` builds :class:`ShardedParams` from now on (undone
    with ``monkeypatch``, if given)."""
    original = parallel.strategy_class

    def strategy_class(name):
        return ShardedParams if name == "shard_map" else original(name)

    if monkeypatch is not None:
        monkeypatch.setattr(parallel, "strategy_class", strategy_class)
    else:
        parallel.strategy_class = strategy_class


if __name__ == "__main__":
    from _inject import from_env

    from train.__main__ import main

    from_env()
    use_sharded_strategy()
    sys.exit(main(sys.argv[1:], standalone=True))
