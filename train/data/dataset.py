"""What a data set is to the trainer: arrays and their split (:class:`Dataset`), and the
seeded order of its batches (samplers), a pure function of (seed, step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .reader import read_rows

MAX_UNUSED_CLASSES = 1000


def labels_are_ids(num_classes: int, distinct: int) -> bool:
    """Whether integer labels ``0..num_classes-1`` of which ``distinct`` occur are ids
    rather than class indices (README: such a file exits 2): more classes of the range
    never occur than occur (``{100, 200, 300}``), or more than MAX_UNUSED_CLASSES. A few
    gaps (a class absent from a small sample) are indices, with a note."""
    unused = num_classes - distinct
    return unused > distinct or unused > MAX_UNUSED_CLASSES


@dataclass(frozen=True)
class Dataset:
    name: str
    x: np.ndarray  # [n, features] float32; text: the training token stream [n] int32
    y: np.ndarray  # [n] int32 labels, [n, outputs] float32 targets; text: x shifted by one
    x_test: np.ndarray  # text: the fixed validation windows [m, window] int32
    y_test: np.ndarray
    num_classes: int | None  # None for regression; text: the vocabulary size
    # Text only: the context length; a batch index is the start of a window of x (and y)
    window: int | None = None
    vocab: str | None = None  # text only: the characters, in id order
    note: str = ""  # said when the data set is built (e.g. characters dropped)
    # Batches are read on the host and sent per call (data.placement: host): x, y may be
    # memory maps of any int/float dtype, converted per batch (see batch_dtype)
    streamed: bool = False
    tokenizer: str | None = (
        None  # prepared tokens: train.data.text.tokenizer.to_spec of the tokenizer
    )
    # What was done to the raw inputs before training ({"scale": s}: x * s, the digits'
    # pixels); checkpoints record it and train.load_run(...).predict applies it
    preprocess: dict | None = None
    # Prepared tokens of a byte or bpe tokenizer: the loss is per "token", not per
    # character; chars_per_token of the evaluation's targets (train/data/text/units.py)
    loss_unit: str | None = None
    chars_per_token: float | None = None
    # An iterable source (train/data/stream.py BatchStream): batches read in order, x and y
    # empty arrays of the rows' shapes; a map-style source's x/y are SourceColumns instead
    stream: Any = None
    # A user's source read on the host per call: each call's batch is checked for non-finite
    # values there (train/data/feed.py; sources read whole are checked once, at load)
    check_finite: bool = False
    # Rows of token windows of this length (data.name: chat, train/data/chat.py): x [n, 2, T]
    # tokens and segment ids, y [n, T] next tokens or -1 (no loss); a batch index is a row
    token_rows: int | None = None

    @property
    def task(self) -> str:
        if self.window is not None or self.token_rows is not None:
            return "language_model"
        return "regression" if self.num_classes is None else "classification"

    @property
    def eval_split(self) -> str:
        """What the held-out split is called in logs: "val" for text, else "test"."""
        return "val" if self.window is not None else "test"

    @property
    def num_indices(self) -> int:
        """How many distinct batch indices there are: examples, or text window starts (an
        iterable source: the test rows, which stand in for its batches' shapes)."""
        if self.stream is not None:
            return len(self.x_test)
        return len(self.x) if self.window is None else len(self.x) - self.window + 1

    def describe(self) -> str:
        streamed = ", streamed" if self.streamed else ""
        if self.stream is not None:
            return f"iterable of batches / {len(self.x_test)} test"
        if self.window is None:
            return f"{len(self.x)} train / {len(self.x_test)} test{streamed}"
        unit = "chars" if self.tokenizer is None else "tokens"
        return (
            f"{len(self.x) + 1:,} train {unit} / {len(self.x_test)} val windows of "
            f"{self.window}, vocabulary {self.num_classes}{streamed}"
        )

    @property
    def in_features(self) -> int:
        return self.x.shape[1]

    @property
    def out_features(self) -> int:
        return self.num_classes if self.num_classes is not None else self.y.shape[1]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(n // batch_size, 1)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation of the training set used in ``epoch`` (a pure function of both)."""
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int32)


def batch_dtype(a: np.ndarray) -> np.dtype:
    """The dtype a batch of array ``a`` has in the step: int32 for integers (labels, token
    ids stored as uint8/16/32), float32 for floats."""
    return np.dtype(np.int32 if np.issubdtype(a.dtype, np.integer) else np.float32)


def host_batch(data: Dataset, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch ``(x, y)`` that indices ``idx`` name, on the host (what the compiled step
    gathers on the device: rows, or text windows starting at ``idx``), in the step's dtypes.
    Reads only those rows or windows (``x``/``y`` may be memory maps, read with ``pread``:
    train/data/reader.py); any leading shape of ``idx`` is kept."""
    idx = np.asarray(idx)
    x, y = data.x, data.y
    if data.stream is not None:  # an iterable: test rows stand in (shapes only, see Sampler)
        x, y = data.x_test, data.y_test
        idx = idx % len(x)
    reader = getattr(x, "pair_reader", None)  # a map-style source: one call reads x and y
    if reader is not None:
        xb, yb = reader.read(idx.reshape(-1))
        return xb.reshape(*idx.shape, *xb.shape[1:]), yb.reshape(*idx.shape, *yb.shape[1:])
    if data.window is not None:  # [n - window + 1, window] views: no copy until indexed
        x = np.lib.stride_tricks.sliding_window_view(x, data.window)
        y = np.lib.stride_tricks.sliding_window_view(y, data.window)
    flat = idx.reshape(-1)
    xb = read_rows(x, flat).astype(batch_dtype(data.x), copy=False)  # memory maps: pread
    yb = read_rows(y, flat).astype(batch_dtype(data.y), copy=False)
    return xb.reshape(*idx.shape, *xb.shape[1:]), yb.reshape(*idx.shape, *yb.shape[1:])


class Sampler(Protocol):
    """Host-side batch indices as a pure function of (seed, step): a step is a data position."""

    def batch(self, step: int) -> np.ndarray: ...

    def batches(self, step: int, count: int) -> np.ndarray: ...

    def position(self, step: int) -> dict: ...

    def restore(self, start: int, meta: dict | None) -> None:
        """Continue at ``start`` from a checkpoint's metadata ``meta`` (None: no checkpoint):
        a no-op for the (seed, step) samplers, whose position is the step."""


def make_sampler(seed: int, data: Dataset, batch_size: int) -> Sampler:
    """The host-side sampler of ``data``: epochs of examples, random text windows, or an
    iterable source's order (train/data/stream.py)."""
    if data.stream is not None:
        return data.stream.sampler(batch_size)
    if data.window is None:
        return BatchIndices(seed, data.num_indices, batch_size)
    return WindowIndices(seed, data.num_indices, batch_size)


class WindowIndices:
    """Host-side sampler for text: step ``s``'s batch is ``batch_size`` window starts drawn
    uniformly from ``[0, n)`` by ``default_rng([seed, s])``, a pure function of both (as
    nanoGPT draws its batches, with replacement), so a resumed run sees the same windows."""

    def __init__(self, seed: int, n: int, batch_size: int):
        self.seed, self.n, self.batch_size = seed, n, batch_size

    def batch(self, step: int) -> np.ndarray:
        # int32 draws while n fits (every text and Shakespeare), int64 for token files of
        # more than 2**31 tokens: the same numbers as train.data.text.tokens.window_starts
        dtype = np.int32 if self.n <= np.iinfo(np.int32).max else np.int64
        return np.random.default_rng([self.seed, step]).integers(
            0, self.n, self.batch_size, dtype=dtype
        )

    def batches(self, step: int, count: int) -> np.ndarray:
        """``[count, batch_size]`` window starts for steps ``step .. step+count-1``."""
        return np.stack([self.batch(s) for s in range(step, step + count)])

    def position(self, step: int) -> dict:
        return {"step": step, "windows": f"numpy default_rng([seed, step]) over {self.n}"}

    def restore(self, start: int, meta: dict | None) -> None:
        pass


class BatchIndices:
    """Host-side sampler: the indices of global batches ``step, step+1, ...``.

    Batches are consecutive slices of each epoch's permutation (the tail that does not
    fill a batch is dropped); a data set smaller than the batch is sampled with wraparound.
    """

    def __init__(self, seed: int, n: int, batch_size: int):
        self.seed, self.n, self.batch_size = seed, n, batch_size
        self.per_epoch = steps_per_epoch(n, batch_size)
        self._cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            order = epoch_order(self.seed, epoch, self.n)
            if self.n < self.batch_size:
                order = np.resize(order, self.batch_size)
            self._cache = (epoch, order)
        return self._cache[1]

    def batch(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.per_epoch)
        b = self.batch_size
        return self._order(epoch)[i * b : (i + 1) * b]

    def batches(self, step: int, count: int) -> np.ndarray:
        """``[count, batch_size]`` indices for steps ``step .. step+count-1``."""
        return np.stack([self.batch(s) for s in range(step, step + count)])

    def position(self, step: int) -> dict:
        epoch, i = divmod(step, self.per_epoch)
        return {"epoch": epoch, "batch_in_epoch": i, "steps_per_epoch": self.per_epoch}

    def restore(self, start: int, meta: dict | None) -> None:
        pass
