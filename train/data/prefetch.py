"""A background prefetcher: compute the next items on a thread while the caller works.

The training loop gathers step ``s + 1``'s batch from the token files (page faults, disk
reads, a copy into int32) while the device runs step ``s``. The producer thread runs ahead
by at most ``depth`` items (a bounded queue, so memory stays bounded), every wait has a
timeout, and an exception in the producer is raised in the consumer at the item that
failed, with the producer's traceback.

Example:
    >>> with Prefetcher(lambda step: step * step, range(5), depth=2) as items:
    ...     list(items)
    [0, 1, 4, 9, 16]
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_TIMEOUT_S = 300.0  # a gather from a healthy disk takes milliseconds
_POLL_S = 0.1  # how often a blocked thread looks at the stop flag


class PrefetchError(RuntimeError):
    """The producer is stuck (no item within the timeout) or vanished."""


class _Failed:
    def __init__(self, arg: Any, error: BaseException):
        self.arg, self.error = arg, error


_DONE = object()


class Prefetcher:
    """Yields ``fn(arg)`` for each ``arg`` of ``args``, in order, computed on a thread up
    to ``depth`` items ahead of the consumer.

    Args:
      fn: the work, e.g. ``lambda step: data.windows(starts(step), context)``.
      args: what to call it with, in order (may be infinite, e.g. ``itertools.count(s)``).
      depth: how many results may wait in the queue (plus the one being computed).
      timeout: seconds :meth:`get` waits for an item before raising PrefetchError.

    :meth:`get` returns the next result; iterating does the same until ``args`` is
    exhausted. An exception raised by ``fn`` (or by ``args``) is raised again by
    :meth:`get` at that item, and the producer stops. Use as a context manager, or call
    :meth:`close`, to stop the thread.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        args: Iterable[Any],
        *,
        depth: int = 2,
        timeout: float = DEFAULT_TIMEOUT_S,
        name: str = "nnlite-prefetch",
    ):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.fn, self.timeout = fn, timeout
        self._args = iter(args)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False  # the consumer has seen the end or an error
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        arg = None
        try:
            for arg in self._args:
                if self._stop.is_set():
                    return
                item = self.fn(arg)
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: B036 -- handed to the consumer, which raises it
            self._put(_Failed(arg, e))
            return
        self._put(_DONE)

    def _put(self, item) -> bool:
        """Queue ``item`` unless the consumer has gone (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        """The next result; StopIteration at the end of ``args``."""
        if self._finished:
            raise StopIteration
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    raise PrefetchError(
                        f"the prefetch thread {self._thread.name!r} ended without a result"
                    ) from None
                if time.monotonic() >= deadline:
                    raise PrefetchError(
                        f"no item from the prefetch thread {self._thread.name!r} within "
                        f"{self.timeout:g} s: the data source is stalled (a slow or hung "
                        "disk or network file system?) or one item takes longer than that"
                    ) from None
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._finished = True
            item.error.add_note(f"(raised in the prefetch thread, on item {item.arg!r})")
            raise item.error
        return item

    def __iter__(self):
        return self

    def __next__(self):
        return self.get()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer (after the item it is computing) and wait for it."""
        self._stop.set()
        self._finished = True
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
