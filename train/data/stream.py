"""Iterable sources: batches read once, in order, regrouped into ``train.batch_size`` rows,
with a position a checkpoint records (train/data/source.py has the protocol)."""

from __future__ import annotations

import base64
import json
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import UserCodeError, users_error
from ..parallel import distributed as dist
from .dataset import Dataset
from .source import (
    NOT_RESUMABLE,
    DataError,
    ResumeNotExactWarning,
    RowSpec,
    as_map_source,
    check_batch,
    check_finite_rows,
    describe_value,
    is_map_source,
    one_line,
    open_source,
    read_all,
)

# Steps back for which an iterable's positions are kept (the feed reads a few calls ahead).
KEEP_POSITIONS = 4096


def _json_state(state: Any) -> Any:
    """A state as JSON-able data (Grain's ``DataLoader`` state is bytes)."""
    if isinstance(state, bytes):
        return {"__bytes__": base64.b64encode(state).decode()}
    json.dumps(state)  # a state that is not JSON is the source's mistake: said at capture
    return state


def _from_json(state: Any) -> Any:
    if isinstance(state, dict) and set(state) == {"__bytes__"}:
        return base64.b64decode(state["__bytes__"])
    return state


class BatchStream:
    """An iterable source's rows regrouped into batches of ``batch_size``, read in order.

    Position: the iterator's state before the batch being consumed and how many of its
    rows are used, captured after each call (``mark``); a resume loads the state and drops
    the used rows again, so it continues at the same row.
    """

    def __init__(self, iterable, name: str, first: tuple, rest_iter, spec: RowSpec):
        self.iterable, self.name, self.spec = iterable, name, spec
        self.it = rest_iter
        self.get_state, self.set_state = _state_methods(rest_iter)
        self.buffer: list[tuple[np.ndarray, np.ndarray]] = []
        self.buffered_state = None  # the state before the first buffered batch was pulled
        self.used = 0  # rows of the first buffered batch already handed out
        self.next_step = 0
        self.batch_size: int | None = None
        self.positions: dict[int, Any] = {}
        self._start_batch = first  # the first batch the trainer sees (after the held-out one)
        self.lock = threading.Lock()

    @property
    def stateful(self) -> bool:
        return self.get_state is not None

    def _state(self):
        return None if self.get_state is None else _json_state(self.get_state())

    def _pull(self) -> tuple[np.ndarray, np.ndarray]:
        if self._start_batch is not None:
            batch, self._start_batch = self._start_batch, None
            return batch
        try:
            out = next(self.it)
        except StopIteration:
            raise DataError(
                f"data source {self.name} ran out at step {self.next_step}: an iterable must "
                "yield batches for every step of train.steps (repeat it, or lower train.steps)"
            ) from None
        except (DataError, UserCodeError):
            raise
        except Exception as e:  # noqa: BLE001
            raise users_error("data source", e, f"{self.name}, next()") or DataError(
                f"data source {self.name}: next() raised {type(e).__name__}: {one_line(e)}"
            ) from None
        return check_batch(out, _rows(out), self.name, self.spec, "next()")

    def rows(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        while count:
            if not self.buffer:
                self.buffered_state = self._state()
                self.buffer.append(self._pull())
                self.used = 0
            x, y = self.buffer[0]
            take = min(count, len(x) - self.used)
            xs.append(x[self.used : self.used + take])
            ys.append(y[self.used : self.used + take])
            self.used += take
            count -= take
            if self.used == len(x):
                self.buffer.pop(0)
                self.used = 0
        return np.concatenate(xs), np.concatenate(ys)

    def call(self, step: int, k: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``[k, batch_size, ...]`` batches of steps ``step .. step + k - 1``."""
        with self.lock:
            if step != self.next_step:
                raise DataError(
                    f"data source {self.name} is an iterable: it is read once, in order, and "
                    f"cannot give step {step} again (it is at step {self.next_step}); replaying "
                    "steps (train.nonfinite=stop naming a bad leaf) needs a map-style source"
                )
            x, y = self.rows(k * batch_size)
            self.next_step = step + k
            self.positions[self.next_step] = self.position()
            for old in [s for s in self.positions if s < step - KEEP_POSITIONS]:
                del self.positions[old]  # the loop checkpoints at most a few calls back
            return x.reshape(k, batch_size, *x.shape[1:]), y.reshape(k, batch_size, *y.shape[1:])

    def position(self) -> dict:
        if not self.stateful:
            return {"state": None}
        if self.buffer:
            return {"state": self.buffered_state, "used_rows": self.used}
        return {"state": self._state(), "used_rows": 0}

    def sampler(self, batch_size: int) -> StreamSampler:
        return StreamSampler(self, batch_size)

    def restore(self, start: int, position: dict | None) -> None:
        """Continue at step ``start`` from a checkpoint's ``position`` (see :meth:`position`)."""
        with self.lock:
            self.next_step = start
            if start == 0:
                return
            state = (position or {}).get("state")
            if state is None or not self.stateful:
                warnings.warn(
                    NOT_RESUMABLE.format(name=self.name)
                    + f" (resuming at step {start} from the iterable's current position)",
                    ResumeNotExactWarning,
                    stacklevel=2,
                )
                return
            try:
                self.set_state(_from_json(state))
            except Exception as e:  # noqa: BLE001
                raise users_error("data source", e, f"{self.name}, load_state_dict") or DataError(
                    f"data source {self.name}: load_state_dict of the checkpoint's position "
                    f"raised {type(e).__name__}: {one_line(e)}"
                ) from None
            self._start_batch, self.buffer, self.used = None, [], 0
            used = int(position.get("used_rows", 0))
            if used:
                self.buffered_state = state
                self.buffer.append(self._pull())
                self.used = used


def _rows(batch: Any) -> int:
    """The rows an iterable's batch claims (its x's first axis), for checking it."""
    x = batch.get("x") if isinstance(batch, Mapping) else None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x = batch[0]
    shape = np.shape(x) if isinstance(x, np.ndarray) or hasattr(x, "shape") else ()
    return shape[0] if len(shape) and shape[0] > 0 else 1


def _state_methods(it) -> tuple:
    for get, set_ in (("state_dict", "load_state_dict"), ("get_state", "set_state")):
        g, s = getattr(it, get, None), getattr(it, set_, None)
        if callable(g) and callable(s):
            return g, s
    return None, None


def stream_dataset(iterable, test, cfg, name: str) -> Dataset:
    it = iter(iterable) if not hasattr(iterable, "__next__") else iterable
    try:
        first = next(it)
    except StopIteration:
        raise DataError(f"data source {name}: the iterable yields no batches") from None
    except Exception as e:  # noqa: BLE001
        raise users_error("data source", e, f"{name}, next()") or DataError(
            f"data source {name}: next() raised {type(e).__name__}: {one_line(e)}"
        ) from None
    x0, y0 = check_batch(first, _rows(first), name, None, "next()")
    spec = RowSpec(x0.shape[1:], x0.dtype, y0.shape[1:], y0.dtype)
    note = ""
    if test is None:  # the first batch is held out
        x_test, y_test, start = x0, y0, None
        note = f"held out the iterable's first batch ({len(x0)} rows) as the test split"
    else:
        test = as_map_source(test) if is_map_source(test) else test
        if not is_map_source(test):
            raise DataError(
                f"data source {name}: its test split is {describe_value(test)}; expected a map-style "
                "source or (x_test, y_test) arrays"
            )
        reader, n_test = open_source(test, f"{name} (test)")
        if reader.spec != spec:
            raise DataError(
                f"data source {name}: the test split's batches are {reader.spec.describe()} "
                f"but the iterable's are {spec.describe()}"
            )
        x_test, y_test = read_all(reader, n_test)
        start = (x0, y0)
    check_finite_rows(name, {"x": x0, "y": y0}, "the iterable's first batch")
    check_finite_rows(name, {"x": x_test, "y": y_test}, "the test split")
    stream = BatchStream(iterable, name, start, it, spec)
    if not stream.stateful:
        warnings.warn(NOT_RESUMABLE.format(name=name), ResumeNotExactWarning, stacklevel=3)
    num_classes = None
    if np.issubdtype(spec.y_dtype, np.integer):
        if spec.y_row != ():
            raise DataError(
                f"data source {name}: integer y must be class labels of shape [batch], got "
                f"rows of shape {list(spec.y_row)}"
            )
        num_classes = getattr(iterable, "num_classes", None) or int(max(y0.max(), y_test.max()) + 1)
    # The columns say the rows' shapes; the stream has no length.
    x = np.empty((0, *spec.x_row), spec.x_dtype)
    y = np.empty((0, *spec.y_row), spec.y_dtype)
    return Dataset(
        name, x, y, x_test, y_test, num_classes, note=note, streamed=True, stream=stream,
        check_finite=True,
    )  # fmt: skip


class StreamSampler:
    """The sampler of an iterable source: no indices (placeholders of the batch's shape),
    and the position is the stream's (checkpointed as JSON)."""

    def __init__(self, stream: BatchStream, batch_size: int):
        self.stream, self.batch_size = stream, batch_size

    def batch(self, step: int) -> np.ndarray:
        return np.zeros(self.batch_size, np.int32)

    def batches(self, step: int, count: int) -> np.ndarray:
        return np.zeros((count, self.batch_size), np.int32)

    def position(self, step: int) -> dict:
        pos = self.stream.positions.get(step, {"state": None})
        return {"step": step, "iterable": json.dumps(pos)}

    def restore(self, start: int, meta: dict | None) -> None:
        """Continue at ``start`` from the checkpoint metadata ``meta`` (process 0 reads it;
        every process takes process 0's position)."""
        text = None
        if meta is not None:
            try:
                text = json.loads(meta.get("data_position", "{}")).get("iterable")
            except (json.JSONDecodeError, AttributeError):
                raise DataError("the checkpoint's data_position metadata is not valid") from None
        text = _from_process_0(text)
        try:
            pos = json.loads(text) if text else None
        except json.JSONDecodeError:
            raise DataError("the checkpoint's iterable position is not valid JSON") from None
        self.stream.restore(start, pos)


def _from_process_0(text: str | None) -> str | None:
    """Process 0's ``text`` on every process (only process 0 reads the run directory)."""

    if not dist.is_multiprocess():
        return text
    raw = np.frombuffer((text or "").encode(), np.uint8)
    n = int(np.asarray(dist.broadcast(np.array([len(raw)], np.int32)))[0])
    buf = raw if dist.is_main() else np.zeros(n, np.uint8)
    return bytes(np.asarray(dist.broadcast(buf), np.uint8)).decode() or None
