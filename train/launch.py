"""``python -m train --config X --processes N``: N local processes on loopback, as one run.

For testing multi-host code paths on one machine, and for users who want several CPU
processes. Each child is ``python -m train`` with the same arguments, CPU devices and gloo
collectives, and the environment that ``train.distributed`` reads (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID). Process 0's output streams to this terminal; the
others' goes to log files that are named when something fails. If any process fails, the
others are stopped and the launcher exits non-zero with one message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import distributed as dist
from .config import Config
from .faults import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_NONFINITE, EXIT_OK, EXIT_PREEMPTED

# Statuses that every process reaches together (they agree through collectives): wait for
# the others to reach them too instead of killing them.
_AGREED = (EXIT_OK, EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_NONFINITE)
_GRACE_S = 20.0  # how long the others may take to follow a process that exited that way


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGKILL the child if the launcher dies, so no orphan keeps training."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def launch(cfg: Config, argv: list[str], processes: int, echo=print) -> int:
    """Run ``python -m train argv`` as ``processes`` local processes; return the exit status."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if isinstance(cfg.parallel.devices, int) and "device_count" not in env.get("XLA_FLAGS", ""):
        flag = f"--xla_force_host_platform_device_count={cfg.parallel.devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    env[dist.ENV_COORDINATOR] = f"127.0.0.1:{free_port()}"
    env[dist.ENV_NUM_PROCESSES] = str(processes)
    env["PYTHONUNBUFFERED"] = "1"
    log_dir = Path(tempfile.mkdtemp(prefix="nnlite-launch-"))
    echo(
        f"launching {processes} processes on {env[dist.ENV_COORDINATOR]} (logs of processes "
        f"1..{processes - 1}: {log_dir})",
        file=sys.stderr,
    )
    procs, logs = [], []
    for i in range(processes):
        child_env = {**env, dist.ENV_PROCESS_ID: str(i)}
        out = None
        if i > 0:
            out = open(log_dir / f"process{i}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(out)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "train", *argv],
                env=child_env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                # Own session: a Ctrl-C reaches only the launcher, which forwards it once.
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        )

    signalled = []

    def forward(signum, _frame):
        if signalled:  # a second signal: stop everything now
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
        signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # each process saves at the agreed step

    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(procs, log_dir, echo)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _supervise(procs, log_dir: Path, echo) -> int:
    first_exit: tuple[int, int, float] | None = None  # (process, status, time)
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if first_exit is None:
            exited = [(i, c) for i, c in enumerate(codes) if c is not None]
            # Several at once: the one killed by a signal is the cause, the rest followed.
            exited.sort(key=lambda ic: (ic[1] >= 0, ic[0]))
            if exited:
                first_exit = (*exited[0], time.monotonic())
        if first_exit is not None:
            i, c, t = first_exit
            if c not in _AGREED or time.monotonic() - t > _GRACE_S:
                # A killed process can take a moment to be reaped after its peers have
                # already failed because of it: look again before naming the cause.
                time.sleep(1.0)
                killed = [(j, p.poll()) for j, p in enumerate(procs) if (p.poll() or 0) < 0]
                if killed and c >= 0:
                    first_exit = (*killed[0], t)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                codes = [p.returncode for p in procs]
                break
        time.sleep(0.05)

    if all(c == codes[0] for c in codes) and codes[0] in _AGREED:
        if codes[0] == EXIT_OK:
            for f in log_dir.iterdir():
                f.unlink()
            log_dir.rmdir()
        return codes[0]
    if first_exit is None:  # all exited between two polls
        i = next(j for j, c in enumerate(codes) if c != EXIT_OK)
        first_exit = (i, codes[i], 0.0)
    i, c, _ = first_exit
    where = "see the output above" if i == 0 else f"its output: {log_dir / f'process{i}.log'}"
    echo(
        f"error: process {i} of {len(procs)} {_describe(c)}; stopped the other processes ({where})",
        file=sys.stderr,
    )
    return c if c > 0 else EXIT_FAILURE
