"""``data.name: chat``: conversations of a JSONL file for a Hugging Face chat model.

One example a line: ``{"messages": [{"role": ..., "content": ...}, ...]}``, ``{"prompt": ...,
"completion": ...}`` (strings, or lists of messages) or a preference triple ``{"prompt":
..., "chosen": ..., "rejected": ...}``. Each conversation is rendered with the tokenizer's
own chat template and tokenized as ``transformers``' ``apply_chat_template`` does
(``nnlite/hf/_chat.py``); the tokenizer is ``data.tokenizer``'s directory, by default the
model's (``model.name: "hf:DIR"``).

Targets: the next token where it is the assistant's (``data.train_on: assistant``, the
default) or any token (``all``), else ``-1`` (no loss). Rows are windows of ``data.context``
tokens: ``x [n, 2, T]`` holds the tokens and their segment ids, ``y [n, T]`` the targets.
With ``data.pack`` (the default) several conversations share a window, one after another
in file order, each its own segment (1, 2, ...; 0 is padding): the model attends within a
segment and restarts its positions there (``segment_ids=``), so a packed conversation
has the logits it has alone. Without, each conversation has a window of its own.

Preference triples for ``loss.name: dpo`` are rows ``x [n, 2, 2, T]`` (chosen, rejected;
tokens, segment ids) and ``y [n, 2, T]`` (targets on the completion's tokens only), one pair
a row, never packed.

The rows are a map-style data set, so the batch order is a pure function of (seed, step)
and a resumed run reads the batches it would have read. ``data.test_fraction`` of the
lines (drawn by ``data.split_seed``) is held out for evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import nnlite as nl

from ..errors import ConfigError
from .dataset import Dataset
from .split import split_indices
from .text.tokenizer import BPETokenizer, to_spec

ROLES = ("system", "user", "assistant", "tool")
_SHAPES = (
    '{"messages": [{"role": ..., "content": ...}]}, {"prompt": ..., "completion": ...} or '
    '{"prompt": ..., "chosen": ..., "rejected": ...}'
)


def _messages(value: Any, default_role: str, where: str) -> list[dict]:
    """A prompt/completion value as messages: a string is one message of ``default_role``."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a string or a non-empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: message {i} is not an object with role and content")
        if "role" not in m:
            raise ConfigError(f"{where}: message {i} has no 'role'")
        if m["role"] not in ROLES:
            raise ConfigError(
                f"{where}: message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: message {i} has no string 'content'")
    return value


def parse_line(text: str, where: str) -> tuple[str, Any]:
    """``("conversation", messages)`` or ``("pair", (prompt, chosen, rejected))`` of one
    JSONL line; a ConfigError naming ``where`` (file:line) for anything else."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON ({e}); expected {_SHAPES}") from None
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where}: a JSON {type(obj).__name__}, not an object; expected {_SHAPES}"
        )
    if "messages" in obj:
        return "conversation", _messages(obj["messages"], "user", f"{where}: messages")
    if "prompt" in obj and "completion" in obj:
        prompt = _messages(obj["prompt"], "user", f"{where}: prompt")
        return "conversation", prompt + _messages(
            obj["completion"], "assistant", f"{where}: completion"
        )
    if {"prompt", "chosen", "rejected"} <= set(obj):
        prompt = _messages(obj["prompt"], "user", f"{where}: prompt")
        chosen = _messages(obj["chosen"], "assistant", f"{where}: chosen")
        rejected = _messages(obj["rejected"], "assistant", f"{where}: rejected")
        return "pair", (prompt, chosen, rejected)
    raise ConfigError(f"{where}: keys {sorted(obj)}; expected {_SHAPES}")


def read_lines(path: Path) -> list[tuple[str, str, Any]]:
    """``[(file:line, kind, value)]`` of the non-blank lines of ``path``."""
    where = f"data.path {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where}: file not found; expected a JSONL file of conversations")
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    at = f"{path}:{n}"
                    out.append((at, *parse_line(line, at)))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason})") from None
    if not out:
        raise ConfigError(f"{where}: no conversations (the file is empty)")
    return out


class Encoder:
    """Conversations as ``(ids, targets)`` with the template and tokenizer of a directory."""

    def __init__(self, directory: str, train_on: str):
        where = f"data.tokenizer {directory!r}"
        try:
            self.tokenizer = nl.hf.load_tokenizer(directory)
            self.template = nl.hf.load_chat_template(directory)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None
        self.train_on = train_on

    def targets(self, messages: list[dict], where: str, first: int = 0):
        """``(ids [L], targets [L])``: ``targets[t]`` is ``ids[t + 1]`` where that token takes
        a loss (the assistant's from message ``first`` on, or all), else -1."""
        try:  # a template's raise_exception, or one that cannot render these messages
            ids, mask = nl.hf.encode_chat(self.tokenizer, self.template, messages)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        if first:  # a pair's completion: only the tokens after the prompt's rendering
            prompt = self.template.render(messages[:first], add_generation_prompt=True)
            n = len(self.tokenizer.encode(prompt))
            mask[:n] = False
        if self.train_on == "all" and not first:
            mask[:] = True
        if not mask[1:].any():
            raise ConfigError(
                f"{where}: no assistant tokens to train on (data.train_on: {self.train_on}); "
                "a conversation needs an assistant message"
            )
        tgt = np.full(len(ids), -1, np.int32)
        tgt[:-1] = np.where(mask[1:], ids[1:], -1)
        return ids, tgt


def pack(docs: list[tuple[np.ndarray, np.ndarray]], context: int, packed: bool, pad: int):
    """Windows ``x [n, 2, context]`` (tokens, segment ids) and ``y [n, context]`` of ``docs``
    (each cut to ``context`` tokens), several a window when ``packed``."""
    windows: list[list] = []
    used = context
    for ids, tgt in docs:
        ids, tgt = ids[:context], tgt[:context]
        if not packed or used + len(ids) > context:
            windows.append([])
            used = 0
        windows[-1].append((ids, tgt))
        used += len(ids)
    x = np.zeros((len(windows), 2, context), np.int32)
    x[:, 0] = pad
    y = np.full((len(windows), context), -1, np.int32)
    for w, parts in enumerate(windows):
        at = 0
        for s, (ids, tgt) in enumerate(parts, 1):
            x[w, 0, at : at + len(ids)], x[w, 1, at : at + len(ids)] = ids, s
            y[w, at : at + len(ids)] = tgt
            at += len(ids)
    return x, y


def pairs(rows: list[tuple], context: int, pad: int):
    """``x [n, 2, 2, context]`` and ``y [n, 2, context]`` of (chosen, rejected) pairs."""
    x = np.zeros((len(rows), 2, 2, context), np.int32)
    x[:, :, 0] = pad
    y = np.full((len(rows), 2, context), -1, np.int32)
    for r, pair in enumerate(rows):
        for k, (ids, tgt) in enumerate(pair):
            n = min(len(ids), context)
            x[r, k, 0, :n], x[r, k, 1, :n], y[r, k, :n] = ids[:n], 1, tgt[:n]
    return x, y


def chat(data, context: int) -> Dataset:
    """``data.name: chat`` (module docstring)."""
    cfg = data  # the section
    if not cfg.tokenizer:
        raise ConfigError(
            "data.name=chat renders conversations with a model's chat template: set "
            'model.name: "hf:DIR" or data.tokenizer: DIR'
        )
    lines = read_lines(Path(cfg.path))
    enc = Encoder(cfg.tokenizer, cfg.train_on)
    kinds = {kind for _, kind, _ in lines}
    if len(kinds) > 1:
        first = next(at for at, kind, _ in lines if kind == "pair")
        raise ConfigError(
            f"{first}: a preference triple among conversations; a file holds one kind "
            "(conversations for SFT, triples for loss.name: dpo)"
        )
    if kinds == {"pair"} and cfg.train_on != "assistant":
        raise ConfigError(
            f"data.train_on={cfg.train_on}: preference pairs score their completions only; "
            "leave data.train_on at assistant"
        )
    examples, cut = [], 0
    for at, kind, value in lines:
        if kind == "conversation":
            ids, tgt = enc.targets(value, at)
            cut += len(ids) > context
            examples.append((ids, tgt))
        else:
            prompt, chosen, rejected = value
            pair = tuple(enc.targets(prompt + c, at, first=len(prompt)) for c in (chosen, rejected))
            if any(not (tgt[:context] >= 0).any() for _, tgt in pair):
                raise ConfigError(
                    f"{at}: the prompt fills data.context={context} tokens, leaving none of a "
                    "completion to score; raise data.context or shorten the prompt"
                )
            cut += any(len(ids) > context for ids, _ in pair)
            examples.append(pair)
    try:
        train, test = split_indices(len(examples), cfg.test_fraction, cfg.split_seed)
    except ValueError as e:
        raise ConfigError(
            f"data.path {cfg.path!r}: data.test_fraction={cfg.test_fraction} cannot split its "
            f"{len(examples)} lines: {e}"
        ) from None
    tok = enc.tokenizer
    pad = tok.eos_id if tok.eos_id is not None else 0
    if kinds == {"pair"}:
        (x, y), (xt, yt) = (
            pairs([examples[i] for i in part], context, pad) for part in (train, test)
        )
    else:
        pk = cfg.pack
        (x, y), (xt, yt) = (
            pack([examples[i] for i in sorted(part)], context, pk, pad) for part in (train, test)
        )
    note = f"{cut} of {len(examples)} lines cut to data.context={context} tokens" if cut else ""
    kind = "preference pairs" if kinds == {"pair"} else "conversations"
    return Dataset(
        "chat",
        x,
        y,
        xt,
        yt,
        tok.vocab_size,
        token_rows=context,
        note=f"{len(examples)} {kind}" + (f"; {note}" if note else ""),
        tokenizer=to_spec(BPETokenizer(tok.tokenizer)),
        loss_unit="token",
    )
