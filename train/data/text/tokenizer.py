"""Tokenizers of prepared token files: ``char``, ``byte`` and ``bpe``.

Each maps text to integer ids and back: ``encode(text) -> int32 array``, ``decode(ids) ->
str``, ``vocab_size``; ``save(dir)`` writes what it needs beside the token files and returns
its entry of ``meta.json``; ``from_dir(dir)`` (or ``from_meta``) rebuilds it.

- ``char``: one id per character, the vocabulary being the sorted characters (code point
  order) of the training text, as ``data.name: text`` builds it (train/data/text/corpus.py). Stored
  in ``meta.json`` itself. Characters outside the vocabulary cannot be encoded.
- ``byte``: the 256 byte values of the UTF-8 encoding; any text (any file) is encodable.
  Decoding replaces a cut multi-byte sequence by U+FFFD, so decoding whole text is exact.
- ``bpe``: a byte-level BPE trained with the ``tokenizers`` package (``pip install
  'nnlite[text]'``), saved as ``tokenizer.json``: GPT-2's byte-to-character alphabet and
  pre-tokenizing regex, no normaliser, no prefix space, so ``decode(encode(text)) == text``
  for every string. Id 0 is the special ``<|endoftext|>`` that prepare puts after each
  file; text that happens to contain that string is encoded as ordinary text.

Example:
    >>> tok = CharTokenizer("\\n abc")
    >>> tok.encode("cab a").tolist()
    [4, 2, 3, 1, 2]
    >>> tok.decode([4, 2, 3])
    'cab'
    >>> ByteTokenizer().decode(ByteTokenizer().encode("é!"))
    'é!'
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ...errors import ConfigError

KINDS = ("char", "byte", "bpe")
EOT = "<|endoftext|>"  # bpe's special token: id 0, the end of each file in the token stream
BPE_FILE = "tokenizer.json"
MAX_CODE_POINT = 0x10FFFF


class CharTokenizer:
    """One id per character of ``vocab`` (its characters in id order, sorted, unique)."""

    kind = "char"

    def __init__(self, vocab: str):
        if not vocab or list(vocab) != sorted(set(vocab)):
            raise ConfigError("a char vocabulary must be non-empty, sorted and without repeats")
        self.vocab = vocab
        self.code_points = np.frombuffer(vocab.encode("utf-32-le"), np.uint32).astype(np.int64)
        # id of each code point up to the largest in the vocabulary, -1 where there is none
        self._lut = np.full(int(self.code_points[-1]) + 1, -1, np.int32)
        self._lut[self.code_points] = np.arange(len(vocab), dtype=np.int32)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def ids_or_minus_one(self, text: str) -> np.ndarray:
        """int32 ids of ``text``'s characters, -1 for characters outside the vocabulary."""
        cps = code_points(text)
        if not len(cps) or cps.max() < len(self._lut):
            return self._lut[cps]
        ids = np.full(len(cps), -1, np.int32)
        inside = cps < len(self._lut)
        ids[inside] = self._lut[cps[inside]]
        return ids

    def encode(self, text: str) -> np.ndarray:
        ids = self.ids_or_minus_one(text)
        if (ids < 0).any():
            unknown = sorted({c for c, i in zip(text, ids.tolist()) if i < 0})
            raise ConfigError(
                f"text has characters outside the vocabulary: {''.join(unknown)!r}; "
                f"the vocabulary is {self.vocab!r}"
            )
        return ids

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in np.asarray(ids, np.int64).tolist())

    def save(self, directory: Path) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "vocab": self.vocab}


class ByteTokenizer:
    """The 256 byte values of UTF-8 text."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return np.asarray(ids).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory: Path) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}


class BPETokenizer:
    """A byte-level BPE of the ``tokenizers`` package (see the module docstring)."""

    kind = "bpe"

    def __init__(self, tokenizer):
        tokenizer.encode_special_tokens = True  # "<|endoftext|>" in text is just text
        self.tokenizer = tokenizer
        self.eot_id = tokenizer.token_to_id(EOT)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str | list[str]], vocab_size: int) -> BPETokenizer:
        """Learn merges from ``texts`` (strings, or lists of strings: pieces of a stream
        that ``tokenizers`` pre-tokenizes in parallel) up to ``vocab_size`` ids."""
        tk = _tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,  # prepare's own bar counts input bytes
        )
        # The trainer runs on a thread while this one waits in short joins: its merge
        # phase is native code that can run for minutes without returning to Python, and
        # signal handlers (Ctrl-C, SIGTERM) only run in the main thread between bytecodes.
        stop = threading.Event()
        failed: list[BaseException] = []

        def feed():
            for t in _flatten(texts):
                if stop.is_set():
                    raise RuntimeError("stopped")
                yield t

        def work():
            try:
                tok.train_from_iterator(feed(), trainer)
            except BaseException as e:  # noqa: B036 -- raised again in the caller's thread
                failed.append(e)

        thread = threading.Thread(target=work, name="nnlite-bpe-train", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.2)
        except BaseException:
            stop.set()  # the trainer stops at its next text; the caller cleans up
            raise
        if failed:
            raise failed[0]
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each string, on all cores (the package's thread pool)."""
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use
        fast = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        out = fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in out]

    def decode(self, ids) -> str:
        ids = np.asarray(ids, np.int64).tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def save(self, directory: Path) -> dict:
        path = Path(directory) / BPE_FILE
        self.tokenizer.save(str(path))
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "file": BPE_FILE,
            "sha256": sha,
            "eot_id": self.eot_id,
        }

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        tk = _tokenizers()
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as e:  # the package raises its own exception types
            raise ConfigError(f"{path}: not a readable tokenizers file ({e})") from None


def from_hf(directory: str | Path) -> BPETokenizer:
    """The tokenizer of a Hugging Face model directory (``--tokenizer hf:DIR``): its
    ``tokenizer.json`` as a ``bpe`` tokenizer (the whole file travels with the tokens and
    the checkpoints), the model's end-of-sequence token ending each file."""
    import nnlite as nl  # start-up: JAX, which `nnlite-train prepare` needs only for hf:DIR

    try:
        hf = nl.hf.load_tokenizer(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer hf:{directory}: {e}") from None
    tok = BPETokenizer(hf.tokenizer)
    if hf.eos_id is not None:
        tok.eot_id = hf.eos_id
    if tok.eot_id is None:
        raise ConfigError(
            f"--tokenizer hf:{directory}: the tokenizer has no end-of-sequence token (none in "
            "config.json's eos_token_id nor tokenizer_config.json's eos_token) to end each file"
        )
    return tok


def _flatten(texts: Iterable[str | list[str]]) -> Iterator[str]:
    for t in texts:
        if isinstance(t, str):
            yield t
        else:
            yield from t


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "--tokenizer bpe needs the tokenizers package: pip install 'nnlite[text]' "
            "(or pip install tokenizers)"
        ) from None
    return tokenizers


def code_points(text: str) -> np.ndarray:
    """The code points of ``text`` as an integer array (uint8 for ASCII, else uint32)."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def from_meta(directory: str | Path, entry: dict):
    """The tokenizer described by the ``tokenizer`` entry of a prepared dir's meta.json."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    where = f"{Path(directory) / 'meta.json'}: tokenizer"
    if kind == "char":
        vocab = entry.get("vocab")
        if not isinstance(vocab, str):
            raise ConfigError(f"{where}: a char tokenizer needs a 'vocab' string")
        tok = CharTokenizer(vocab)
    elif kind == "byte":
        tok = ByteTokenizer()
    elif kind == "bpe":
        name = entry.get("file", BPE_FILE)
        if not isinstance(name, str) or Path(name).name != name:
            raise ConfigError(f"{where}: 'file' must be a file name, got {name!r}")
        tok = BPETokenizer.load(Path(directory) / name)
    else:
        raise ConfigError(f"{where}: kind {kind!r}, expected one of {', '.join(KINDS)}")
    if tok.vocab_size != entry.get("vocab_size"):
        raise ConfigError(
            f"{where}: vocab_size {entry.get('vocab_size')!r} but the {kind} tokenizer has "
            f"{tok.vocab_size} ids"
        )
    return tok


def from_dir(directory: str | Path):
    """The tokenizer of a directory written by ``nnlite-train prepare``."""
    path = Path(directory) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the metadata of prepared tokens ({e})") from None
    return from_meta(directory, meta.get("tokenizer"))


def to_spec(tok) -> str:
    """A self-contained JSON string describing ``tok`` (e.g. for checkpoint metadata, so a
    run can decode without the prepared directory): its meta entry, and for bpe the
    whole tokenizer.json."""
    if tok.kind == "bpe":
        return json.dumps({"kind": "bpe", "tokenizer_json": tok.tokenizer.to_str()})
    return json.dumps(tok.save(Path(".")), ensure_ascii=False)


def from_spec(spec: str):
    """The tokenizer of a :func:`to_spec` string."""
    entry = json.loads(spec)
    if entry.get("kind") == "bpe":
        return BPETokenizer(_tokenizers().Tokenizer.from_str(entry["tokenizer_json"]))
    return from_meta(".", entry)
