"""Streamed batches (``data.placement: host``): read on the host, placed a call ahead.

Each call of the loop runs K steps from step s. Its batch is a pure function of
``(seed, s, K)``: the sampler's ``[K, global batch]`` indices (rows, or text window
starts), this process's block of them (``train.parallel.distributed.process_share``), the rows or
windows read from the data set's arrays (memory maps: read with ``pread``, so the
process maps none of the file, see train/data/reader.py) and converted to the step's dtypes, then placed by the strategy so that each device receives
only its slice (``Strategy.put_batch``). A :class:`~train.data.prefetch.Prefetcher` does all
that on a thread, at most ``depth`` calls ahead, so the device does not wait for the disk
in steady state; host memory holds at most ``depth + 2`` calls' batches whatever the
size of the data set, and every wait is bounded (``PrefetchError`` names a stalled read).

The held-out split streams too: :func:`evaluate` sends it to the evaluation device a
chunk at a time and sums the chunks' metrics on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import numpy as np

from ..parallel import distributed as dist
from .dataset import Dataset, Sampler, batch_dtype, host_batch
from .prefetch import DEFAULT_TIMEOUT_S, Prefetcher
from .reader import read_range
from .source import check_finite_call, check_finite_rows, source_rows

EVAL_TOKENS_PER_CHUNK = 2**15  # evaluation: tokens per compiled chunk

DEPTH = 2  # calls prepared ahead of the one running: double-buffered
# Rows of an example data set's held-out split per evaluation chunk, at most this many bytes
EVAL_CHUNK_BYTES = 16 << 20


def call_batch(data: Dataset, sampler: Sampler, step: int, k: int) -> tuple:
    """This process's host batch ``(x, y)`` ``[k, B / processes, ...]`` of the call that
    runs steps ``step .. step + k - 1`` (an iterable source: its next ``k`` batches)."""
    if data.stream is not None:
        x, y = data.stream.call(step, k, sampler.batch_size)
        x, y, idx = dist.process_share(x), dist.process_share(y), None
    else:
        idx = dist.process_share(sampler.batches(step, k))
        x, y = host_batch(data, idx)
    if data.check_finite:  # a user's source: on the host anyway, a pass over the batch
        rows = None if idx is None else source_rows(data.x, idx)
        check_finite_call(data.name, x, y, step, jax.process_index() * x.shape[1], rows)
    return x, y


def call_schedule(start: int, stop: int, steps_in_call: Callable[[int], int]) -> Iterator:
    """``(step, k)`` of each call from ``start`` to ``stop``, as the loop makes them."""
    step = start
    while step < stop:
        k = steps_in_call(step)
        yield step, k
        step += k


class BatchFeed:
    """The placed batches of the calls ``calls`` (``(step, k)`` pairs, in order), prepared
    on a thread (module docstring); :meth:`get` hands out the next one."""

    def __init__(
        self, data: Dataset, sampler: Sampler, stepper, calls, *, timeout=DEFAULT_TIMEOUT_S
    ):
        self.data, self.sampler, self.stepper = data, sampler, stepper

        def load(call):
            step, k = call
            x, y = call_batch(data, sampler, step, k)
            return step, k, stepper.put_batch(x, y, step)

        self._items = Prefetcher(load, calls, depth=DEPTH, timeout=timeout, name="nnlite-batches")

    def get(self, step: int, k: int):
        """The placed batch of the call ``(step, k)`` (the next one of the schedule)."""
        got_step, got_k, placed = self._items.get()
        if (got_step, got_k) != (step, k):  # the loop and the schedule disagree: a bug
            raise RuntimeError(
                f"batch feed out of step: expected {(step, k)}, got {(got_step, got_k)}"
            )
        return placed

    def close(self) -> None:
        self._items.close()


def eval_chunk(data: Dataset) -> int:
    """Rows of the held-out split per evaluation chunk (text: 32k tokens of windows)."""

    n = len(data.x_test)
    if data.window is not None:
        return max(1, min(n, EVAL_TOKENS_PER_CHUNK // data.window))
    row = max(1, int(np.prod(data.x_test.shape[1:])) * 4)
    return max(1, min(n, EVAL_CHUNK_BYTES // row))


def evaluate(
    sums: Callable, params, data: Dataset, chunk: int, device, *state, stop=None
) -> dict | None:
    """Means of the model's per-example loss and metrics over ``data``'s held-out split,
    ``chunk`` rows at a time on ``device`` (``sums``: ``train.step.step.build_chunk_eval``;
    ``state``: a stateful model's, in eval mode); None if ``stop()`` ended it early
    (:func:`sum_chunks`)."""
    n = len(data.x_test)

    def load(i):
        x = read_range(data.x_test, i, i + chunk).astype(batch_dtype(data.x_test), copy=False)
        y = read_range(data.y_test, i, i + chunk).astype(batch_dtype(data.y_test), copy=False)
        if data.check_finite:  # a user's source: named here, not as a non-finite loss
            check_finite_rows(data.name, {"x": x, "y": y}, "the test split", first=i)
        valid = len(x)
        if valid < chunk:  # pad the last chunk: one shape, one compiled program
            x, y = (np.resize(a, (chunk, *a.shape[1:])) for a in (x, y))
        return jax.device_put((x, y, np.int32(valid)), device)

    with Prefetcher(load, range(0, n, chunk), depth=DEPTH, name="nnlite-eval") as chunks:
        return sum_chunks(sums, params, chunks, state, stop)


def sum_chunks(sums: Callable, params, chunks, state=(), stop=None) -> dict | None:
    """Means of the per-example loss and metrics over ``chunks`` (placed ``(x, y, valid)``
    triples; ``sums``: ``build_chunk_eval``'s), one chunk at a time: the host waits for each
    chunk's sums, and ``stop()`` (a signal came) before each chunk ends it (None), so a
    stop waits for one chunk, not the whole split."""
    totals: dict[str, float] = {}
    count = 0
    for x, y, valid in chunks:
        if stop is not None and stop():
            return None
        values, c = sums(params, x, y, valid, *state)
        for k, v in values.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        count += int(c)
    return {k: v / count for k, v in totals.items()}


def device_chunks(x: np.ndarray, y: np.ndarray, chunk: int, device) -> list[tuple]:
    """A held-out split kept on ``device`` as ``(x, y, valid)`` chunks of ``chunk`` rows
    (the last one padded: one shape, one compiled program) for :func:`sum_chunks`."""
    out = []
    for i in range(0, len(x), chunk):
        xc, yc = x[i : i + chunk], y[i : i + chunk]
        valid = len(xc)
        if valid < chunk:
            xc, yc = (np.resize(a, (chunk, *a.shape[1:])) for a in (xc, yc))
        out.append(jax.device_put((xc, yc, np.int32(valid)), device))
    return out
