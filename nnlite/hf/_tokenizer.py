"""A model directory's ``tokenizer.json`` as a tokenizer, through Hugging Face ``tokenizers``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ._config import HFConfigError, read_json

__all__ = [
    "TOKENIZER_FILES",
    "Tokenizer",
    "as_tokenizer",
    "check_tokenizer",
    "copy_tokenizer",
    "load_tokenizer",
    "stop_ids",
]

TOKENIZER_FILE = "tokenizer.json"
# Files beside tokenizer.json that transformers' AutoTokenizer reads; copied on save.
_SIDE_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)  # fmt: skip
#: What a model directory's tokenizer is: ``tokenizer.json`` and the files beside it.
TOKENIZER_FILES = (TOKENIZER_FILE, *_SIDE_FILES)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "nl.hf tokenizers need the 'tokenizers' package: pip install tokenizers"
        ) from None
    return tokenizers


class Tokenizer:
    """Text to ids and back with a Hugging Face fast tokenizer (``tokenizer.json``).

    ``encode(text) -> int32 array`` (without the special tokens a model's template adds,
    unless ``add_special_tokens=True``), ``decode(ids) -> str``, ``vocab_size``,
    ``eos_id`` (None where unknown), ``stop_ids`` (the end-of-text ids where generation
    stops: the directory's ``eos_token_id`` values), ``save(dir)``. The same protocol as the
    trainer's tokenizers, ``kind = "hf"``.
    """

    kind = "hf"

    def __init__(self, tokenizer, source: str | os.PathLike | None = None, eos_id=None):
        self.tokenizer = tokenizer
        self.source = None if source is None else Path(source)
        self.eos_id = eos_id
        self.stop_ids: tuple[int, ...] = () if eos_id is None else (int(eos_id),)

    @classmethod
    def from_file(cls, path: str | os.PathLike, error: type[Exception] = ValueError) -> Tokenizer:
        """A tokenizer from a ``tokenizer.json`` file (``error``, one line, if it is not
        one)."""
        tk = _tokenizers()
        try:
            tok = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # the package raises its own exception types
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise error(f"{path}: not a readable tokenizers file ({first})") from None
        return cls(tok, Path(path).parent)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: expected a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return np.asarray(ids, np.int32)

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"Tokenizer.decode: id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike, *, context: int | None = None) -> dict:
        """Write ``tokenizer.json`` into ``directory``, with the source directory's files
        beside it (``tokenizer_config.json``, ``special_tokens_map.json``, a chat
        template), or, for a tokenizer without them, a ``tokenizer_config.json`` naming its
        end-of-text token (and ``model_max_length=context``), so ``transformers``'
        ``AutoTokenizer.from_pretrained(directory)`` reads it; returns ``{"kind": "hf",
        "file": "tokenizer.json"}``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(d / TOKENIZER_FILE))
        if self.source is not None and self.source.resolve() != d.resolve():
            for name in _SIDE_FILES:
                if (self.source / name).is_file():
                    shutil.copyfile(self.source / name, d / name)
        if not (d / "tokenizer_config.json").is_file():
            special = {}
            if self.eos_id is not None:
                special["eos_token"] = self.tokenizer.id_to_token(int(self.eos_id))
            cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
            if context is not None:
                cfg["model_max_length"] = int(context)
            (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            (d / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        return {"kind": self.kind, "file": TOKENIZER_FILE}


def as_tokenizer(tokenizer: Any) -> Tokenizer:
    """An ``nl.hf.Tokenizer`` of ``tokenizer``: one already, a ``tokenizers.Tokenizer``, or
    a trainer's tokenizer that wraps one (``.tokenizer``, its end-of-text id ``eot_id``)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if type(inner).__module__.split(".")[0] == "tokenizers" and hasattr(inner, "to_str"):
        return Tokenizer(inner, eos_id=getattr(tokenizer, "eot_id", None))
    raise TypeError(
        "tokenizer: expected an nl.hf.Tokenizer, a tokenizers.Tokenizer or a trainer's BPE "
        f"tokenizer (a run on prepared tokens), got {type(tokenizer).__name__}"
    )


def copy_tokenizer(source: str | os.PathLike, directory: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files of the model directory ``source`` into ``directory``
    (those it has); returns their names."""
    src, d = Path(source), Path(directory)
    if src.resolve() == d.resolve():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, d / name)
            copied.append(name)
    return copied


def _ids(value: Any, path: Path, error: type[Exception]) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise error(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def stop_ids(directory: str | os.PathLike, error: type[Exception] = ValueError) -> tuple:
    """The end-of-text ids of a Hugging Face model directory, where generation stops:
    ``generation_config.json``'s ``eos_token_id`` (an id or a list), else ``config.json``'s;
    ``()`` where neither names one."""
    d = Path(directory)
    for name in ("generation_config.json", "config.json"):
        if (d / name).is_file():
            found = _ids(read_json(d / name, error).get("eos_token_id"), d / name, error)
            if found is not None:
                return found
    return ()


def check_tokenizer(directory: str | os.PathLike, vocab_size: int) -> None:
    """A directory's ``tokenizer.json`` (when it has one, and ``tokenizers`` is installed)
    must be readable and make no id past the model's ``vocab_size`` embedding rows."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        return
    try:
        _tokenizers()
    except ImportError:
        return  # nothing reads the tokenizer without the package
    n = Tokenizer.from_file(path, HFConfigError).vocab_size
    if n > vocab_size:
        raise HFConfigError(
            f"{path}: {n} tokens, more than the model's {vocab_size} embedding rows "
            f"(config.json vocab_size): the tokenizer is not this model's"
        )


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (its ``tokenizer.json``); ``eos_id``
    from ``config.json`` or ``tokenizer_config.json`` where they name one."""
    d = Path(directory)
    path = d / TOKENIZER_FILE if d.is_dir() else d
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory}: no {TOKENIZER_FILE} (nnlite reads Hugging Face fast tokenizers only)"
        )
    tok = Tokenizer.from_file(path)
    eos = None
    cfg = path.parent / "config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text()).get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and (path.parent / "tokenizer_config.json").is_file():
        name = json.loads((path.parent / "tokenizer_config.json").read_text()).get("eos_token")
        if isinstance(name, dict):
            name = name.get("content")
        if isinstance(name, str):
            eos = tok.tokenizer.token_to_id(name)
    tok.eos_id = eos
    tok.stop_ids = stop_ids(path.parent) or (() if eos is None else (int(eos),))
    return tok
