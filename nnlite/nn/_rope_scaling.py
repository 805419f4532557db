"""Rotary embeddings with explicit frequencies: ``rope`` with its hand rule, and the
frequency tables of the rope-scaling kinds pretrained decoders use (linear, Llama 3, YaRN).

``RotaryEmbedding`` (``_rotary.py``) turns pair ``j`` at ``base ** (-2j / D)``; a long-context
checkpoint stretches those frequencies instead, and YaRN also scales ``cos`` and ``sin`` by an
"attention factor". Both come down to ``rope(x, positions, inv_freq=..., attention_factor=...)``
with a table computed once from the checkpoint's config by :func:`rope_frequencies`, in float32
as Hugging Face ``transformers`` computes it, so the angles agree to the bit where the
arithmetic is the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..grad._manual import hand_rule

__all__ = ["ROPE_SCALING_KINDS", "rope", "rope_frequencies", "rope_vjp"]

#: The ``rope_scaling`` kinds ``rope_frequencies`` computes (``rope_type`` or ``type``).
ROPE_SCALING_KINDS = ("default", "linear", "llama3", "yarn")


def _cos_sin(x: jax.Array, positions: jax.Array, inv_freq: tuple, attention_factor: float):
    acc = jnp.promote_types(x.dtype, jnp.float32)
    half = x.shape[-1] // 2
    if len(inv_freq) != half:
        raise ValueError(
            f"rope: {len(inv_freq)} frequencies for a last axis of {x.shape[-1]} (expected "
            f"{half}, one per feature pair)"
        )
    freq = jnp.asarray(np.asarray(inv_freq, np.float32), acc)
    lead = x.ndim - 1
    pos = positions.reshape((1,) * (lead - positions.ndim) + positions.shape).astype(acc)
    angles = pos[..., None] * freq.reshape((1,) * lead + (half,))
    angles = jnp.broadcast_to(angles, x.shape[:-1] + (half,))
    factor = jnp.asarray(attention_factor, acc)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(cos.dtype), x[..., half:].astype(cos.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_vjp(x, positions, dret, *, inv_freq: tuple, attention_factor: float = 1.0):
    """Hand VJP of ``rope``: a scaled rotation's transpose is the inverse rotation with the
    same scale, so the cotangent is turned back by the angles and scaled again."""
    cos, sin = _cos_sin(x, positions, inv_freq, attention_factor)
    return _rotate(dret, cos, -sin).astype(x.dtype), None


@hand_rule(rope_vjp)
def rope(
    x: jax.Array, positions: jax.Array, *, inv_freq: tuple, attention_factor: float = 1.0
) -> jax.Array:
    """Rotate the feature pairs ``(j, j + D/2)`` of ``x: [..., D]`` by ``positions *
    inv_freq[j]`` and scale by ``attention_factor`` (YaRN's; 1 otherwise), the "rotate-half"
    layout of Hugging Face's Llama. ``positions``: integers broadcastable to ``x.shape[:-1]``.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([[1.0, 0.0], [1.0, 0.0]])
        >>> y = rope(x, jnp.array([0, 1]), inv_freq=(0.5,))  # position 1: (cos 0.5, sin 0.5)
        >>> [[round(v, 4) for v in row] for row in y.tolist()]
        [[1.0, 0.0], [0.8776, 0.4794]]
    """
    if x.shape[-1] % 2:
        raise ValueError(f"rope: the last axis must have even size, got shape {x.shape}")
    return _rotate(x, *_cos_sin(x, positions, inv_freq, attention_factor))


def _get(scaling: Mapping, key: str, where: str) -> Any:
    if key not in scaling or scaling[key] is None:
        raise ValueError(f"{where}: rope_scaling of kind {scaling_kind(scaling)!r} needs {key!r}")
    return scaling[key]


def scaling_kind(scaling: Mapping | None) -> str:
    """``rope_type`` (or the older ``type``) of a ``rope_scaling`` dict; ``"default"``."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    *,
    max_position_embeddings: int | None = None,
    where: str = "rope",
) -> tuple[tuple[float, ...], float]:
    """``(inv_freq, attention_factor)`` for a head of ``head_dim`` features, base ``theta``
    and a Hugging Face ``rope_scaling`` dict (None: plain RoPE).

    Kinds: ``default``; ``linear`` (``factor``: positions divided by it); ``llama3``
    (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``:
    long wavelengths divided by ``factor``, short ones kept, a smooth ramp between);
    ``yarn`` (``factor``, optional ``beta_fast`` 32, ``beta_slow`` 1, ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``original_max_position_embeddings``,
    ``truncate``). ``dynamic`` NTK scaling changes the frequencies with the sequence length
    the model is called on, which a key/value cache cannot follow: refused, as is every
    other kind, by name.

    Example:
        >>> f, a = rope_frequencies(4, 10000.0, {"rope_type": "linear", "factor": 2.0})
        >>> [round(v, 6) for v in f], a
        ([0.5, 0.005], 1.0)
    """
    scaling = dict(scaling or {})
    kind = scaling_kind(scaling)
    if kind not in ROPE_SCALING_KINDS:
        raise ValueError(
            f"{where}: rope_scaling kind {kind!r} is not supported; supported: "
            + ", ".join(ROPE_SCALING_KINDS)
            + (
                " (dynamic NTK scaling re-derives the frequencies from each call's length, "
                "which a key/value cache cannot follow)"
                if "dynamic" in kind
                else ""
            )
        )
    if head_dim % 2:
        raise ValueError(f"{where}: rotary embeddings need an even head_dim, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    base_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
    attention_factor = 1.0
    if kind == "linear":
        inv = base_freq / np.float32(float(_get(scaling, "factor", where)))
    elif kind == "llama3":
        factor = float(_get(scaling, "factor", where))
        low = float(_get(scaling, "low_freq_factor", where))
        high = float(_get(scaling, "high_freq_factor", where))
        old = float(_get(scaling, "original_max_position_embeddings", where))
        wavelen = np.float32(2 * math.pi) / base_freq
        inv = np.where(wavelen > old / low, base_freq / np.float32(factor), base_freq)
        smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
        smoothed = (1 - smooth) * inv / np.float32(factor) + smooth * inv
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, inv)
    elif kind == "yarn":
        inv, attention_factor = _yarn(head_dim, theta, scaling, max_position_embeddings, where)
    else:
        inv = base_freq
    return tuple(float(v) for v in np.asarray(inv, np.float32)), float(attention_factor)


def _yarn(dim: int, theta: float, scaling: dict, max_positions: int | None, where: str):
    """YaRN (Peng et al. 2023): interpolate the low frequencies by ``factor``, keep the high
    ones, a linear ramp between the dimensions whose wavelengths fit ``beta_slow`` and
    ``beta_fast`` rotations in the original context; ``cos``/``sin`` scaled by
    ``0.1 ln(factor) + 1`` unless the config gives the attention factor."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    if original is None:
        raise ValueError(f"{where}: yarn rope_scaling needs original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        if not max_positions:
            raise ValueError(f"{where}: yarn rope_scaling needs 'factor'")
        factor = max_positions / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)
