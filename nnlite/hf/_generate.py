"""Sampling from a decoder with a key/value cache: greedy, temperature, top-k and top-p,
a repetition penalty, stop ids, and batches of prompts of different lengths (left padding).

One compiled program per (model, prompt bucket, ``n_tokens``, batch, ``top_k``, ``top_p``):
prompts are left-padded to a power of two (:func:`bucket`), so a new prompt length within a
bucket compiles nothing; temperature, penalty, stop and pad ids are traced values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._compile import jit

__all__ = ["bucket", "generate", "generate_stream", "sample_logits"]

#: The shortest prompt bucket: prompts of 1..8 tokens share one program.
MIN_BUCKET = 8


def sample_logits(
    logits: jax.Array,
    key: jax.Array,
    temperature: Any = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """One token id per row of ``logits [batch, vocab]``.

    ``temperature == 0`` is greedy (argmax); otherwise a draw from ``softmax(logits /
    temperature)`` after, in this order (as ``transformers``' logits warpers), keeping the
    ``top_k`` largest and keeping the smallest set of most likely tokens whose probability
    reaches ``top_p`` (nucleus sampling; the most likely token is always kept).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
        >>> int(jax.jit(sample_logits)(logits, jax.random.key(0), temperature=0)[0])
        0
        >>> @jax.jit
        ... def draw_200(key):  # 200 draws with top_p=0.7, as one compiled program
        ...     keys = jax.random.split(key, 200)
        ...     return jax.vmap(lambda k: sample_logits(logits, k, top_p=0.7))(keys)
        >>> draws = draw_200(jax.random.key(0))
        >>> sorted(set(draws[:, 0].tolist()))  # 0.5 + 0.3 reaches 0.7: tokens 0 and 1 only
        [0, 1]
    """
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    if isinstance(temperature, int | float) and temperature == 0:
        return greedy
    temperature = jnp.asarray(temperature)

    def draw():
        t = jnp.maximum(temperature.astype(jnp.float32), 1e-6)
        scaled = logits / t
        if top_k is not None and top_k < logits.shape[-1]:
            kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        if top_p is not None and top_p < 1:
            order = jnp.argsort(-scaled, axis=-1)
            sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
            drop_sorted = before >= top_p
            drop = (
                jnp.zeros_like(drop_sorted)
                .at[jnp.arange(scaled.shape[0])[:, None], order]
                .set(drop_sorted)
            )
            scaled = jnp.where(drop, -jnp.inf, scaled)
        drawn = jax.random.categorical(key, scaled, axis=-1).astype(greedy.dtype)
        return jnp.where(temperature == 0, greedy, drawn)

    # A traced temperature of 0 (greedy) skips the draw at run time: its random numbers,
    # their logs over the vocabulary and top_p's sort (the 135M Llama's greedy decoding:
    # 1.3 ms of each 43 ms token).
    return jax.lax.cond(jnp.all(temperature == 0), lambda: greedy, draw)


def bucket(length: int) -> int:
    """The padded prompt width for a prompt of ``length`` tokens: the next power of two,
    at least ``MIN_BUCKET``.

    Example:
        >>> [bucket(n) for n in (1, 8, 9, 100)]
        [8, 8, 16, 128]
    """
    return max(MIN_BUCKET, 1 << (max(int(length), 1) - 1).bit_length())


def penalize(logits: jax.Array, seen: jax.Array, penalty: Any) -> jax.Array:
    """``transformers``' repetition penalty: the logits of tokens already ``seen [batch,
    vocab]`` divided by ``penalty`` where positive, multiplied where negative."""
    hit = jnp.where(logits < 0, logits * penalty, logits / penalty)
    return jnp.where(seen, hit, logits)


class _Opts:
    """The traced sampling settings (one program serves every value)."""

    def __init__(self, key, temperature, penalty, stop, pad):
        self.key, self.temperature, self.penalty = key, temperature, penalty
        self.stop, self.pad = stop, pad


jax.tree_util.register_pytree_node(
    _Opts,
    lambda o: ((o.key, o.temperature, o.penalty, o.stop, o.pad), None),
    lambda _, c: _Opts(*c),
)


def _pick(logits, state, i, opts, top_k, top_p):
    """Token ``i`` of each row (``pad`` for a row already stopped) and the state's
    ``seen`` and ``done`` after it."""
    logits = penalize(logits.astype(jnp.float32), state["seen"], opts.penalty)
    key = jax.random.fold_in(opts.key, i)
    nxt = sample_logits(logits, key, opts.temperature, top_k, top_p).astype(jnp.int32)
    nxt = jnp.where(state["done"], opts.pad, nxt)
    rows = jnp.arange(nxt.shape[0])
    seen = state["seen"].at[rows, nxt].set(True, mode="drop")
    return nxt, seen, state["done"] | jnp.isin(nxt, opts.stop)


def _prefill(model, params, prompt, mask, opts, n_tokens, top_k, top_p) -> dict:
    """The state after the left-padded ``prompt [batch, W]`` (``mask``: its real tokens)
    and the first new token: ``buf [batch, W + n]``, the cache, ``keys`` (the cache slots
    a query may see), ``lengths`` (real prompt tokens), ``seen``, ``done``, ``i`` (tokens
    made)."""
    batch, width = prompt.shape
    total = width + n_tokens
    prompt = jnp.where(mask, prompt, 0)
    keys = jnp.concatenate([mask, jnp.ones((batch, n_tokens), bool)], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
    cache = model.empty_cache(batch, total)
    logits, cache = model.decode_step(params, cache, prompt, 0, mask=keys, positions=positions)
    rows = jnp.arange(batch)[:, None]
    seen = (
        jnp.zeros((batch, logits.shape[-1]), jnp.int32).at[rows, prompt].max(mask.astype(jnp.int32))
    )
    state = {"seen": seen > 0, "done": jnp.zeros((batch,), bool)}
    nxt, seen, done = _pick(logits[:, -1], state, 0, opts, top_k, top_p)
    buf = jnp.full((batch, total), opts.pad, jnp.int32).at[:, :width].set(prompt)
    buf = buf.at[:, width].set(nxt)
    lengths = jnp.sum(mask, axis=1, dtype=jnp.int32)
    one = jnp.int32(1)
    state = dict(buf=buf, cache=cache, keys=keys, lengths=lengths, seen=seen, done=done)
    return {**state, "i": one, "last": nxt}


def _step(model, params, state, opts, width, top_k, top_p) -> dict:
    """Feed token ``i - 1`` (at cache slot ``width + i - 1``), draw token ``i``."""
    i = jnp.asarray(state["i"], jnp.int32)
    slot = width + i - 1
    tok = jax.lax.dynamic_slice_in_dim(state["buf"], slot, 1, axis=1)
    pos = (state["lengths"] + i - 1)[:, None]
    logits, cache = model.decode_step(
        params, state["cache"], tok, slot, mask=state["keys"], positions=pos
    )
    nxt, seen, done = _pick(logits[:, -1], state, i, opts, top_k, top_p)
    buf = jax.lax.dynamic_update_slice_in_dim(state["buf"], nxt[:, None], slot + 1, axis=1)
    new = {"buf": buf, "cache": cache, "seen": seen, "done": done, "i": i + 1, "last": nxt}
    return {**state, **new}


_STATIC = ("model", "n_tokens", "top_k", "top_p")


@functools.partial(jit, static_argnames=_STATIC)
def _run(model, params, prompt, mask, opts, *, n_tokens, top_k, top_p):
    """The whole generation as one program: prefill, then a ``while_loop`` until
    ``n_tokens`` are made or every row has stopped."""
    state = _prefill(model, params, prompt, mask, opts, n_tokens, top_k, top_p)
    width = prompt.shape[1]

    def more(s):
        return (s["i"] < n_tokens) & ~jnp.all(s["done"])

    state = jax.lax.while_loop(
        more, lambda s: _step(model, params, s, opts, width, top_k, top_p), state
    )
    return state["buf"]


@functools.partial(jit, static_argnames=_STATIC)
def _first(model, params, prompt, mask, opts, *, n_tokens, top_k, top_p):
    return _prefill(model, params, prompt, mask, opts, n_tokens, top_k, top_p)


@functools.partial(jit, static_argnames=(*_STATIC, "width"))
def _next(model, params, state, opts, *, width, n_tokens, top_k, top_p):
    return _step(model, params, state, opts, width, top_k, top_p)


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _prepare(model, prompt, n_tokens, key, temperature, top_k, top_p, attention_mask,
             stop_ids, pad_id, repetition_penalty):  # fmt: skip
    """Checked arguments: ``(prompt, mask)`` left-padded to their bucket, the traced
    options, the static ones, and the caller's prompt width."""
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"generate: prompt must be integer ids [batch, P], got {prompt.shape}")
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
        raise ValueError(f"generate: n_tokens must be an int >= 0, got {n_tokens!r}")
    batch, p_len = prompt.shape
    if p_len < 1:
        raise ValueError("generate: the prompt needs at least one token")
    if attention_mask is None:
        mask = jnp.ones((batch, p_len), bool)
    else:
        mask = jnp.asarray(attention_mask)
        if mask.shape != prompt.shape:
            raise ValueError(
                f"generate: attention_mask has shape {tuple(mask.shape)}, the prompt "
                f"{tuple(prompt.shape)}"
            )
        mask = mask.astype(bool)
    longest = p_len
    if _concrete(mask):
        m = np.asarray(mask)
        lengths = m.sum(1)
        if (lengths == 0).any():
            raise ValueError(
                f"generate: row {int(np.argmin(lengths))} of attention_mask has no token"
            )
        # left padding: each row's real tokens are its last ones
        left = m == (np.arange(p_len)[None, :] >= p_len - lengths[:, None])
        if not left.all():
            raise ValueError(
                f"generate: row {int(np.argmin(left.all(1)))} of attention_mask is not left "
                "padding (zeros, then ones to the end): pad prompts on the left"
            )
        longest = int(lengths.max())
    limit = getattr(model, "max_positions", None) or model.context
    if longest + n_tokens > limit:
        raise ValueError(
            f"generate: prompt ({longest}) + n_tokens ({n_tokens}) = {longest + n_tokens} "
            f"exceeds the model's context of {limit} positions"
        )
    if stop_ids is None:
        stop_ids = getattr(model, "stop_ids", None) or ()
    stop = tuple(int(s) for s in ([stop_ids] if isinstance(stop_ids, int) else stop_ids))
    if any(s < 0 for s in stop):
        raise ValueError(f"generate: stop_ids must be token ids >= 0, got {stop}")
    if pad_id is None:
        pad_id = stop[0] if stop else 0
    if repetition_penalty is None:
        repetition_penalty = 1.0
    if _concrete(repetition_penalty) and not float(repetition_penalty) > 0:
        raise ValueError(f"generate: repetition_penalty must be > 0, got {repetition_penalty!r}")
    width = bucket(p_len)
    prompt = jnp.pad(prompt.astype(jnp.int32), ((0, 0), (width - p_len, 0)))
    mask = jnp.pad(mask, ((0, 0), (width - p_len, 0)))
    opts = _Opts(
        key,
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(repetition_penalty, jnp.float32),
        # padded with -1 (no token) to a multiple of 4: another list compiles nothing new
        jnp.asarray(stop + (-1,) * (-len(stop) % 4 or (0 if stop else 4)), jnp.int32),
        jnp.asarray(pad_id, jnp.int32),
    )
    static = dict(n_tokens=n_tokens, top_k=top_k, top_p=top_p)
    return prompt, mask, opts, static, p_len


def generate(
    model: Any,
    params: Any,
    prompt: jax.Array,
    n_tokens: int,
    key: jax.Array,
    temperature: Any = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    *,
    attention_mask: jax.Array | None = None,
    stop_ids: Any = None,
    pad_id: int | None = None,
    repetition_penalty: Any = None,
) -> jax.Array:
    """``prompt [batch, P]`` followed by ``n_tokens`` sampled tokens, ``[batch, P + n]``.

    ``model`` provides ``context``, ``empty_cache(batch, length, dtype)`` and
    ``decode_step(params, cache, tokens [batch, T], slot, *, mask, positions) -> (logits,
    cache)``. The prompt goes through in one call (prefill), then a ``lax.while_loop``
    feeds one token at a time against a fixed-size cache, until ``n_tokens`` are made or
    every row has made a stop id. Token ``i`` is drawn with ``fold_in(key, i)``.

    Args:
        temperature: 0 is greedy; ``top_k``, ``top_p`` as :func:`sample_logits`.
        attention_mask: ``[batch, P]``, 1 for a prompt's tokens and 0 for padding, which
            must be on the left (prompts of different lengths end at the same column);
            each row's positions count its own tokens, so a row gives what it gives alone.
        stop_ids: end-of-text ids: a row that makes one is done (the id is kept, ``pad_id``
            follows). Default: the model's ``stop_ids`` (``nl.hf.Pretrained``: its
            directory's ``eos_token_id``), else none.
        pad_id: what follows a stop (default: the first stop id, else 0).
        repetition_penalty: as ``transformers``: the logits of the tokens a row has seen
            (its prompt, padding excluded, and its new tokens) divided by it where
            positive, multiplied where negative; None or 1 is none.

    Prompts are left-padded to a power of two (:func:`bucket`) inside: one compiled
    program per bucket, not per prompt length. Callable under ``jax.jit`` with
    ``n_tokens``, ``top_k`` and ``top_p`` static.
    """
    prompt, mask, opts, static, p_len = _prepare(
        model, prompt, n_tokens, key, temperature, top_k, top_p, attention_mask, stop_ids,
        pad_id, repetition_penalty,
    )  # fmt: skip
    if n_tokens == 0:
        return prompt[:, prompt.shape[1] - p_len :]
    out = _run(model, params, prompt, mask, opts, **static)
    return out[:, prompt.shape[1] - p_len :]


def generate_stream(
    model: Any,
    params: Any,
    prompt: jax.Array,
    n_tokens: int,
    key: jax.Array,
    temperature: Any = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    **options: Any,
) -> Iterator[np.ndarray]:
    """:func:`generate` one token at a time: yields each step's new tokens ``[batch]``
    (numpy; ``pad_id`` for a row already stopped) as soon as they are made, until
    ``n_tokens`` or every row has stopped. The same tokens as :func:`generate` (the same
    prefill and step, compiled as two programs and driven from Python)."""
    prompt, mask, opts, static, _ = _prepare(
        model, prompt, n_tokens, key, temperature, top_k, top_p,
        options.pop("attention_mask", None), options.pop("stop_ids", None),
        options.pop("pad_id", None), options.pop("repetition_penalty", None),
    )  # fmt: skip
    if options:
        raise TypeError(f"generate_stream: unexpected argument {sorted(options)[0]!r}")
    if n_tokens == 0:
        return
    width = prompt.shape[1]
    state = _first(model, params, prompt, mask, opts, **static)
    for i in range(1, n_tokens + 1):
        yield np.asarray(state["last"])
        if i == n_tokens or bool(np.all(np.asarray(state["done"]))):
            return
        state = _next(model, params, state, opts, width=width, **static)
