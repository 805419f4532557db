"""The Llama decoder block (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, SmolLM): RMSNorm,
grouped-query attention with rotary embeddings, RMSNorm, gated MLP, each half behind a
residual add; Gemma 2 also normalises each half's output."""

from __future__ import annotations

from typing import Any

import jax

from ..core._axes import param_axes
from ..core._module import Module
from ..core._params import ParamsDict
from ._gqa import GroupedQueryAttention
from ._lora import split_key
from ._normalisation import RMSNorm
from ._ops import add
from ._swiglu import SwiGLU

__all__ = ["LlamaBlock"]

_ATTN = ("attn/q", "attn/k", "attn/v", "attn/out")
_MLP = ("mlp/gate", "mlp/up", "mlp/down")


class LlamaBlock(Module):
    """Pre-RMSNorm decoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, the attention
    an ``nl.GroupedQueryAttention`` with rotary embeddings, the MLP an ``nl.SwiGLU`` (Hugging
    Face's ``LlamaDecoderLayer``; ``MistralDecoderLayer`` and ``Qwen2DecoderLayer`` are the
    same block, Qwen2 with ``qkv_bias``; Qwen3's adds ``qk_norm``; Gemma's has ``(1 + w)``
    norms, ``norm_offset=1``, and a GeGLU MLP, ``activation="gelu"``; Gemma 2's also
    ``post_norms``, ``x + post_ln1(attn(ln1(x)))`` and ``x + post_ln2(mlp(ln2(x)))``, soft-capped
    attention logits and sliding-window layers).

    Args:
        features: model width (``hidden_size``).
        num_heads: query heads; ``num_kv_heads``: key/value heads (None: ``num_heads``).
        hidden: the MLP's gated width (``intermediate_size``).
        head_dim: features per head (None: ``features // num_heads``).
        eps: RMSNorm epsilon (``rms_norm_eps``).
        rope_theta, rope_scaling, max_position_embeddings: rotary embeddings (see
            ``GroupedQueryAttention``).
        qkv_bias, out_bias: attention biases (Llama's ``attention_bias`` sets both, Qwen2
            has ``qkv_bias`` only); ``mlp_bias``: MLP biases.
        activation: the MLP's gate, ``"silu"`` (SwiGLU) or ``"gelu"`` (GeGLU, tanh form).
        norm_offset: every RMSNorm multiplies by ``norm_offset + scale`` (Gemma's 1).
        qk_norm: RMSNorm of each head of q and k (Qwen3).
        post_norms: an RMSNorm on each half's output before its residual add (Gemma 2).
        attn_scale, attn_softcap, window: the attention's ``scale``, ``softcap`` and sliding
            ``window`` (see ``GroupedQueryAttention``; None: ``1 / sqrt(head_dim)``, no cap,
            no window).
        lora: projections wrapped in ``nl.LoRA``, as paths inside the block (``"attn/q"``,
            ``"attn/v"``, ``"mlp/down"``, ...), with ``lora_rank``, ``lora_alpha`` and
            ``lora_dropout``.
        w_init, param_dtype, dtype: as ``nl.Linear``.

    Params: ``/ln1/scale``, ``/attn/{q,k,v,out}/...``, ``/ln2/scale``,
    ``/mlp/{gate,up,down}/...``; with ``qk_norm`` ``/attn/{q_norm,k_norm}/scale``, with
    ``post_norms`` ``/post_ln1/scale`` and ``/post_ln2/scale``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> block = LlamaBlock(16, num_heads=4, num_kv_heads=2, hidden=32)
        >>> p = jax.jit(block.init)(jax.random.key(0))
        >>> jax.jit(block)(p, jnp.ones((2, 5, 16))).shape
        (2, 5, 16)
        >>> cache = block.attn.empty_cache(2, 8)
        >>> y, cache = jax.jit(block.decode)(p, jnp.ones((2, 1, 16)), cache, 0)
        >>> y.shape, cache[0].shape
        ((2, 1, 16), (2, 8, 2, 4))
    """

    features: int
    num_heads: int
    num_kv_heads: int | None = None
    hidden: int = 0
    head_dim: int | None = None
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = ()
    max_position_embeddings: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    norm_offset: float = 0.0
    qk_norm: bool = False
    post_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
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
        super().__post_init__()
        if self.hidden == 0 and isinstance(self.features, int):
            object.__setattr__(self, "hidden", 4 * self.features)
        for name in self.lora:
            if name not in _ATTN + _MLP:
                raise ValueError(
                    f"LlamaBlock: lora names {name!r}, not a projection of the block; valid: "
                    + ", ".join(_ATTN + _MLP)
                )
        self.attn  # validates the attention's fields  # noqa: B018
        self.mlp  # noqa: B018

    def _lora_of(self, prefix: str) -> tuple[str, ...]:
        return tuple(n.split("/", 1)[1] for n in self.lora if n.startswith(prefix + "/"))

    @property
    def ln1(self) -> RMSNorm:
        return RMSNorm(
            self.features,
            self.eps,
            scale_offset=self.norm_offset,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )

    @property
    def ln2(self) -> RMSNorm:
        return self.ln1

    @property
    def _norms(self) -> tuple[str, ...]:
        return ("ln1", "ln2", "post_ln1", "post_ln2") if self.post_norms else ("ln1", "ln2")

    @property
    def attn(self) -> GroupedQueryAttention:
        return GroupedQueryAttention(
            self.features,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            causal=True,
            qkv_bias=self.qkv_bias,
            out_bias=self.out_bias,
            rotary=True,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            qk_norm=self.qk_norm,
            norm_eps=self.eps,
            norm_offset=self.norm_offset,
            scale=self.attn_scale,
            softcap=self.attn_softcap,
            window=self.window,
            lora=self._lora_of("attn"),
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            w_init=self.w_init,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )

    @property
    def mlp(self) -> SwiGLU:
        return SwiGLU(
            self.features,
            self.hidden,
            use_bias=self.mlp_bias,
            activation=self.activation,
            lora=self._lora_of("mlp"),
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            w_init=self.w_init,
            param_dtype=self.param_dtype,
            dtype=self.dtype,
        )

    def param_axes(self) -> ParamsDict:
        p = ParamsDict(attn=param_axes(self.attn), mlp=param_axes(self.mlp))
        for name in self._norms:
            p[name] = param_axes(self.ln1)
        return p

    def init(self, key: jax.Array) -> ParamsDict:
        k_attn, k_mlp = jax.random.split(key)
        p = ParamsDict(ln1=self.ln1.init(key), attn=self.attn.init(k_attn))
        p.ln2, p.mlp = self.ln2.init(key), self.mlp.init(k_mlp)
        if self.post_norms:
            p.post_ln1, p.post_ln2 = self.ln1.init(key), self.ln1.init(key)
        return p

    def _norm(self, params: ParamsDict, name: str, x: jax.Array) -> jax.Array:
        with self.params_scope(f"/{name}"):
            return self.ln1(self.child(params, name), x)

    def _residual(self, params: ParamsDict, x: jax.Array, y: jax.Array, post: str) -> jax.Array:
        """``x + y``, ``y`` (a half's output) normalised first with ``post_norms``."""
        if self.post_norms:
            y = self._norm(params, post, y)
        return add(x, y.astype(x.dtype))

    def _mlp_half(self, params: ParamsDict, x: jax.Array, key=None) -> jax.Array:
        h = self._norm(params, "ln2", x)
        with self.params_scope("/mlp"):
            y = self.mlp(self.child(params, "mlp"), h, key=key)
        return self._residual(params, x, y, "post_ln2")

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        """The block on ``x [B, T, features]``; ``mask`` and ``positions [B, T]`` as
        ``GroupedQueryAttention``'s (packed documents: ``nl.segment_mask``/``positions``)."""
        self.check_input(x, self.features, min_rank=3)
        if self.dtype is not None:
            x = x.astype(self.dtype)  # the residual stream in the compute dtype
        h = self._norm(params, "ln1", x)
        k_attn, k_mlp = split_key(key, 2)  # keys: LoRA dropout in training
        with self.params_scope("/attn"):
            y = self.attn(self.child(params, "attn"), h, mask=mask, positions=positions, key=k_attn)
        return self._mlp_half(params, self._residual(params, x, y, "post_ln1"), k_mlp)

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
        """The block on ``x: [B, T, features]`` at cache slots ``pos ..`` against this layer's
        key/value ``cache`` (``attn.empty_cache``); returns the output and the updated cache.
        ``mask``, ``positions``: a left-padded batch's (``GroupedQueryAttention.decode``)."""
        if self.dtype is not None:
            x = x.astype(self.dtype)
        h = self.ln1(params.ln1, x)
        o, cache = self.attn.decode(params.attn, h, cache, pos, mask=mask, positions=positions)
        return self._mlp_half(params, self._residual(params, x, o, "post_ln1")), cache
