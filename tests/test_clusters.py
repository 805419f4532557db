"""``distributed.cluster``: Slurm, Open MPI and Kubernetes launchers through
``jax.distributed.initialize``'s own cluster detection (train/clusters.py).

The Open MPI test needs ``mpirun`` (Debian/Ubuntu: ``apt-get install -y openmpi-bin``);
without it, it is skipped saying so. Slurm is simulated: its variables on loopback.
"""

import os
import shutil
import subprocess
import sys

import pytest
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32
from test_distributed import (
    COMMON,
    CONFIG,
    ROOT,
    env_with_devices,
    final_params,
    first_step_grads_saved,
    in_process,
    max_diff,
)
from test_faults import streamed_copy

from train.config import DistributedConfig
from train.errors import ConfigError
from train.parallel.distributed import resolve
from train.parallel.launch import free_port

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "127.0.0.1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}
CLUSTER_VARS = [*SLURM, "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_LOCAL_RANK", "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX",
                "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"]  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for v in CLUSTER_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_auto_finds_slurm_and_mpi_and_none_ignores_them(clean_env):
    assert resolve(DistributedConfig()) is None  # no launcher: one process
    for k, v in SLURM.items():
        clean_env.setenv(k, v)
    s = resolve(DistributedConfig())
    assert (s.cluster, s.jax_method, s.num_processes, s.process_id) == ("slurm", "slurm", 2, 1)
    assert s.coordinator_address is None  # JAX derives it from the node list and job id
    assert resolve(DistributedConfig(cluster="none")) is None
    assert resolve(DistributedConfig(cluster="slurm")).cluster == "slurm"
    clean_env.setenv("SLURM_NTASKS", "1")  # one task of an allocation: one process
    clean_env.setenv("SLURM_PROCID", "0")
    assert resolve(DistributedConfig()) is None
    for k in SLURM:
        clean_env.delenv(k)
    ompi = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911",
            "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_RANK": "3"}  # fmt: skip
    for k, v in ompi.items():
        clean_env.setenv(k, v)
    s = resolve(DistributedConfig())
    assert (s.cluster, s.jax_method, s.num_processes, s.process_id) == ("mpi", "ompi", 4, 3)
    # an explicit coordinator (nnlite's own variables) wins over auto-detection
    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    clean_env.setenv("JAX_NUM_PROCESSES", "2")
    clean_env.setenv("JAX_PROCESS_ID", "0")
    assert resolve(DistributedConfig()).cluster == "env"
    assert resolve(DistributedConfig(cluster="env")).num_processes == 2


def test_a_named_cluster_without_its_variables_says_what_is_missing(clean_env):
    with pytest.raises(ConfigError, match=r"distributed.cluster=slurm, but SLURM_JOB_ID, .*SLURM_LOCALID are not set: run the command under srun"):  # fmt: skip
        resolve(DistributedConfig(cluster="slurm"))
    with pytest.raises(ConfigError, match=r"cluster=mpi, but .* under Open MPI's mpirun"):
        resolve(DistributedConfig(cluster="mpi"))
    with pytest.raises(ConfigError, match=r"cluster=k8s, but KUBERNETES_SERVICE_HOST, JOB_COMPLETION_INDEX are not set"):  # fmt: skip
        resolve(DistributedConfig(cluster="k8s"))
    for k, v in {**SLURM, "SLURM_PROCID": "x"}.items():
        clean_env.setenv(k, v)
    with pytest.raises(ConfigError, match=r"SLURM_PROCID='x' is not an integer"):
        resolve(DistributedConfig(cluster="slurm"))


# 2 processes x 2 devices: a mesh of several devices in each process (the launcher's
# shard_map row of test_distributed was this; its pmap row is the SIGTERM test's)
STEPS = ["train.steps=10", "train.log_every=5", "train.eval_every=10", "checkpoint.every=1",
         "checkpoint.keep=10", "parallel.strategy=shard_map", "parallel.devices=2"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory, npz) -> list[str]:
    """The npz fixture's data streamed from .npy files (data.placement=host): each process
    reads only its share of every batch (once test_streamed's own two-process run)."""
    return streamed_copy(npz, tmp_path_factory.mktemp("streamed") / "arrays")


def _args(tmp_path, data, name):
    args = ["-m", "train", "--config", CONFIG]
    for o in (*COMMON, f"log.dir={tmp_path}", *data, *STEPS, f"name={name}"):
        args += ["--set", o]
    return args


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data):
    """The same run in one process with 4 devices: both launchers' reference."""
    return in_process(tmp_path_factory.mktemp("ref"), *data, *STEPS[:-1], "parallel.devices=4")


def _same_as_one_process(tmp_path, ref, name):
    grads = first_step_grads_saved(tmp_path / name)
    assert_close_f32(grads, first_step_grads_saved(ref.run_dir), ops=ROUNDINGS_PER_LAYER * 4)
    assert max_diff(final_params(tmp_path / name), ref.params) <= ref.cfg.optimizer.learning_rate


def test_slurm_simulated_on_loopback_equals_one_process(tmp_path, data, one_process):
    env = env_with_devices(2)
    env.update(SLURM, JAX_COORDINATOR_PORT=str(free_port()))
    procs = []
    for rank in (0, 1):
        e = dict(env, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
        procs.append(subprocess.Popen([sys.executable, *_args(tmp_path, data, "slurm")], cwd=ROOT,
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "devices: 2 processes x 2 x cpu" in outs[0][0] and "nnlite train:" not in outs[1][0]
    _same_as_one_process(tmp_path, one_process, "slurm")


@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="Open MPI's mpirun is not installed (Debian/Ubuntu: apt-get install -y openmpi-bin)",
)
def test_mpirun_two_processes_equal_one_process(tmp_path, data, one_process):
    env = env_with_devices(2)
    cmd = ["mpirun", "-n", "2", "--oversubscribe"]
    cmd += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd += [sys.executable, *_args(tmp_path, data, "mpi")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("nnlite train:") == 1  # only process 0 prints
    assert "devices: 2 processes x 2 x cpu" in proc.stdout
    _same_as_one_process(tmp_path, one_process, "mpi")
