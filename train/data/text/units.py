"""What a language model's loss is per: tokens, and characters where the data knows how
many characters its tokens stand for.

The step reports a language model's cross-entropy in bits as ``bits_per_char`` (its name
since char-level text, where a token is a character). For prepared tokens of a ``byte`` or
``bpe`` tokenizer that is bits per *token*: :func:`name_metrics` renames it
``bits_per_token`` and adds the true ``bits_per_char`` (bits per token over the evaluated
targets' characters per token) where the tokenizer's pieces give their characters.
"""

from __future__ import annotations

import numpy as np


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): each byte as the printable character that
    stands for it in a ``tokenizers`` ByteLevel vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def _chars_of_bytes(data: bytes) -> int:
    """Characters that ``data`` (UTF-8) contributes: its bytes that are not continuation
    bytes, so a character split over two tokens counts once, with its first byte."""
    return sum(1 for b in data if not 0x80 <= b <= 0xBF)


def char_lengths(tok) -> np.ndarray | None:
    """``[vocab_size]`` characters each token id decodes to (None: unknown)."""
    kind = getattr(tok, "kind", None)
    if kind == "char":
        return np.ones(tok.vocab_size, np.int64)
    if kind == "byte":
        return np.array([_chars_of_bytes(bytes([b])) for b in range(tok.vocab_size)], np.int64)
    if kind == "bpe":
        back = {c: b for b, c in _bytes_to_unicode().items()}
        out = np.zeros(tok.vocab_size, np.int64)
        for i in range(tok.vocab_size):
            piece = tok.tokenizer.id_to_token(i)
            if piece is None or i == tok.eot_id or any(c not in back for c in piece):
                continue  # a special token: no text
            out[i] = _chars_of_bytes(bytes(back[c] for c in piece))
        return out
    return None


def chars_per_token(tok, targets: np.ndarray) -> float | None:
    """Characters per token of the evaluated ``targets`` (token ids), or None."""
    lengths = char_lengths(tok)
    targets = np.asarray(targets)
    if lengths is None or targets.size == 0:
        return None
    return float(lengths[targets.reshape(-1)].sum()) / targets.size


def name_metrics(metrics: dict, unit: str | None, chars_per_tok: float | None) -> dict:
    """``metrics`` with ``bits_per_char`` named for what it is: for ``unit="token"``,
    ``bits_per_token``, plus ``bits_per_char`` where ``chars_per_tok`` is known (only for
    the evaluation, whose targets it was counted on)."""
    if unit != "token" or "bits_per_char" not in metrics:
        return metrics
    out = {}
    for k, v in metrics.items():
        if k != "bits_per_char":
            out[k] = v
            continue
        out["bits_per_token"] = v
        if chars_per_tok:
            out["bits_per_char"] = v / chars_per_tok
    return out
