"""A language model's head and loss in chunks of tokens: the log-probability of each label
under ``softmax(h @ W)`` without ever holding all the logits.

At a real vocabulary the logits are the biggest tensor of a training step (SmolLM's 49,152
tokens: 200 MB in float32 for 4x256 tokens, and autodiff keeps them, and the softmax's
temporaries, for the backward pass). :func:`label_log_probs` forms one chunk of rows'
logits at a time (a ``lax.scan``), reduces each to its log-sum-exp and its label's logit,
and drops it; its hand rule recomputes each chunk's softmax in the backward pass and
accumulates ``dW`` chunk by chunk. Peak memory holds one chunk's logits; the price is the
head's matrix product once more (the backward pass recomputes the logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._gemm import matmul
from ..core._mode import is_frozen, manual_active
from ..grad._custom_vjp import _varying, plug
from ..grad._manual import hand_rule

__all__ = [
    "CHUNK_ELEMENTS",
    "CHUNK_MIN_TOKENS",
    "chunked_log_probs",
    "chunked_log_probs_vjp",
    "label_log_probs",
]

#: Logits per chunk when ``chunk`` is not given: 4M elements (16 MB in float32), but never
#: fewer than CHUNK_MIN_TOKENS tokens.
CHUNK_ELEMENTS = 1 << 22
#: The fewest tokens in a default chunk: each chunk's head is a matrix product with this many
#: rows, and fewer make a slow one. SmolLM-135M's head (49,152 x 576) over 1,024 tokens, its
#: gradient by this rule on 2 cores: chunks of 85 tokens (4M logits) 1.78 s, of 512
#: 1.34 s, of 1,024 1.13 s; PyTorch's through all the logits 1.07-1.30 s.
CHUNK_MIN_TOKENS = 1024


def _rows(w: jax.Array, vocab_axis: int, chunk: int | None, n: int) -> int:
    vocab = w.shape[vocab_axis]
    rows = chunk if chunk is not None else max(CHUNK_MIN_TOKENS, CHUNK_ELEMENTS // vocab)
    return max(1, min(rows, n))


def _split(a: jax.Array, rows: int) -> jax.Array:
    """``a [n, ...]`` zero-padded to a multiple of ``rows``, as ``[chunks, rows, ...]``."""
    pad = -a.shape[0] % rows
    if pad:
        a = jnp.concatenate([a, jnp.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(-1, rows, *a.shape[1:])


def _logits(h: jax.Array, w: jax.Array, vocab_axis: int, softcap) -> tuple:
    """One chunk's float32 logits ``[rows, vocab]`` (soft-capped when ``softcap``) and the
    capped logits over the cap, ``tanh`` (None without a cap: its derivative needs it)."""
    z = matmul(h, w, transpose_b=vocab_axis == 0, preferred_element_type=jnp.float32)
    if softcap is None:
        return z, None
    t = jnp.tanh(z / softcap)
    return softcap * t, t


def _flat(h, labels):
    return h.reshape(-1, h.shape[-1]), labels.reshape(-1)


def _forward(h, w, labels, vocab_axis, chunk, softcap):
    rows = _rows(w, vocab_axis, chunk, labels.size)
    hf, lf = _flat(h, labels)

    def one(_, hl):
        hc, lc = hl
        z, _t = _logits(hc, w, vocab_axis, softcap)
        lse = jax.nn.logsumexp(z, axis=-1)
        picked = jnp.take_along_axis(z, lc[:, None].astype(jnp.int32), axis=-1)[:, 0]
        return None, picked - lse

    _, out = jax.lax.scan(one, None, (_split(hf, rows), _split(lf, rows)))
    return out.reshape(-1)[: labels.size].reshape(labels.shape)


def _backward(h, w, labels, vocab_axis, chunk, softcap, dret):
    rows = _rows(w, vocab_axis, chunk, labels.size)
    hf, lf = _flat(h, labels)
    vocab = w.shape[vocab_axis]
    d = _split(dret.reshape(-1).astype(jnp.float32), rows)  # padded rows: zero cotangent

    def one(dw, hld):
        hc, lc, dc = hld
        z, t = _logits(hc, w, vocab_axis, softcap)
        p = jax.nn.softmax(z, axis=-1)
        hit = lc[:, None].astype(jnp.int32) == jnp.arange(vocab, dtype=jnp.int32)[None, :]
        g = dc[:, None] * (hit.astype(jnp.float32) - p)  # d(log p[label]) / dz
        if t is not None:
            g = g * (1 - t * t)  # through cap * tanh(a / cap)
        gc = g.astype(w.dtype)
        f32 = jnp.float32
        dh = matmul(gc, w, transpose_b=vocab_axis != 0, preferred_element_type=f32)
        if vocab_axis == 0:  # w [vocab, d]: z = h @ w.T
            dw = dw + matmul(gc, hc, transpose_a=True, preferred_element_type=f32)
        else:  # w [d, vocab]: z = h @ w
            dw = dw + matmul(hc, gc, transpose_a=True, preferred_element_type=f32)
        return dw, dh.astype(h.dtype)

    dw0 = jnp.zeros(w.shape, jnp.float32)
    axes = tuple(sorted(set().union(*(_varying(a) for a in (h, w, dret)))))
    if axes:  # inside shard_map: the sum varies over the mesh axes its terms vary over
        dw0 = jax.lax.pcast(dw0, axes, to="varying")
    dw, dh = jax.lax.scan(one, dw0, (_split(hf, rows), _split(lf, rows), d))
    dh = dh.reshape(-1, h.shape[-1])[: labels.size].reshape(h.shape)
    return dh, dw.astype(w.dtype)


def chunked_log_probs_vjp(h, w, labels, vocab_axis, chunk, softcap, dret):
    """The rule of :func:`chunked_log_probs`: each chunk's logits recomputed, ``g = dret *
    (onehot(label) - softmax)`` (times ``1 - tanh^2`` under a soft cap), ``dh = g @ W^T``
    per chunk and ``dW`` summed over the chunks (float32)."""
    return _backward(h, w, labels, vocab_axis, chunk, softcap, dret)


@hand_rule(chunked_log_probs_vjp)
def chunked_log_probs(h, w, labels, vocab_axis, chunk, softcap):
    """:func:`label_log_probs` without its checks: ``h [..., d]``, ``w`` (``vocab_axis`` 0:
    ``[vocab, d]``, -1: ``[d, vocab]``), ``labels [...]``, ``chunk`` tokens per chunk (None:
    :data:`CHUNK_ELEMENTS` logits), ``softcap`` (None or a float)."""
    return _forward(h, w, labels, vocab_axis, chunk, softcap)


def label_log_probs(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    vocab_axis: int = -1,
    chunk: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """``log softmax(h @ W)[label]`` for every token, a chunk of tokens at a time.

    Equal to ``jax.nn.log_softmax(logits)[..., label]`` of the full ``logits`` (float32),
    its gradient to autodiff's (a hand rule, under ``jax.grad`` as under
    ``nl.manual_grads``), but peak memory holds one chunk's logits, never ``[tokens,
    vocab]``. The cross-entropy is its negation; a sequence's log-likelihood (DPO) its sum.

    Args:
        h: ``[..., d]`` the features the head reads (after the final norm).
        w: the head's matrix: ``[d, vocab]`` (``vocab_axis=-1``, a ``Linear``'s ``W``) or
            ``[vocab, d]`` (``vocab_axis=0``, a tied token table).
        labels: ``[...]`` integer ids (``h``'s shape without its last axis).
        vocab_axis: which axis of ``w`` is the vocabulary, 0 or -1.
        chunk: tokens per chunk (None: as many as make :data:`CHUNK_ELEMENTS` logits, and
            at least :data:`CHUNK_MIN_TOKENS`).
        softcap: Gemma 2's ``cap * tanh(logits / cap)`` on the logits first (None: none).

    Returns:
        ``[...]`` float32 log-probabilities of the labels.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> h, w = jnp.ones((2, 3, 4)), jnp.zeros((4, 10))
        >>> label_log_probs(h, w, jnp.zeros((2, 3), jnp.int32), chunk=4).round(4)[0]
        Array([-2.3026, -2.3026, -2.3026], dtype=float32)
    """
    if vocab_axis not in (0, -1, 1):
        raise ValueError(f"label_log_probs: vocab_axis must be 0 or -1, got {vocab_axis!r}")
    vocab_axis = 0 if vocab_axis == 0 else -1
    if w.ndim != 2 or h.shape[-1] != w.shape[1 if vocab_axis == 0 else 0]:
        raise ValueError(
            f"label_log_probs: h {tuple(h.shape)} does not fit the head w {tuple(w.shape)} "
            f"with vocab_axis={vocab_axis} (expected h [..., {w.shape[1 if vocab_axis == 0 else 0]}])"
        )
    if labels.shape != h.shape[:-1] or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(
            f"label_log_probs: expected integer labels of shape {tuple(h.shape[:-1])}, got "
            f"{labels.dtype}{list(labels.shape)}"
        )
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"label_log_probs: chunk must be a positive int or None, got {chunk!r}")
    cap = None if softcap is None else float(softcap)
    args = (h, w, labels, vocab_axis, chunk, cap)
    if manual_active():
        return chunked_log_probs(*args)
    # autodiff: the same rule (autodiff of the scan would keep every chunk's logits); a
    # frozen head (LoRA's base) gets no dW, not even computed
    nondiff = [1] if is_frozen(w) else []
    return plug(
        _forward, chunked_log_probs_vjp, nondiff=nondiff, record=False, prune=bool(nondiff)
    )(*args)
