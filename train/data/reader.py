"""Rows of memory-mapped arrays read with ``os.pread``, not through the mapping.

Indexing an ``np.memmap`` maps the file pages it touches into the process, and the
kernel maps a whole page-cache folio per fault (up to 2 MB on current Linux): 600 random
64-token windows of a 2 GB token file added 414 MB of resident memory, and over a long
run the process's RSS grows toward the size of the file. ``pread`` copies only the bytes
asked for into the process's own buffer (the page cache still caches the file, outside
the process), so a streamed run's memory does not depend on the size of its data.

:func:`read_rows` reads ``a[rows]`` this way whenever ``a`` (or the array it views, e.g.
``sliding_window_view`` windows of a token map) lives in a file mapped by ``np.memmap``
with contiguous rows, and falls back to indexing otherwise.
"""

from __future__ import annotations

import math
import mmap
import os
import threading

import numpy as np

_fds: dict[str, int] = {}
_lock = threading.Lock()


def _fd(path: str) -> int:
    with _lock:
        if path not in _fds:
            _fds[path] = os.open(path, os.O_RDONLY)
        return _fds[path]


def _file_offset(a: np.ndarray) -> tuple[str, int] | None:
    """``(file, byte offset of a's first element)`` when ``a`` views a ``np.memmap`` and its
    rows are contiguous in the file; None otherwise."""
    m = a
    while m is not None and not (isinstance(m, np.memmap) and m._mmap is not None):
        m = getattr(m, "base", None)  # as_strided views hold a DummyArray with .base
    if m is None or m.filename is None or a.ndim == 0:
        return None
    row = a.shape[1:]
    want, step = [], a.itemsize
    for n in reversed(row):  # C-contiguous strides of one row (size-1 axes: any stride)
        want.append(step)
        step *= n
    if any(n > 1 and s != w for n, s, w in zip(row, a.strides[1:], reversed(want))):
        return None
    if a.strides[0] < 0:
        return None
    base = np.frombuffer(m._mmap, np.uint8).ctypes.data
    start = m.offset - m.offset % mmap.ALLOCATIONGRANULARITY  # where np.memmap's map begins
    offset = a.ctypes.data - base + start
    return (m.filename, offset) if 0 <= offset - start < len(m._mmap) else None


def read_rows(a: np.ndarray, rows) -> np.ndarray:
    """``a[rows]`` (``rows``: 1-D ints), read from the file with ``pread`` when ``a`` is
    memory-mapped (module docstring); a new array in ``a``'s dtype."""
    rows = np.asarray(rows).reshape(-1)
    src = _file_offset(a)
    if src is None:
        return np.asarray(a[rows])
    path, first = src
    row_bytes = a.itemsize * math.prod(a.shape[1:])
    out = np.empty((len(rows), row_bytes), np.uint8)
    fd = _fd(path)
    stride = a.strides[0]
    n = a.shape[0]
    for j, r in enumerate(rows.tolist()):
        if not -n <= r < n:
            raise IndexError(f"row {r} is out of bounds for {n} rows")
        off = first + (r % n) * stride
        got = os.preadv(fd, [out[j]], off)
        if got != row_bytes:
            raise OSError(f"{path}: short read at byte {off} ({got} of {row_bytes}): truncated?")
    return out.view(a.dtype).reshape(len(rows), *a.shape[1:])


def read_range(a: np.ndarray, start: int, stop: int) -> np.ndarray:
    """``a[start:stop]`` as a new array, one ``pread`` when ``a`` is memory-mapped."""
    stop = min(stop, a.shape[0])
    src = _file_offset(a)
    if src is None or start >= stop:
        return np.array(a[start:stop])
    path, first = src
    row_bytes = a.itemsize * math.prod(a.shape[1:])
    if a.strides[0] != row_bytes:  # rows overlap or have gaps: one read each
        return read_rows(a, np.arange(start, stop))
    out = np.empty((stop - start) * row_bytes, np.uint8)
    off = first + start * row_bytes
    got = os.preadv(_fd(path), [out], off)
    if got != out.size:
        raise OSError(f"{path}: short read at byte {off} ({got} of {out.size}): truncated?")
    return out.view(a.dtype).reshape(stop - start, *a.shape[1:])
