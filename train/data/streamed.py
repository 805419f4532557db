"""Data sets read from disk (``data.name: tokens`` and ``arrays``) and where a data set
lives during training (``data.placement``).

Both loaders memory-map their files: a :class:`~train.data.builtin.Dataset` whose ``x``/``y`` are
``np.memmap`` views costs no host memory until a batch reads its rows or windows.

- ``tokens``: a directory written by ``nnlite-train prepare`` (``train/data/text/tokens.py`` reads
  it). ``x``/``y`` are ``train.bin[:-1]`` and ``train.bin[1:]`` (views of one map), the
  validation split is ``data.eval_windows`` fixed windows of ``val.bin`` chosen as for
  ``data.name: text``, and the checkpoint carries the tokenizer (``tokenizer`` spec).
- ``arrays``: a directory of ``x.npy``, ``y.npy`` (and optionally ``x_test.npy``,
  ``y_test.npy``), each opened with ``mmap_mode="r"``. Integer ``y`` is classification
  (class indices ``0..K-1``), float ``y`` regression. Without a test split the last
  ``data.test_fraction`` of the rows is held out (a random split of a memory map would
  copy it; shuffle the rows before saving, or save ``x_test.npy``/``y_test.npy``).

Placement: ``device`` keeps today's path (the training split on every device, each step
gathers its batch there: fastest for small data); ``host`` streams each call's batches
from the host (``train/data/feed.py``); ``auto`` picks device when the training split takes
at most :data:`AUTO_DEVICE_MAX_BYTES` as the step reads it (int32 ids / float32 rows, x
and y), else host.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..errors import ConfigError, relative_to
from .dataset import Dataset, batch_dtype, labels_are_ids
from .reader import read_rows
from .section import DataConfig
from .text import units
from .text.tokenizer import to_spec
from .text.tokens import TokenFiles

# data.placement=auto: a training split up to this size (as the step reads it) lives on
# the device. Shakespeare (1 MB of text) takes 8 MiB; a 2 GB corpus 16 GiB.
AUTO_DEVICE_MAX_BYTES = 256 << 20
# Rows of labels scanned at a time when checking an arrays data set's labels.
_SCAN_ROWS = 1 << 22


def device_bytes(data: Dataset) -> int:
    """Bytes of the training split ``x`` and ``y`` as the step reads them (int32/float32)."""
    return sum(a.size * batch_dtype(a).itemsize for a in (data.x, data.y))


def place(data: Dataset, cfg: DataConfig) -> Dataset:
    """``data`` with ``cfg.placement`` resolved: streamed (host), or read whole into the
    step's dtypes (device; a memory map is loaded then)."""
    host = cfg.placement == "host" or (
        cfg.placement == "auto" and device_bytes(data) > AUTO_DEVICE_MAX_BYTES
    )
    if host:
        return dataclasses.replace(data, streamed=True)
    if isinstance(data.x, np.memmap) or isinstance(data.y, np.memmap):
        data = dataclasses.replace(
            data,
            x=np.asarray(data.x, batch_dtype(data.x)),
            y=np.asarray(data.y, batch_dtype(data.y)),
        )
    return dataclasses.replace(data, streamed=False)


def tokens(data: DataConfig, context: int) -> Dataset:
    """``data.name: tokens``: a prepared directory, memory-mapped (module docstring)."""
    cfg = data  # the section (``data`` below is the data set)
    path = Path(cfg.path)
    where = f"data.path {str(path)!r}"
    try:
        files = TokenFiles(path)
        files.num_starts(context, "train")
        starts = files.eval_starts(context, cfg.eval_windows_for(context), "val")
        tok = files.tokenizer
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    # data.eval_windows (bounded) windows of val.bin, read without mapping its pages
    w = read_rows(np.lib.stride_tricks.sliding_window_view(files.val, context + 1), starts)
    x_test, y_test = w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32)
    vocab = tok.vocab if tok.kind == "char" else None
    dropped = files.meta.get("dropped_val_chars") or {}
    note = ""
    if dropped.get("count"):
        note = (
            f"prepare dropped {dropped['count']} validation characters absent from the "
            f"training split ({dropped.get('chars', '')!r})"
        )
    return Dataset(
        "tokens",
        files.train[:-1],
        files.train[1:],
        x_test,
        y_test,
        files.vocab_size,
        window=context,
        vocab=vocab,
        note=note,
        tokenizer=to_spec(tok),
        loss_unit="char" if tok.kind == "char" else "token",
        chars_per_token=units.chars_per_token(tok, y_test) if tok.kind != "char" else 1.0,
    )


def arrays(data: DataConfig) -> Dataset:
    """``data.name: arrays``: ``x.npy``/``y.npy`` (``x_test.npy``/``y_test.npy``) memory-mapped."""
    cfg = data  # the section
    path = Path(cfg.path)
    where = f"data.path {str(path)!r}"
    if not path.is_dir():
        raise ConfigError(
            f"{where}: no such directory{relative_to(path)}; expected one holding x.npy and y.npy"
        )
    found = {p.stem: p for p in path.glob("*.npy")}
    for k in ("x", "y"):
        if k not in found:
            raise ConfigError(
                f"{where}: no {k}.npy; found {sorted(p + '.npy' for p in found) or 'no .npy files'}"
                "; expected x.npy, y.npy and optionally x_test.npy, y_test.npy"
            )
    if ("x_test" in found) != ("y_test" in found):
        raise ConfigError(f"{where}: x_test.npy and y_test.npy must be given together")
    x, y = (_open(found[k], where) for k in ("x", "y"))
    _check_pair(x, y, where, "x", "y")
    note = ""
    if "x_test" in found:
        x_test, y_test = (_open(found[k], where) for k in ("x_test", "y_test"))
        _check_pair(x_test, y_test, where, "x_test", "y_test")
        if x_test.shape[1:] != x.shape[1:] or y_test.shape[1:] != y.shape[1:]:
            raise ConfigError(
                f"{where}: x_test/y_test have shapes {x_test.shape}/{y_test.shape}, which do not "
                f"match x/y's rows {x.shape[1:]}/{y.shape[1:]}"
            )
        if np.issubdtype(y_test.dtype, np.integer) != np.issubdtype(y.dtype, np.integer):
            raise ConfigError(
                f"{where}: y_test has dtype {y_test.dtype} but y has {y.dtype}; both integer "
                "labels or both float targets"
            )
    else:
        n_test = int(round(len(x) * cfg.test_fraction))
        if not 0 < n_test < len(x):
            raise ConfigError(
                f"data.test_fraction={cfg.test_fraction} of {len(x)} rows leaves no "
                f"train or test rows; save x_test.npy and y_test.npy"
            )
        x, x_test = x[:-n_test], x[-n_test:]
        y, y_test = y[:-n_test], y[-n_test:]
        note = f"held out the last {n_test} rows as the test split (no x_test.npy)"
    if x.ndim == 1:
        x, x_test = x[:, None], x_test[:, None]
    if np.issubdtype(y.dtype, np.integer):
        lo, hi, seen = _label_range(y, y_test)
        if lo < 0:
            raise ConfigError(f"{where}: labels must be >= 0, found {lo}")
        num_classes = hi + 1
        if labels_are_ids(num_classes, seen):
            raise ConfigError(
                f"{where}: labels must be class indices 0..K-1, but the largest is {hi} and "
                f"only {seen} distinct labels occur; map them to 0..{seen - 1}"
            )
        return Dataset("arrays", x, y, x_test, y_test, num_classes, note=note)
    y, y_test = y.reshape(len(y), -1), y_test.reshape(len(y_test), -1)
    return Dataset("arrays", x, y, x_test, y_test, None, note=note)


def _open(path: Path, where: str) -> np.ndarray:
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {path.name} is not a readable .npy file ({e})") from None
    if not isinstance(a, np.memmap) and a.size:  # np.load maps every non-empty plain array
        raise ConfigError(f"{where}: {path.name} cannot be memory-mapped")
    return a


def _check_pair(x: np.ndarray, y: np.ndarray, where: str, xn: str, yn: str) -> None:
    for name, a in ((xn, x), (yn, y)):
        if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
            raise ConfigError(f"{where}: {name}.npy must be numeric, got dtype {a.dtype}")
    if x.ndim == 0 or len(x) == 0:
        raise ConfigError(f"{where}: {xn}.npy is empty (shape {x.shape})")
    if y.ndim == 0 or len(y) != len(x):
        raise ConfigError(f"{where}: {yn}.npy has shape {y.shape} but {xn}.npy has {len(x)} rows")
    if np.issubdtype(y.dtype, np.integer) and y.ndim != 1:
        raise ConfigError(f"{where}: integer labels {yn}.npy must have shape [n], got {y.shape}")


def _label_range(*ys: np.ndarray) -> tuple[int, int, int]:
    """``(min, max, distinct count)`` of integer labels, read a block at a time."""
    lo, hi, seen = None, None, set()
    for y in ys:
        for i in range(0, len(y), _SCAN_ROWS):
            block = np.asarray(y[i : i + _SCAN_ROWS])
            lo = int(block.min()) if lo is None else min(lo, int(block.min()))
            hi = int(block.max()) if hi is None else max(hi, int(block.max()))
            seen.update(np.unique(block).tolist())
    return lo, hi, len(seen)
