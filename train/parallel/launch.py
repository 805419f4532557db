"""``nnlite-train --config X --processes N``: N local processes on loopback, as one run.

For testing multi-host code paths on one machine, and for users who want several CPU
processes. Each child is this trainer's package run with the same arguments (``python -m
nnlite.train``; ``train`` when the launcher itself runs as a checkout's ``python -m train``;
never a user's own ``train.py``), CPU devices and gloo collectives, and the environment that ``train.parallel.distributed`` reads (JAX_COORDINATOR_ADDRESS,
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

from ..faults import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STUCK,
)
from . import distributed as dist

# Statuses that every process reaches together (they agree through collectives, or each
# one's watchdog fires on the same stuck call): wait for the others to reach them too
# instead of killing them.
_AGREED = (EXIT_OK, EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_NONFINITE, EXIT_STUCK)
_GRACE_S = 20.0  # how long the others may take to follow a process that exited that way
# How long a failure waits for its peers before naming the cause: a SIGKILLed process can
# be reaped after its peers have failed because of it (seconds on a busy machine).
_REAP_S = 10.0


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


#: The package the children run (``python -m``): the one this launcher belongs to.
TRAINER = __name__.rsplit(".parallel.", 1)[0]


def launch(cfg, argv: list[str], processes: int, echo=print) -> int:
    """Run ``nnlite-train argv`` as ``processes`` local processes; return the exit status."""
    signalled: list[int] = []  # signals received, in order
    procs: list[subprocess.Popen] = []
    forwarded: set[int] = set()  # pids the first signal was forwarded to

    def forward(signum, _frame):
        signalled.append(signum)
        if len(signalled) > 1:  # a second signal: stop everything now
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # each process saves at the agreed step
                forwarded.add(p.pid)

    # First of all, so that a signal during start-up is forwarded and reported too.
    saved = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
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
    logs = []
    # A progress bar may have left process 0's last line open: start ours on a new one.
    fresh_line = "\n" if cfg.log.progress else ""
    try:
        for i in range(processes):
            if signalled:  # stopped during start-up: start no more
                break
            child_env = {**env, dist.ENV_PROCESS_ID: str(i)}
            out = None
            if i > 0:
                out = open(log_dir / f"process{i}.log", "wb")  # noqa: SIM115 - closed below
                logs.append(out)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", TRAINER, *argv],
                    env=child_env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    # Own session: a Ctrl-C reaches only the launcher, which forwards it once.
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            )
        if signalled:
            # The signal may have come while a process was being started (its handler runs
            # once Popen returns, before the process is in ``procs``): that one, started
            # anyway, would wait for a coordinator that has stopped, until the grace ends.
            for p in procs:
                if p.pid not in forwarded and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        status = _supervise(procs, processes, log_dir, echo, signalled, fresh_line)
        if status == EXIT_OK:
            _remove(log_dir)
        return status
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _remove(log_dir: Path) -> None:
    for f in log_dir.iterdir():
        f.unlink()
    log_dir.rmdir()


def _wait(procs, signalled) -> tuple[list[int], tuple[int, int, float] | None] | None:
    """Wait until every process has exited, stopping the others when one fails (or when
    they do not follow one that stopped with an agreed status within ``_GRACE_S``): their
    statuses and the first exit seen ``(process, status, time)``, None if none was seen
    before all had exited. None: a second signal came (``forward`` killed them all)."""
    first_exit: tuple[int, int, float] | None = None
    while True:
        # Checked before the exit codes: the processes forward() SIGKILLed may already be gone.
        if len(signalled) > 1:
            return None
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes, first_exit
        if first_exit is None:
            exited = [(i, c) for i, c in enumerate(codes) if c is not None]
            # Several at once: the one killed by a signal is the cause, the rest followed.
            exited.sort(key=lambda ic: (ic[1] >= 0, ic[0]))
            if exited:
                first_exit = (*exited[0], time.monotonic())
        if first_exit is not None:
            _, c, t = first_exit
            # After a forwarded SIGTERM, a process still starting up may die of it.
            agreed = (*_AGREED, -signal.SIGTERM) if signalled else _AGREED
            if c not in agreed or time.monotonic() - t > _GRACE_S:
                return _stop_all(procs, first_exit)
        time.sleep(0.05)


def _stop_all(procs, first_exit: tuple[int, int, float]) -> tuple[list[int], tuple]:
    """Stop the processes after ``first_exit``: their statuses, and the cause (a process
    seen killed by a signal, if one was, else ``first_exit``)."""
    _, c, t = first_exit
    # A killed process can take a while to be reaped after its peers have already failed
    # because of it (_REAP_S): look again before naming the cause, until one is seen
    # killed or all have exited.
    deadline = time.monotonic() + _REAP_S
    while time.monotonic() < deadline:
        polled = [p.poll() for p in procs]
        if any((c or 0) < 0 for c in polled) or None not in polled:
            break
        time.sleep(0.05)
    killed = [(j, p.poll()) for j, p in enumerate(procs) if (p.poll() or 0) < 0]
    if killed and c >= 0:
        first_exit = (*killed[0], t)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    return [p.returncode for p in procs], first_exit


def _supervise(procs, processes: int, log_dir: Path, echo, signalled, fresh_line="") -> int:
    """Wait for the processes; stop the others when one fails; return the run's status."""

    def second_signal() -> int:  # forward() killed them all: that, not their deaths, is news
        for p in procs:
            p.wait()
        name = signal.Signals(signalled[-1]).name
        echo(
            f"{fresh_line}stopped by a second {name}: killed all {processes} processes "
            "without a checkpoint; the last one written is intact",
            file=sys.stderr,
        )
        return 128 + signalled[-1]

    waited = _wait(procs, signalled)
    if waited is None:  # a second signal
        return second_signal()
    codes, first_exit = waited
    # All exited between polls: a process killed by a signal is the cause, the rest followed
    # (its peers may have been seen failing first, while it was not yet reaped).
    killed = [(j, c) for j, c in enumerate(codes) if c is not None and c < 0]
    # ... except an abort after process 0 stopped with a documented status: JAX's client
    # aborts a process whose coordinator (process 0) has gone, so that death followed
    said_first = first_exit is not None and first_exit[0] == 0 and first_exit[1] in _AGREED
    if said_first and all(c == -signal.SIGABRT for _, c in killed):
        killed = []
    if first_exit is not None and first_exit[1] >= 0 and killed:
        first_exit = (*killed[0], first_exit[2])
    if len(signalled) > 1:  # it came while the processes were being stopped or reaped
        return second_signal()

    # Stopped early: some never started, or the forwarded SIGTERM reached a process before
    # Python could install a handler (it died of it) and the rest stopped with status 3.
    # A process that died of the forwarded SIGTERM had no handler yet, so it was starting
    # up; its peers may then fail on the lost peer (status 1) rather than stop with 3.
    early = signalled and (
        -signal.SIGTERM in codes
        or (len(procs) < processes and all(c in (EXIT_PREEMPTED, -signal.SIGTERM) for c in codes))
    )
    if early:
        name = signal.Signals(signalled[0]).name
        echo(
            f"{fresh_line}stopped by {name} during start-up ({len(procs)} of {processes} "
            "processes started); checkpoints on disk are intact; rerun to resume",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    if all(c == codes[0] for c in codes) and codes[0] in _AGREED:
        return codes[0]
    if first_exit is None:  # all exited between two polls
        # a killed one is the cause, unless process 0 stopped with a documented status
        # (its own line said why)
        said = codes[0] in _AGREED and codes[0] != EXIT_OK
        if killed and not said:
            i = killed[0][0]
        else:
            i = next(j for j, c in enumerate(codes) if c != EXIT_OK)
        first_exit = (i, codes[i], 0.0)
    i, c, _ = first_exit
    if i == 0 and c in _AGREED:  # process 0's own line said what happened: it stays last
        return c
    where = "see the output above" if i == 0 else f"its output: {log_dir / f'process{i}.log'}"
    echo(
        f"{fresh_line}error: process {i} of {len(procs)} {_describe(c)}; stopped the other "
        f"processes ({where})",
        file=sys.stderr,
    )
    last = _last_line(log_dir / f"process{i}.log") if i > 0 else None
    if last:  # the cause, in the child's words, is the last line
        echo(f"process {i}: {last}", file=sys.stderr)
    return c if c > 0 else EXIT_FAILURE


def _last_line(path: Path) -> str | None:
    """The last non-empty line of a child's log (None: no log, or empty)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    lines = [ln for ln in lines if ln.strip()]
    return lines[-1].strip() if lines else None
