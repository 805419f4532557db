"""Sampling from a decoder with a key/value cache: greedy, temperature, top-k and top-p."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["generate", "sample_logits"]


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
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
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
    drawn = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(jnp.asarray(temperature) == 0, greedy, drawn)


def generate(
    model: Any,
    params: Any,
    prompt: jax.Array,
    n_tokens: int,
    key: jax.Array,
    temperature: Any = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """``prompt [batch, P]`` followed by ``n_tokens`` sampled tokens, ``[batch, P + n]``.

    ``model`` provides ``empty_cache(batch, length, dtype)`` and ``decode_step(params, cache,
    tokens [batch, T], pos) -> (logits [batch, T, vocab], cache)``. The prompt goes through
    in one call (prefill), then a ``lax.fori_loop`` feeds one token at a time against a
    fixed-size cache of ``P + n`` positions. Traceable: jit it with ``n_tokens``, ``top_k``
    and ``top_p`` static. Token ``i`` is drawn with ``fold_in(key, i)``.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"generate: prompt must be integer ids [batch, P], got {prompt.shape}")
    if not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"generate: n_tokens must be an int >= 0, got {n_tokens!r}")
    batch, p_len = prompt.shape
    total = p_len + n_tokens
    if p_len < 1:
        raise ValueError("generate: the prompt needs at least one token")
    if total > model.context:
        raise ValueError(
            f"generate: prompt ({p_len}) + n_tokens ({n_tokens}) = {total} exceeds the "
            f"model's context of {model.context} positions"
        )
    if n_tokens == 0:
        return prompt
    prompt = prompt.astype(jnp.int32)
    cache = model.empty_cache(batch, total)
    logits, cache = model.decode_step(params, cache, prompt, 0)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k, top_p)
    buf = jnp.zeros((batch, total), jnp.int32).at[:, :p_len].set(prompt)
    buf = buf.at[:, p_len].set(first.astype(jnp.int32))

    def step(i, state):
        buf, cache = state
        pos = p_len + i - 1  # the position of the token fed now
        tok = jax.lax.dynamic_slice_in_dim(buf, pos, 1, axis=1)
        logits, cache = model.decode_step(params, cache, tok, pos)
        nxt = sample_logits(logits[:, -1], jax.random.fold_in(key, i), temperature, top_k, top_p)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None].astype(jnp.int32), pos + 1, 1)
        return buf, cache

    buf, _ = jax.lax.fori_loop(1, n_tokens, step, (buf, cache))
    return buf
