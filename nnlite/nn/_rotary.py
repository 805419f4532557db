"""Rotary position embeddings (RoPE, Su et al. 2021): ``rope`` with its hand rule, the
frequency tables of the rope-scaling kinds pretrained decoders use, and the layer.

Pairs of features are rotated by an angle proportional to the position: feature ``j`` and
``j + D/2`` of a vector at position ``p`` turn by ``p * inv_freq[j]`` (the "rotate-half"
pairing of GPT-NeoX, Llama in Hugging Face and Equinox), ``inv_freq[j] = base ** (-2j / D)``
unless a long-context checkpoint stretches the frequencies (its ``rope_scaling``: linear,
Llama 3, YaRN), which :func:`rope_frequencies` computes once from the config, in float32 as
Hugging Face ``transformers`` does, so the angles agree to the bit where the arithmetic is
the same; YaRN also scales ``cos`` and ``sin`` by an "attention factor". A rotation is
orthogonal, so its rule turns the cotangent back by the inverse rotation. Queries and keys
rotated this way give attention scores that depend on positions only through ``p_q - p_k``,
and a key rotated once at its absolute position can sit in a key/value cache.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ..grad._rule_table import register

__all__ = [
    "ROPE_SCALING_KINDS",
    "RotaryEmbedding",
    "rope",
    "rope_frequencies",
    "rope_vjp",
    "rotary",
    "rotary_vjp",
]

#: The ``rope_scaling`` kinds ``rope_frequencies`` computes (``rope_type`` or ``type``).
ROPE_SCALING_KINDS = ("default", "linear", "llama3", "yarn")


def _cos_sin(x, positions, base, inv_freq, attention_factor):
    """``cos`` and ``sin`` of the angles (times ``attention_factor``), ``[..., D/2]`` laid
    out against ``x [..., D]``, in float32 at least (angles of positions in the thousands
    need its precision)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    half = x.shape[-1] // 2
    if inv_freq is None:  # plain RoPE's table, as rope_frequencies computes it
        inv_freq = _frequencies(x.shape[-1], float(base), (), None)[0]
    if len(inv_freq) != half:
        raise ValueError(
            f"rope: {len(inv_freq)} frequencies for a last axis of {x.shape[-1]} (expected "
            f"{half}, one per feature pair)"
        )
    lead = x.ndim - 1
    # cos and sin at the positions' own shape (``[1, T, 1, D/2]`` against ``[B, T, H, D]``),
    # broadcast only where they multiply x. Static positions (numpy: a layer's ``0 .. T-1``)
    # give tables built here, constants of the program: XLA:CPU fuses the cos and sin of
    # traced positions into each consumer and evaluates them once per element of q and k.
    if isinstance(positions, np.ndarray) and positions.size * half <= MAX_TABLE:
        tables = _tables(positions.tobytes(), positions.dtype.str, positions.shape,
                         tuple(inv_freq), attention_factor, lead, np.dtype(acc).name)  # fmt: skip
        return jnp.asarray(tables[0]), jnp.asarray(tables[1])
    freq = jnp.asarray(np.asarray(inv_freq, np.float32), acc).reshape((1,) * lead + (half,))
    pos = jnp.asarray(positions)
    pos = pos.reshape((1,) * (lead - pos.ndim) + pos.shape).astype(acc)
    angles = pos[..., None] * freq
    if attention_factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    factor = jnp.asarray(attention_factor, acc)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


#: The most ``cos`` (and ``sin``) entries built at trace time as constants (1 MB in float32:
#: 8192 positions of a 64-wide head); longer tables are computed in the program.
MAX_TABLE = 1 << 18


@functools.lru_cache(maxsize=32)
def _tables(positions: bytes, kind: str, shape: tuple, inv_freq: tuple, factor, lead, dtype):
    """The ``(cos, sin)`` numpy tables of static positions (``positions`` their bytes, of
    numpy dtype ``kind``). Cached: every layer of a model gets the same two arrays, which a
    traced program then holds once."""
    pos = np.frombuffer(positions, np.dtype(kind)).reshape(shape)
    pos = pos.reshape((1,) * (lead - pos.ndim) + pos.shape)
    freq = np.asarray(inv_freq, np.float32).astype(dtype)
    angles = (pos[..., None].astype(dtype) * freq.reshape((1,) * lead + (-1,))).astype(np.float64)
    tables = (np.cos(angles) * factor).astype(dtype), (np.sin(angles) * factor).astype(dtype)
    for t in tables:
        t.flags.writeable = False  # shared by every caller
    return tables


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``[x1 cos - x2 sin, x2 cos + x1 sin]`` of the halves ``x1, x2`` of ``x: [..., D]``.
    Written over a pair axis, ``[..., 2, D/2]`` times its own reverse, not as two halves
    joined again: XLA:CPU runs a concatenating fusion 3-4 times slower (30 rotations of
    ``[4, 256, 9, 64]``: 65 ms against 20 ms)."""
    half = x.shape[-1] // 2
    pairs = x.reshape(*x.shape[:-1], 2, half).astype(cos.dtype)
    signed_sin = jnp.stack([-sin, sin], axis=-2)  # at cos's (small) shape
    y = pairs * cos[..., None, :] + jnp.flip(pairs, axis=-2) * signed_sin
    return y.reshape(x.shape).astype(x.dtype)


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


def rope_vjp(x, positions, dret, *, base=10000.0, inv_freq=None, attention_factor=1.0):
    """Hand rule of ``rope``: a (scaled) rotation's transpose is the inverse rotation with the
    same scale, so the cotangent is turned back by the angles and scaled again; ``None``
    for the integer positions."""
    cos, sin = _cos_sin(x, positions, base, inv_freq, attention_factor)
    return _rotate(dret, cos, -sin).astype(x.dtype), None


@hand_rule(rope_vjp)
def rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    base: float = 10000.0,
    inv_freq: tuple[float, ...] | None = None,
    attention_factor: float = 1.0,
) -> jax.Array:
    """Rotate the feature pairs ``(j, j + D/2)`` of ``x: [..., D]`` by ``positions *
    inv_freq[j]`` and scale by ``attention_factor`` (YaRN's; 1 otherwise); ``inv_freq``
    defaults to ``base ** (-2j / D)`` (plain RoPE; :func:`rope_frequencies` gives a scaled
    checkpoint's). ``positions``: integers broadcastable to ``x.shape[:-1]`` (``[T, 1]``
    against ``[B, T, heads, D]``). ``rotary`` is the same function.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.array([[1.0, 0.0], [1.0, 0.0]])  # D = 2: one pair, frequency 1
        >>> print(jax.jit(rope)(x, jnp.array([0, 1])).round(4))  # position 1: (cos 1, sin 1)
        [[1.     0.    ]
         [0.5403 0.8415]]
        >>> y = rope(x, jnp.array([0, 1]), inv_freq=(0.5,))  # position 1: (cos 0.5, sin 0.5)
        >>> [[round(v, 4) for v in row] for row in y.tolist()]
        [[1.0, 0.0], [0.8776, 0.4794]]
    """
    _check(x, positions)
    return _rotate(x, *_cos_sin(x, positions, base, inv_freq, attention_factor))


# The plain rotation's older name: the same rule, listed under both names in nl.rules.
rotary, rotary_vjp = rope, rope_vjp
register(rope, rope_vjp, "rotary")


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


class RotaryEmbedding(Module):
    """Rotary position embedding (RoPE): rotates feature pairs by position-dependent angles;
    applied to queries and keys, attention depends on relative positions only (Equinox
    ``eqx.nn.RotaryPositionalEmbedding``; Flax: none). The attention layers apply it to q
    and k (``MultiHeadAttention(rotary=True)``, ``GroupedQueryAttention``).

    Positions run along ``seq_axis``: ``offset, offset + 1, ...``. ``offset`` (an int, may
    be traced) is where the sequence starts: a decoder with a key/value cache rotates the
    new token's q and k at its absolute position, so cached keys never need re-rotating.
    ``positions`` (an integer array broadcastable to ``x.shape[:-1]``) overrides both.
    No params.

    Args:
        features: size of the rotated last axis (the head dimension); even.
        base: the wavelength scale (``rope_theta``); pair ``j`` turns at ``base ** (-2j /
            features)`` radians per position.
        seq_axis: the position axis of the input, negative: ``-2`` for ``[..., T,
            features]``, ``-3`` for attention's ``[..., T, heads, head_dim]``.
        scaling: a Hugging Face ``rope_scaling`` dict (``linear``, ``llama3``, ``yarn``; see
            :func:`rope_frequencies`), stored as sorted ``(key, value)`` pairs so the layer
            stays hashable; empty: plain RoPE.
        max_position_embeddings: the model's context (YaRN's default original context).

    ``__call__(x, *, offset=0, positions=None)``: same shape and dtype as ``x``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> rope = RotaryEmbedding(8, seq_axis=-3)
        >>> q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))  # [B, T, heads, D]
        >>> rope_jit = jax.jit(rope)  # offset may be traced (a cached decoder's position)
        >>> rope_jit(q).shape
        (2, 5, 4, 8)
        >>> last = rope_jit(q[:, 4:], offset=4)  # the 5th token alone, at position 4
        >>> bool(jnp.allclose(last, rope_jit(q)[:, 4:], atol=1e-6))
        True
    """

    has_params = False  # called as rope(x), or rope(ParamsDict(), x) as before

    features: int
    base: float = 10000.0
    seq_axis: int = -2
    scaling: Any = ()
    max_position_embeddings: int | None = None

    def __post_init__(self):
        if isinstance(self.scaling, Mapping) or self.scaling is None:
            object.__setattr__(self, "scaling", tuple(sorted((self.scaling or {}).items())))
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
        self.frequencies  # validates the scaling  # noqa: B018

    @property
    def frequencies(self) -> tuple[tuple[float, ...], float]:
        """``(inv_freq, attention_factor)`` (``rope_frequencies`` of the fields)."""
        return _frequencies(
            self.features, float(self.base), self.scaling, self.max_position_embeddings
        )

    def init(self, key: jax.Array) -> ParamsDict:
        return ParamsDict()

    def positions(self, length: int, offset: Any = 0) -> jax.Array | np.ndarray:
        """``offset + arange(length)`` laid out along ``seq_axis`` (``[T, 1, ...]``): a numpy
        array for a Python ``offset`` (the rotation's cos and sin are then constants of the
        compiled program), a traced one otherwise."""
        shape = (length,) + (1,) * (-self.seq_axis - 2)
        if isinstance(offset, int | np.integer):  # static: numpy, so cos and sin are too
            return np.arange(offset, offset + length, dtype=np.int32).reshape(shape)
        p = jnp.arange(length, dtype=jnp.int32) + jnp.asarray(offset, jnp.int32)
        return p.reshape(shape)

    def __call__(
        self,
        x: jax.Array,
        *,
        offset: Any = 0,
        positions: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        self.check_input(x, self.features, min_rank=-self.seq_axis)
        if positions is None:
            positions = self.positions(x.shape[self.seq_axis], offset)
        inv_freq, factor = self.frequencies
        return rope(x, positions, base=float(self.base), inv_freq=inv_freq, attention_factor=factor)


@functools.cache
def _frequencies(dim: int, theta: float, scaling: tuple, max_positions: int | None):
    """``rope_frequencies`` of a layer's hashable fields, computed once per configuration."""
    return rope_frequencies(
        dim, theta, dict(scaling), max_position_embeddings=max_positions, where="RotaryEmbedding"
    )
