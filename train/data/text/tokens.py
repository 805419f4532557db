"""Reading prepared token files (``nnlite-train prepare``): windows from memory maps.

``TokenFiles(dir)`` checks ``meta.json`` against the files (format, dtype, sizes; the
sha256 too with ``verify=True``) and maps ``train.bin`` / ``val.bin`` with ``np.memmap``:
nothing is read until a batch asks for it, so the data may be far bigger than memory.

The data order is a pure function of ``(seed, step)``, as for ``data.name: text``:
:func:`window_starts` draws step ``s``'s ``batch_size`` window starts with
``default_rng([seed, s])``, the same draws as ``train.data.builtin.WindowIndices`` (so a
checkpoint's step is its data position). In a run of several processes every process
draws the same global batch and gathers only its block of it (:func:`process_share`).

Example:
    >>> import tempfile, pathlib
    >>> from train.prepare import main
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("hello tokens! " * 50)
    >>> main(["--input", str(d / "a.txt"), "--out", str(d / "tok"), "--tokenizer", "byte"])
    ... # doctest: +ELLIPSIS
    wrote ...
    0
    >>> data = TokenFiles(d / "tok")
    >>> starts = window_starts(seed=0, step=7, batch_size=4, num_starts=data.num_starts(8))
    >>> x, y = data.windows(starts, context=8)
    >>> x.shape, x.dtype, bool((x[:, 1:] == y[:, :-1]).all())
    ((4, 8), dtype('int32'), True)
    >>> data.tokenizer.decode(x[0]) in "hello tokens! " * 3
    True
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import numpy as np

from ...errors import ConfigError, relative_to
from .tokenizer import from_meta

FORMAT = "nnlite.tokens"  # what nnlite-train prepare writes (meta.json "format")
FORMAT_VERSION = 1
DTYPES = {"uint8": 1 << 8, "uint16": 1 << 16, "uint32": 1 << 32}

SPLITS = ("train", "val")


class TokenFiles:
    """The token files of a prepared directory, memory-mapped.

    Args:
      directory: what ``nnlite-train prepare --out`` wrote.
      verify: also check each file's sha256 against meta.json (reads every byte: seconds
        per GB); by default only the sizes are checked.

    Attributes: ``meta`` (meta.json), ``dtype``, ``vocab_size``, ``train`` / ``val``
    (1-D read-only memory maps of the token ids), ``tokenizer`` (built on first use).
    """

    def __init__(self, directory: str | Path, *, verify: bool = False):
        self.directory = Path(directory)
        self.meta = _read_meta(self.directory)
        where = f"{self.directory / 'meta.json'}"
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.vocab_size = int(self.meta["tokenizer"]["vocab_size"])
        self.maps: dict[str, np.ndarray] = {}
        for split in SPLITS:
            entry = self.meta[split]
            path = self.directory / entry["file"]
            n = entry["tokens"]
            try:
                size = path.stat().st_size
            except OSError as e:
                raise ConfigError(f"{where}: {split} file {path}: {e.strerror}") from None
            if size != n * self.dtype.itemsize:
                raise ConfigError(
                    f"{path}: {size} bytes, but meta.json says {n} {self.dtype.name} tokens "
                    f"({n * self.dtype.itemsize} bytes); the directory is damaged, prepare it "
                    "again"
                )
            if verify:
                _check_sha256(path, entry.get("sha256"))
            # np.memmap cannot map an empty file; prepare never writes one, but be exact
            self.maps[split] = (
                np.memmap(path, self.dtype, mode="r", shape=(n,)) if n else np.empty(0, self.dtype)
            )

        if verify:
            tok = self.meta["tokenizer"]
            if "file" in tok:
                _check_sha256(self.directory / tok["file"], tok.get("sha256"))
            for split, tokens in self.maps.items():
                top = max(
                    (int(tokens[i : i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24)),
                    default=0,
                )
                if top >= self.vocab_size:
                    raise ConfigError(
                        f"{self.directory / self.meta[split]['file']}: holds id {top}, outside "
                        f"the vocabulary of {self.vocab_size}; prepare it again"
                    )

    @property
    def train(self) -> np.ndarray:
        return self.maps["train"]

    @property
    def val(self) -> np.ndarray:
        return self.maps["val"]

    @cached_property
    def tokenizer(self):
        return from_meta(self.directory, self.meta["tokenizer"])

    def num_starts(self, context: int, split: str = "train") -> int:
        """How many windows of ``context`` tokens (plus the next token) ``split`` holds:
        starts are ``0 .. n - context - 1``. Raises ConfigError if there are none."""
        n = len(self.maps[_split(split)])
        if n < context + 1:
            raise ConfigError(
                f"{self.directory}: the {split} split has {n} tokens but a window of "
                f"context={context} needs {context + 1}; prepare more text or use a shorter "
                "context"
            )
        return n - context

    def windows(
        self, starts: np.ndarray, context: int, split: str = "train"
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``, int32 ``[B, context]``: the windows starting at ``starts`` ``[B]``
        and their next-token targets (``y[:, t] = x[:, t + 1]``, the last one the token
        after the window). Read from the memory map on the host."""
        tokens = self.maps[_split(split)]
        starts = np.asarray(starts)
        if starts.ndim != 1:
            raise ValueError(f"starts must be 1-D [batch], got shape {starts.shape}")
        hi = self.num_starts(context, split)
        if len(starts) and (starts.min() < 0 or starts.max() >= hi):
            raise ValueError(
                f"window starts must lie in [0, {hi - 1}] for context={context} on the "
                f"{split} split, got [{starts.min()}, {starts.max()}]"
            )
        w = np.empty((len(starts), context + 1), np.int32)
        for i, s in enumerate(starts.tolist()):  # B contiguous reads: the pages they touch
            w[i] = tokens[s : s + context + 1]
        return w[:, :-1], w[:, 1:]

    def eval_starts(self, context: int, count: int, split: str = "val") -> np.ndarray:
        """Up to ``count`` fixed window starts spread evenly over ``split`` (the same
        windows every evaluation, as ``data.name: text`` chooses them)."""
        n = self.num_starts(context, split)
        m = min(count, n)
        return np.unique(np.linspace(0, n - 1, m).round().astype(np.int64))


def window_starts(seed: int, step: int, batch_size: int, num_starts: int) -> np.ndarray:
    """Step ``step``'s global batch: ``batch_size`` window starts drawn uniformly from
    ``[0, num_starts)`` by ``default_rng([seed, step])`` (with replacement, as nanoGPT).

    A pure function of its arguments; int32 draws while ``num_starts`` fits (the same
    numbers as ``train.data.builtin.WindowIndices``), int64 beyond (files over 2**31 tokens).
    """
    dtype = np.int32 if num_starts <= np.iinfo(np.int32).max else np.int64
    return np.random.default_rng([seed, step]).integers(0, num_starts, batch_size, dtype=dtype)


def process_share(starts: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """Process ``process_index``'s block of a global batch (the last axis of ``starts``):
    process p of P takes columns ``p * B/P .. (p + 1) * B/P - 1``, the order in which
    ``train.parallel.distributed.global_devices`` places the devices; so the shares of all
    processes, concatenated in process order, are the global batch."""
    starts = np.asarray(starts)
    b = starts.shape[-1]
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if b % process_count:
        raise ValueError(
            f"a global batch of {b} does not split over {process_count} processes; use a "
            "batch size divisible by the number of processes"
        )
    k = b // process_count
    return starts[..., process_index * k : (process_index + 1) * k]


def _split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    return split


def _check_sha256(path: Path, want: str | None) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    if h.hexdigest() != want:
        raise ConfigError(
            f"{path}: sha256 {h.hexdigest()} does not match meta.json's {want}; the file "
            "is damaged, prepare it again"
        )


def _read_meta(directory: Path) -> dict:
    path = directory / "meta.json"
    if not directory.is_dir():
        raise ConfigError(
            f"{directory}: no such directory{relative_to(directory)}; write it with "
            "nnlite-train prepare"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{directory}: no meta.json; is it a directory written by nnlite-train prepare?"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: not the metadata of prepared tokens (format {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path}: format_version {meta.get('format_version')!r}, this nnlite reads "
            f"{FORMAT_VERSION}; prepare the data again"
        )
    if meta.get("dtype") not in DTYPES:
        raise ConfigError(f"{path}: dtype {meta.get('dtype')!r}, expected one of {list(DTYPES)}")
    for split in SPLITS:
        entry = meta.get(split)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("tokens"), int)
            or entry["tokens"] < 0
            or not isinstance(entry.get("file"), str)
            or "/" in entry["file"]
        ):
            raise ConfigError(f"{path}: {split!r} needs 'file' (a name) and 'tokens' (>= 0)")
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("vocab_size"), int):
        raise ConfigError(f"{path}: 'tokenizer' needs 'kind' and 'vocab_size'")
    if tok["vocab_size"] > DTYPES[meta["dtype"]]:
        raise ConfigError(
            f"{path}: a vocabulary of {tok['vocab_size']} does not fit dtype {meta['dtype']}"
        )
    return meta
