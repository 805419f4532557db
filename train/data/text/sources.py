"""The input of ``nnlite-train prepare``: which files, read in chunks, checked as text.

``find_sources`` lists the files of ``--input`` (see train/prepare.py for the rule);
``read_blocks`` streams a file's bytes in blocks of :data:`CHUNK_BYTES` and notices a file
that changes while it is read; ``read_text`` decodes them as strict UTF-8 (an incremental
decoder carries a character cut by a block boundary over to the next block) and calls a
NUL byte or invalid UTF-8 a binary file; ``bpe_pieces`` cuts the text at newlines into
pieces that the BPE encodes in parallel. Errors are ConfigError: one line naming the file.
"""

from __future__ import annotations

import codecs
import fnmatch
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError, relative_to

CHUNK_BYTES = 4 << 20  # read size; prepare's peak memory is a small multiple of it
BPE_PIECE_CHARS = 64 << 10  # bpe encodes chunks as pieces of this size (at newlines), in parallel


@dataclass(frozen=True)
class Source:
    path: Path  # what is opened
    name: str  # the path relative to --input (posix), or the file's name; in meta.json
    size: int
    mtime_ns: int


def find_sources(input_path: str, glob: str, exclude: Path | None = None) -> list[Source]:
    """The files of ``--input`` in reading order (the rule is in train/prepare.py's
    docstring); the directory ``exclude`` (``--out``, inside ``--input``) is skipped."""
    root = Path(input_path)
    where = f"--input {input_path!r}"
    if not root.exists():
        if root.is_symlink():
            raise ConfigError(f"{where}: a broken symbolic link; expected a file or directory")
        raise ConfigError(f"{where}: no such file or directory{relative_to(root)}")
    if not root.is_dir():
        src = _source(root, root.name, where)
        if src.size == 0:
            raise ConfigError(f"{where}: the file is empty; expected text")
        return [src]
    found = []

    def fail(e: OSError):
        raise ConfigError(f"{where}: cannot list {e.filename} ({e.strerror})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and (exclude is None or (Path(dirpath) / d).resolve() != exclude)
        )
        for f in filenames:
            if f.startswith(".") or not fnmatch.fnmatchcase(f, glob):
                continue
            path = Path(dirpath) / f
            found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    sources = [_source(path, name, where) for name, path in found]
    if not sources:
        raise ConfigError(
            f"{where}: no files to read (none matches --glob {glob!r}; names starting "
            "with '.' are skipped); expected text files"
        )
    if not any(s.size for s in sources):
        raise ConfigError(f"{where}: all {len(sources)} files are empty; expected text")
    return sources


def _source(path: Path, name: str, where: str) -> Source:
    try:
        st = path.stat()
    except OSError as e:
        kind = "a broken symbolic link" if path.is_symlink() else e.strerror
        raise ConfigError(f"{where}: cannot read {name} ({kind})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{where}: {name} is not a regular file (a FIFO, socket or device); expected text files"
        )
    return Source(path, name, st.st_size, st.st_mtime_ns)


def read_blocks(src: Source, where: str, progress=None) -> Iterator[bytes]:
    """The bytes of ``src`` in blocks of ``CHUNK_BYTES``; a file that changes meanwhile
    (another size or modification time than when it was listed) is an error."""
    try:
        f = open(src.path, "rb")
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {src.name} ({e.strerror})") from None
    with f:
        left = src.size
        while left > 0:
            try:
                block = f.read(min(CHUNK_BYTES, left))
            except OSError as e:
                raise ConfigError(f"{where}: cannot read {src.name} ({e.strerror})") from None
            if not block:
                break
            left -= len(block)
            if progress is not None:
                progress.update(len(block))
            yield block
        st = os.fstat(f.fileno())
        if left or (st.st_size, st.st_mtime_ns) != (src.size, src.mtime_ns):
            raise ConfigError(
                f"{where}: {src.name} changed while it was being read (it was "
                f"{src.size} bytes); rerun once the input is stable"
            )


def read_text(src: Source, where: str, progress=None) -> Iterator[str]:
    """The text of ``src`` in chunks cut at character boundaries; a NUL byte or invalid
    UTF-8 is an error (a binary file, or another encoding)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # of the block being decoded, in the file
    for block in read_blocks(src, where, progress):
        nul = block.find(b"\0")
        if nul >= 0:
            raise ConfigError(
                f"{where}: {src.name} is binary (a NUL byte at offset {offset + nul}); "
                f"expected UTF-8 text (--tokenizer byte reads any bytes)"
            )
        try:
            text = decoder.decode(block)
        except UnicodeDecodeError as e:
            raise _not_utf8(src, where, offset, e) from None
        offset += len(block)
        yield text
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise _not_utf8(src, where, offset, e) from None


def _not_utf8(src: Source, where: str, offset: int, e: UnicodeDecodeError) -> ConfigError:
    # The decoder's buffer holds at most 3 bytes of the previous block: the offset is near.
    return ConfigError(
        f"{where}: {src.name} is not UTF-8 text (byte {e.object[e.start]:#04x} near offset "
        f"{max(offset + e.start - 3, 0)}); convert it to UTF-8, or use --tokenizer byte"
    )


def split_pieces(text: str, size: int) -> tuple[list[str], str]:
    """``(pieces, rest)``: ``text`` cut into pieces of at most ``size`` characters, each
    ending just after a newline where the piece has one; ``rest`` (the text after the
    last cut, shorter than ``size``) is for the caller to prepend to the next text."""
    pieces, start = [], 0
    while len(text) - start >= size:
        cut = text.rfind("\n", start, start + size)
        cut = start + size if cut < 0 else cut + 1
        pieces.append(text[start:cut])
        start = cut
    return pieces, text[start:]


def bpe_pieces(src: Source, where: str, progress=None) -> Iterator[list[str]]:
    """The text of ``src`` as lists of pieces (:func:`split_pieces`), one list per chunk."""
    rest = ""
    for text in read_text(src, where, progress):
        pieces, rest = split_pieces(rest + text, BPE_PIECE_CHARS)
        yield pieces
    if rest:
        yield [rest]
