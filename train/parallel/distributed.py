"""Several processes, one run: ``jax.distributed`` setup and the helpers the loop needs.

Every process runs the same loop on the same config. Process 0 hosts the coordinator,
owns the run directory and does all the printing; the others compute and stay silent.
Nothing here touches a device before ``jax.distributed.initialize`` has run.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import clusters
from .section import DistributedConfig

# The environment variables read for unset fields of the ``distributed`` section. JAX
# itself reads only JAX_COORDINATOR_ADDRESS; the other two are ours, named to match.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclass(frozen=True)
class Settings:
    coordinator_address: str | None  # None: the cluster's (jax.distributed finds it)
    num_processes: int | None  # None: known to JAX only (Kubernetes)
    process_id: int | None
    initialization_timeout: int
    heartbeat_timeout: int
    cluster: str = "env"  # distributed.cluster as resolved (train/clusters.py)
    jax_method: str | None = None  # jax.distributed's cluster_detection_method


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve(dc: DistributedConfig) -> Settings | None:
    """The multi-process settings from the config, then the environment, or from a cluster
    launcher (``distributed.cluster``, train/clusters.py); None: one process."""
    if dc.cluster == "none":
        return None
    address = dc.coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num = dc.num_processes if dc.num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = dc.process_id if dc.process_id is not None else _env_int(ENV_PROCESS_ID)
    explicit = address is not None or num is not None or pid is not None
    found = None
    if dc.cluster in clusters.CLUSTERS:
        found = clusters.detect(dc.cluster)
    elif dc.cluster == "auto" and not explicit:
        found = clusters.auto()
    if found is not None:
        return Settings(
            dc.coordinator_address,  # the config may still name it; else JAX derives it
            found.num_processes,
            found.process_id,
            dc.initialization_timeout,
            dc.heartbeat_timeout,
            found.cluster,
            found.jax_method,
        )
    if address is None:
        if num not in (None, 1) or pid not in (None, 0):
            raise ConfigError(
                f"distributed: num_processes={num}, process_id={pid} but no coordinator address; "
                f"set distributed.coordinator_address or {ENV_COORDINATOR} (host:port of process 0)"
            )
        return None
    if num is None or pid is None:
        missing = [
            f"distributed.{k} (or {env})"
            for k, v, env in (
                ("num_processes", num, ENV_NUM_PROCESSES),
                ("process_id", pid, ENV_PROCESS_ID),
            )
            if v is None
        ]
        raise ConfigError(
            f"distributed: coordinator address {address!r} is set, so {' and '.join(missing)} "
            "must be set too"
        )
    if not 0 <= pid < num:
        raise ConfigError(
            f"distributed: process_id must be in 0..{num - 1} for num_processes={num}, got {pid}"
        )
    if address.rpartition(":")[2].isdigit() is False:
        raise ConfigError(f"distributed: coordinator address {address!r} must be host:port")
    return Settings(address, num, pid, dc.initialization_timeout, dc.heartbeat_timeout)


def initialize(dc: DistributedConfig) -> Settings | None:
    """Join the multi-process run described by ``dc`` (idempotent); None for one process."""
    import jax  # here, not at the top: resolve() serves the CLI before it loads JAX

    settings = resolve(dc)
    if settings is None or jax.distributed.is_initialized():
        return settings
    # Cross-process collectives on CPU; GPUs and TPUs ignore this option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # SIGTERM -> the preemption sync point all processes agree on (see faults.py).
    jax.config.update("jax_enable_preemption_service", True)
    if settings.cluster != "env":  # the launcher's variables, read by JAX
        _interruptible(
            jax.distributed.initialize,
            coordinator_address=settings.coordinator_address,
            cluster_detection_method=settings.jax_method,
            initialization_timeout=settings.initialization_timeout,
            heartbeat_timeout_seconds=settings.heartbeat_timeout,
        )
        return settings
    _interruptible(
        jax.distributed.initialize,
        coordinator_address=settings.coordinator_address,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        initialization_timeout=settings.initialization_timeout,
        heartbeat_timeout_seconds=settings.heartbeat_timeout,
    )
    return settings


def _interruptible(fn, **kwargs) -> None:
    """``fn(**kwargs)`` on a helper thread while the main thread waits in short joins.

    ``jax.distributed.initialize`` blocks in C++ until every process has joined (up to
    ``initialization_timeout``), and Python runs a signal handler only when the main thread
    is back in the interpreter: a SIGTERM sent during start-up (the launcher forwards its
    own) went unanswered there while the other processes had already stopped, and the
    launcher waited its 20 s grace for this one. Waiting here, the handler runs within
    0.1 s and the run stops with exit 3 and its line (the helper thread is a daemon: the
    exit does not wait for it)."""
    if threading.current_thread() is not threading.main_thread():
        fn(**kwargs)
        return
    failed: list[BaseException] = []

    def target():
        try:
            fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread
            failed.append(e)

    helper = threading.Thread(target=target, name="nnlite-distributed-init", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
    if failed:
        raise failed[0]


def is_multiprocess() -> bool:
    import jax

    return jax.process_count() > 1


def is_main() -> bool:
    """Process 0 owns the run directory, the checkpoints and the console."""
    import jax

    return jax.process_index() == 0


def global_devices(per_process: int) -> list:
    """The first ``per_process`` devices of every process, ordered by (process, id).

    The order fixes which slice of the global batch each device gets: process p's devices
    take the p-th block, so 2 processes x 2 devices split a batch like 1 process x 4.
    """
    import jax

    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    return [
        d
        for p in sorted(by_process)
        for d in sorted(by_process[p], key=lambda d: d.id)[:per_process]
    ]


def process_share(idx: np.ndarray) -> np.ndarray:
    """This process's columns of a ``[K, global_batch]`` index block."""
    import jax

    n, p = jax.process_count(), jax.process_index()
    b = idx.shape[1] // n
    return idx[:, p * b : (p + 1) * b]


def broadcast(tree):
    """Process 0's value of ``tree`` (numpy leaves) on every process; identity for one."""
    if not is_multiprocess():
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


# A checkpoint's barriers wait for the slowest process to write its shards: bounded, and
# long enough for a large model's shards on a slow disk.
BARRIER_TIMEOUT_S = 600.0
_barriers = 0  # every process passes the same barriers in the same order: a shared count


class BarrierTimeout(RuntimeError):
    """A barrier that not every process reached in time (a dead or stuck peer)."""


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Return once every process has called ``barrier(name)``; raise
    :class:`BarrierTimeout` after ``timeout_s`` seconds (a no-op for one process).

    Waits in the coordination service (``jax.distributed``), not in a device collective,
    so the wait has a time limit whatever the devices are doing.
    """
    global _barriers
    if not is_multiprocess():
        return
    # JAX has no public barrier with a time limit (multihost_utils.sync_global_devices is
    # a device collective without one); the coordination client's is the one orbax uses.
    from jax._src.distributed import global_state

    _barriers += 1
    key = f"nnlite/{_barriers}/{name}"
    try:
        global_state.client.wait_at_barrier(key, int(timeout_s * 1000))
    except Exception as e:  # the client raises JaxRuntimeError (DEADLINE_EXCEEDED, ...)
        raise BarrierTimeout(
            f"barrier {name!r}: not every process arrived within {timeout_s:g} s "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); a peer died or is "
            "stuck; the last complete checkpoint is intact, rerun every process to resume"
        ) from None
