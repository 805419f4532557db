"""What the sharded strategies share: one ``jax.jit`` over a 2-D ``(data, model)`` mesh.

The step is written for one device and compiled once with ``jax.jit``; every leaf of the
params and optimizer state carries a ``NamedSharding`` and XLA inserts the collectives
(GSPMD). Where a leaf goes is decided per dimension:

1. **tensor** (``parallel.tensor > 1``): a dimension whose logical name (the layer's
   ``param_axes``, see ``nl.param_axes``) the rule table :data:`TENSOR_RULES` maps to the
   ``model`` axis is split over it, when it divides; Megatron's layout for nnlite's
   transformer layers (column-parallel ``fc``/``qkv``, row-parallel ``proj``/``out``).
2. **FSDP** (the ``fsdp`` strategy only): of the dimensions left, the largest one that
   the ``data`` axis divides is split over it, for every leaf of at least
   ``parallel.fsdp_min_bytes``; smaller leaves and scalars stay whole on every device.

Optimizer state follows the params: a moment of a param (optax's ``tree_map_params``)
gets its param's sharding, anything else (step counts) the rule for its own shape. The
batch is split over ``data`` and whole along ``model``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl

from ..errors import ConfigError
from . import distributed as dist
from .base import Strategy, nbytes, place_by_batch

DATA, MODEL = "data", "model"  # the mesh's axes: the batch (and FSDP) and tensor parallelism

#: Logical axis name -> mesh axis under tensor parallelism (MaxText's logical-axis rules).
#: Names not listed (``embed``, ``in``, ``out``, ``norm``, ``position``, ...) are never
#: split over ``model``.
TENSOR_RULES = {"mlp": MODEL, "qkv": MODEL, "heads": MODEL, "vocab": MODEL}


def _signature(avals) -> tuple:
    return tuple((tuple(np.shape(a)), str(np.dtype(a.dtype))) for a in avals)


class Sharded(Strategy):
    """Params (and with :attr:`shard_data`, optimizer state) placed by logical-axis rules
    on a ``(data, model)`` mesh; the step is one ``jax.jit`` with donated state."""

    tensor_parallel = True
    sharded_state = True  # checkpoints written shard by shard, resumed onto state_shardings
    shard_data: ClassVar[bool]  # FSDP: split leaves over the data axis too
    rules: ClassVar[dict[str, str]] = TENSOR_RULES

    def __init__(self, devices, tensor: int = 1, min_bytes: int = 16384):
        super().__init__(devices)
        n = len(self.devices)
        if tensor < 1 or n % tensor:
            raise ConfigError(f"parallel.tensor={tensor} does not divide the {n} devices")
        self.tensor, self.data, self.min_bytes = tensor, n // tensor, min_bytes
        # Devices in (process, id) order, the model axis innermost: a tensor group sits
        # within one process, and process p's devices hold the p-th block of the batch.
        self.mesh = jax.make_mesh(
            (self.data, tensor),
            (DATA, MODEL),
            (jax.sharding.AxisType.Auto,) * 2,
            devices=self.devices,
        )
        self.replicated = NamedSharding(self.mesh, P())
        self.by_batch = NamedSharding(self.mesh, P(None, DATA))
        self._plans: dict[tuple, list] = {}  # leaf signature -> shardings (see plan)
        self._trees: tuple | None = None  # (params, opt_state) trees of shardings

    @classmethod
    def select_devices(cls, parallel, batch_size: int) -> list[jax.Device]:
        local = jax.local_devices()
        want = len(local) if parallel.devices == "all" else parallel.devices
        if want > len(local):
            raise ConfigError(f"parallel.devices={want} but only {len(local)} local devices exist")
        t = parallel.tensor
        if want % t:
            raise ConfigError(
                f"parallel.tensor={t} does not divide the {want} devices of a process "
                f"(parallel.devices={parallel.devices}); use a divisor of {want}"
            )
        data = want * jax.process_count() // t
        if batch_size % data:
            lo = batch_size // data * data
            options = [b for b in (lo, lo + data) if b > 0]
            raise ConfigError(
                f"train.batch_size={batch_size} does not split across the data axis of {data} "
                f"devices ({want * jax.process_count()} devices / parallel.tensor={t}); use a "
                f"multiple of {data}, e.g. {' or '.join(map(str, options))}"
            )
        return dist.global_devices(want)

    @classmethod
    def from_config(cls, parallel, batch_size: int) -> Sharded:
        devices = cls.select_devices(parallel, batch_size)
        return cls(devices, parallel.tensor, parallel.fsdp_min_bytes)

    # -- where each leaf goes ----------------------------------------------------------

    def spec(self, aval: Any, axes: tuple | None = None) -> P:
        """The ``PartitionSpec`` of a leaf of this shape and logical ``axes`` (None:
        undeclared): the rules of the module docstring."""
        shape = tuple(np.shape(aval))
        names: list[str | None] = [None] * len(shape)
        if self.tensor > 1 and axes:
            for i, logical in enumerate(axes):
                if self.rules.get(logical) == MODEL and shape[i] % self.tensor == 0:
                    names[i] = MODEL
                    break  # a mesh axis splits one dimension
        if self.shard_data and self.data > 1 and nbytes(aval) >= self.min_bytes:
            free = [i for i, d in enumerate(shape) if names[i] is None and d % self.data == 0]
            if free:
                names[max(free, key=lambda i: shape[i])] = DATA
        while names and names[-1] is None:  # P(None, "data"), P(): the shortest spelling
            names.pop()
        return P(*names)

    def sharding(self, aval: Any, axes: tuple | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(aval, axes))

    def plan(self, model, optimizer) -> None:
        p_avals = jax.eval_shape(lambda: model.init(jax.random.key(0)))  # traced, not run
        axes = nl.param_axes(model, p_avals)
        p_tree = jax.tree.map(self.sharding, p_avals, axes)
        o_avals = jax.eval_shape(optimizer.init, p_avals)

        def like_param(o, s, p):  # a moment of param p gets p's sharding
            return s if np.shape(o) == np.shape(p) else self.sharding(o)

        try:
            o_tree = optax.tree_map_params(
                optimizer,
                like_param,
                o_avals,
                p_tree,
                p_avals,
                transform_non_params=self.sharding,
            )
        except (TypeError, ValueError):  # a state optax cannot map: place by shape alone
            o_tree = jax.tree.map(self.sharding, o_avals)
        self._trees = (p_tree, o_tree)
        for avals, tree in ((p_avals, p_tree), (o_avals, o_tree)):
            self._plans[_signature(jax.tree.leaves(avals))] = jax.tree.leaves(tree)

    def init_shardings(self):
        return self._trees

    def state_shardings(self, avals):
        planned = self._plans.get(_signature(avals))
        return planned if planned is not None else [self.sharding(a) for a in avals]

    def leaf_sharding(self, aval):
        return self.sharding(aval)

    def bytes_per_device(self, avals) -> int:
        leaves = jax.tree.leaves(avals)
        return sum(
            math.prod(s.shard_shape(tuple(np.shape(a)))) * np.dtype(a.dtype).itemsize
            for a, s in zip(leaves, self.state_shardings(leaves), strict=True)
        )

    # -- inside the compiled step ------------------------------------------------------

    def compute_params(self, params):
        # ZeRO-3: the forward and backward pass see each weight whole along the data axis
        # (one all-gather per sharded weight; its gradient is reduce-scattered back), and
        # the batch stays split. Without this, XLA's cost model gathered the activations
        # of small batches instead, a different algorithm with more collectives.
        if self._trees is None or not self.shard_data:
            return params
        gathered = jax.tree.map(
            lambda s: NamedSharding(self.mesh, P(*(None if a == DATA else a for a in s.spec))),
            self._trees[0],
        )
        return jax.lax.with_sharding_constraint(params, gathered)

    def reduce(self, loss, metrics, grads, *, local_grads=False):
        # Each gradient where its param lives: a sharded one reduce-scattered, a whole one
        # all-reduced. Left to itself, XLA computed small whole params' updates sharded and
        # all-gathered them afterwards (3 per leaf: param, mu, nu).
        if self._trees is not None:
            grads = jax.lax.with_sharding_constraint(grads, self._trees[0])
        return loss, metrics, grads

    # -- compiling and placing ---------------------------------------------------------

    def compile(self, multi_step, *, keyed):
        out = None
        if self._trees is not None:
            p_tree, o_tree = self._trees
            # a stateful model's state (BatchNorm's statistics: small) stays whole
            out = (
                jax.tree.leaves(p_tree),
                (jax.tree.leaves(o_tree), self.replicated),
                self.replicated,
            )
        return nl.jit(multi_step, out_shardings=out, donate_argnums=(0, 1))

    def _put(self, value, sharding):
        if isinstance(value, jax.Array):
            return jax.device_put(value, sharding)
        host = np.asarray(value)  # every process holds the whole value: each places its part
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def put_state(self, leaves):
        shardings = self.state_shardings(leaves)
        return [self._put(v, s) for v, s in zip(leaves, shardings, strict=True)]

    def put_data(self, array):
        return self._put(array, self.replicated)

    def put_indices(self, idx):
        return place_by_batch(self.by_batch, idx)  # this process's share, each device its slice

    def put_batch(self, batch):
        return place_by_batch(self.by_batch, batch)

    def put_steps(self, steps):
        return self._put(steps, self.replicated)

    def get_state(self, leaves):
        if all(v.is_fully_addressable for v in leaves):
            return leaves  # np.asarray / device_put gather the shards
        from jax.experimental import multihost_utils

        return [np.asarray(v) for v in multihost_utils.process_allgather(leaves, tiled=True)]

    def describe(self) -> str:
        return f"{self.name}, mesh data {self.data} x model {self.tensor}"
