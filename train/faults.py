"""Surviving faults: exit statuses, preemption (SIGTERM/SIGINT) and the non-finite guard.

Exit statuses of ``nnlite-train`` (also listed in docs/faults.md):

====  ==================================================================================
0     finished
1     unexpected failure, including a lost peer in a multi-process run, or the user's
      code raising during the run (the newest checkpoint kept)
2     bad input: config, command line, data, or a checkpoint that does not fit; the
      user's code raising before the first step
3     preempted: stopped on SIGTERM/SIGINT after writing a checkpoint; rerun to resume
4     stopped on a non-finite loss/gradient/param (``train.nonfinite: stop``); the last
      good checkpoint is untouched
5     stuck: a compiled call did not finish within ``train.step_timeout`` (a collective
      waiting for a dead or hung peer); the last checkpoint is intact, rerun to resume
====  ==================================================================================
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import Any

# No jax/numpy/optax at import time: ``nnlite-train`` imports this module first and
# installs its start-up signal handlers right after, before the heavy imports.

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 3
EXIT_NONFINITE = 4
EXIT_STUCK = 5


class Preempted(Exception):
    """Training stopped on a signal after saving ``checkpoint`` at ``step``."""

    def __init__(self, step: int, checkpoint, signal_name: str):
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name
        super().__init__(f"{signal_name}: stopped at step {step}, checkpoint {checkpoint}")


class Interrupted(BaseException):
    """SIGTERM/SIGINT outside the training loop (start-up, shutdown): nothing to save.

    A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` on the way
    swallows it."""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(signal_name)


class NonFinite(Exception):
    """A step produced a non-finite loss, gradient or param; the message says which."""


class PreemptionWatch:
    """Turns SIGTERM/SIGINT into "stop after this call, checkpoint, exit 3".

    One process: a Python handler sets a flag that the loop reads after each compiled
    call. Several processes: the processes must stop at the *same* step, so we use JAX's
    preemption sync point: ``jax.distributed.initialize`` installs a SIGTERM notifier that
    tells the coordinator; every process reports its call counter and all of them stop at
    the fastest one's next call. ``reached_preemption_sync_point`` is a local, lock-only
    check, so calling it after every compiled call costs nothing. SIGINT (Ctrl-C) is
    forwarded as SIGTERM to reach the same notifier. A second signal quits at once
    (exit 128 + signal number); the checkpoints on disk are crash-safe.

    Use as a context manager around the loop; the previous handlers come back on exit.
    """

    def __init__(self, multiprocess: bool):
        self.multiprocess = multiprocess
        self.signal_name: str | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self):
        # Several processes: leave SIGTERM to JAX's notifier (a Python handler would replace it).
        sigs = (signal.SIGINT,) if self.multiprocess else (signal.SIGINT, signal.SIGTERM)
        for s in sigs:
            self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved.clear()

    def _handle(self, signum, _frame):
        if self.signal_name is not None:
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, call_index: int) -> bool:
        """True at the call where this (and every other) process must save and stop.

        ``call_index`` counts compiled calls since the loop started: 1, 2, 3, ... on every
        process alike.
        """
        if not self.multiprocess:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(call_index):
            self.signal_name = self.signal_name or "SIGTERM"
            return True
        return False


# -- the watchdog: nothing waits on the device without a bound ---------------------------
STARTUP_TIMEOUT_S = 300.0  # automatic step_timeout: the first call (it may compile)
STEP_TIMEOUT_FLOOR_S = 30.0  # automatic step_timeout: later calls, at least this long
STEP_TIMEOUT_FACTOR = 20.0  # ... or this many times the slowest of the first calls


class Watchdog:
    """Ends the process (exit 5, one line naming the step) when a compiled call does not
    finish within its time limit.

    The loop dispatches calls asynchronously and looks at results only at boundaries, so
    it cannot time a call itself: after each dispatch it hands the call's output to
    :meth:`watch`; a waiter thread blocks on the outputs in order (``block_until_ready``
    releases the GIL) and a monitor thread checks how long the current one has run (from
    its dispatch, or from the previous call's end if it was queued behind it). On a
    timeout the monitor prints the line and leaves with ``os._exit``: the main thread may
    be blocked in the same stuck call, and a normal exit would wait in JAX's shutdown
    barrier for the peer that is gone.

    ``timeout``: seconds for every call; None: automatic (:data:`STARTUP_TIMEOUT_S` for
    the first ``warmup`` calls, then ``max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR x``
    the slowest of them), capped at ``cap`` when given); 0: off.
    """

    def __init__(
        self,
        timeout: float | None,
        *,
        multiprocess: bool = False,
        cap: float | None = None,
        warmup: int = 3,
        fresh_line: bool = False,
        on_timeout=None,
    ):
        self.timeout, self.multiprocess, self.cap, self.warmup = timeout, multiprocess, cap, warmup
        self.on_timeout = on_timeout or _exit_stuck
        self.fresh_line = fresh_line  # a progress bar may have left the line open
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._current: tuple[float, int] | None = (
            None  # (started, first step) of the call waited on
        )
        self._last_done: float = 0.0
        self._done = 0
        self._slowest = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def enabled(self) -> bool:
        return self.timeout != 0

    def limit(self) -> float:
        """The time limit of the call being waited on now."""
        if self.timeout is not None:
            return self.timeout
        with self._lock:
            done, slowest = self._done, self._slowest
        if done < self.warmup:
            auto = STARTUP_TIMEOUT_S
        else:
            auto = max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_FACTOR * slowest)
        return min(auto, self.cap) if self.cap else auto

    def __enter__(self):
        if self.enabled:
            self._last_done = time.monotonic()
            for target in (self._wait, self._monitor):
                t = threading.Thread(target=target, name=f"nnlite-watchdog{target.__name__}")
                t.daemon = True  # never keeps the process alive
                t.start()
                self._threads.append(t)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._queue.put(None)
        # Let the threads end before the interpreter does: a daemon thread still inside a
        # C++ wait (jax.block_until_ready) while Python finalizes is unwound by force and
        # the process aborts ("FATAL: exception not rethrown", status -6, seen once at the
        # end of a resumed run). Bounded: a call stuck for good leaves its thread behind.
        for t in self._threads:
            t.join(EXIT_JOIN_S)

    def watch(self, step: int, output) -> None:
        """The call that runs steps ``step + 1 ...`` was dispatched; ``output``: its result."""
        if self.enabled:
            self._queue.put((time.monotonic(), step + 1, output))

    def _wait(self):
        import jax

        while True:
            item = self._queue.get()
            if item is None or self._stop.is_set():
                return
            dispatched, step, output = item
            started = max(dispatched, self._last_done)
            with self._lock:
                self._current = (started, step)
            try:
                jax.block_until_ready(output)
            except Exception:  # the main thread sees the same error and reports it
                pass
            now = time.monotonic()
            with self._lock:
                self._current = None
                self._last_done = now
                if self._done < self.warmup:
                    self._slowest = max(self._slowest, now - started)
                self._done += 1

    def _monitor(self):
        while not self._stop.wait(0.2):
            with self._lock:
                current = self._current
            if current is None:
                continue
            started, step = current
            limit = self.limit()
            if time.monotonic() - started > limit:
                self.on_timeout(("\n" if self.fresh_line else "") + self._message(step, limit))
                return

    def _message(self, step: int, limit: float) -> str:
        cause = (
            "most likely a collective is stuck because another process died, hangs or was "
            "stopped (see its output)"
            if self.multiprocess
            else "the device is stuck, or steps really take this long"
        )
        return (
            f"error: no compiled call finished within {limit:g} s (train.step_timeout) at "
            f"step {step}: {cause}; the last checkpoint is intact, rerun to resume "
            "(train.step_timeout: seconds, 0 to disable)"
        )


EXIT_JOIN_S = 5.0  # how long leaving the watchdog waits for its threads


def _exit_stuck(message: str) -> None:
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STUCK)
