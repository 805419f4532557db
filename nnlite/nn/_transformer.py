"""The pre-LayerNorm transformer block (GPT-2, nanoGPT): attention and an MLP, each
behind a LayerNorm and a residual add."""

from __future__ import annotations

from typing import Any

import jax

from ..core._axes import param_axes
from ..core._module import Module
from ..core._params import ParamsDict
from ._attention import MultiHeadAttention
from ._dropout import dropout
from ._linear import Linear, linear_axes, linear_like
from ._names import get_activation
from ._normalisation import LayerNorm
from ._ops import add

__all__ = ["TransformerBlock"]


class _MLP(Module):
    """The transformer block's MLP: ``fc`` (``features -> hidden``), activation, ``proj``
    (``hidden -> features``), dropout (as nanoGPT). Params ``/fc/{W,b}``, ``/proj/{W,b}``."""

    features: int
    hidden: int
    activation: str = "gelu"
    dropout_rate: float = 0.0
    use_bias: bool = True
    w_init: str = "lecun_normal"
    param_dtype: str = "float32"
    dtype: str | None = None

    @property
    def uses_key(self) -> bool:
        """A key turns dropout on: only when ``dropout_rate > 0``."""
        return self.dropout_rate > 0

    @property
    def fc(self) -> Linear:
        return linear_like(self, self.features, self.hidden)

    @property
    def proj(self) -> Linear:
        return linear_like(self, self.hidden, self.features)

    def param_axes(self) -> ParamsDict:
        """Megatron's MLP: ``fc`` column-parallel, ``proj`` row-parallel."""
        return ParamsDict(
            fc=linear_axes(self.fc, "embed", "mlp"), proj=linear_axes(self.proj, "mlp", "embed")
        )

    def init(self, key: jax.Array) -> ParamsDict:
        k_fc, k_proj = jax.random.split(key)
        return ParamsDict(fc=self.fc.init(k_fc), proj=self.proj.init(k_proj))

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        p_fc = self.child(params, "fc")
        with self.params_scope("/fc"):
            h = get_activation(self.activation)(self.fc(p_fc, x))
        p_proj = self.child(params, "proj")
        with self.params_scope("/proj"):
            y = self.proj(p_proj, h)
        return dropout(y, key, self.dropout_rate)


class TransformerBlock(Module):
    """Pre-LayerNorm transformer block, as GPT-2/nanoGPT: ``x + attn(ln1(x))`` then
    ``x + mlp(ln2(x))``, the MLP ``Linear(features, mlp_ratio * features)``, activation,
    ``Linear(mlp_ratio * features, features)`` (Equinox and Flax have no such block; it is
    built from their ``LayerNorm``, ``MultiheadAttention`` and ``Linear``/``Dense``).

    Dropout (``dropout_rate``) as nanoGPT: on the attention weights, after the attention
    output projection and after the MLP; ``key`` is split once per random child.
    Children, for step-by-step use (a key/value-cache decoder): ``block.ln1``,
    ``block.attn`` (a ``MultiHeadAttention``), ``block.ln2``, ``block.mlp`` (with
    ``.fc`` and ``.proj``).

    Initialisers: LayerNorm scale ones, bias zeros; projections by ``w_init`` (LeCun normal
    as Flax; GPT-2 uses ``"normal_0.02"``), biases zeros.

    Args:
        features: model width.
        num_heads: attention heads (must divide ``features``).
        mlp_ratio: MLP hidden width multiplier (hidden = ``int(mlp_ratio * features)``).
        dropout_rate: dropout probability, ``0 <= rate < 1``.
        causal: causal self-attention (default True, a decoder block).
        activation: MLP activation name (default ``"gelu"``, the tanh approximation).
        use_bias: biases in the projections and LayerNorms.
        eps: LayerNorm epsilon.
        w_init: initializer of the projection weights.
        implementation: attention implementation (see ``MultiHeadAttention``).
        rotary: rotary position embeddings on the attention's q and k (see
            ``MultiHeadAttention``); adds no params.
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote). With
            ``dtype`` set the residual stream is cast to it, so the block returns ``dtype``
            (LayerNorm statistics and the attention softmax stay float32 inside).
        remat: checkpoint the attention half and the MLP half separately
            (``jax.checkpoint``): the backward pass recomputes each half's internals and
            holds one half's at a time. Inside an outer ``nl.Remat`` of the block this is
            ``remat: full`` of the GPT.

    Params: ``/ln1/{scale,bias}``, ``/attn/qkv/{W,b}``, ``/attn/out/{W,b}``,
    ``/ln2/{scale,bias}``, ``/mlp/fc/{W,b}``, ``/mlp/proj/{W,b}``.

    ``__call__(params, x, *, mask=None, key=None)``: ``x: [..., T, features]`` -> same shape;
    ``mask`` as in ``MultiHeadAttention``.

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

    @property
    def uses_key(self) -> bool:
        """A key turns dropout on: only when ``dropout_rate > 0``."""
        return self.dropout_rate > 0

    def __post_init__(self):
        super().__post_init__()
        r = self.mlp_ratio
        number = isinstance(r, int | float) and not isinstance(r, bool)
        features = self.features if isinstance(self.features, int) else 1
        if not number or not r > 0 or int(r * features) < 1:
            raise ValueError(
                f"TransformerBlock: mlp_ratio must be a number > 0 giving at least one hidden "
                f"unit, got {self.mlp_ratio!r}"
            )
        get_activation(self.activation)
        self.attn  # validates features, num_heads, dropout_rate, dtypes  # noqa: B018
        self.ln1  # noqa: B018

    @property
    def ln1(self) -> LayerNorm:
        return LayerNorm(self.features, self.eps, use_bias=self.use_bias, **self._dtypes)

    @property
    def ln2(self) -> LayerNorm:
        return self.ln1

    @property
    def attn(self) -> MultiHeadAttention:
        return MultiHeadAttention(
            self.features,
            self.num_heads,
            causal=self.causal,
            use_bias=self.use_bias,
            dropout_rate=self.dropout_rate,
            w_init=self.w_init,
            implementation=self.implementation,
            rotary=self.rotary,
            **self._dtypes,
        )

    @property
    def mlp(self) -> _MLP:
        return _MLP(
            self.features,
            int(self.mlp_ratio * self.features),
            self.activation,
            self.dropout_rate,
            self.use_bias,
            self.w_init,
            **self._dtypes,
        )

    @property
    def _dtypes(self) -> dict[str, Any]:
        return {"param_dtype": self.param_dtype, "dtype": self.dtype}

    def param_axes(self) -> ParamsDict:
        ln = param_axes(self.ln1)
        return ParamsDict(ln1=ln, attn=param_axes(self.attn), ln2=ln, mlp=param_axes(self.mlp))

    def init(self, key: jax.Array) -> ParamsDict:
        k_attn, k_mlp = jax.random.split(key)
        return ParamsDict(
            ln1=self.ln1.init(key),
            attn=self.attn.init(k_attn),
            ln2=self.ln2.init(key),
            mlp=self.mlp.init(k_mlp),
        )

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        self.check_input(x, self.features, min_rank=2)
        if self.dtype is not None:
            # The residual stream follows the compute dtype: a bfloat16 block returns
            # bfloat16 (a float32 stream would make each add promote back to float32).
            x = x.astype(self.dtype)
        k_attn, k_mlp = (None, None) if key is None else jax.random.split(key)
        attn_half, mlp_half = self._attn_half, self._mlp_half
        if self.remat:
            attn_half, mlp_half = jax.checkpoint(attn_half), jax.checkpoint(mlp_half)
        return mlp_half(params, attn_half(params, x, mask, k_attn), k_mlp)

    def _attn_half(self, params: ParamsDict, x: jax.Array, mask, key) -> jax.Array:
        """``x + attn(ln1(x))``."""
        p_ln1 = self.child(params, "ln1")
        with self.params_scope("/ln1"):
            h = self.ln1(p_ln1, x)
        p_attn = self.child(params, "attn")
        with self.params_scope("/attn"):
            return add(x, self.attn(p_attn, h, mask=mask, key=key).astype(x.dtype))

    def _mlp_half(self, params: ParamsDict, x: jax.Array, key) -> jax.Array:
        """``x + mlp(ln2(x))``."""
        p_ln2 = self.child(params, "ln2")
        with self.params_scope("/ln2"):
            h = self.ln2(p_ln2, x)
        p_mlp = self.child(params, "mlp")
        with self.params_scope("/mlp"):
            return add(x, self.mlp(p_mlp, h, key=key).astype(x.dtype))
