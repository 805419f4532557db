"""Your data: the data-source protocol, and how a source becomes a trainer's :class:`Dataset`.

A **map-style source** has ``__len__()`` and ``__getitem__(indices)``: ``indices`` is a
1-D int array of rows, the result ``(x, y)``, two arrays whose first axis is
``len(indices)`` (as Grain's ``RandomAccessDataSource``, batched). The trainer keeps
asking for the rows of the seeded ``(seed, step)`` order (train/data/dataset.py), so a
resumed run reads exactly the batches it would have read, and each process asks only for
its share of each batch. Its rows are read on the host a call ahead of the device
(``data.placement: host``, train/data/feed.py), or read whole once and kept on the devices
(``data.placement: device``).

An **iterable source** (a generator, a Grain ``IterDataset`` or ``DataLoader``, any
iterable of ``(x, y)`` batches) is read in order; its rows are regrouped into batches of
``train.batch_size``. Its position is checkpointed when its iterator offers
``state_dict()``/``load_state_dict(state)`` (or Grain's ``get_state``/``set_state``), as
JSON in the checkpoint's metadata; otherwise a resumed run starts it afresh and
:class:`ResumeNotExactWarning` says so.

What the data determines of the model (``in_features``/``in_shape``, ``num_classes``,
``out_features``) comes from a first batch: integer ``y`` of shape ``[batch]`` is
classification (``num_classes``: the source's ``num_classes`` attribute, else the largest
label + 1, the labels scanned once), float ``y`` regression.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError
from .dataset import MAX_UNUSED_CLASSES, Dataset, batch_dtype
from .split import split_indices

# Rows per read when a source is scanned (labels) or read whole (data.placement: device).
SCAN_ROWS = 4096
# Steps back for which an iterable's positions are kept (the feed reads a few calls ahead).
KEEP_POSITIONS = 4096
# Modules whose map-style data sets return one record per int index (not a batch).
PER_RECORD_MODULES = ("grain", "torch")


class DataError(ConfigError):
    """A data source that breaks the protocol (one line, exit 2)."""


class ResumeNotExactWarning(UserWarning):
    """An iterable source without ``state_dict``: a resumed run restarts it."""


NOT_RESUMABLE = (
    "data source {name} is an iterable without state_dict()/load_state_dict(): a checkpoint "
    "cannot record its position, so resuming this run is not exact"
)


@runtime_checkable
class MapSource(Protocol):
    """Rows by index: ``source[indices] -> (x, y)`` with ``len(indices)`` rows each."""

    def __len__(self) -> int: ...

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class ArraySource:
    """Two arrays ``x [n, ...]``, ``y [n, ...]`` as a map-style source (the built-in data
    sets are these; small ones live on the devices, each step sending indices)."""

    def __init__(self, x, y, *, num_classes: int | None = None):
        self.x, self.y = np.asarray(x), np.asarray(y)
        if self.x.ndim == 0 or self.y.ndim == 0 or len(self.x) != len(self.y):
            raise DataError(
                f"ArraySource: x {self.x.shape} and y {self.y.shape} need the same number of rows"
            )
        if num_classes is not None:
            self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices):
        return self.x[indices], self.y[indices]


class RecordSource:
    """A map-style source of single records (``source[i] -> (x, y)`` or ``{"x": .., "y": ..}``:
    a Grain ``MapDataset`` or ``RandomAccessDataSource``, a PyTorch ``Dataset``), batched:
    ``__getitem__(indices)`` stacks the records."""

    def __init__(self, records, keys: tuple[str, str] = ("x", "y")):
        self.records, self.keys = records, keys
        self.name = _name(records)
        if hasattr(records, "num_classes"):
            self.num_classes = records.num_classes

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, indices):
        xs, ys = [], []
        for i in np.asarray(indices).reshape(-1).tolist():
            rec = self.records[i]
            if isinstance(rec, Mapping) and all(k in rec for k in self.keys):
                x, y = rec[self.keys[0]], rec[self.keys[1]]
            elif isinstance(rec, (tuple, list)) and len(rec) == 2:
                x, y = rec
            else:
                raise DataError(
                    f"data source {self.name}: record {i} is {_what(rec)}; expected an (x, y) "
                    f"pair or a mapping with keys {self.keys[0]!r} and {self.keys[1]!r}"
                )
            xs.append(np.asarray(x))
            ys.append(np.asarray(y))
        try:
            return np.stack(xs), np.stack(ys)
        except ValueError as e:
            raise DataError(
                f"data source {self.name}: records of different shapes ({_line(e)})"
            ) from None


class Subset:
    """The rows ``indices`` of a map-style source (a held-out split by index)."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, indices):
        return self.source[self.indices[np.asarray(indices)]]


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """What every batch of a source must look like (from its first batch)."""

    x_row: tuple
    x_dtype: np.dtype  # as the step reads it: int32 or float32
    y_row: tuple
    y_dtype: np.dtype

    def describe(self, n: int | str = "batch") -> str:
        return (
            f"x [{n}, {', '.join(map(str, self.x_row))}] {_kind(self.x_dtype)} and "
            f"y [{n}{''.join(f', {d}' for d in self.y_row)}] {_kind(self.y_dtype)}"
        ).replace(", ]", "]")


def _kind(dtype: np.dtype) -> str:
    return "integers" if np.issubdtype(dtype, np.integer) else "floats"


def _name(source: Any) -> str:
    """What messages and the run call a source: its ``name`` attribute, else its class."""
    name = getattr(source, "name", None)
    if isinstance(name, str) and name:
        return name
    t = type(source)
    top = t.__module__.split(".")[0]
    if top in PER_RECORD_MODULES or top in ("builtins", "__main__"):
        return f"{top}.{t.__qualname__}" if top in PER_RECORD_MODULES else t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def _line(e: BaseException) -> str:
    """An exception's message, one line (the rest of a multi-line message left out)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""


def _what(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} ({value.dtype})"
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(value, (tuple, list)):
        return f"{article} {kind} of {len(value)}"
    return f"{article} {kind}"


def check_batch(out: Any, rows: int, name: str, spec: RowSpec | None, call: str) -> tuple:
    """``out`` as ``(x, y)`` arrays in the step's dtypes, checked against the protocol and
    ``spec`` (None: the first batch, which sets it); one line naming ``name`` otherwise."""
    expected = (
        f"expected (x, y) arrays of {rows} rows"
        if spec is None
        else f"expected {spec.describe(rows)}"
    )
    if isinstance(out, Mapping) and "x" in out and "y" in out:
        out = (out["x"], out["y"])
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise DataError(f"data source {name}: {call} returned {_what(out)}; {expected}")
    arrays = []
    for part, v in zip("xy", out):
        try:
            a = np.asarray(v)
        except Exception:  # noqa: BLE001 -- any failure to convert is the source's mistake
            a = None
        ok = a is not None and (
            np.issubdtype(a.dtype, np.integer)
            or np.issubdtype(a.dtype, np.floating)
            or a.dtype == np.bool_
        )
        if not ok:
            raise DataError(
                f"data source {name}: {call} returned {part} as {_what(v)}, not a numeric "
                f"array; {expected}"
            )
        if a.ndim == 0 or len(a) != rows:
            raise DataError(
                f"data source {name}: {call} returned {part} of shape {a.shape} for {rows} "
                f"rows; {expected}"
            )
        arrays.append(a)
    x, y = arrays
    if spec is not None:
        got = RowSpec(x.shape[1:], batch_dtype(x), y.shape[1:], batch_dtype(y))
        if got != spec:
            raise DataError(
                f"data source {name}: {call} returned x {x.shape} {x.dtype}, y {y.shape} "
                f"{y.dtype}, unlike its first batch; {expected}"
            )
    return x.astype(batch_dtype(x), copy=False), y.astype(batch_dtype(y), copy=False)


class PairReader:
    """Reads ``(x, y)`` rows of a map-style source, checked; the last read is kept so the
    ``x`` and ``y`` columns of one read cost one call of the source."""

    def __init__(self, source, name: str, spec: RowSpec | None = None):
        self.source, self.name, self.spec = source, name, spec
        self._last: tuple[bytes, tuple] | None = None
        self._lock = threading.Lock()

    def read(self, indices) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        key = idx.tobytes()
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            try:
                out = self.source[idx]
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 -- the user's code: one line, named
                raise DataError(
                    f"data source {self.name}: __getitem__ of {len(idx)} indices raised "
                    f"{type(e).__name__}: {_line(e)}"
                ) from None
            call = f"__getitem__ of {len(idx)} indices"
            pair = check_batch(out, len(idx), self.name, self.spec, call)
            if self.spec is None:
                x, y = pair
                self.spec = RowSpec(x.shape[1:], x.dtype, y.shape[1:], y.dtype)
            self._last = (key, pair)
            return pair


class SourceColumn:
    """``x`` or ``y`` of a map-style source as the trainer's array-like column: shape,
    dtype and rows by index or slice, read through the source on demand. It holds no
    rows itself (``nbytes`` 0)."""

    def __init__(self, reader: PairReader, part: int, n: int, row: tuple, dtype):
        self.pair_reader, self.part = reader, part
        self.shape, self.dtype = (n, *row), np.dtype(dtype)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))
    itemsize = property(lambda self: self.dtype.itemsize)
    nbytes = 0

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        n = self.shape[0]
        if isinstance(key, slice):
            idx = np.arange(n)[key]
        else:
            idx = np.asarray(key)
            if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
                raise TypeError(f"a source column reads rows by 1-D int index, got {key!r}")
            if idx.size and (idx.min() < -n or idx.max() >= n):
                raise IndexError(f"row indices out of range for {n} rows")
            idx = idx % n if n else idx
        return self.pair_reader.read(idx)[self.part]

    def __array__(self, dtype=None, copy=None):
        a = self[slice(None)]
        return a if dtype is None else a.astype(dtype)


def read_pairs(x_column: Any, indices) -> tuple[np.ndarray, np.ndarray] | None:
    """The batch ``indices`` of a source's columns in one call (None: not source columns)."""
    reader = getattr(x_column, "pair_reader", None)
    return None if reader is None else reader.read(indices)


# -- a source as the trainer's Dataset ---------------------------------------------------


def is_map_source(obj: Any) -> bool:
    return hasattr(type(obj), "__len__") and hasattr(type(obj), "__getitem__")


def _per_record(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] in PER_RECORD_MODULES


def as_map_source(obj: Any) -> Any:
    """``obj`` as a batched map-style source (Grain/PyTorch per-record data sets wrapped)."""
    if isinstance(obj, RecordSource) or not _per_record(obj):
        return obj
    return RecordSource(obj)


def to_dataset(obj: Any, cfg, name: str | None = None) -> Dataset:
    """The trainer's :class:`Dataset` of a user's data ``obj``: a map-style source, an
    iterable of batches, ``(x, y)`` arrays, a mapping ``{"train": .., "test": ..}``, or a
    Dataset (kept). ``cfg``: the config's ``data`` section (placement, test split)."""
    if isinstance(obj, Dataset):
        return obj
    test = None
    if isinstance(obj, Mapping):
        unknown = set(obj) - {"train", "test"}
        if "train" not in obj or unknown:
            raise DataError(
                f"data: a mapping of splits needs the keys 'train' (and optionally 'test'), "
                f"got {sorted(map(str, obj))}"
            )
        obj, test = obj["train"], obj.get("test")
    if _is_pair(obj):
        obj = ArraySource(*obj)
    if test is None:
        test = getattr(obj, "test", None)
    if _is_pair(test):
        test = ArraySource(*test)
    name = name or _name(obj.records if isinstance(obj, RecordSource) else obj)
    if isinstance(obj, ArraySource) and (test is None or isinstance(test, ArraySource)):
        return _array_dataset(obj, test, cfg, name)
    if is_map_source(obj) and not isinstance(obj, list):  # a list holds batches: iterable
        return _map_dataset(as_map_source(obj), test, cfg, name)
    if isinstance(obj, Iterable) or hasattr(obj, "__next__"):
        return _stream_dataset(obj, test, cfg, name)
    raise DataError(
        f"data: {_what(obj)} ({name}) is not a data source; expected a map-style source "
        "(__len__ and __getitem__(indices) -> (x, y)), an iterable of (x, y) batches, or "
        "(x, y) arrays"
    )


def _is_pair(obj: Any) -> bool:
    """``(x, y)`` arrays (numpy, JAX or nested lists)."""
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and all(isinstance(a, (np.ndarray, list)) or hasattr(a, "__array__") for a in obj)
    )


def _first(source, name: str) -> tuple[PairReader, int]:
    try:
        n = len(source)
    except Exception as e:  # noqa: BLE001
        raise DataError(
            f"data source {name}: len() raised {type(e).__name__}: {_line(e)}"
        ) from None
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise DataError(f"data source {name}: len() is {n!r}; expected at least one row")
    reader = PairReader(source, name)
    reader.read(np.arange(min(int(n), 2)))  # the first batch sets the shapes and dtypes
    return reader, int(n)


def _map_dataset(source, test, cfg, name: str) -> Dataset:
    reader, n = _first(source, name)
    note = ""
    if test is None:
        train_idx, test_idx = _split(n, cfg, name)
        # each split reads through its own reader (the prefetch and eval threads)
        # in the split's order, as the built-in data sets' (the same source, the same batches)
        reader = PairReader(Subset(source, train_idx), name, reader.spec)
        test_reader = PairReader(Subset(source, test_idx), f"{name} (test)", reader.spec)
        n, n_test = len(train_idx), len(test_idx)
        note = f"held out {n_test} of {n + n_test} rows as the test split (data.test_fraction)"
    else:
        if not is_map_source(test):
            raise DataError(
                f"data source {name}: its test split is {_what(test)}; expected a map-style "
                "source or (x_test, y_test) arrays"
            )
        test = as_map_source(test)
        test_reader, n_test = _first(test, f"{name} (test)")
        if test_reader.spec != reader.spec:
            raise DataError(
                f"data source {name}: the test split's batches are "
                f"{test_reader.spec.describe()} but the training split's are "
                f"{reader.spec.describe()}"
            )
    spec = reader.spec
    num_classes = _num_classes(source, spec, name, reader, test_reader, n, n_test)
    if cfg.placement == "device":  # read whole, once: the devices gather each batch
        x, y = _read_all(reader, n)
        x_test, y_test = _read_all(test_reader, n_test)
        return Dataset(name, x, y, x_test, y_test, num_classes, note=note)
    cols = [
        SourceColumn(r, i, m, row, dt)
        for r, m in ((reader, n), (test_reader, n_test))
        for i, (row, dt) in enumerate(((spec.x_row, spec.x_dtype), (spec.y_row, spec.y_dtype)))
    ]
    return Dataset(name, *cols, num_classes, note=note, streamed=True)


def _array_dataset(src: ArraySource, test, cfg, name: str) -> Dataset:
    """Arrays in memory: the built-in data sets' path (small ones live on the devices)."""
    from .streamed import place

    reader, n = _first(src, name)
    spec = reader.spec
    x, y = (a.astype(dt, copy=False) for a, dt in ((src.x, spec.x_dtype), (src.y, spec.y_dtype)))
    note = ""
    if test is None:
        train_idx, test_idx = _split(n, cfg, name)
        x, x_test, y, y_test = x[train_idx], x[test_idx], y[train_idx], y[test_idx]
        note = f"held out {len(test_idx)} of {n} rows as the test split (data.test_fraction)"
    else:
        test_reader, _ = _first(test, f"{name} (test)")
        if test_reader.spec != spec:
            raise DataError(
                f"data source {name}: the test arrays are {test_reader.spec.describe()} but the "
                f"training arrays are {spec.describe()}"
            )
        x_test, y_test = (
            a.astype(dt, copy=False) for a, dt in ((test.x, spec.x_dtype), (test.y, spec.y_dtype))
        )
    num_classes = _num_classes(
        src,
        spec,
        name,
        PairReader(ArraySource(x, y), name),
        PairReader(ArraySource(x_test, y_test), name),
        len(x),
        len(x_test),
    )
    return place(Dataset(name, x, y, x_test, y_test, num_classes, note=note), cfg)


def _split(n: int, cfg, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return split_indices(n, cfg.test_fraction, cfg.split_seed)
    except ValueError as e:
        raise DataError(
            f"data source {name} has no test split and data.test_fraction="
            f"{cfg.test_fraction} cannot split its {n} rows: {_line(e)}"
        ) from None


def _read_all(reader: PairReader, n: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [reader.read(np.arange(i, min(i + SCAN_ROWS, n))) for i in range(0, n, SCAN_ROWS)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _num_classes(source, spec: RowSpec, name, reader, test_reader, n, n_test) -> int | None:
    """Classification (integer ``y [batch]``): the source's ``num_classes``, else the
    largest label + 1 (the labels read once); regression: None."""
    if not np.issubdtype(spec.y_dtype, np.integer):
        return None
    if spec.y_row != ():
        raise DataError(
            f"data source {name}: integer y must be class labels of shape [batch], got rows "
            f"of shape {list(spec.y_row)}; float y is a regression target (language-model "
            "token windows: data.name: tokens)"
        )
    declared = getattr(source, "num_classes", None)
    if declared is not None:
        if not isinstance(declared, (int, np.integer)) or declared < 1:
            raise DataError(
                f"data source {name}: num_classes is {declared!r}; expected an int >= 1"
            )
        return int(declared)
    hi, seen = -1, set()
    for r, m in ((reader, n), (test_reader, n_test)):
        for i in range(0, m, SCAN_ROWS):
            y = r.read(np.arange(i, min(i + SCAN_ROWS, m)))[1]
            if y.size and y.min() < 0:
                raise DataError(f"data source {name}: labels must be >= 0, found {y.min()}")
            hi = max(hi, int(y.max()) if y.size else -1)
            seen.update(np.unique(y).tolist())
    if hi + 1 > MAX_UNUSED_CLASSES + len(seen):
        raise DataError(
            f"data source {name}: labels must be class indices 0..K-1, but the largest is {hi} "
            f"and only {len(seen)} distinct labels occur; map them to 0..{len(seen) - 1}"
        )
    return hi + 1


# -- iterable sources --------------------------------------------------------------------


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
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"data source {self.name}: next() raised {type(e).__name__}: {_line(e)}"
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
                raise DataError(
                    f"data source {self.name}: load_state_dict of the checkpoint's position "
                    f"raised {type(e).__name__}: {_line(e)}"
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


def _stream_dataset(iterable, test, cfg, name: str) -> Dataset:
    it = iter(iterable) if not hasattr(iterable, "__next__") else iterable
    try:
        first = next(it)
    except StopIteration:
        raise DataError(f"data source {name}: the iterable yields no batches") from None
    except Exception as e:  # noqa: BLE001
        raise DataError(
            f"data source {name}: next() raised {type(e).__name__}: {_line(e)}"
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
                f"data source {name}: its test split is {_what(test)}; expected a map-style "
                "source or (x_test, y_test) arrays"
            )
        reader, n_test = _first(test, f"{name} (test)")
        if reader.spec != spec:
            raise DataError(
                f"data source {name}: the test split's batches are {reader.spec.describe()} "
                f"but the iterable's are {spec.describe()}"
            )
        x_test, y_test = _read_all(reader, n_test)
        start = (x0, y0)
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
    return Dataset(name, x, y, x_test, y_test, num_classes, note=note, streamed=True, stream=stream)


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
    from ..parallel import distributed as dist

    if not dist.is_multiprocess():
        return text
    raw = np.frombuffer((text or "").encode(), np.uint8)
    n = int(np.asarray(dist.broadcast(np.array([len(raw)], np.int32)))[0])
    buf = raw if dist.is_main() else np.zeros(n, np.uint8)
    return bytes(np.asarray(dist.broadcast(buf), np.uint8)).decode() or None


def with_source(cfg, data: Any) -> tuple[Any, Dataset]:
    """``train.fit(..., data=...)``: the config with ``data.name`` naming the source (what
    the run directory and a resume's check record) and the source as a Dataset."""
    dataset = to_dataset(data, cfg.data)
    section = dataclasses.replace(cfg.data, name=f"<{dataset.name}>", options={})
    return dataclasses.replace(cfg, data=section), dataset
