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

import dataclasses
import math
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError, UserCodeError, one_line, users_error
from .dataset import MAX_UNUSED_CLASSES, batch_dtype

# Rows per read when a source is scanned (labels) or read whole (data.placement: device).
SCAN_ROWS = 4096

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
    """Two arrays ``x [n, ...]``, ``y [n, ...]`` as a map-style source. Given to the trainer
    they take the built-in data sets' path: held in memory, and on the devices when small
    (each step then sends indices, not rows)."""

    name = "numpy arrays"

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
        self.name = source_name(records)
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
                    f"data source {self.name}: record {i} is {describe_value(rec)}; expected an (x, y) "
                    f"pair or a mapping with keys {self.keys[0]!r} and {self.keys[1]!r}"
                )
            xs.append(np.asarray(x))
            ys.append(np.asarray(y))
        try:
            return np.stack(xs), np.stack(ys)
        except ValueError as e:
            raise DataError(
                f"data source {self.name}: records of different shapes ({one_line(e)})"
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


def source_name(source: Any) -> str:
    """What messages and the run call a source: its ``name`` attribute, else its class."""
    name = getattr(source, "name", None)
    if isinstance(name, str) and name:
        return name
    t = type(source)
    top = t.__module__.split(".")[0]
    if top in PER_RECORD_MODULES or top in ("builtins", "__main__"):
        return f"{top}.{t.__qualname__}" if top in PER_RECORD_MODULES else t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def describe_value(value: Any) -> str:
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
        raise DataError(f"data source {name}: {call} returned {describe_value(out)}; {expected}")
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
                f"data source {name}: {call} returned {part} as {describe_value(v)}, not a numeric "
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


# -- non-finite values: named at the source, before they reach a step ----------------------
NONFINITE_HINT = (
    "a non-finite input makes the step's loss non-finite; fix the source or leave the row out"
)


def first_nonfinite(a: Any) -> tuple[int, ...] | None:
    """The index of the first non-finite value of a float array (None: all finite, or not
    floats). One pass over the array when every value is finite."""
    a = np.asarray(a)
    if a.size == 0 or not np.issubdtype(a.dtype, np.floating):
        return None
    finite = np.isfinite(a)
    if finite.all():
        return None
    return tuple(int(i) for i in np.argwhere(~finite)[0])


def _element(part: str, at: tuple[int, ...]) -> str:
    return part + (f"[{', '.join(map(str, at))}]" if at else "")


def check_finite_rows(
    name: str, parts: Mapping[str, Any], split: str, rows=None, first: int = 0
) -> None:
    """DataError naming the row, part (``x``/``y``) and element of the first non-finite
    value of a source's rows read whole (``split``: which rows they are; ``rows``: their
    rows in the source, if a subset; ``first``: the split's row of the first one)."""
    for part, a in parts.items():
        at = first_nonfinite(a)
        if at is not None:
            row = f"row {first + at[0]} of {split}"
            if rows is not None:
                row = f"row {int(rows[at[0]])} of the source ({split})"
            raise DataError(
                f"data source {name}: {row}: {_element(part, at[1:])} is "
                f"{np.asarray(a)[at]}; {NONFINITE_HINT}"
            )


def source_rows(x_column: Any, indices: np.ndarray) -> np.ndarray | None:
    """The source's rows that ``indices`` of a map-style source's column read (None: not
    a source column)."""
    reader = getattr(x_column, "pair_reader", None)
    if reader is None:
        return None
    src = reader.source
    return src.indices[indices] if isinstance(src, Subset) else indices


def check_finite_call(name: str, x, y, step: int, row0: int = 0, rows=None) -> None:
    """DataError naming the step, the row of its batch (and the source's row, ``rows``:
    the indices read, ``[k, batch]``) and the element of the first non-finite value of a
    call's host batch ``(x, y)`` ``[k, batch, ...]`` that runs steps ``step + 1 ...``
    (``row0``: this process's first row of the global batch)."""
    for part, a in (("x", x), ("y", y)):
        at = first_nonfinite(a)
        if at is None:
            continue
        j, r = at[0], at[1]
        source_row = "" if rows is None else f" (row {int(rows[j, r])} of the source)"
        raise DataError(
            f"data source {name}: step {step + j + 1}, row {row0 + r} of its batch"
            f"{source_row}: {_element(part, at[2:])} is {np.asarray(a)[at]}; {NONFINITE_HINT}"
        )


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
            except (DataError, UserCodeError):
                raise
            except Exception as e:  # noqa: BLE001 -- the user's code: one line, named
                raise users_error(
                    "data source", e, f"{self.name}, __getitem__ of {len(idx)} indices"
                ) or DataError(
                    f"data source {self.name}: __getitem__ of {len(idx)} indices raised "
                    f"{type(e).__name__}: {one_line(e)}"
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


def is_map_source(obj: Any) -> bool:
    return hasattr(type(obj), "__len__") and hasattr(type(obj), "__getitem__")


def _per_record(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] in PER_RECORD_MODULES


def as_map_source(obj: Any) -> Any:
    """``obj`` as a batched map-style source (Grain/PyTorch per-record data sets wrapped)."""
    if isinstance(obj, RecordSource) or not _per_record(obj):
        return obj
    return RecordSource(obj)


def is_array_pair(obj: Any) -> bool:
    """``(x, y)`` arrays (numpy, JAX or nested lists)."""
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and all(isinstance(a, (np.ndarray, list)) or hasattr(a, "__array__") for a in obj)
    )


def open_source(source, name: str) -> tuple[PairReader, int]:
    try:
        n = len(source)
    except Exception as e:  # noqa: BLE001
        raise users_error("data source", e, f"{name}, len()") or DataError(
            f"data source {name}: len() raised {type(e).__name__}: {one_line(e)}"
        ) from None
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise DataError(f"data source {name}: len() is {n!r}; expected at least one row")
    reader = PairReader(source, name)
    reader.read(np.arange(min(int(n), 2)))  # the first batch sets the shapes and dtypes
    return reader, int(n)


def read_all(reader: PairReader, n: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [reader.read(np.arange(i, min(i + SCAN_ROWS, n))) for i in range(0, n, SCAN_ROWS)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def infer_num_classes(source, spec: RowSpec, name, reader, test_reader, n, n_test) -> int | None:
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
