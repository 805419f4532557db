"""Several processes as one run (jax.distributed on loopback, CPU devices, gloo).

Every test starts real processes: ``python -m train --processes 2`` through the launcher,
or two ``python -m train`` processes wired by environment variables.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _inject
import jax
import numpy as np
import safetensors.numpy
from _common import NPZ_MLP
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32
from _xla import xla_flags

from train.checkpoint.store import flatten_with_paths
from train.config import load_config
from train.loop.trainer import train
from train.parallel.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/digits_mlp.yaml"
# Small and quick to start: an 8-16-4 MLP on a generated npz (no scikit-learn import).
COMMON = [
    *NPZ_MLP,
    "train.batch_size=64",
    "log.progress=false",
    "log.plot=false",
    "checkpoint.keep=2",
]
# The JAX tutorial's linear regression: the quickest run, for tests that kill it anyway.
LINREG = ["model={name: linreg}", "data.name=linreg", "optimizer.name=sgd"]


def env_with_devices(n: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    # Every test starts fresh processes that compile the same steps: share JAX's cache.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/nnlite-test-jax-cache")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env["XLA_FLAGS"] = xla_flags(n)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    return env


def cli(tmp_path, *overrides, module: str = "train") -> list[str]:
    """``python -m train`` (``module="_inject"``: with the faults of tests/_inject.py that
    its environment names) with these overrides."""
    args = [sys.executable, "-m", module, "--config", CONFIG]
    for o in (*COMMON, f"log.dir={tmp_path}", *overrides):
        args += ["--set", o]
    return args


def in_process(tmp_path, *overrides):
    cfg = load_config(ROOT / CONFIG, [*COMMON, f"log.dir={tmp_path}", *overrides])
    return train(cfg, resume="fresh", echo=lambda *_: None)


def final_params(run_dir: Path) -> dict:
    last = sorted((run_dir / "checkpoints").glob("ckpt_*.safetensors"))[-1]
    tensors = safetensors.numpy.load_file(str(last))
    return {k: v for k, v in tensors.items() if k.startswith("params")}


def max_diff(saved: dict, params) -> float:
    ref = {k: np.asarray(v) for k, v in flatten_with_paths("params", params).items()}
    assert sorted(saved) == sorted(ref)
    return max(float(np.max(np.abs(saved[k] - ref[k]))) for k in ref)


def first_step_grads_saved(run_dir: Path) -> dict:
    """The first step's gradient from a run's step-1 checkpoint: ``{path: grad}``, Adam's
    first moment over ``1 - b1`` (see tests/_tolerance.py, ``first_step_grads``)."""
    tensors = safetensors.numpy.load_file(
        str(run_dir / "checkpoints" / "ckpt_00000001.safetensors")
    )
    mu = {
        k.split("/mu/", 1)[1]: v
        for k, v in tensors.items()
        if k.startswith("opt_state") and "/mu/" in k
    }
    assert mu, sorted(tensors)
    return {k: np.asarray(v, np.float64) / (1 - 0.9) for k, v in mu.items()}


def wait_until(ready, proc, what: str, timeout=60.0) -> None:
    """Until ``ready()`` (bounded by ``timeout``), while ``proc`` runs."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ready():
            return
        assert proc.poll() is None, f"the run ended before {what}"
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def wait_for_progress(metrics: Path, proc, timeout=60.0, lines=1) -> None:
    def ready():
        return metrics.exists() and len(metrics.read_text().splitlines()) >= lines

    wait_until(ready, proc, "it made progress (metrics.jsonl)", timeout)


def children(pid: int) -> dict[int, int]:
    """{JAX_PROCESS_ID: pid} of the launcher's child processes."""
    found = {}
    for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        env = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
        for item in env:
            if item.startswith(b"JAX_PROCESS_ID="):
                found[int(item.split(b"=")[1])] = int(c)
    return found


# Two processes x 2 devices equal one process with 4: pmap through the launcher is the
# SIGTERM test's resumed run (below); shard_map's is test_clusters' (the same two
# processes wired by Slurm's and Open MPI's variables instead of the launcher's, which
# sets nnlite's own; the launcher starts every strategy alike).


def assert_two_processes_match_four_devices(stdout, run_dir, tmp_path, steps, par):
    """A 2 processes x 2 devices run (its ``stdout``, and ``run_dir`` with its step-1
    checkpoint) against one process with 4 devices."""
    assert "devices: 2 processes x 2 x cpu" in stdout
    # Only process 0 prints the run's lines.
    assert stdout.count("nnlite train:") == 1 and stdout.count("done:") == 1
    one = [*(o for o in par if o != "parallel.devices=2"), "parallel.devices=4"]
    ref = in_process(tmp_path, *steps, *one, "name=ref")
    init = ref.model.init(jax.random.key(0))
    assert max_diff(final_params(run_dir), init) > 1e-3  # it trained
    # Across processes the batch's gradient is summed in another order: one step's to
    # rounding (8 per layer: linear, relu, linear, loss), N steps within one lr.
    if (ref.run_dir / "checkpoints" / "ckpt_00000001.safetensors").exists():
        first = ref.run_dir
    else:  # the same program's 1-step run (a constant learning rate)
        first = in_process(tmp_path, *steps, *one, "train.steps=1", "name=ref1").run_dir
    grads = first_step_grads_saved(run_dir)
    assert_close_f32(grads, first_step_grads_saved(first), ops=ROUNDINGS_PER_LAYER * 4)
    assert max_diff(final_params(run_dir), ref.params) <= ref.cfg.optimizer.learning_rate


def test_a_dead_peer_makes_the_other_exit_with_a_documented_line_not_a_cpp_abort(tmp_path):
    # (once two tests: a killed peer under JAX's default 100 s heartbeat with an explicit
    # train.step_timeout, and this one; the explicit limit's multi-process line is
    # test_a_stuck_collective_ends_every_process_and_the_launcher's)
    env = env_with_devices(2)
    address = f"127.0.0.1:{free_port()}"
    args = cli(
        tmp_path,
        *LINREG,
        "train.steps=1000000",
        "train.log_every=10",
        "parallel.strategy=shard_map",
        "distributed.heartbeat_timeout=5",
        "distributed.initialization_timeout=30",
    )
    procs = []
    for i in range(2):
        penv = dict(
            env, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)
        )
        err = subprocess.PIPE if i == 0 else subprocess.DEVNULL
        procs.append(
            subprocess.Popen(args, cwd=ROOT, env=penv, stdout=subprocess.DEVNULL, stderr=err)
        )
    try:
        wait_for_progress(tmp_path / "run" / "metrics.jsonl", procs[0])
        procs[1].kill()
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=30)  # heartbeat_timeout + margin
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    err = err.decode()
    # The survivor's first error line is a documented one, with its exit status (a C++
    # abort would leave none): either a collective fails at once (our message, exit 1) or
    # it hangs and the watchdog, whose automatic limit is capped below the heartbeat
    # timeout, ends it (exit 5).
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines, err[-2000:]
    assert (procs[0].returncode, lines[0][:40]) in [
        (1, "error: this process (multi-process run) "),
        (5, "error: no compiled call finished within "),
    ], err[-2000:]
    # (the watchdog's limit: half the heartbeat timeout, so it fires well before JAX's own
    # heartbeat abort even when the machine is busy)
    assert (
        "error: this process (multi-process run) failed, most likely because another" in err
        or "error: no compiled call finished within 2.5 s (train.step_timeout)" in err
    ), err[-2000:]
    assert took < 5 + 10


def signal_process_1(tmp_path, args, sig, env=None) -> tuple[subprocess.Popen, str, dict]:
    """Start the launcher with ``args`` (in ``env``, default: two devices), wait for
    training progress, send ``sig`` to its process 1 only, and wait for the launcher:
    ``(launcher, stderr, children)``."""
    launcher = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env or env_with_devices(2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_progress(tmp_path / "run" / "metrics.jsonl", launcher)
        kids = children(launcher.pid)
        os.kill(kids[1], sig)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.communicate()
    return launcher, err, kids


def test_launcher_stops_everything_when_one_process_dies(tmp_path):
    overrides = [*LINREG, "train.steps=1000000", "train.log_every=10", "parallel.strategy=pmap"]
    args = [*cli(tmp_path, *overrides), "--processes", "2"]
    launcher, err, kids = signal_process_1(tmp_path, args, signal.SIGKILL)
    assert launcher.returncode not in (0, None)
    assert "error: process 1 of 2 was killed by SIGKILL; stopped the other processes" in err
    assert not any(Path(f"/proc/{pid}").exists() for pid in kids.values())


def test_sigterm_to_one_process_stops_all_at_the_same_step_and_resumes(tmp_path, npz):
    # 120 steps. The first run writes a checkpoint after every step (the first shows the
    # first step's gradient), each paused 2 x 0.05 s (tests/_inject.py): the signal, sent at
    # step 10, lands seconds before the run could end, however loaded the machine.
    steps = [npz, "train.steps=120", "train.log_every=10", "train.eval_every=120"]
    steps += ["checkpoint.keep=1000", "optimizer.schedule=constant"]
    # pmap: a long multi-process pmap run once deadlocked (after ~100 steps) without a
    # wait per call, hence a resumed run of ~110 steps without a checkpoint per step. Each
    # step is a blocking cross-process round trip: with the two start-ups, what this test
    # waits on (~190 steps took ~40% of its wall time; test_calls_in_flight pins the
    # wait per call of several processes, benchmarks/stress_multidevice.py the long runs).
    par = ["parallel.strategy=pmap", "parallel.devices=2"]
    args = [
        *cli(tmp_path, *steps, *par, "checkpoint.every=1", module="_inject"),
        "--processes",
        "2",
    ]
    # Process 1 only: JAX's preemption service tells process 0.
    paused = _inject.env(env_with_devices(2), pause=0.05)
    launcher, err, _ = signal_process_1(tmp_path, args, signal.SIGTERM, paused)
    # Both processes saved at the agreed step and exited 3; a disagreement would have hung
    # one of them in a collective and made the launcher kill it.
    assert launcher.returncode == 3, err
    assert "preempted by SIGTERM at step" in err and "resume with: nnlite-train" in err
    saved = sorted((tmp_path / "run" / "checkpoints").glob("ckpt_*.safetensors"))
    assert saved and int(saved[-1].name[5:13]) < 120
    args = [*cli(tmp_path, *steps, *par, "checkpoint.every=100"), "--processes", "2"]
    resumed = subprocess.run(
        args, cwd=ROOT, env=env_with_devices(2), capture_output=True, text=True, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming at step" in resumed.stdout
    # ... and the run equals one process with 4 devices: the first step's gradient to
    # rounding, the params after 120 Adam steps within one learning rate
    # (tests/_tolerance.py); a resume at the wrong step or data position moves params by
    # ~lr per step
    assert_two_processes_match_four_devices(resumed.stdout, tmp_path / "run", tmp_path, steps, par)


# -- the watchdog and the launcher's own lines (issue 14) -----------------------------------
def test_a_stuck_collective_ends_every_process_and_the_launcher(tmp_path):
    from train import faults

    overrides = [*LINREG, "train.steps=1000000", "train.log_every=10", "train.step_timeout=3"]
    overrides += ["parallel.strategy=shard_map", "log.progress=true"]
    args = [*cli(tmp_path, *overrides, module="_inject"), "--processes", "2"]
    env = _inject.env(env_with_devices(2), stuck="25:1")  # process 1 sticks at step 25
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == faults.EXIT_STUCK, proc.stderr[-3000:]
    # process 0's own line: its collective at step 25 never completes
    assert (
        "\nerror: no compiled call finished within 3 s (train.step_timeout) at step 2"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "most likely a collective is stuck because another process died" in proc.stderr
    assert "Traceback" not in proc.stderr and took < 90


def launcher_with_progress(tmp_path, *overrides):
    args = [*cli(tmp_path, *LINREG, "train.log_every=10", *overrides), "--processes", "2"]
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env_with_devices(2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_while_waiting_for_the_coordinator_exits_3_with_a_line(tmp_path):
    # jax.distributed.initialize blocks in C++ until its coordinator answers: a SIGTERM
    # there must still stop the process at once (it went unanswered until the timeout).
    import socket

    coordinator = socket.socket()  # listens, never answers: the process waits in connect
    coordinator.bind(("127.0.0.1", 0))
    coordinator.listen()
    env = env_with_devices(1)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{coordinator.getsockname()[1]}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="1",
    )
    args = [sys.executable, "-m", "train", "--config", "configs/digits_mlp.yaml"]
    args += ["--set", f"log.dir={tmp_path}", "--set", "log.plot=false"]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        coordinator.settimeout(1)
        for _ in range(120):  # until the process is inside initialize (or has failed)
            try:
                conn, _ = coordinator.accept()
                break
            except TimeoutError:
                assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        conn.close()
    finally:
        coordinator.close()
        proc.kill()
        proc.communicate()
    assert proc.returncode == 3, err[-2000:]
    assert "stopped by SIGTERM outside the training loop" in err and "Traceback" not in err


def test_a_sigterm_while_the_launcher_starts_a_process_reaches_that_process(tmp_path):
    # The launcher's handler runs once Popen returns, before the new process is recorded:
    # that process must get the SIGTERM too, not wait for a stopped coordinator until the
    # launcher's grace ends and it is killed. (A launcher of its own: this process has
    # JAX's threads, which a fork here would warn about.)
    overrides = [*COMMON, f"log.dir={tmp_path}", *LINREG]
    code = f"""
import os, signal, subprocess
from train.config import load_config
from train.parallel import launch as launcher
real, started = subprocess.Popen, []
def popen(*args, **kwargs):
    p = real(*args, **kwargs)
    started.append(p)
    if len(started) == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # handled before this returns p
    return p
launcher.subprocess.Popen = popen
overrides = {overrides!r}
argv = ["--config", {CONFIG!r}, *(a for o in overrides for a in ("--set", o))]
status = launcher.launch(load_config({CONFIG!r}, overrides), argv, 2, echo=lambda *a, **k: None)
print(status, *(p.returncode for p in started))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env_with_devices(1),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert out[0] == "3", out
    # each stopped of the SIGTERM: its line (3) or, still starting, its default action
    assert all(int(c) in (3, -signal.SIGTERM) for c in out[1:]) and len(out) == 3, out


def test_launcher_second_ctrl_c_names_itself_not_its_sigkill(tmp_path):
    # the first SIGINT is forwarded as SIGTERM, which a child waits out here: JAX's
    # preemption sync point comes only with the next call, and the step is stuck

    launcher = subprocess.Popen(
        [
            *cli(
                tmp_path,
                *LINREG,
                "train.steps=1000000",
                "train.log_every=10",
                "parallel.strategy=shard_map",
                "train.step_timeout=60",
                module="_inject",
            ),
            "--processes",
            "2",
        ],
        cwd=ROOT,
        env=_inject.env(env_with_devices(2), stuck="25:1", stuck_mark=tmp_path / "stuck"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_progress(tmp_path / "run" / "metrics.jsonl", launcher, lines=2)
        # only once the step is stuck: a SIGTERM that came before it would be honoured at
        # the next step's sync point (a clean exit 3 before the second Ctrl-C)
        wait_until((tmp_path / "stuck").exists, launcher, "process 1 was stuck")
        launcher.send_signal(signal.SIGINT)
        time.sleep(1.0)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
        launcher.communicate()
    assert launcher.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "stopped by a second SIGINT: killed all 2 processes" in err
    assert "was killed by SIGKILL" not in err


def test_launcher_sigterm_during_start_up_exits_3_with_a_line(tmp_path):
    launcher = launcher_with_progress(tmp_path, "train.steps=1000000")
    try:
        for _ in range(200):  # as soon as the launcher has said where it launches
            time.sleep(0.05)
            if Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
                break
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.communicate()
    assert launcher.returncode == 3, err[-2000:]
    assert (
        "stopped by SIGTERM outside the training loop" in err
        or "stopped by SIGTERM during start-up" in err
        or "preempted by SIGTERM at step" in err
    ), err[-2000:]
    assert "Traceback" not in err
