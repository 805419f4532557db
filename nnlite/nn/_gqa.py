"""Grouped-query attention (Ainslie et al. 2023): ``grouped_attention`` with its hand rule,
and the layer, with a key/value-cache ``decode`` step.

``num_heads`` query heads share ``num_kv_heads`` key/value heads in groups of ``num_heads //
num_kv_heads`` (query head ``h`` reads kv head ``h // group``, the layout of Llama, Mistral and
Qwen2 in Hugging Face ``transformers``); ``num_kv_heads == num_heads`` is ordinary multi-head
attention, 1 is multi-query attention. The cache holds ``num_kv_heads`` heads, so it is
``num_heads / num_kv_heads`` times smaller than a multi-head one.
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
from ._attention import causal_mask
from ._linear import Linear
from ._lora import LoRA, adapter_axes, split_key, wrap
from ._normalisation import RMSNorm
from ._rotary import rope, rope_frequencies

__all__ = ["GroupedQueryAttention", "grouped_attention", "grouped_attention_vjp"]

_BIG_NEGATIVE = -0.7 * np.finfo(np.float32).max


def _grouped(q, k, mask, scale, softcap):
    """Float32 logits ``[B, KV, G, T, S]`` of ``q: [B, T, H, D]`` against ``k: [B, S, KV,
    D]``, scaled, soft-capped and masked; the mask in that layout; and ``tanh(logits /
    softcap)`` (None without a cap), which the rule's chain factor needs."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.reshape(b, t, kv, h // kv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc)
    logits = logits * jnp.asarray(1.0 / math.sqrt(d) if scale is None else scale, acc)
    tanh = None
    if softcap is not None:  # Gemma 2: cap * tanh(logits / cap), before the mask
        tanh = jnp.tanh(logits / jnp.asarray(softcap, acc))
        logits = tanh * jnp.asarray(softcap, acc)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, h, t, k.shape[1])).reshape(logits.shape)
        logits = jnp.where(mask, logits, jnp.asarray(_BIG_NEGATIVE, acc))
    return logits, mask, tanh


def grouped_attention_vjp(q, k, v, mask, dret, *, scale=None, softcap=None):
    """Hand VJP of ``grouped_attention``: the attention rule (``dv = p^T do``, ``ds = p (dp -
    sum p dp)`` masked, through the cap's ``1 - tanh^2`` and scaled, ``dq = ds k``, ``dk =
    ds^T q``) with each kv head's cotangents summed over the query heads of its group."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    logits, mask, tanh = _grouped(q, k, mask, scale, softcap)
    acc = logits.dtype
    probs = jax.nn.softmax(logits, axis=-1)
    dog = dret.reshape(b, t, kv, h // kv, d)
    dv = jnp.einsum("bkgts,btkgd->bskd", probs.astype(v.dtype), dog)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, v, preferred_element_type=acc)
    ds = probs * (dp - jnp.sum(probs * dp, axis=-1, keepdims=True))
    if mask is not None:
        ds = jnp.where(mask, ds, jnp.zeros((), acc))
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    ds = ds * jnp.asarray(1.0 / math.sqrt(d) if scale is None else scale, acc)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(acc)).reshape(q.shape).astype(q.dtype)
    qg = q.reshape(b, t, kv, h // kv, d).astype(acc)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg).astype(k.dtype)
    return dq, dk, dv.astype(v.dtype), None


@hand_rule(grouped_attention_vjp)
def grouped_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """``softmax(q k^T * scale) v`` for ``q: [B, T, H, D]`` and ``k, v: [B, S, KV, D]``
    (``KV`` divides ``H``; query head ``h`` reads kv head ``h // (H // KV)``), ``mask``
    boolean broadcastable to ``[B, H, T, S]`` (True = attend). ``scale`` defaults to ``1 /
    sqrt(D)``; ``softcap`` caps the scaled logits at ``softcap * tanh(logits / softcap)``
    (Gemma 2's). Logits and softmax in float32; ``[B, T, H, D]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = jnp.ones((1, 2, 4, 8)); kv = jnp.ones((1, 3, 2, 8))
        >>> jax.jit(grouped_attention)(q, kv, kv).shape
        (1, 2, 4, 8)
    """
    b, t, h, d = q.shape
    logits, _, _ = _grouped(q, k, mask, scale, softcap)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)


class GroupedQueryAttention(Module):
    """Self-attention with ``num_kv_heads`` key/value heads shared by ``num_heads`` query heads
    (grouped-query attention, as Llama 2/3, Mistral, Qwen2; Flax and Equinox have no such
    layer), separate or fused q/k/v projections, optional rotary embeddings with scaled
    frequencies, and LoRA adapters on chosen projections.

    Projections: ``q: features -> num_heads * head_dim``, ``k``, ``v: features -> num_kv_heads
    * head_dim``, ``out: num_heads * head_dim -> features``; with ``fused_qkv`` one ``qkv``
    projection whose columns are ``[q | k | v]`` (GPT-2's ``c_attn``). Heads are contiguous
    blocks of ``head_dim`` columns.

    Optional, as pretrained decoders have them: an RMSNorm over each head's features of q
    and of k before the rotation (``qk_norm``, Qwen3's ``q_norm``/``k_norm``), another
    logit scale than ``1 / sqrt(head_dim)`` (``scale``, Gemma 2's ``query_pre_attn_scalar **
    -0.5``), soft-capped logits (``softcap``, Gemma 2's ``attn_logit_softcapping``), and a
    sliding window (``window``: each query sees its ``window`` latest keys, itself included,
    as Mistral's and Gemma 2's ``sliding_window``), part of the causal mask, so prefill and
    the cached decode step apply it alike.

    Rotary embeddings (``rotary``): q and k rotated at their positions by
    ``rope_frequencies(head_dim, rope_theta, rope_scaling)`` (the "rotate-half" pairing of
    Hugging Face's Llama), ``rope_scaling`` a dict as in a Hugging Face config (``linear``,
    ``llama3``, ``yarn``); stored as sorted ``(key, value)`` pairs so the layer stays hashable.

    Args:
        features: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads, dividing ``num_heads`` (None: ``num_heads``).
        head_dim: features per head (None: ``features // num_heads``).
        causal: causal mask.
        qkv_bias: biases on the q/k/v projections (Qwen2, GPT-2).
        out_bias: bias on the output projection.
        fused_qkv: one ``qkv`` projection instead of ``q``, ``k``, ``v``.
        rotary, rope_theta, rope_scaling, max_position_embeddings: rotary embeddings (the
            last is YaRN's default original context).
        qk_norm, norm_eps, norm_offset: RMSNorm of each head of q and k (``/q_norm``,
            ``/k_norm``), its epsilon and ``scale_offset``.
        scale: the logits' factor (None: ``1 / sqrt(head_dim)``).
        softcap: cap the logits at ``softcap * tanh(logits / softcap)`` (None: no cap).
        window: sliding-window size, with ``causal`` (None: every earlier key).
        lora: names of the projections wrapped in ``nl.LoRA`` (``"q"``, ``"k"``, ``"v"``,
            ``"qkv"``, ``"out"``), with ``lora_rank``, ``lora_alpha`` and ``lora_dropout``
            (dropout on each adapter's input when called with a ``key``).
        w_init, param_dtype, dtype: as ``nl.Linear``.

    Params: ``/q``, ``/k``, ``/v`` (or ``/qkv``) and ``/out``, each a ``Linear``'s (``W``,
    ``b``) or a ``LoRA``'s (also ``lora_a``, ``lora_b``); ``/q_norm/scale``,
    ``/k_norm/scale`` ``[head_dim]`` with ``qk_norm``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> attn = GroupedQueryAttention(16, num_heads=4, num_kv_heads=2)
        >>> p = jax.jit(attn.init)(jax.random.key(0))
        >>> [(k, v.shape) for k, v in p.items()]
        [('/q/W', (16, 16)), ('/k/W', (16, 8)), ('/v/W', (16, 8)), ('/out/W', (16, 16))]
        >>> jax.jit(attn)(p, jnp.ones((2, 5, 16))).shape
        (2, 5, 16)
    """

    features: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    fused_qkv: bool = False
    rotary: bool = True
    rope_theta: float = 10000.0
    rope_scaling: Any = ()
    max_position_embeddings: int | None = None
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
    w_init: str = "lecun_normal"
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        elif self.rope_scaling is None:
            object.__setattr__(self, "rope_scaling", ())
        super().__post_init__()
        self._check_positive_ints("features", "num_heads", "kv_heads")
        if self.head_dim is not None:
            self._check_positive_ints("head_dim")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"GroupedQueryAttention: num_kv_heads={self.kv_heads} must divide "
                f"num_heads={self.num_heads}"
            )
        if self.head_dim is None and self.features % self.num_heads:
            raise ValueError(
                f"GroupedQueryAttention: features={self.features} is not a multiple of "
                f"num_heads={self.num_heads}; give head_dim"
            )
        names = ("qkv", "out") if self.fused_qkv else ("q", "k", "v", "out")
        for name in self.lora:
            if name not in names:
                raise ValueError(
                    f"GroupedQueryAttention: lora names {name!r}, not a projection of this "
                    f"layer; valid: {', '.join(names)}"
                )
        if self.window is not None:
            self._check_positive_ints("window")
            if not self.causal:
                raise ValueError("GroupedQueryAttention: a sliding window needs causal=True")
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(
                    f"GroupedQueryAttention: {name} must be a number > 0 or None, got {value!r}"
                )
        if self.rotary:
            self.frequencies  # validates the scaling and an even head_dim  # noqa: B018
        self.out  # validates w_init and the dtypes  # noqa: B018

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        return self.features // self.num_heads if isinstance(self.features, int) else 0

    @property
    def frequencies(self) -> tuple[tuple[float, ...], float]:
        """``(inv_freq, attention_factor)`` of the rotary embedding."""
        return rope_frequencies(
            self.dim,
            self.rope_theta,
            dict(self.rope_scaling),
            max_position_embeddings=self.max_position_embeddings,
            where="GroupedQueryAttention",
        )

    def _linear(self, name: str, n_in: int, n_out: int, bias: bool) -> Linear | LoRA:
        lin = Linear(
            n_in,
            n_out,
            use_bias=bias,
            w_init=self.w_init,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )
        return wrap(lin, name in self.lora, self.lora_rank, self.lora_alpha, self.lora_dropout)

    @property
    def q(self):
        return self._linear("q", self.features, self.num_heads * self.dim, self.qkv_bias)

    @property
    def k(self):
        return self._linear("k", self.features, self.kv_heads * self.dim, self.qkv_bias)

    @property
    def v(self):
        return self._linear("v", self.features, self.kv_heads * self.dim, self.qkv_bias)

    @property
    def qkv_linear(self):
        width = (self.num_heads + 2 * self.kv_heads) * self.dim
        return self._linear("qkv", self.features, width, self.qkv_bias)

    @property
    def out(self):
        return self._linear("out", self.num_heads * self.dim, self.features, self.out_bias)

    @property
    def head_norm(self) -> RMSNorm:
        """The RMSNorm of one head's features (``/q_norm`` and ``/k_norm`` with ``qk_norm``)."""
        return RMSNorm(
            self.dim,
            self.norm_eps,
            scale_offset=self.norm_offset,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )

    @property
    def children(self) -> dict[str, Linear | LoRA]:
        """The projections by param name."""
        if self.fused_qkv:
            return {"qkv": self.qkv_linear, "out": self.out}
        return {"q": self.q, "k": self.k, "v": self.v, "out": self.out}

    def param_axes(self) -> ParamsDict:
        """Megatron's attention: q/k/v column-parallel (``("embed", "qkv")``), ``out``
        row-parallel (``("heads", "embed")``); a tensor axis splits the heads."""
        p = ParamsDict()
        for name, layer in self.children.items():
            p[name] = adapter_axes(
                layer, *(("heads", "embed") if name == "out" else ("embed", "qkv"))
            )
        if self.qk_norm:
            p.q_norm = p.k_norm = param_axes(self.head_norm)
        return p

    def init(self, key: jax.Array) -> ParamsDict:
        children = self.children
        keys = jax.random.split(key, len(children))
        p = ParamsDict(**{n: c.init(k) for (n, c), k in zip(children.items(), keys, strict=True)})
        if self.qk_norm:
            p.q_norm, p.k_norm = self.head_norm.init(key), self.head_norm.init(key)
        return p

    def _norm_heads(self, params: ParamsDict, name: str, x: jax.Array) -> jax.Array:
        with self.params_scope(f"/{name}"):
            return self.head_norm(self.child(params, name), x)

    def _project(self, params: ParamsDict, name: str, x: jax.Array, key=None) -> jax.Array:
        layer = self.children[name]
        p = self.child(params, name)
        with self.params_scope(f"/{name}"):
            return layer(p, x) if key is None else layer(p, x, key=key)

    def qkv(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        offset: Any = 0,
        positions: Any = None,
        key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``q: [..., T, num_heads, head_dim]``, ``k, v: [..., T, num_kv_heads, head_dim]`` of
        ``x: [..., T, features]``; q and k rotated at positions ``offset ..`` when ``rotary``,
        or at ``positions: [..., T]`` (integers: per row of a left-padded batch, restarting
        per packed document)."""
        self.check_input(x, self.features, min_rank=2)
        lead, h, kv, d = x.shape[:-1], self.num_heads, self.kv_heads, self.dim
        if self.fused_qkv:
            y = self._project(params, "qkv", x, key)
            q, k, v = jnp.split(y, [h * d, (h + kv) * d], axis=-1)
        else:  # a key (training with LoRA dropout) is one per projection
            keys = split_key(key, 3)
            q, k, v = (self._project(params, n, x, kn) for n, kn in zip("qkv", keys, strict=True))
        q = q.reshape(*lead, h, d)
        k, v = k.reshape(*lead, kv, d), v.reshape(*lead, kv, d)
        if self.qk_norm:
            q, k = self._norm_heads(params, "q_norm", q), self._norm_heads(params, "k_norm", k)
        if self.rotary:
            inv_freq, factor = self.frequencies
            t = x.shape[-2]
            pos = jnp.arange(t, dtype=jnp.int32) + jnp.asarray(offset, jnp.int32)
            pos = (pos if positions is None else jnp.asarray(positions, jnp.int32))[..., None]
            q = rope(q, pos, inv_freq=inv_freq, attention_factor=factor)
            k = rope(k, pos, inv_freq=inv_freq, attention_factor=factor)
        return q, k, v

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        mask: jax.Array | None = None,
        q_offset: Any = None,
    ) -> jax.Array:
        """Attention of ``q: [B, T, num_heads, head_dim]`` over ``k, v: [B, S, num_kv_heads,
        head_dim]``: ``[B, T, num_heads, head_dim]``. ``mask``: boolean, broadcastable to
        ``[B, num_heads, T, S]``. ``q_offset``: the causal alignment, query ``i`` sees keys
        ``j <= i + q_offset`` (default ``S - T``; a fixed-size cache passes the position of
        the first query, which also hides its unfilled slots), and with ``window`` only
        ``j > i + q_offset - window``."""
        h, kv, d = self.num_heads, self.kv_heads, self.dim
        if q.ndim != 4 or q.shape[2:] != (h, d) or k.shape[2:] != (kv, d) or v.shape != k.shape:
            raise ValueError(
                f"{self._short_repr()}.attend: expected q [B, T, {h}, {d}] and k, v [B, S, "
                f"{kv}, {d}], got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        full = (b, h, t, s)
        if mask is not None:
            if getattr(mask, "dtype", None) != jnp.bool_:
                raise ValueError(f"{self._short_repr()}: mask must be a boolean array")
            try:
                mask = jnp.broadcast_to(mask, full)
            except ValueError:
                raise ValueError(
                    f"{self._short_repr()}: mask of shape {tuple(mask.shape)} does not "
                    f"broadcast to [B, num_heads, T, S] = {full}"
                ) from None
        if self.causal:
            c = jnp.broadcast_to(causal_mask(t, s, q_offset, self.window), full)
            mask = c if mask is None else jnp.logical_and(mask, c)
        if manual_active() or self.softcap is not None:
            return grouped_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)
        # jax.nn.dot_product_attention groups kv heads itself (its XLA path: same arithmetic)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=self.scale)

    def project(self, params: ParamsDict, o: jax.Array, key: jax.Array | None = None):
        """Merge the heads of ``o: [..., T, num_heads, head_dim]``; the output projection."""
        o = o.reshape(*o.shape[:-2], self.num_heads * self.dim)
        return self._project(params, "out", o, key)

    def empty_cache(self, batch: int, length: int, dtype: Any = jnp.float32):
        """Zeroed ``(k, v)`` caches, each ``[batch, length, num_kv_heads, head_dim]``."""
        shape = (batch, length, self.kv_heads, self.dim)
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
        """Self-attention of ``x [B, T, features]``; ``mask`` boolean broadcastable to ``[B,
        num_heads, T, T]`` (with the causal mask), ``positions [B, T]`` the rotary positions
        (default ``0 .. T-1``)."""
        if x.ndim != 3:
            raise ValueError(
                f"{self._short_repr()}: expected x [B, T, {self.features}], got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
        if positions is not None and not self.rotary:
            raise ValueError(
                f"{self._short_repr()}: positions rotate q and k; this layer has rotary=False"
            )
        k_qkv, k_out = split_key(key, 2)
        q, k, v = self.qkv(params, x, positions=positions, key=k_qkv)
        return self.project(params, self.attend(q, k, v, mask=mask), k_out)
