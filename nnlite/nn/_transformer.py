"""The transformer block, one for the whole family: attention and an MLP, each behind a norm
and a residual add. GPT-2/nanoGPT (LayerNorm, GELU MLP, fused q/k/v), Llama, Mistral, Qwen2,
Qwen3, Gemma and Gemma 2 (RMSNorm, gated MLP, grouped-query attention with rotary
embeddings) are configurations of it: the norm kind, the MLP kind, the attention's heads and
positions are fields."""

from __future__ import annotations

from typing import Any

import jax

from ..core._compose import derived_param_axes
from ..core._module import Module
from ..core._params import ParamsDict
from ._attention import MultiHeadAttention
from ._lora import split_key
from ._names import get_activation
from ._normalisation import LayerNorm, RMSNorm
from ._ops import add
from ._swiglu import MLP, SwiGLU

__all__ = ["NORMS", "TransformerBlock"]

#: The block's ``norm`` kinds: ``"layer"`` (LayerNorm, GPT-2), ``"rms"`` (RMSNorm, Llama).
NORMS = ("layer", "rms")


class TransformerBlock(Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` (Equinox and
    Flax have no such block; it is built from their norms, attention and ``Linear``/``Dense``).
    The defaults are GPT-2's/nanoGPT's: LayerNorms, multi-head attention with one fused q/k/v
    projection, an MLP ``Linear(features, mlp_ratio * features)``, activation,
    ``Linear(mlp_ratio * features, features)``, biases everywhere. The rest of the family
    are fields: ``norm="rms"`` (RMSNorm, ``norm_offset=1``: Gemma's ``(1 + w)``), a gated
    MLP (``gated``: SwiGLU with ``activation="silu"``, Gemma's GeGLU with ``"gelu"``),
    ``num_kv_heads`` (grouped-query attention), rotary embeddings (``rotary``, ``rope_theta``,
    ``rope_scaling``), ``qk_norm`` (Qwen3), ``post_norms`` (Gemma 2: ``x +
    post_ln1(attn(ln1(x)))`` and ``x + post_ln2(mlp(ln2(x)))``), the attention's
    ``attn_scale``, ``attn_softcap`` and sliding ``window``. ``nl.LlamaBlock`` is this block
    with Llama's defaults.

    Dropout (``dropout_rate``) as nanoGPT: on the attention weights, after the attention
    output projection and after the MLP; ``key`` is split once per half. Children, for
    step-by-step use (a key/value-cache decoder, ``decode``): ``block.ln1``, ``block.attn``
    (an ``nl.MultiHeadAttention``), ``block.ln2``, ``block.mlp`` (with ``.fc`` and
    ``.proj``, or ``nl.SwiGLU``'s ``.gate``, ``.up``, ``.down``).

    Initialisers: norm scales ones, biases zeros; projections by ``w_init`` (LeCun normal as
    Flax; GPT-2 uses ``"normal_0.02"``), biases zeros.

    Args:
        features: model width.
        num_heads: attention (query) heads; ``num_kv_heads``: key/value heads (None: as
            many); ``head_dim``: features per head (None: ``features // num_heads``).
        mlp_ratio: MLP hidden width multiplier (hidden = ``int(mlp_ratio * features)``)
            unless ``hidden`` gives the width (``intermediate_size``).
        dropout_rate: dropout probability, ``0 <= rate < 1``.
        causal: causal self-attention (default True, a decoder block).
        activation: MLP activation name (default ``"gelu"``, the tanh approximation); with
            ``gated`` the gate's, ``"silu"`` or ``"gelu"``.
        use_bias: biases in the projections and LayerNorms (``qkv_bias``, ``out_bias``,
            ``mlp_bias``: each set apart; None: ``use_bias``).
        eps: the norms' epsilon.
        w_init: initializer of the projection weights.
        implementation: attention implementation (see ``MultiHeadAttention``).
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote). With
            ``dtype`` set the residual stream is cast to it, so the block returns ``dtype``
            (norm statistics and the attention softmax stay float32 inside).
        rotary, rope_theta, rope_scaling, max_position_embeddings: rotary position
            embeddings on the attention's q and k (see ``MultiHeadAttention``); no params.
        remat: checkpoint the attention half and the MLP half separately
            (``jax.checkpoint``): the backward pass recomputes each half's internals and
            holds one half's at a time. Inside an outer ``nl.Remat`` of the block this is
            ``remat: full`` of the GPT.
        norm: ``"layer"`` or ``"rms"``; ``norm_offset``: RMSNorm's ``scale_offset``.
        gated: a gated MLP (``nl.SwiGLU``) instead of ``fc``/``proj``.
        fused_qkv: one ``qkv`` projection (GPT-2's ``c_attn``) or ``q``, ``k``, ``v``.
        qk_norm, post_norms, attn_scale, attn_softcap, window: as above.
        lora: projections wrapped in ``nl.LoRA``, as paths inside the block (``"attn/q"``,
            ``"attn/qkv"``, ``"mlp/down"``, ``"mlp/fc"``, ...), with ``lora_rank``,
            ``lora_alpha`` and ``lora_dropout``.

    Params: ``/ln1/{scale,bias}``, ``/attn/qkv/{W,b}``, ``/attn/out/{W,b}``,
    ``/ln2/{scale,bias}``, ``/mlp/fc/{W,b}``, ``/mlp/proj/{W,b}`` by default; RMSNorms have
    ``scale`` only, separate projections are ``/attn/{q,k,v}``, a gated MLP's
    ``/mlp/{gate,up,down}``; with ``qk_norm`` ``/attn/{q_norm,k_norm}/scale``, with
    ``post_norms`` ``/post_ln1`` and ``/post_ln2``.

    ``__call__(params, x, *, mask=None, positions=None, key=None)``: ``x: [..., T,
    features]`` -> same shape; ``mask`` as in ``MultiHeadAttention``, ``positions [B, T]``
    the rotary positions (packed documents: ``nl.segment_mask``/``positions``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> block = TransformerBlock(8, num_heads=2, mlp_ratio=2)
        >>> p = jax.jit(block.init)(jax.random.key(0))
        >>> p.print()
        /ln1/scale: f32[8]
        /ln1/bias: f32[8]
        /attn/qkv/W: f32[8,24]
        /attn/qkv/b: f32[24]
        /attn/out/W: f32[8,8]
        /attn/out/b: f32[8]
        /ln2/scale: f32[8]
        /ln2/bias: f32[8]
        /mlp/fc/W: f32[8,16]
        /mlp/fc/b: f32[16]
        /mlp/proj/W: f32[16,8]
        /mlp/proj/b: f32[8]
        >>> jax.jit(block)(p, jnp.ones((4, 5, 8))).shape
        (4, 5, 8)
    """

    features: int
    num_heads: int
    mlp_ratio: float = 4
    dropout_rate: float = 0.0
    causal: bool = True
    activation: str = "gelu"
    use_bias: bool = True
    eps: float = 1e-5
    w_init: str = "lecun_normal"
    implementation: str | None = None
    param_dtype: str = "float32"
    dtype: str | None = None
    rotary: bool = False
    remat: bool = False
    norm: str = "layer"
    norm_offset: float = 0.0
    gated: bool = False
    hidden: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Any = ()
    max_position_embeddings: int | None = None
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    mlp_bias: bool | None = None
    fused_qkv: bool = True
    qk_norm: bool = False
    post_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    window: int | None = None
    lora: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict) or self.rope_scaling is None:
            scaling = tuple(sorted((self.rope_scaling or {}).items()))
            object.__setattr__(self, "rope_scaling", scaling)
        super().__post_init__()
        name = type(self).__name__
        if self.hidden is None or self.hidden == 0:  # 0: LlamaBlock's old "not given"
            r = self.mlp_ratio
            number = isinstance(r, int | float) and not isinstance(r, bool)
            features = self.features if isinstance(self.features, int) else 1
            if not number or not r > 0 or int(r * features) < 1:
                raise ValueError(
                    f"{name}: mlp_ratio must be a number > 0 giving at least one hidden unit, "
                    f"got {self.mlp_ratio!r}"
                )
            object.__setattr__(self, "hidden", int(r * features))
        if self.norm not in NORMS:
            raise ValueError(f"{name}: norm {self.norm!r} is not one of {', '.join(NORMS)}")
        get_activation(self.activation)
        attn = ("qkv", "out") if self.fused_qkv else ("q", "k", "v", "out")
        mlp = ("gate", "up", "down") if self.gated else ("fc", "proj")
        valid = [f"attn/{n}" for n in attn] + [f"mlp/{n}" for n in mlp]
        for path in self.lora:
            if path not in valid:
                raise ValueError(
                    f"{name}: lora names {path!r}, not a projection of the block; valid: "
                    + ", ".join(valid)
                )

    def setup(self):
        self.ln1 = self._norm()
        self.attn = MultiHeadAttention(
            self.features,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            causal=self.causal,
            use_bias=self.use_bias,
            dropout_rate=self.dropout_rate,
            w_init=self.w_init,
            implementation=self.implementation,
            rotary=self.rotary,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            qkv_bias=self.qkv_bias,
            out_bias=self.out_bias,
            fused_qkv=self.fused_qkv,
            qk_norm=self.qk_norm,
            norm_eps=self.eps,
            norm_offset=self.norm_offset,
            scale=self.attn_scale,
            softcap=self.attn_softcap,
            window=self.window,
            **self._lora_of("attn"),
            **self._dtypes,
        )
        self.ln2 = self._norm()
        mlp_bias = self.use_bias if self.mlp_bias is None else self.mlp_bias
        if self.gated:
            self.mlp = SwiGLU(
                self.features,
                self.hidden,
                mlp_bias,
                self.activation,
                w_init=self.w_init,
                **self._lora_of("mlp"),
                **self._dtypes,
            )
        else:
            self.mlp = MLP(
                self.features,
                self.hidden,
                self.activation,
                self.dropout_rate,
                mlp_bias,
                self.w_init,
                **self._lora_of("mlp"),
                **self._dtypes,
            )
        if self.post_norms:
            self.post_ln1 = self._norm()
            self.post_ln2 = self._norm()

    def _norm(self) -> LayerNorm | RMSNorm:
        if self.norm == "rms":
            return RMSNorm(self.features, self.eps, scale_offset=self.norm_offset, **self._dtypes)
        return LayerNorm(self.features, self.eps, use_bias=self.use_bias, **self._dtypes)

    def _lora_of(self, prefix: str) -> dict[str, Any]:
        """The LoRA fields of the child ``prefix`` (its projections' names within it)."""
        names = tuple(n.split("/", 1)[1] for n in self.lora if n.startswith(prefix + "/"))
        if not names:
            return {}
        return {
            "lora": names,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
        }

    @property
    def _dtypes(self) -> dict[str, Any]:
        return {"param_dtype": self.param_dtype, "dtype": self.dtype}

    @property
    def uses_key(self) -> bool:
        """A key turns dropout on: the block's (``dropout_rate > 0``), or LoRA's."""
        return self.dropout_rate > 0 or super().uses_key

    def init(self, key: jax.Array) -> ParamsDict:
        """The children's params; one key for the attention, one for the MLP (the norms
        take none), as the blocks drew them before they were one."""
        k_attn, k_mlp = jax.random.split(key)
        p = ParamsDict(ln1=self.ln1.init(key), attn=self.attn.init(k_attn))
        p.ln2, p.mlp = self.ln2.init(key), self.mlp.init(k_mlp)
        if self.post_norms:
            p.post_ln1, p.post_ln2 = self.post_ln1.init(key), self.post_ln2.init(key)
        return p

    def param_axes(self) -> ParamsDict:
        """Each child's logical axes under its name (Megatron's layout for the attention
        and the MLP)."""
        return derived_param_axes(self)

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        self.check_input(x, self.features, min_rank=2)
        if self.dtype is not None:
            # The residual stream follows the compute dtype: a bfloat16 block returns
            # bfloat16 (a float32 stream would make each add promote back to float32).
            x = x.astype(self.dtype)
        k_attn, k_mlp = split_key(key, 2)
        attn_half, mlp_half = self._attn_half, self._mlp_half
        if self.remat:
            attn_half, mlp_half = jax.checkpoint(attn_half), jax.checkpoint(mlp_half)
        return mlp_half(params, attn_half(params, x, mask, positions, k_attn), k_mlp)

    def _norm_at(self, params: ParamsDict, name: str, x: jax.Array) -> jax.Array:
        p = self.child(params, name)
        with self.params_scope(f"/{name}"):
            return getattr(self, name)(p, x)

    def _residual(self, params: ParamsDict, x: jax.Array, y: jax.Array, post: str) -> jax.Array:
        """``x + y``, ``y`` (a half's output) normalised first with ``post_norms``."""
        if self.post_norms:
            y = self._norm_at(params, post, y)
        return add(x, y.astype(x.dtype))

    def _attn_half(self, params: ParamsDict, x: jax.Array, mask, positions, key) -> jax.Array:
        """``x + attn(ln1(x))``."""
        h = self._norm_at(params, "ln1", x)
        kw = {} if positions is None else {"positions": positions}
        p = self.child(params, "attn")
        with self.params_scope("/attn"):
            y = self.attn(p, h, mask=mask, key=key, **kw)
        return self._residual(params, x, y, "post_ln1")

    def _mlp_half(self, params: ParamsDict, x: jax.Array, key=None) -> jax.Array:
        """``x + mlp(ln2(x))``."""
        h = self._norm_at(params, "ln2", x)
        p = self.child(params, "mlp")
        with self.params_scope("/mlp"):
            y = self.mlp(p, h, key=key)
        return self._residual(params, x, y, "post_ln2")

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
        ``mask``, ``positions``: a left-padded batch's (``MultiHeadAttention.decode``).
        Inference: no dropout."""
        if self.dtype is not None:
            x = x.astype(self.dtype)
        h = self.ln1(params.ln1, x)
        o, cache = self.attn.decode(params.attn, h, cache, pos, mask=mask, positions=positions)
        return self._mlp_half(params, self._residual(params, x, o, "post_ln1")), cache
