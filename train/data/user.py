"""A user's data as the trainer's :class:`Dataset`: a map-style source read through its
``__getitem__`` (streamed, or read whole for ``data.placement: device``), ``(x, y)`` arrays
(the built-in data sets' path), or an iterable (train/data/stream.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .dataset import Dataset
from .source import (
    ArraySource,
    DataError,
    PairReader,
    RecordSource,
    SourceColumn,
    Subset,
    as_map_source,
    check_finite_rows,
    describe_value,
    infer_num_classes,
    is_array_pair,
    is_map_source,
    one_line,
    open_source,
    read_all,
    source_name,
)
from .split import split_indices
from .stream import stream_dataset
from .streamed import place


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
    if is_array_pair(obj):
        obj = ArraySource(*obj)
    if test is None:
        test = getattr(obj, "test", None)
    if is_array_pair(test):
        test = ArraySource(*test)
    name = name or source_name(obj.records if isinstance(obj, RecordSource) else obj)
    if isinstance(obj, ArraySource) and (test is None or isinstance(test, ArraySource)):
        return _array_dataset(obj, test, cfg, name)
    if is_map_source(obj) and not isinstance(obj, list):  # a list holds batches: iterable
        return _map_dataset(as_map_source(obj), test, cfg, name)
    if isinstance(obj, Iterable) or hasattr(obj, "__next__"):
        return stream_dataset(obj, test, cfg, name)
    raise DataError(
        f"data: {describe_value(obj)} ({name}) is not a data source; expected a map-style source "
        "(__len__ and __getitem__(indices) -> (x, y)), an iterable of (x, y) batches, or "
        "(x, y) arrays"
    )


def _map_dataset(source, test, cfg, name: str) -> Dataset:
    reader, n = open_source(source, name)
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
                f"data source {name}: its test split is {describe_value(test)}; expected a map-style "
                "source or (x_test, y_test) arrays"
            )
        test = as_map_source(test)
        test_reader, n_test = open_source(test, f"{name} (test)")
        if test_reader.spec != reader.spec:
            raise DataError(
                f"data source {name}: the test split's batches are "
                f"{test_reader.spec.describe()} but the training split's are "
                f"{reader.spec.describe()}"
            )
    spec = reader.spec
    num_classes = infer_num_classes(source, spec, name, reader, test_reader, n, n_test)
    if cfg.placement == "device":  # read whole, once: the devices gather each batch
        x, y = read_all(reader, n)
        x_test, y_test = read_all(test_reader, n_test)
        # a non-finite value named now, once (streamed: each call's batch, train/data/feed.py)
        subset = (train_idx, test_idx) if test is None else (None, None)
        check_finite_rows(name, {"x": x, "y": y}, "the training split", subset[0])
        check_finite_rows(name, {"x": x_test, "y": y_test}, "the test split", subset[1])
        return Dataset(name, x, y, x_test, y_test, num_classes, note=note)
    cols = [
        SourceColumn(r, i, m, row, dt)
        for r, m in ((reader, n), (test_reader, n_test))
        for i, (row, dt) in enumerate(((spec.x_row, spec.x_dtype), (spec.y_row, spec.y_dtype)))
    ]
    return Dataset(name, *cols, num_classes, note=note, streamed=True, check_finite=True)


def _array_dataset(src: ArraySource, test, cfg, name: str) -> Dataset:
    """Arrays in memory: the built-in data sets' path (small ones live on the devices)."""
    reader, n = open_source(src, name)
    spec = reader.spec
    x, y = (a.astype(dt, copy=False) for a, dt in ((src.x, spec.x_dtype), (src.y, spec.y_dtype)))
    check_finite_rows(name, {"x": x, "y": y}, "the arrays")  # in memory: once, here
    note = ""
    if test is None:
        train_idx, test_idx = _split(n, cfg, name)
        x, x_test, y, y_test = x[train_idx], x[test_idx], y[train_idx], y[test_idx]
        note = f"held out {len(test_idx)} of {n} rows as the test split (data.test_fraction)"
    else:
        test_reader, _ = open_source(test, f"{name} (test)")
        if test_reader.spec != spec:
            raise DataError(
                f"data source {name}: the test arrays are {test_reader.spec.describe()} but the "
                f"training arrays are {spec.describe()}"
            )
        x_test, y_test = (
            a.astype(dt, copy=False) for a, dt in ((test.x, spec.x_dtype), (test.y, spec.y_dtype))
        )
        check_finite_rows(name, {"x": x_test, "y": y_test}, "the test arrays")
    num_classes = infer_num_classes(
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
            f"{cfg.test_fraction} cannot split its {n} rows: {one_line(e)}"
        ) from None


def with_source(cfg, data: Any) -> tuple[Any, Dataset]:
    """``train.fit(..., data=...)``: the config with ``data.name`` naming the source (what
    the run directory and a resume's check record) and the source as a Dataset."""
    dataset = to_dataset(data, cfg.data)
    section = dataclasses.replace(cfg.data, name=f"<{dataset.name}>", options={})
    return dataclasses.replace(cfg, data=section), dataset
