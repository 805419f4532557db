"""``nnlite-train prepare --input FILE_OR_DIR --out DIR [--tokenizer char|byte|bpe]
[--vocab-size N] [--val-fraction F] [--dtype auto|uint8|uint16|uint32] [--glob PATTERN]
[--bpe-sample-mb M] [--force]``: tokenise text of any size into memmappable token files.

Writes ``DIR/train.bin`` and ``DIR/val.bin`` (raw little-endian token ids in the smallest
unsigned dtype that holds the vocabulary, nanoGPT's format), ``DIR/meta.json`` (format,
tokenizer, dtype, token counts, sha256 of each file, the sources and the split rule) and,
for bpe, ``DIR/tokenizer.json``. ``train/data/text/tokens.py`` reads them back; docs/data.md has
the whole story.

- Input: a file, or every regular file under a directory whose name matches ``--glob``
  (default ``*``), recursively, in sorted order of their paths relative to it; names
  starting with ``.`` (files and directories) are skipped and symbolic links to
  directories are not followed. Files are concatenated in that order (bpe puts
  ``<|endoftext|>`` after each file's part of each split).
- Split: the first ``int(n * (1 - val_fraction))`` of each file's ``n`` tokens go to
  train.bin, the rest to val.bin: for one file this is nanoGPT's split, and the char
  vocabulary is built from the training parts, as ``data.name: text`` does
  (validation characters outside it are dropped and counted in meta.json).
- Streaming, in constant memory: files are read in 4 MiB chunks (train/data/text/sources.py), a
  character cut by a chunk's end carried over to the next; char and bpe read the input
  twice (vocabulary or BPE training, then encoding), byte once. bpe trains on every k-th
  chunk, k chosen so that at most ``--bpe-sample-mb`` of text is used (the merges of a
  hundred MB are close to those of the whole; the trainer's memory grows with the
  distinct words it sees).
- Atomic: everything is written into ``.<DIR>.prepare-<pid>-*`` beside DIR and renamed to
  DIR once complete and fsynced, so an interrupted run (Ctrl-C, SIGTERM, SIGKILL) leaves
  no DIR; leftovers of killed runs are removed by the next run. An existing non-empty
  DIR is kept unless ``--force``.

Exit statuses: 0 written, 1 unexpected failure (e.g. the disk filled up), 2 bad input
(one line naming the value and what was expected), 3 stopped by SIGINT/SIGTERM (nothing
written).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np

from . import faults
from .config import ArgumentParser
from .data.text import staging
from .data.text.sources import CHUNK_BYTES, Source, bpe_pieces, find_sources, read_blocks, read_text
from .data.text.tokenizer import (
    KINDS,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    code_points,
    from_hf,
)
from .data.text.tokens import DTYPES, FORMAT, FORMAT_VERSION
from .errors import ConfigError

BPE_BATCH_PIECES = 16  # pieces per encode call: enough for 16 threads, ~25 MB of transient state
DEFAULT_BPE_VOCAB = 8192
# The BPE trainer's memory grows with the distinct words of its sample (a 55 MB sample with
# 386k distinct words peaked at 416 MB); 100 MB of text keeps typical corpora under 1 GB.
DEFAULT_BPE_SAMPLE_MB = 100
# dtype -> how many ids it holds
MIN_BPE_VOCAB = 257  # the 256 byte values and <|endoftext|>
COPY_BYTES = 8 << 20  # block size when moving a file's validation tail out of train.bin

# Test hook, never set in normal runs: seconds to sleep after each chunk written (and before
# the final rename), so tests can interrupt a run halfway.


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(
        prog="nnlite-train prepare",
        description="Tokenise a text file or a directory of text files into train.bin / "
        "val.bin / meta.json (memmappable token ids), streaming in constant memory.",
        epilog="exit statuses: 0 written, 1 failure, 2 bad input, 3 interrupted (nothing "
        "written). See docs/data.md.",
    )
    ap.add_argument(
        "--input",
        required=True,
        metavar="FILE_OR_DIR",
        help="a UTF-8 text file, or a directory of them",
    )
    ap.add_argument(
        "--out", required=True, metavar="DIR", help="directory to create (train.bin, val.bin, ...)"
    )
    ap.add_argument(
        "--tokenizer",
        default="char",
        metavar="{char,byte,bpe}",
        help=f"one of {', '.join(KINDS)} (default: char), or hf:DIR: the tokenizer.json of a "
        "Hugging Face model directory",
    )
    ap.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"bpe: ids to learn, >= {MIN_BPE_VOCAB} (default {DEFAULT_BPE_VOCAB})",
    )
    ap.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="share of each file's tokens (its end) that goes to val.bin, in (0, 1); default 0.1",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        metavar="{auto,uint8,uint16,uint32}",
        help="token dtype: auto (the smallest that holds the vocabulary), uint8, uint16 or uint32",
    )
    ap.add_argument(
        "--glob",
        default="*",
        metavar="PATTERN",
        help="directory input: file names to read (default: all)",
    )
    ap.add_argument(
        "--bpe-sample-mb",
        type=float,
        metavar="MB",
        default=DEFAULT_BPE_SAMPLE_MB,
        help=f"bpe: train on at most this much text, spread over the corpus (default "
        f"{DEFAULT_BPE_SAMPLE_MB})",
    )
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    return _check_args(ap.parse_args(argv))


def _check_args(args: argparse.Namespace) -> argparse.Namespace:
    """The rules between ``prepare``'s arguments (one ConfigError line each); a bpe
    ``--vocab-size`` left out takes its default."""
    if args.tokenizer not in KINDS and not args.tokenizer.startswith("hf:"):
        raise ConfigError(
            f"--tokenizer {args.tokenizer!r}: expected one of {', '.join(KINDS)}, or hf:DIR "
            "(a Hugging Face model directory's tokenizer.json)"
        )
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r}: expected auto, {', '.join(DTYPES)}")
    if not 0 < args.val_fraction < 1:
        raise ConfigError(
            f"--val-fraction {args.val_fraction}: expected a number in (0, 1), e.g. 0.1"
        )
    if not args.bpe_sample_mb > 0 or not math.isfinite(args.bpe_sample_mb):
        raise ConfigError(f"--bpe-sample-mb {args.bpe_sample_mb}: expected a number > 0")
    if args.tokenizer != "bpe":
        if args.vocab_size is not None:
            raise ConfigError(
                f"--vocab-size {args.vocab_size}: only --tokenizer bpe takes a vocabulary "
                "size (char: the characters of the text, byte: 256)"
            )
    else:
        if args.vocab_size is None:
            args.vocab_size = DEFAULT_BPE_VOCAB
        largest = max(DTYPES.values())
        if args.vocab_size > largest:
            raise ConfigError(
                f"--vocab-size {args.vocab_size}: too large for the largest token dtype, "
                f"uint32 (at most {largest} ids)"
            )
        if args.vocab_size < MIN_BPE_VOCAB:
            raise ConfigError(
                f"--vocab-size {args.vocab_size}: too small for bpe, which needs at least "
                f"{MIN_BPE_VOCAB} ids (256 byte values and <|endoftext|>)"
            )
        if args.dtype != "auto":
            check_dtype(args.vocab_size, args.dtype, f"--vocab-size {args.vocab_size}")
    return args


def check_dtype(vocab_size: int, dtype: str, what: str) -> None:
    if vocab_size > DTYPES[dtype]:
        raise ConfigError(
            f"{what}: {vocab_size} ids do not fit --dtype {dtype} (at most {DTYPES[dtype]}); "
            "use a larger dtype or --dtype auto"
        )


def smallest_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype whose values cover ids ``0 .. vocab_size - 1``."""
    return next(name for name, n in DTYPES.items() if vocab_size <= n)


# -- the output: token files ---------------------------------------------------------------


class TokenWriter:
    """Appends token ids to train.bin / val.bin; counts and moves a file's tail."""

    def __init__(self, directory: Path, dtype: str):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.files = {s: open(directory / f"{s}.bin", "w+b") for s in ("train", "val")}
        self.tokens = {"train": 0, "val": 0}

    def write(self, split: str, ids: np.ndarray) -> None:
        if len(ids):
            self.files[split].write(np.asarray(ids).astype(self.dtype, copy=False).tobytes())
            self.tokens[split] += len(ids)

    def move_tail(self, count: int) -> None:
        """Move the last ``count`` tokens of train.bin to the end of val.bin."""
        if count <= 0:
            return
        train, size = self.files["train"], self.dtype.itemsize
        end = self.tokens["train"] * size
        pos = end - count * size
        while pos < end:
            train.seek(pos)
            block = train.read(min(COPY_BYTES, end - pos))
            self.files["val"].write(block)
            pos += len(block)
        train.seek(end - count * size)
        train.truncate()
        self.tokens["train"] -= count
        self.tokens["val"] += count

    def close(self) -> dict:
        """Flush, fsync and close; the meta.json entries of both files (with sha256)."""
        out = {}
        for split, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            h = hashlib.sha256()
            for block in iter(lambda f=f: f.read(COPY_BYTES), b""):
                h.update(block)
            f.close()
            out[split] = {
                "file": f"{split}.bin",
                "tokens": self.tokens[split],
                "sha256": h.hexdigest(),
            }
        return out


def _say(msg: str) -> None:
    print(f"nnlite prepare: {msg}", file=sys.stderr, flush=True)


def _bar(total: int, desc: str):
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, tests)
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        file=sys.stderr, disable=None, leave=False, dynamic_ncols=True,
    )  # fmt: skip


# -- the three tokenizers' passes ---------------------------------------------------------


def _n_train(n: int, val_fraction: float) -> int:
    return int(n * (1 - val_fraction))  # as train/data/text/corpus.py and nanoGPT split


def char_vocabulary(sources, val_fraction, where) -> tuple[str, list[int]]:
    """``(vocab, characters per file)``: the sorted characters of the files' training
    parts (first pass). Per file it keeps where each character first appears, so the
    training part's characters are known once the file's length is."""
    vocab: set[int] = set()
    counts = []
    with _bar(sum(s.size for s in sources), "vocabulary") as bar:
        for src in sources:
            first: dict[int, int] = {}  # code point -> first position in the file
            n = 0
            for text in read_text(src, where, bar):
                cps = code_points(text)
                present = np.flatnonzero(np.bincount(cps)).tolist()
                for c in present:
                    if c not in first:  # str.find stops at the first one: usually early
                        first[c] = n + text.find(chr(c))
                n += len(cps)
            s = _n_train(n, val_fraction)
            vocab.update(c for c, p in first.items() if p < s)
            counts.append(n)
    return "".join(map(chr, sorted(vocab))), counts


def encode_char(sources, tok, counts, val_fraction, writer, where) -> dict:
    """Second pass of char: each file's characters, split at its training length; the
    validation characters outside the vocabulary are dropped (and counted)."""
    dropped: dict[int, int] = {}
    with _bar(sum(s.size for s in sources), "encode") as bar:
        for src, n in zip(sources, counts):
            s, pos = _n_train(n, val_fraction), 0
            for text in read_text(src, where, bar):
                ids = tok.ids_or_minus_one(text)
                cut = min(max(s - pos, 0), len(ids))
                writer.write("train", ids[:cut])
                val = ids[cut:]
                bad = val < 0
                if bad.any():
                    cps = code_points(text)[cut:][bad]
                    for c, k in zip(*np.unique(cps, return_counts=True)):
                        dropped[int(c)] = dropped.get(int(c), 0) + int(k)
                    val = val[~bad]
                writer.write("val", val)
                pos += len(ids)
    return {
        "count": sum(dropped.values()),
        "chars": "".join(map(chr, sorted(dropped))),
    }


def encode_byte(sources, val_fraction, writer, where) -> None:
    with _bar(sum(s.size for s in sources), "encode") as bar:
        for src in sources:
            s, pos = _n_train(src.size, val_fraction), 0
            for block in read_blocks(src, where, bar):
                ids = np.frombuffer(block, np.uint8)
                cut = min(max(s - pos, 0), len(ids))
                writer.write("train", ids[:cut])
                writer.write("val", ids[cut:])
                pos += len(ids)


def train_bpe(sources, vocab_size, sample_mb, where) -> tuple[BPETokenizer, dict]:
    """First pass of bpe: read (and check) everything, train on every k-th chunk."""
    total = sum(s.size for s in sources)
    every = max(1, math.ceil(total / (sample_mb * 1e6)))
    used = [0]

    def texts():
        i = 0
        with _bar(total, "train bpe") as bar:
            for src in sources:
                for pieces in bpe_pieces(src, where, bar):
                    if i % every == 0:
                        used[0] += sum(len(p) for p in pieces)
                        yield pieces
                    i += 1

    tok = BPETokenizer.train(texts(), vocab_size)
    sample = {"every_nth_chunk": every, "chunk_bytes": CHUNK_BYTES, "characters": used[0]}
    return tok, sample


def encode_bpe(sources, tok, val_fraction, writer, where) -> None:
    """Second pass of bpe: each file's tokens go to train.bin; once the file's count ``n``
    is known its last ``n - int(n * (1 - f))`` move to val.bin. Each split's part of a
    file ends with ``<|endoftext|>``."""
    eot = np.array([tok.eot_id], np.int32)
    with _bar(sum(s.size for s in sources), "encode") as bar:
        for src in sources:
            n = 0
            for pieces in bpe_pieces(src, where, bar):
                for i in range(0, len(pieces), BPE_BATCH_PIECES):
                    for ids in tok.encode_batch(pieces[i : i + BPE_BATCH_PIECES]):
                        writer.write("train", ids)
                        n += len(ids)
            writer.move_tail(n - _n_train(n, val_fraction))
            if _n_train(n, val_fraction):
                writer.write("train", eot)
            if n - _n_train(n, val_fraction):
                writer.write("val", eot)


# -- the command --------------------------------------------------------------------------


def prepare(args: argparse.Namespace, work: Path, sources: list[Source]) -> dict:
    """Tokenise ``sources`` into the directory ``work``; return the metadata (also written there)."""
    where = f"--input {args.input!r}"
    f = args.val_fraction
    extra: dict = {}
    if args.tokenizer == "char":
        vocab, counts = char_vocabulary(sources, f, where)
        if not vocab:
            raise _empty_split(where, "train", f)
        tok = CharTokenizer(vocab)
        dtype = _dtype(args, tok.vocab_size, f"the char vocabulary of {len(vocab)} characters")
        writer = TokenWriter(work, dtype)
        extra["dropped_val_chars"] = encode_char(sources, tok, counts, f, writer, where)
    elif args.tokenizer == "byte":
        tok = ByteTokenizer()
        writer = TokenWriter(work, _dtype(args, 256, "the byte vocabulary"))
        encode_byte(sources, f, writer, where)
    elif args.tokenizer.startswith("hf:"):
        tok = from_hf(args.tokenizer[3:])
        writer = TokenWriter(work, _dtype(args, tok.vocab_size, "the model's vocabulary"))
        encode_bpe(sources, tok, f, writer, where)
    else:
        tok, extra["bpe_training_sample"] = train_bpe(
            sources, args.vocab_size, args.bpe_sample_mb, where
        )
        if tok.vocab_size < args.vocab_size:
            _say(f"the text gave {tok.vocab_size} ids (--vocab-size {args.vocab_size} asked)")
        writer = TokenWriter(work, _dtype(args, tok.vocab_size, "the bpe vocabulary"))
        encode_bpe(sources, tok, f, writer, where)
    splits = writer.close()
    for split in ("train", "val"):
        if splits[split]["tokens"] == 0:
            raise _empty_split(where, split, f)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.save(work),
        "dtype": writer.dtype.name,
        "byteorder": "little",
        **splits,
        "val_fraction": f,
        "split": "per file: its first int(n * (1 - val_fraction)) of n tokens to train, "
        "the rest to val" + ("; <|endoftext|> ends each part" if tok.kind == "bpe" else ""),
        "input": args.input,
        "glob": args.glob,
        "sources": [{"path": s.name, "bytes": s.size} for s in sources],
        **extra,
    }
    with open(work / "meta.json", "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    return meta


def _empty_split(where: str, split: str, val_fraction: float) -> ConfigError:
    return ConfigError(
        f"{where}: the {split} split came out empty (--val-fraction {val_fraction}); "
        "expected more text or another --val-fraction"
    )


def _dtype(args, vocab_size: int, what: str) -> str:
    if args.dtype == "auto":
        return smallest_dtype(vocab_size)
    check_dtype(vocab_size, args.dtype, what)
    return args.dtype


def _interrupted(signum, _frame):
    raise faults.Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    saved = {s: signal.signal(s, _interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    work = None  # the staging directory, removed unless it became --out
    t0 = time.perf_counter()
    try:
        args = parse_args(argv)
        out = Path(args.out)
        sources = find_sources(args.input, args.glob, exclude=out.resolve())
        staging.check_out(out, args.force)
        work, removed = staging.create(out)
        for p in removed:
            _say(f"removed {p}, left by an interrupted run")
        meta = prepare(args, work, sources)
        staging.commit(work, out, args.force)
        work = None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    except faults.Interrupted as e:
        print(f"stopped by {e.signal_name}: nothing was written to --out", file=sys.stderr)
        return faults.EXIT_PREEMPTED
    except OSError as e:  # the disk filled up, a directory vanished or became read-only
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}; nothing was written to --out", file=sys.stderr)
        return faults.EXIT_FAILURE
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - t0
    mb = sum(s["bytes"] for s in meta["sources"]) / 1e6
    tk = meta["tokenizer"]
    print(
        f"wrote {out}: {meta['train']['tokens']:,} train + {meta['val']['tokens']:,} val "
        f"tokens ({meta['dtype']}, {tk['kind']} vocabulary of {tk['vocab_size']:,}) from "
        f"{len(meta['sources'])} file(s), {mb:,.1f} MB in {seconds:.1f} s "
        f"({mb / max(seconds, 1e-9):,.1f} MB/s)"
    )
    dropped = meta.get("dropped_val_chars", {}).get("count")
    if dropped:
        chars = meta["dropped_val_chars"]["chars"]
        _say(f"dropped {dropped} validation characters absent from the training split ({chars!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
