"""Cluster launchers that already know the processes of a run: Slurm (``srun``), Open
MPI (``mpirun``) and Kubernetes (an indexed Job). ``distributed.cluster`` names one (or
``auto``); ``jax.distributed.initialize``'s own cluster detection then finds the
coordinator address, the process count and this process's id, so nobody sets them by hand.

nnlite reads the count and the id from the launcher's variables too (``SLURM_NTASKS`` /
``SLURM_PROCID``, ``OMPI_COMM_WORLD_SIZE`` / ``OMPI_COMM_WORLD_RANK``,
``JOB_COMPLETION_INDEX``) for what it decides before JAX starts (which process draws the
plot); the variables JAX needs are checked first, so a missing one is one line naming it,
not a failure inside JAX. ``JAX_COORDINATOR_PORT`` overrides the port JAX derives
(from the job id for Slurm and Open MPI).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from ..errors import ConfigError

# nnlite's name -> (JAX's cluster_detection_method, variables JAX needs, count, id)
# Kubernetes' ClusterEnv has no name in JAX 0.10: it is found by auto-detection (None).
CLUSTERS = {
    "slurm": (
        "slurm",
        ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
        "SLURM_NTASKS",
        "SLURM_PROCID",
    ),
    "mpi": (
        "ompi",
        (
            "OMPI_MCA_orte_hnp_uri",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ),
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
    ),  # fmt: skip
    "k8s": (
        None,
        ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"),
        None,
        "JOB_COMPLETION_INDEX",
    ),
}
LAUNCHED_BY = {"slurm": "srun", "mpi": "Open MPI's mpirun", "k8s": "an indexed Kubernetes Job"}


@dataclass(frozen=True)
class Detected:
    """A cluster's view of this process (``num_processes`` None: known only to JAX)."""

    cluster: str
    jax_method: str | None
    num_processes: int | None
    process_id: int | None


def present(name: str) -> bool:
    """Whether the launcher ``name`` started this process (its variables are set)."""
    return all(v in os.environ for v in CLUSTERS[name][1])


def detect(name: str) -> Detected:
    """``name``'s view of this process; ConfigError naming what is missing."""
    method, needed, count_var, id_var = CLUSTERS[name]
    missing = [v for v in needed if v not in os.environ]
    if missing:
        raise ConfigError(
            f"distributed.cluster={name}, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: run the command under "
            f"{LAUNCHED_BY[name]}, or set distributed.cluster to auto, env or none"
        )
    if name == "k8s" and importlib.util.find_spec("kubernetes") is None:
        raise ConfigError(
            "distributed.cluster=k8s needs the kubernetes package: pip install 'jax[k8s]'"
        )
    count = _int(count_var) if count_var else None
    pid = _int(id_var)
    if count is not None and not 0 <= pid < count:
        raise ConfigError(f"{id_var}={pid} is not in 0..{count - 1} ({count_var}={count})")
    return Detected(name, method, count, pid)


def auto() -> Detected | None:
    """The launcher that started this process with more than one process, or None."""
    for name in CLUSTERS:
        if name != "k8s" and present(name):
            d = detect(name)
            if d.num_processes and d.num_processes > 1:
                return d
    # Kubernetes sets its variables in every pod; only an indexed Job's pods take part
    if present("k8s") and importlib.util.find_spec("kubernetes") is not None:
        return detect("k8s")
    return None


def _int(var: str) -> int:
    raw = os.environ[var]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {var}={raw!r} is not an integer") from None
