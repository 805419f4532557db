"""The config's ``parallel`` and ``distributed`` sections (no JAX here: the config is read
before JAX imports)."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import Where, choice
from . import NAMES as STRATEGIES

CLUSTERS = ("auto", "slurm", "mpi", "k8s", "env", "none")
MAX_TIMEOUT_S = 2**31 - 1  # jax.distributed passes these to C++ as int32 seconds


@dataclass(frozen=True)
class ParallelConfig:
    # none (one device), pmap / shard_map (data parallel), tensor (jit over a 2-D mesh,
    # params replicated over its data axis), fsdp (params and optimizer state sharded too)
    strategy: str = choice("none", STRATEGIES)
    devices: int | str = "all"  # per process: "all" local devices or a count
    # devices per tensor-parallel group (the mesh's "model" axis, Megatron layout); the
    # other devices / tensor form the data axis. > 1 needs strategy tensor or fsdp.
    tensor: int = 1
    # fsdp: params smaller than this many bytes stay whole on every device (their
    # all-gather would cost more time than they save memory)
    fsdp_min_bytes: int = 16384

    def check(self, where: Where) -> None:
        d = self.devices
        if isinstance(d, str) and d != "all" or isinstance(d, int) and d < 1:
            raise where.bad("parallel.devices", f"must be 'all' or a positive int, got {d!r}")
        if self.tensor < 1:
            raise where.bad("parallel.tensor", f"must be a positive int, got {self.tensor}")
        if self.fsdp_min_bytes < 0:
            raise where.bad("parallel.fsdp_min_bytes", f"must be >= 0, got {self.fsdp_min_bytes}")


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process training with ``jax.distributed`` (see docs/distributed.md).

    Unset fields are read from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID; with no coordinator address anywhere the run is a single process.
    ``cluster`` picks who says how many processes there are: ``env`` (those fields and
    variables), ``slurm`` / ``mpi`` (Open MPI's mpirun) / ``k8s`` (an indexed Job), read by
    ``jax.distributed.initialize``'s own cluster detection, ``none`` (one process whatever
    the environment says), or ``auto``: ``env`` when a coordinator address is set, else
    the cluster whose environment is present, else one process.
    """

    cluster: str = choice("auto", CLUSTERS)  # see train/parallel/distributed.py
    coordinator_address: str | None = None  # host:port of process 0 (all processes agree)
    num_processes: int | None = None  # how many processes take part
    process_id: int | None = None  # this process: 0 .. num_processes - 1
    initialization_timeout: int = 300  # seconds to wait for every process to connect
    heartbeat_timeout: int = 100  # seconds of silence after which a process counts as dead

    def check(self, where: Where) -> None:
        timeouts = ("initialization_timeout", "heartbeat_timeout")
        where.at_least("distributed.", self, timeouts, 1)
        for key in timeouts:
            if getattr(self, key) > MAX_TIMEOUT_S:
                raise where.bad(
                    f"distributed.{key}",
                    f"must be at most {MAX_TIMEOUT_S} seconds, got {getattr(self, key)}",
                )
        if self.num_processes is not None and self.num_processes < 1:
            raise where.bad("distributed.num_processes", f"must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise where.bad("distributed.process_id", f"must be >= 0, got {self.process_id}")
