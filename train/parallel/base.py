"""What every parallel strategy answers: the interface the stepper and the loop use."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np


def place_by_batch(sharding: jax.sharding.Sharding, tree: Any) -> Any:
    """This process's ``[K, B / processes, ...]`` leaves of ``tree`` as global arrays of
    ``[K, B, ...]`` placed on ``sharding`` (axis 1 split over the batch's devices): each
    device receives its own slice, nothing more."""

    def put(a):
        shape = (a.shape[0], a.shape[1] * jax.process_count(), *a.shape[2:])
        return jax.make_array_from_process_local_data(sharding, a, shape)

    return jax.tree.map(put, tree)


def nbytes(aval: Any) -> int:
    """Bytes of an array or ``ShapeDtypeStruct``."""
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


class Strategy:
    """How one training step is spread over devices.

    The compiled step is written once (``train.step.step``); a strategy decides:

    - **inside the step** (while it is traced): the loss that autodiff differentiates
      (:meth:`global_loss`), how the loss, metrics and gradients are reduced over devices
      (:meth:`reduce`), and each device's random key (:meth:`device_key`);
    - **around it**: how the step is compiled (:meth:`compile`), where the state, the data
      and each call's indices or streamed batches are placed (:meth:`put_state`,
      :meth:`put_data`, :meth:`put_indices`, :meth:`put_batch`, :meth:`put_steps`), how
      one copy of the state comes back for evaluation and checkpoints (:meth:`get_state`),
      each leaf's sharding
      (:meth:`leaf_sharding`, for compiling ahead of time) and bytes per device
      (:meth:`bytes_per_device`, for the memory estimate and the banner).

    Every strategy equals one device for the same global batch.

    **Sharded state** (:attr:`sharded_state` true): the placed leaves are split over the
    devices, not replicated. Checkpoints are then written shard by shard from the placed
    leaves (``nl.save_sharded``: each process writes what its devices hold; :meth:`get_state`
    is never called for them), and a resume places each leaf straight onto its
    :meth:`state_shardings` entry (by default :meth:`leaf_sharding`, which must then
    return a sharding for every leaf), reading
    only the parts this process's devices hold, whatever mesh wrote the checkpoint.
    """

    name: ClassVar[str]
    #: The mapped axis that splits the batch inside the step (``pmap``/``shard_map``), over
    #: which layers average batch statistics (``nl.batch_axis``); None where the step sees
    #: the global batch as one array (one device, or ``jit`` over a sharded batch).
    axis: ClassVar[str | None] = None
    sharded_state: ClassVar[bool] = False  # see the class docstring
    #: whether ``parallel.tensor > 1`` (a tensor-parallel mesh axis) is accepted
    tensor_parallel: ClassVar[bool] = False
    #: whether the step runs on one device with no collective (what ``--eject`` writes out)
    one_device: ClassVar[bool] = False

    def __init__(self, devices: Sequence[jax.Device]):
        self.devices = list(devices)
        self.local_devices = [d for d in self.devices if d.process_index == jax.process_index()]

    @classmethod
    def select_devices(cls, parallel, batch_size: int) -> list[jax.Device]:
        """The devices a config's ``parallel`` section selects (all processes)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, parallel, batch_size: int) -> Strategy:
        """The strategy on the devices a config's ``parallel`` section selects."""
        return cls(cls.select_devices(parallel, batch_size))

    def plan(self, model, optimizer) -> None:
        """Learn where each leaf of ``model``'s params and ``optimizer``'s state goes (a
        strategy that shards by the layers' logical axes); nothing to learn by default."""

    def init_shardings(self) -> tuple | None:
        """``(params, opt_state)`` trees of shardings that init creates the state with (the
        state is then never whole on one device), or None: init on the default device."""
        return None

    # -- inside the compiled step ------------------------------------------------------

    def compute_params(self, params: Any) -> Any:
        """The params as the forward and backward pass use them (FSDP: each weight
        gathered whole along the data axis; autodiff turns that into a reduce-scatter of
        its gradient)."""
        return params

    def global_loss(self, loss: jax.Array) -> jax.Array:
        """The loss autodiff differentiates, from this device's mean loss."""
        return loss

    def local_accumulator(self, acc: Any) -> Any:
        """A gradient accumulator that sums this device's own microbatch gradients."""
        return acc

    def reduce(self, loss, metrics, grads, *, local_grads: bool = False) -> tuple:
        """``(loss, metrics, grads)`` over the global batch from this device's values.

        ``local_grads``: ``grads`` are this device's own sums (a model's accumulating
        pass), not the gradient of :meth:`global_loss`.
        """
        return loss, metrics, grads

    def reduce_squares(self, tree: Any) -> Any:
        """Sums of squares of the loss's cotangents over the global batch, from this
        device's sums of its own (``log.grad_by_layer``'s taps). By default they already
        are: one device, or the gradient of :meth:`global_loss` of a replicated input."""
        return tree

    def device_key(self, key: jax.Array) -> jax.Array:
        """This device's random key from the step's key (its share gets its own masks)."""
        return key

    # -- compiling and placing ---------------------------------------------------------

    def compile(self, multi_step: Callable, *, keyed: bool) -> Callable:
        """The compiled ``(p_leaves, o_leaves, X, Y, batch) -> (p_leaves, o_leaves,
        metrics)`` (params and optimizer state donated). ``keyed``: ``batch`` is
        ``(data, step numbers)``, else data alone; data is a ``[K, B]`` index block, or a
        streamed ``(x, y)`` of ``[K, B, ...]`` arrays split along axis 1 like indices
        (then ``X``, ``Y`` are empty tuples)."""
        raise NotImplementedError

    def put_state(self, leaves: list) -> list:
        """Host or device leaves of the params or optimizer state, placed for the step."""
        raise NotImplementedError

    def put_data(self, array: np.ndarray) -> Any:
        """A whole (small) data set array, placed for the step."""
        raise NotImplementedError

    def put_indices(self, idx: np.ndarray) -> Any:
        """This process's ``[K, B / processes]`` int indices of a call, placed."""
        raise NotImplementedError

    def put_batch(self, batch: Any) -> Any:
        """This process's share of a call's streamed batch, a pytree of host arrays
        ``[K, B / processes, ...]`` (the K steps' inputs and targets), placed so that each
        device receives only its slice of axis 1 (as :meth:`put_indices` splits indices).
        May be called on a background thread (the next call's batch is sent while the
        current one runs)."""
        raise NotImplementedError

    def put_steps(self, steps: np.ndarray) -> Any:
        """The ``[K]`` step numbers of a call (keyed models), placed."""
        raise NotImplementedError

    def get_state(self, leaves: list) -> list:
        """One whole copy of each placed leaf (for evaluation and checkpoints)."""
        raise NotImplementedError

    def leaf_sharding(self, aval: Any) -> jax.sharding.Sharding | None:
        """Where :meth:`put_state` places a leaf of this shape, or None when the strategy
        has no such sharding (its step then compiles on its first call)."""
        return None

    def state_shardings(self, avals: Sequence[Any]) -> list | None:
        """:meth:`leaf_sharding` of each of a tree's leaves (a strategy whose placement
        depends on the leaf's place in the tree overrides this), or None."""
        shardings = [self.leaf_sharding(a) for a in avals]
        return None if any(s is None for s in shardings) else shardings

    def bytes_per_device(self, avals: Any) -> int:
        """Bytes that one device holds of a tree placed by :meth:`put_state`
        (replicated: all of it)."""
        return sum(nbytes(a) for a in jax.tree.leaves(avals))

    @property
    def eval_device(self) -> jax.Device:
        """Where the held-out split is evaluated (process 0's first device)."""
        return self.local_devices[0]

    def describe(self) -> str:
        """How the banner names the strategy."""
        return self.name
