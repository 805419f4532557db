"""Where a checkpoint's bytes are written: inline, or on a thread while training goes on
(``checkpoint.async: true``).

The loop takes a snapshot of the state at the boundary (a copy on the devices, so the next
steps may donate and overwrite their buffers; the metadata computed then) and hands
:meth:`Writer.submit` a function that writes it with ``store.save`` / ``store.save_sharded``
as a synchronous run does: the same atomic rename, fsyncs and checksums, so a kill at any
moment leaves the previous checkpoint or the new one. At most one write is in flight: the
next checkpoint, a stop, a preemption and the end of the run wait for it, each wait
bounded (:meth:`Writer.limit`). A write that fails, or does not finish in time, is raised
as :class:`CheckpointWriteError`: one line, at the next boundary that collects it, never
dropped (``drain`` prints it when the run is already ending with another error).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

# A wait for an async write gives up after max(floor, factor x the slowest write so far):
# long enough for a large model on a slow disk, short enough that a hung file system ends
# the run with a line instead of never.
WAIT_FLOOR_S = 300.0
WAIT_FACTOR = 20.0


class CheckpointWriteError(OSError):
    """A checkpoint write that failed on the writer thread, or did not finish in time.
    An OSError: ``nnlite-train`` prints it as one line, exit status 1, as a failed
    synchronous write."""


class _Job:
    def __init__(self, step: int, write: Callable[[], Path | None]):
        self.step, self.write = step, write
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.path = self.write()
        except BaseException as e:  # noqa: BLE001 -- kept for the loop to raise
            self.error = e
        self.seconds = time.perf_counter() - t0


class Writer:
    """Runs checkpoint writes: inline (``background`` false), or one at a time on a thread."""

    def __init__(self, background: bool):
        self.background = background
        self._job: _Job | None = None  # the write in flight (background)
        self._done: list[_Job] = []  # finished writes not yet collected
        self.slowest = 0.0  # seconds of the slowest write so far

    def submit(self, step: int, write: Callable[[], Path | None] | None) -> None:
        """Write the checkpoint of ``step`` (``write()`` returns its path; None: this
        process writes nothing). The caller has collected the previous write."""
        if self._job is not None:
            raise RuntimeError("a checkpoint write is still in flight; collect it first")
        job = _Job(step, write or (lambda: None))
        if not self.background or write is None:
            job.run()  # a synchronous write raises as it always did
            if job.error is not None:
                raise job.error
            self._finished(job)
            return
        job.thread = threading.Thread(target=job.run, name=f"nnlite-checkpoint-{step}", daemon=True)
        self._job = job
        job.thread.start()

    def in_flight(self) -> bool:
        return self._job is not None

    def limit(self) -> float:
        """Seconds a wait for the write in flight may take."""
        return max(WAIT_FLOOR_S, WAIT_FACTOR * self.slowest)

    def collect(self, wait: bool) -> list[tuple[int, Path | None]]:
        """``(step, path)`` of the writes finished since the last call, oldest first;
        ``wait``: wait (bounded) for the one in flight. Raises CheckpointWriteError for a
        write that failed or timed out."""
        self._settle(wait)
        done, self._done = self._done, []
        return [(j.step, j.path) for j in done]

    def _settle(self, wait: bool) -> None:
        """Move the write in flight to the finished ones if it has finished (``wait``:
        wait for it, bounded)."""
        job = self._job
        if job is not None and (wait or not job.thread.is_alive()):
            job.thread.join(self.limit() if wait else None)
            if job.thread.is_alive():
                raise CheckpointWriteError(
                    f"the checkpoint write of step {job.step} did not finish within "
                    f"{self.limit():.0f} s (a stuck or very slow disk); the checkpoints "
                    "written before it are intact: rerun to resume from the newest"
                )
            self._job = None
            if job.error is not None:
                raise _failure(job)
            self._finished(job)

    def drain(self, say=None) -> None:
        """Wait (bounded) for the write in flight when the run ends with another error;
        a failure is printed (``say``, default stderr) rather than raised over it. What
        finished is still there for :meth:`collect`."""
        if self._job is None:
            return
        try:
            self._settle(wait=True)
        except CheckpointWriteError as e:
            (say or _stderr)(f"error: {e}")

    def _finished(self, job: _Job) -> None:
        self.slowest = max(self.slowest, job.seconds)
        self._done.append(job)


def _failure(job: _Job) -> CheckpointWriteError:
    e = job.error
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = getattr(e, "strerror", None) or text
    where = getattr(e, "filename", None)
    detail = f"{type(e).__name__}: {what}" + (f": {where}" if where else "")
    return CheckpointWriteError(
        f"the checkpoint write of step {job.step} failed on the writer thread "
        f"(checkpoint.async): {detail}; the checkpoints written before it are intact: rerun "
        "to resume from the newest"
    )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
