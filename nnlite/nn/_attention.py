"""Attention: ``dot_product_attention`` with its hand rule, and the one attention layer.

``num_heads`` query heads share ``num_kv_heads`` key/value heads in groups of ``num_heads //
num_kv_heads`` (grouped-query attention, Ainslie et al. 2023: query head ``h`` reads kv head
``h // group``, the layout of Llama, Mistral and Qwen2 in Hugging Face ``transformers``);
``num_kv_heads == num_heads`` is ordinary multi-head attention (Vaswani et al. 2017), 1 is
multi-query attention. ``MultiHeadAttention`` is the layer; ``GroupedQueryAttention`` is the
same layer with the defaults of a pretrained decoder's (separate q/k/v projections, rotary
embeddings, causal, no biases).

The layer exposes its three stages as public methods, ``qkv``, ``attend`` and ``project``,
and a key/value-cache step, ``decode``: a decoder projects the new token, writes its k/v into
the cache and attends over the cache with ``q_offset``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._axes import param_axes
from ..core._mode import manual_active
from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ..grad._rule_table import register
from ._dropout import check_rate, dropout
from ._flash import flash_attention, usable
from ._linear import Linear
from ._lora import LoRA, adapter_axes, split_key
from ._normalisation import RMSNorm
from ._rotary import RotaryEmbedding
from ._swiglu import project, projection

__all__ = [
    "IMPLEMENTATIONS",
    "GroupedQueryAttention",
    "MultiHeadAttention",
    "causal_blocks",
    "causal_mask",
    "dot_product_attention",
    "dot_product_attention_vjp",
    "grouped_attention",
    "grouped_attention_vjp",
]

# None: on the CPU nnlite's fused kernel where it applies (nl.flash_attention, _flash.py),
# else as "xla": jax.nn.dot_product_attention's XLA path; "cudnn": its fused GPU kernel
# (fp16/bf16 on NVIDIA GPUs only); "plain": dot_product_attention below (always used when
# attention dropout or a soft cap is active, which jax.nn.dot_product_attention lacks).
IMPLEMENTATIONS = (None, "xla", "cudnn", "plain")


def causal_mask(t_q: int, t_k: int, q_offset: Any = None, window: int | None = None) -> jax.Array:
    """``[t_q, t_k]`` boolean mask, True where query ``i`` may see key ``j``:
    ``j <= i + q_offset``. ``q_offset`` is the position of the first query among the keys;
    the default ``t_k - t_q`` aligns the last query with the last key. ``window`` (sliding-
    window attention, Mistral's and Gemma 2's): also ``j > i + q_offset - window``, the
    ``window`` latest keys, the query's own included.

    Example:
        >>> causal_mask(4, 4, window=2).astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    offset = t_k - t_q if q_offset is None else q_offset
    i = jnp.arange(t_q)[:, None]
    j = jnp.arange(t_k)[None, :]
    at = jnp.broadcast_to(i + offset, (t_q, t_k))  # the query's own position among the keys
    if window is None:
        return j <= at
    return (j <= at) & (j > at - window)


_BIG_NEGATIVE = -0.7 * np.finfo(np.float32).max

# Causal attention on the CPU in query blocks of CAUSAL_BLOCK rows (more where that would make
# over MAX_BLOCKS blocks), each against only the keys it can see: the products and the softmax
# skip the masked upper triangle. A GPT 6x6x384 layer's attention at context 256, batch 64,
# forward and backward on 2 cores: 705 ms as one block through jax.nn.dot_product_attention,
# 453 ms in blocks of 128 through it, 378 ms in blocks of 128 and 366 ms in blocks of 64
# through this module's products (dot_product_attention), which XLA:CPU lays out better. Not
# on accelerators, where one fused kernel (cuDNN's) is the faster route.
CAUSAL_BLOCK = 64
MAX_BLOCKS = 16


def causal_blocks(t_q: int, t_k: int, q_offset: Any = None, window: int | None = None):
    """The query blocks of causal attention, each with the key range it sees: a list of
    ``(lo, hi, k_lo, k_hi, offset)`` (queries ``lo:hi`` see keys ``k_lo:k_hi``, ``offset``
    the first query's position among those keys), or None where one dense block is the
    better program: not on the CPU, fewer than two blocks of ``CAUSAL_BLOCK`` queries, a
    traced ``q_offset``, or queries that see no key at all (``q_offset < 0``).

    Example (on the CPU):
        >>> causal_blocks(192, 192)
        [(0, 64, 0, 64, 0), (64, 128, 0, 128, 64), (128, 192, 0, 192, 128)]
    """
    offset = t_k - t_q if q_offset is None else q_offset
    if not isinstance(offset, int | np.integer) or offset < 0 or t_q < 2 * CAUSAL_BLOCK:
        return None
    if jax.default_backend() != "cpu":
        return None
    offset, size = int(offset), max(CAUSAL_BLOCK, -(-t_q // MAX_BLOCKS))
    blocks = []
    for lo in range(0, t_q, size):
        hi = min(t_q, lo + size)
        k_lo = 0 if window is None else max(0, lo + offset - window + 1)
        blocks.append((lo, hi, k_lo, min(t_k, hi + offset), lo + offset - k_lo))
    return blocks


# The three products of attention in the grouped layout ``[B, KV, G, T, S]``; with one query
# head per kv head (multi-head attention) in the plain layout ``[B, H, T, S]``: a group axis
# of 1 costs XLA transposes and copies at every layer (GPT 6x6x384: 96 transposes and 135
# copies against 60 and 63).
def _q_k(q, k, acc=None):
    """``q: [B, T, H, D]`` against ``k: [B, S, KV, D]``: ``[B, KV, H // KV, T, S]``, or
    ``[B, H, T, S]`` where ``KV == H``."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    if kv == h:
        return jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=acc)
    qg = q.reshape(b, t, kv, h // kv, d)
    return jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc)


def _p_v(p, v):
    """``p: [B, KV, G, T, S]`` (or ``[B, H, T, S]``) times ``v: [B, S, KV, D]``:
    ``[B, T, H, D]``."""
    if p.ndim == 4:
        return jnp.einsum("bhts,bshd->bthd", p, v)
    b, kv, g, t, _ = p.shape
    return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, kv * g, v.shape[-1])


def _pt_x(p, x):
    """``p: [B, KV, G, T, S]`` transposed times ``x: [B, T, H, D]``, summed over each
    group's heads: ``[B, S, KV, D]``."""
    if p.ndim == 4:
        return jnp.einsum("bhts,bthd->bshd", p, x)
    b, kv, g, t, _ = p.shape
    return jnp.einsum("bkgts,btkgd->bskd", p, x.reshape(b, t, kv, g, x.shape[-1]))


def _logits(q, k, mask, scale, softcap):
    """Float32 logits ``[B, KV, G, T, S]`` of ``q: [B, T, H, D]`` against ``k: [B, S, KV,
    D]`` (``G = H // KV``; ``[B, H, T, S]`` for multi-head attention, ``KV == H``), scaled, soft-capped and masked; the
    mask in that layout; and ``tanh(logits / softcap)`` (None without a cap), which the
    rule's chain factor needs."""
    b, t, h, d = q.shape
    acc = jnp.promote_types(q.dtype, jnp.float32)  # float32 logits, float64 stays float64
    logits = _q_k(q, k, acc)
    logits = logits * jnp.asarray(1.0 / math.sqrt(d) if scale is None else scale, acc)
    tanh = None
    if softcap is not None:  # Gemma 2: cap * tanh(logits / cap), before the mask
        tanh = jnp.tanh(logits / jnp.asarray(softcap, acc))
        logits = tanh * jnp.asarray(softcap, acc)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, h, t, k.shape[1])).reshape(logits.shape)
        logits = jnp.where(mask, logits, jnp.asarray(_BIG_NEGATIVE, acc))
    return logits, mask, tanh


def dot_product_attention_vjp(
    q, k, v, mask, dret, *, scale=None, softcap=None, key=None, dropout_rate=0.0
):
    """Hand rule of ``dot_product_attention``: ``(dq, dk, dv, None)``.

    With ``s = q k^T * scale`` (capped, masked), ``p = softmax(s)``, ``p' = dropout(p)``
    and ``o = p' v``: ``dv = p'^T do``, ``dp' = do v^T``, ``dp`` = the same dropout mask and
    scale on ``dp'``, ``ds = p * (dp - sum(p * dp))`` (softmax's rule) zeroed where masked,
    through the cap's ``1 - tanh^2`` and scaled, then ``dq = ds k`` and ``dk = ds^T q``, each
    kv head's cotangents summed over the query heads of its group.
    """
    d = q.shape[-1]
    logits, mask, tanh = _logits(q, k, mask, scale, softcap)
    acc = logits.dtype
    probs = jax.nn.softmax(logits, axis=-1)
    dropped = dropout(probs.astype(v.dtype), key, dropout_rate)
    dv = _pt_x(dropped, dret)
    d_dropped = _q_k(dret, v, acc)
    dp = dropout(d_dropped, key, dropout_rate)  # the same mask and scale
    ds = probs * (dp - jnp.sum(probs * dp, axis=-1, keepdims=True))
    if mask is not None:
        ds = jnp.where(mask, ds, jnp.zeros((), acc))
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    ds = ds * jnp.asarray(1.0 / math.sqrt(d) if scale is None else scale, acc)
    dq = _p_v(ds, k.astype(acc)).astype(q.dtype)
    dk = _pt_x(ds, q.astype(acc)).astype(k.dtype)
    return dq, dk, dv.astype(v.dtype), None


@hand_rule(dot_product_attention_vjp)
def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    key: jax.Array | None = None,
    dropout_rate: float = 0.0,
) -> jax.Array:
    """``softmax(q k^T * scale) v`` for ``q: [B, T, H, D]`` and ``k, v: [B, S, KV, D]``
    (``KV`` divides ``H``; query head ``h`` reads kv head ``h // (H // KV)``), ``mask``
    boolean broadcastable to ``[B, H, T, S]`` (True = attend), with dropout on the
    attention weights when ``key`` is given. ``scale`` defaults to ``1 / sqrt(D)``;
    ``softcap`` caps the scaled logits at ``softcap * tanh(logits / softcap)`` (Gemma 2's).
    Logits and softmax in float32, masked logits set to a large negative number: the same
    arithmetic as ``jax.nn.dot_product_attention``'s XLA path, so the two agree.
    ``grouped_attention`` is the same function.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = jnp.ones((1, 2, 4, 8)); kv = jnp.ones((1, 3, 2, 8))
        >>> jax.jit(dot_product_attention)(q, kv, kv).shape
        (1, 2, 4, 8)
    """
    logits, _, _ = _logits(q, k, mask, scale, softcap)
    probs = dropout(jax.nn.softmax(logits, axis=-1).astype(v.dtype), key, dropout_rate)
    return _p_v(probs, v)


# The grouped-query form's older name: the same rule, listed under both names in nl.rules.
grouped_attention, grouped_attention_vjp = dot_product_attention, dot_product_attention_vjp
register(dot_product_attention, dot_product_attention_vjp, "grouped_attention")


def slot_vjp(y, dret, *, start, size):
    """Hand rule of ``slot``: the cotangent placed back in its heads, zeros elsewhere."""
    return jnp.zeros_like(y).at[..., start : start + size, :].set(dret)


@hand_rule(slot_vjp)
def slot(y: jax.Array, *, start: int, size: int) -> jax.Array:
    """Heads ``start .. start + size - 1`` of ``y: [..., heads, head_dim]``: the q, k or v
    of a fused projection's ``[..., T, num_heads + 2 * num_kv_heads, head_dim]``."""
    return y[..., start : start + size, :]


def _batch_mask(mask: Any, full: tuple[int, ...]) -> jax.Array:
    """A mask broadcastable to ``full = (*batch, H, T, S)`` as ``[B, H', T', S']`` with its
    batch axes folded into one (1 where it broadcasts over all of them), and its last three
    axes left unbroadcast: the fused kernel reads a broadcast axis without copying it."""
    m = jnp.asarray(mask)
    m = m.reshape((1,) * (len(full) - m.ndim) + m.shape)
    batch = full[:-3]
    if all(n == 1 for n in m.shape[:-3]):
        return m.reshape(1, *m.shape[-3:])
    return jnp.broadcast_to(m, (*batch, *m.shape[-3:])).reshape(-1, *m.shape[-3:])


class MultiHeadAttention(Module):
    """Scaled dot-product attention with ``num_heads`` query heads and ``num_kv_heads``
    key/value heads (``None``: as many, multi-head attention; fewer: grouped-query attention,
    as Llama 2/3, Mistral, Qwen2), fused or separate q/k/v projections, optional rotary
    embeddings, and LoRA adapters on chosen projections (nanoGPT's ``CausalSelfAttention``
    with the defaults; Flax ``nn.MultiHeadDotProductAttention`` and Equinox
    ``eqx.nn.MultiheadAttention`` have separate q/k/v weights and no kv groups).

    Projections: ``q: features -> num_heads * head_dim``, ``k``, ``v: features ->
    num_kv_heads * head_dim``, ``out: num_heads * head_dim -> features``; with ``fused_qkv``
    (the default; GPT-2's ``c_attn``) one ``qkv`` projection whose columns are ``[q | k |
    v]``. Heads are contiguous blocks of ``head_dim`` columns. ``qkv`` projects and splits
    the heads, ``attend`` computes ``softmax(q k^T * scale) v`` per head, ``project``
    merges the heads and applies the output projection.

    Masks: ``mask`` is boolean, True where a query may attend to a key, broadcastable
    (numpy rules) to ``[..., num_heads, T_q, T_k]`` where ``...`` are the input's batch
    axes; e.g. a key-padding mask ``valid: [B, T]`` is passed as ``valid[:, None, None, :]``.
    With ``causal=True`` query ``i`` also sees only keys ``j <= i + q_offset`` (see
    ``attend``), and with a sliding ``window`` only its ``window`` latest keys (Mistral's
    and Gemma 2's ``sliding_window``), in prefill and the cached decode step alike. A query
    that may see no key gets the mean of all values (finite, not NaN).

    Dropout (``dropout_rate``, as nanoGPT): on the attention weights and on the output
    projection, each with its own half of ``key``; ``key=None`` is inference.

    Rotary position embeddings (``rotary=True``): ``qkv`` rotates q and k by their
    positions (``nl.RotaryEmbedding`` with ``rope_theta`` and a Hugging Face
    ``rope_scaling`` dict: ``linear``, ``llama3``, ``yarn``), ``0 .. T - 1``, or ``offset
    ..`` for a decoder with a key/value cache (cached keys are stored rotated at their
    absolute positions), or per-row ``positions``. No params are added.

    Optional, as pretrained decoders have them: an RMSNorm over each head's features of q
    and of k before the rotation (``qk_norm``, Qwen3's), another logit scale than ``1 /
    sqrt(head_dim)`` (``scale``, Gemma 2's ``query_pre_attn_scalar ** -0.5``) and soft-capped
    logits (``softcap``, Gemma 2's ``attn_logit_softcapping``).

    Args:
        features: model width (last axis of ``x``).
        num_heads: query heads.
        num_kv_heads: key/value heads, dividing ``num_heads`` (None: ``num_heads``).
        head_dim: features per head (None: ``features // num_heads``, which must divide).
        causal: apply the causal mask.
        use_bias: biases in the projections (``qkv_bias``, ``out_bias``: each set apart,
            None: ``use_bias``; Qwen2 has q/k/v biases only).
        dropout_rate: dropout probability, ``0 <= rate < 1``.
        w_init: initializer of the projection weights (LeCun normal, as Flax); biases zeros.
        implementation: ``None``: on the CPU the fused kernel ``nl.flash_attention``
            where it applies (float32, no attention dropout or cap), else as ``"xla"``;
            ``"xla"``/``"cudnn"`` pass to ``jax.nn.dot_product_attention`` (``"cudnn"``:
            fused GPU kernel, fp16/bf16);
            ``"plain"`` uses ``dot_product_attention`` (also whenever attention dropout or a
            soft cap is on, in manual-gradient mode, and for float16).
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote).
        rotary, rope_theta, rope_scaling, max_position_embeddings: rotary embeddings
            (``rope_theta``: the wavelength scale, ``rotary_base`` its older name; the last
            is YaRN's original context).
        fused_qkv: one ``qkv`` projection instead of ``q``, ``k``, ``v``.
        qk_norm, norm_eps, norm_offset: RMSNorm of each head of q and k (``/q_norm``,
            ``/k_norm``), its epsilon and ``scale_offset``.
        scale: the logits' factor (None: ``1 / sqrt(head_dim)``).
        softcap: cap the logits at ``softcap * tanh(logits / softcap)`` (None: no cap).
        window: sliding-window size, with ``causal`` (None: every earlier key).
        lora: names of the projections wrapped in ``nl.LoRA`` (``"q"``, ``"k"``, ``"v"``,
            ``"qkv"``, ``"out"``), with ``lora_rank``, ``lora_alpha`` and ``lora_dropout``
            (dropout on each adapter's input when called with a ``key``).

    Params: ``/qkv`` (or ``/q``, ``/k``, ``/v``) and ``/out``, each a ``Linear``'s (``W``,
    ``b``) or a ``LoRA``'s (also ``lora_a``, ``lora_b``); ``/q_norm/scale``,
    ``/k_norm/scale`` ``[head_dim]`` with ``qk_norm``.

    ``__call__(params, x, *, mask=None, positions=None, key=None)``: ``x: [..., T,
    features]`` -> ``[..., T, features]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mha = MultiHeadAttention(8, num_heads=2, causal=True)
        >>> p = jax.jit(mha.init)(jax.random.key(0))
        >>> p.print()
        /qkv/W: f32[8,24]
        /qkv/b: f32[24]
        /out/W: f32[8,8]
        /out/b: f32[8]
        >>> x = jnp.ones((3, 5, 8))  # batch 3, 5 positions
        >>> jax.jit(mha)(p, x).shape
        (3, 5, 8)
        >>> q, k, v = jax.jit(mha.qkv)(p, x)  # the pieces, for a key/value-cache decoder
        >>> q.shape
        (3, 5, 2, 4)
        >>> jax.jit(lambda p, q, k, v: mha.project(p, mha.attend(q, k, v)))(p, q, k, v).shape
        (3, 5, 8)
    """

    features: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = False
    use_bias: bool = True
    dropout_rate: float = 0.0
    w_init: str = "lecun_normal"
    implementation: str | None = None
    param_dtype: str = "float32"
    dtype: str | None = None
    rotary: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Any = ()
    max_position_embeddings: int | None = None
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    fused_qkv: bool = True
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    lora: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    rotary_base: float | None = None  # rope_theta's older name, kept working

    def __post_init__(self):
        if self.rotary_base is not None:  # one field holds the value: rope_theta
            object.__setattr__(self, "rope_theta", self.rotary_base)
            object.__setattr__(self, "rotary_base", None)
        if isinstance(self.rope_scaling, dict) or self.rope_scaling is None:
            scaling = tuple(sorted((self.rope_scaling or {}).items()))
            object.__setattr__(self, "rope_scaling", scaling)
        super().__post_init__()
        name = type(self).__name__
        self._check_positive_ints("features", "num_heads", "kv_heads")
        if self.head_dim is None:
            if self.features % self.num_heads:
                raise ValueError(
                    f"{name}: features={self.features} must be a multiple of "
                    f"num_heads={self.num_heads} (or give head_dim)"
                )
            object.__setattr__(self, "head_dim", self.features // self.num_heads)
        self._check_positive_ints("head_dim")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"{name}: num_kv_heads={self.kv_heads} must divide num_heads={self.num_heads}"
            )
        check_rate(name, "dropout_rate", self.dropout_rate)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"{name}: unknown implementation {self.implementation!r}; valid: "
                + ", ".join(map(repr, IMPLEMENTATIONS))
            )
        names = ("qkv", "out") if self.fused_qkv else ("q", "k", "v", "out")
        for lora in self.lora:
            if lora not in names:
                raise ValueError(
                    f"{name}: lora names {lora!r}, not a projection of this layer; valid: "
                    f"{', '.join(names)}"
                )
        if self.window is not None:
            self._check_positive_ints("window")
            if not self.causal:
                raise ValueError(f"{name}: a sliding window needs causal=True")
        for field in ("scale", "softcap"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name}: {field} must be a number > 0 or None, got {value!r}")
        if self.rotary and self.head_dim % 2:
            raise ValueError(
                f"{name}: rotary=True needs an even head_dim, got features={self.features} // "
                f"num_heads={self.num_heads} = {self.head_dim}"
            )

    def setup(self):
        h, kv, d = self.num_heads, self.kv_heads, self.head_dim
        if self.fused_qkv:
            self.qkv_ = self._linear("qkv", self.features, (h + 2 * kv) * d, self.qkv_bias)
        else:
            self.q = self._linear("q", self.features, h * d, self.qkv_bias)
            self.k = self._linear("k", self.features, kv * d, self.qkv_bias)
            self.v = self._linear("v", self.features, kv * d, self.qkv_bias)
        self.out = self._linear("out", h * d, self.features, self.out_bias)
        if self.qk_norm:
            self.q_norm = self.head_norm
            self.k_norm = self.head_norm
        if self.rotary:
            self.rotary_embedding = RotaryEmbedding(
                d, self.rope_theta, -3, self.rope_scaling, self.max_position_embeddings
            )

    def _linear(self, name: str, n_in: int, n_out: int, bias: bool | None) -> Linear | LoRA:
        return projection(self, name, n_in, n_out, self.use_bias if bias is None else bias)

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim(self) -> int:
        """``head_dim`` (the name older code reads)."""
        return self.head_dim

    @property
    def uses_key(self) -> bool:
        """A key turns dropout on: attention dropout, or a LoRA adapter's."""
        return self.dropout_rate > 0 or super().uses_key

    @property
    def head_norm(self) -> RMSNorm:
        """The RMSNorm of one head's features (``/q_norm`` and ``/k_norm`` with ``qk_norm``)."""
        return RMSNorm(
            self.head_dim,
            self.norm_eps,
            scale_offset=self.norm_offset,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )

    @property
    def qkv_linear(self) -> Linear | LoRA:
        """The fused q/k/v projection (``fused_qkv``)."""
        return self.qkv_

    @property
    def out_linear(self) -> Linear | LoRA:
        """The output projection."""
        return self.out

    @property
    def children(self) -> dict[str, Linear | LoRA]:
        """The projections by param name."""
        if self.fused_qkv:
            return {"qkv": self.qkv_, "out": self.out}
        return {"q": self.q, "k": self.k, "v": self.v, "out": self.out}

    def param_axes(self) -> ParamsDict:
        """Megatron's attention: q/k/v column-parallel (``W: ("embed", "qkv")``), ``out``
        row-parallel (``W: ("heads", "embed")``), so a tensor axis splits the heads."""
        p = ParamsDict()
        for name, layer in self.children.items():
            axes = ("heads", "embed") if name == "out" else ("embed", "qkv")
            p[name] = adapter_axes(layer, *axes)
        if self.qk_norm:
            p.q_norm = p.k_norm = param_axes(self.head_norm)
        return p

    def init(self, key: jax.Array) -> ParamsDict:
        """The projections' params, one key each (the norms take none)."""
        keys = jax.random.split(key, len(self.children))
        p = ParamsDict(
            {n: c.init(k) for (n, c), k in zip(self.children.items(), keys, strict=True)}
        )
        if self.qk_norm:
            p.q_norm, p.k_norm = self.q_norm.init(key), self.k_norm.init(key)
        return p

    def _project(self, params: ParamsDict, name: str, x: jax.Array, key=None) -> jax.Array:
        return project(self, params, name, x, key)

    def qkv(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        offset: Any = 0,
        positions: Any = None,
        key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q: [..., T, num_heads, head_dim]``, ``k, v: [..., T, num_kv_heads, head_dim]``
        of ``x: [..., T, features]``; with ``rotary``, q and k rotated at positions
        ``offset ..`` (an int that may be traced: where ``x`` starts in the sequence; a
        cached decoder passes the new token's position), or at ``positions: [..., T]``
        (integers: per row of a left-padded batch, restarting per packed document; unused
        without ``rotary``).
        ``key``: LoRA dropout on the projections."""
        self.check_input(x, self.features, min_rank=2)
        lead, h, kv, d = x.shape[:-1], self.num_heads, self.kv_heads, self.head_dim
        if self.fused_qkv:
            y = self._project(params, "qkv", x, key).reshape(*lead, h + 2 * kv, d)
            q, k = slot(y, start=0, size=h), slot(y, start=h, size=kv)
            v = slot(y, start=h + kv, size=kv)
        else:  # a key (training with LoRA dropout) is one per projection
            keys = split_key(key, 3)
            q, k, v = (self._project(params, n, x, kn) for n, kn in zip("qkv", keys, strict=True))
            q, k, v = q.reshape(*lead, h, d), k.reshape(*lead, kv, d), v.reshape(*lead, kv, d)
        if self.qk_norm:
            p_q, p_k = self.child(params, "q_norm"), self.child(params, "k_norm")
            with self.params_scope("/q_norm"):
                q = self.q_norm(p_q, q)
            with self.params_scope("/k_norm"):
                k = self.k_norm(p_k, k)
        if self.rotary:
            rope = self.rotary_embedding
            if positions is None:
                pos = rope.positions(x.shape[-2], offset)  # [T, 1]
            else:
                pos = jnp.asarray(positions, jnp.int32)[..., None]  # [..., T, 1]
            q, k = rope(q, positions=pos), rope(k, positions=pos)
        return q, k, v

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        mask: jax.Array | None = None,
        key: jax.Array | None = None,
        q_offset: Any = None,
    ) -> jax.Array:
        """``softmax(q k^T * scale) v`` per head, with this layer's causal mask, window, cap
        and attention dropout.

        Args:
            q: ``[..., T_q, num_heads, head_dim]``.
            k, v: ``[..., T_k, num_kv_heads, head_dim]`` (same batch axes as ``q``).
            mask: boolean, True = attend, broadcastable to ``[..., num_heads, T_q, T_k]``.
            key: dropout key for the attention weights (``None``: no dropout).
            q_offset: causal alignment, the position of ``q``'s first row among the keys:
                query ``i`` sees keys ``j <= i + q_offset`` (and with ``window`` only
                ``j > i + q_offset - window``). Default ``T_k - T_q``, which aligns the
                last query with the last key (the usual case, and decoding with a cache that
                holds exactly the past keys). With a fixed-size cache of length ``T_k``
                filled up to position ``n`` and new queries from position ``n``, pass
                ``q_offset=n`` (may be traced): it also hides the unfilled slots.

        Returns:
            ``[..., T_q, num_heads, head_dim]``.
        """
        h, kv, d = self.num_heads, self.kv_heads, self.head_dim
        if q.ndim < 3 or q.shape[-2:] != (h, d) or k.shape[-2:] != (kv, d) or v.shape != k.shape:
            raise ValueError(
                f"{self._short_repr()}.attend: expected q [..., T_q, {h}, {d}] and k, v "
                f"[..., T_k, {kv}, {d}], got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                f"{tuple(v.shape)}"
            )
        batch = q.shape[:-3]
        if k.shape[:-3] != batch:
            raise ValueError(
                f"{self._short_repr()}.attend: q and k must share their batch axes, got q "
                f"{tuple(q.shape)} and k {tuple(k.shape)}"
            )
        t_q, t_k = q.shape[-3], k.shape[-3]
        full = (*batch, h, t_q, t_k)
        given = mask
        if mask is not None:
            mask = self._check_mask(mask, full)
        b = math.prod(batch)
        q4, k4, v4 = (a.reshape(b, *a.shape[-3:]) for a in (q, k, v))
        blocks = None
        dropping = key is not None and self.dropout_rate > 0
        if self._fused(q4, k4, v4, dropping, q_offset):  # one kernel: _flash.py
            out = flash_attention(
                q4, k4, v4, scale=self.scale, causal=self.causal, q_offset=q_offset,
                window=self.window, mask=None if given is None else _batch_mask(given, full),
            )  # fmt: skip
            return out.reshape(*batch, *out.shape[-3:])
        if self.causal and mask is None and not dropping and self.implementation != "cudnn":
            blocks = causal_blocks(t_q, t_k, q_offset, self.window)
        if blocks is not None:  # only the key blocks each query block can see
            out = jnp.concatenate(
                [
                    self._dense(
                        q4[:, lo:hi],
                        k4[:, k_lo:k_hi],
                        v4[:, k_lo:k_hi],
                        causal_mask(hi - lo, k_hi - k_lo, offset, self.window)[None, None],
                        plain=True,
                    )
                    for lo, hi, k_lo, k_hi, offset in blocks
                ],
                axis=1,
            )
            return out.reshape(*batch, *out.shape[-3:])
        if self.causal:
            c = jnp.broadcast_to(causal_mask(t_q, t_k, q_offset, self.window), full)
            mask = c if mask is None else jnp.logical_and(mask, c)
        m4 = None if mask is None else mask.reshape(b, *full[-3:])
        out = self._dense(q4, k4, v4, m4, key)
        return out.reshape(*batch, *out.shape[-3:])

    def _fused(self, q4, k4, v4, dropping: bool, q_offset: Any) -> bool:
        """Whether ``attend`` runs as one fused kernel (``nl.flash_attention``): the default
        implementation on the CPU, float32 (or half precision, widened), no attention dropout
        or cap."""
        if self.implementation is not None or dropping or self.softcap is not None:
            return False
        return usable(q4, k4, v4, causal=self.causal, q_offset=q_offset)

    def _dense(self, q4, k4, v4, m4, key=None, plain=False) -> jax.Array:
        """Attention of ``q4: [B, T, H, D]`` over all of ``k4, v4``, ``m4`` the mask, with
        dropout when ``key`` is given; ``plain``: through ``dot_product_attention`` whatever
        the implementation."""
        dropping = key is not None and self.dropout_rate > 0
        # The plain path where jax.nn's has no equivalent (dropout, a cap), in manual-gradient
        # mode (its rule is dot_product_attention_vjp), and for float16: jax.nn's XLA path
        # asks for the F16_F16_F32 dot algorithm, which XLA:CPU refuses.
        plain = plain or self.implementation == "plain" or self.softcap is not None
        if plain or dropping or manual_active() or q4.dtype == jnp.float16:
            return dot_product_attention(
                q4, k4, v4, m4, scale=self.scale, softcap=self.softcap, key=key,
                dropout_rate=self.dropout_rate,
            )  # fmt: skip
        # jax.nn groups kv heads itself (its XLA path: the same arithmetic)
        return jax.nn.dot_product_attention(
            q4, k4, v4, mask=m4, scale=self.scale, implementation=self.implementation
        )

    def _check_mask(self, mask: Any, full: tuple[int, ...]) -> jax.Array:
        shape = tuple(getattr(mask, "shape", ()))
        dtype = getattr(mask, "dtype", None)
        if dtype is None or dtype != jnp.bool_:
            raise ValueError(
                f"{self._short_repr()}: mask must be a boolean array (True = attend), got "
                f"{f'dtype {dtype}' if dtype is not None else type(mask).__name__}"
            )
        try:
            ok = np.broadcast_shapes(shape, full) == full
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"{self._short_repr()}: mask of shape {shape} does not broadcast to "
                f"[..., num_heads, T_q, T_k] = {full}; a key-padding mask valid: [B, T] "
                "is passed as valid[:, None, None, :]"
            )
        return jnp.broadcast_to(mask, full)

    def project(self, params: ParamsDict, o: jax.Array, key: jax.Array | None = None):
        """Merge the heads of ``o: [..., T, num_heads, head_dim]`` and apply the output
        projection: ``[..., T, features]`` (``key``: LoRA dropout)."""
        if o.ndim < 3 or o.shape[-2:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"{self._short_repr()}.project: expected [..., T, {self.num_heads}, "
                f"{self.head_dim}], got shape {tuple(o.shape)}"
            )
        o = o.reshape(*o.shape[:-2], self.num_heads * self.head_dim)
        return self._project(params, "out", o, key)

    def empty_cache(self, batch: int, length: int, dtype: Any = jnp.float32):
        """Zeroed ``(k, v)`` caches, each ``[batch, length, num_kv_heads, head_dim]``."""
        shape = (batch, length, self.kv_heads, self.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def decode(
        self,
        params: ParamsDict,
        x: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        pos: Any,
        *,
        mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """``x: [B, T, features]`` at cache slots ``pos .. pos + T - 1`` (``pos`` may be
        traced) against a fixed-size ``cache`` holding slots ``< pos``: the attention output
        and the cache with these slots' keys and values written in. Inference only.

        A left-padded batch passes ``mask: [B, S]`` (boolean over the cache's ``S`` slots:
        False for padding, which no query sees) and ``positions: [B, T]`` (each row's
        rotary positions; default: the slots)."""
        ck, cv = cache
        q, k, v = self.qkv(params, x, offset=pos, positions=positions)
        at = (0, pos, 0, 0)
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), at)
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), at)
        keys = None if mask is None else mask[:, None, None, :]
        o = self.attend(q, ck.astype(q.dtype), cv.astype(q.dtype), mask=keys, q_offset=pos)
        return self.project(params, o), (ck, cv)

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Self-attention of ``x [..., T, features]``; ``mask`` boolean broadcastable to
        ``[..., num_heads, T, T]`` (with the causal mask), ``positions [..., T]`` the rotary
        positions (default ``0 .. T-1``)."""
        if positions is not None and not self.rotary:
            raise ValueError(
                f"{self._short_repr()}: positions rotate q and k; this layer has rotary=False"
            )
        k_in, k_out = split_key(key, 2)
        q, k, v = self.qkv(params, x, positions=positions, key=self._lora_key(k_in, "q"))
        o = self.attend(q, k, v, mask=mask, key=k_in)
        y = self.project(params, o, self._lora_key(k_out, "out"))
        return dropout(y, k_out, self.dropout_rate)

    def _lora_key(self, key: jax.Array | None, which: str) -> jax.Array | None:
        """The key of the LoRA dropout on the projections ``which`` names (``"q"``: the
        input projections), drawn apart from the attention dropout's; None without one."""
        names = ("out",) if which == "out" else ("q", "k", "v", "qkv")
        if key is None or not any(n in self.lora for n in names) or not self.lora_dropout:
            return None
        return jax.random.fold_in(key, 1) if self.dropout_rate > 0 else key


class GroupedQueryAttention(MultiHeadAttention):
    """``MultiHeadAttention`` with the defaults of a pretrained decoder's attention (Llama,
    Mistral, Qwen2): separate ``q``, ``k``, ``v`` projections, rotary embeddings, causal, no
    biases; ``num_kv_heads`` key/value heads shared by the query heads in groups. Every
    field, method and param name is ``MultiHeadAttention``'s.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> attn = GroupedQueryAttention(16, num_heads=4, num_kv_heads=2)
        >>> p = jax.jit(attn.init)(jax.random.key(0))
        >>> [(k, v.shape) for k, v in p.items()]
        [('/q/W', (16, 16)), ('/k/W', (16, 8)), ('/v/W', (16, 8)), ('/out/W', (16, 16))]
        >>> jax.jit(attn)(p, jnp.ones((2, 5, 16))).shape
        (2, 5, 16)
    """

    causal: bool = True
    use_bias: bool = False
    rotary: bool = True
    fused_qkv: bool = False
