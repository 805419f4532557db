"""Rotary position embeddings (RoPE, Su et al. 2021): ``rotary`` with its hand rule, and the
layer.

Pairs of features are rotated by an angle proportional to the position: feature ``j`` and
``j + D/2`` of a vector at position ``p`` turn by ``p * base ** (-2j / D)`` (the
"rotate-half" pairing of GPT-NeoX, LLaMA in Hugging Face and Equinox). A rotation is
orthogonal, so its VJP is the inverse rotation of the cotangent. Queries and keys rotated
this way give attention scores that depend on positions only through ``p_q - p_k``, and a
key rotated once at its absolute position can sit in a key/value cache.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule

__all__ = ["RotaryEmbedding", "rotary", "rotary_vjp"]


def _cos_sin(x: jax.Array, positions: jax.Array, base: float):
    """``cos`` and ``sin`` of the angles, ``[..., D/2]`` laid out against ``x [..., D]``, in
    float32 at least (angles of positions in the thousands need its precision)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=acc) * (2.0 / x.shape[-1]))
    lead = x.ndim - 1
    pos = positions.reshape((1,) * (lead - positions.ndim) + positions.shape).astype(acc)
    angles = pos[..., None] * inv_freq.reshape((1,) * lead + (half,))
    angles = jnp.broadcast_to(angles, x.shape[:-1] + (half,))
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    acc = cos.dtype
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(acc), x[..., half:].astype(acc)
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x.dtype)


def _check(x: Any, positions: Any) -> None:
    if x.shape[-1] % 2:
        raise ValueError(f"rotary: the last axis must have even size, got shape {x.shape}")
    dtype = getattr(positions, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"rotary: positions must be an integer array, got "
            f"{dtype if dtype is not None else type(positions).__name__}"
        )
    if positions.ndim > x.ndim - 1:
        raise ValueError(
            f"rotary: positions of shape {positions.shape} must broadcast to x's leading "
            f"axes {x.shape[:-1]}"
        )


def rotary_vjp(x, positions, dret, *, base: float = 10000.0):
    """Hand VJP of ``rotary``: the cotangent rotated back (by minus the angles); ``None``
    for the integer positions."""
    cos, sin = _cos_sin(x, positions, base)
    return _rotate(dret, cos, -sin).astype(x.dtype), None


@hand_rule(rotary_vjp)
def rotary(x: jax.Array, positions: jax.Array, *, base: float = 10000.0) -> jax.Array:
    """Rotate the feature pairs ``(j, j + D/2)`` of ``x: [..., D]`` by ``positions * base **
    (-2j / D)``; ``positions`` is an integer array broadcastable to ``x.shape[:-1]``
    (``[T, 1]`` against ``[B, T, heads, D]``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.array([[1.0, 0.0], [1.0, 0.0]])  # D = 2: one pair, frequency 1
        >>> print(jax.jit(rotary)(x, jnp.array([0, 1])).round(4))  # position 1: (cos 1, sin 1)
        [[1.     0.    ]
         [0.5403 0.8415]]
    """
    _check(x, positions)
    return _rotate(x, *_cos_sin(x, positions, base))


class RotaryEmbedding(Module):
    """Rotary position embedding (RoPE): rotates feature pairs by position-dependent angles;
    applied to queries and keys, attention depends on relative positions only (Equinox
    ``eqx.nn.RotaryPositionalEmbedding``; Flax: none). ``MultiHeadAttention(rotary=True)``
    applies it to q and k.

    Positions run along ``seq_axis``: ``offset, offset + 1, ...``. ``offset`` (an int, may
    be traced) is where the sequence starts: a decoder with a key/value cache rotates the
    new token's q and k at its absolute position, so cached keys never need re-rotating.
    ``positions`` (an integer array broadcastable to ``x.shape[:-1]``) overrides both.
    No params.

    Args:
        features: size of the rotated last axis (the head dimension); even.
        base: the wavelength scale; pair ``j`` turns at ``base ** (-2j / features)``
            radians per position.
        seq_axis: the position axis of the input, negative: ``-2`` for ``[..., T,
            features]``, ``-3`` for attention's ``[..., T, heads, head_dim]``.

    ``__call__(params, x, *, offset=0, positions=None)``: same shape and dtype as ``x``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> rope = RotaryEmbedding(8, seq_axis=-3)
        >>> q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))  # [B, T, heads, D]
        >>> rope_jit = jax.jit(rope)  # offset may be traced (a cached decoder's position)
        >>> rope_jit(rope.init(None), q).shape
        (2, 5, 4, 8)
        >>> last = rope_jit(ParamsDict(), q[:, 4:], offset=4)  # the 5th token alone, at position 4
        >>> bool(jnp.allclose(last, rope_jit(ParamsDict(), q)[:, 4:], atol=1e-6))
        True
    """

    features: int
    base: float = 10000.0
    seq_axis: int = -2

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("features")
        if self.features % 2:
            raise ValueError(f"RotaryEmbedding: features must be even, got {self.features}")
        if not (isinstance(self.base, int | float) and self.base > 1):
            raise ValueError(f"RotaryEmbedding: base must be a number > 1, got {self.base!r}")
        if not (isinstance(self.seq_axis, int) and self.seq_axis <= -2):
            raise ValueError(
                "RotaryEmbedding: seq_axis must be a negative int <= -2 (counted from the "
                f"end, before the feature axis), got {self.seq_axis!r}"
            )

    def init(self, key: jax.Array) -> ParamsDict:
        return ParamsDict()

    def positions(self, length: int, offset: Any = 0) -> jax.Array:
        """``offset + arange(length)`` laid out along ``seq_axis`` (``[T, 1, ...]``)."""
        p = jnp.arange(length, dtype=jnp.int32) + jnp.asarray(offset, jnp.int32)
        return p.reshape((length,) + (1,) * (-self.seq_axis - 2))

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        offset: Any = 0,
        positions: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        self.check_input(x, self.features, min_rank=-self.seq_axis)
        if positions is None:
            positions = self.positions(x.shape[self.seq_axis], offset)
        return rotary(x, positions, base=float(self.base))
