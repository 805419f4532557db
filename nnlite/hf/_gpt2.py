"""GPT-2 (Radford et al. 2019) as Hugging Face's ``GPT2LMHeadModel``: ``GPT2Block`` and
``GPT2LM``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._axes import Axes, param_axes
from ..core._module import Module
from ..core._params import ParamsDict
from ..nn._embedding import Embedding
from ..nn._gqa import GroupedQueryAttention
from ..nn._linear import Linear
from ..nn._lora import LoRA, adapter_axes, split_key, wrap
from ..nn._names import get_activation
from ..nn._normalisation import LayerNorm
from ..nn._ops import add
from ._models import _Decoder

__all__ = ["GPT2LM", "GPT2Block"]


class _GeluMLP(Module):
    """GPT-2's MLP: ``proj(act(fc(x)))``; params ``/fc``, ``/proj`` (either may be a LoRA)."""

    features: int
    hidden: int
    activation: str = "gelu"
    lora: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0

    def _lin(self, name, n_in, n_out):
        on = name in self.lora
        return wrap(Linear(n_in, n_out), on, self.lora_rank, self.lora_alpha, self.lora_dropout)

    @property
    def fc(self):
        return self._lin("fc", self.features, self.hidden)

    @property
    def proj(self):
        return self._lin("proj", self.hidden, self.features)

    @property
    def children(self) -> dict[str, Linear | LoRA]:
        return {"fc": self.fc, "proj": self.proj}

    def param_axes(self) -> ParamsDict:
        return ParamsDict(
            fc=adapter_axes(self.fc, "embed", "mlp"), proj=adapter_axes(self.proj, "mlp", "embed")
        )

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return ParamsDict(fc=self.fc.init(k1), proj=self.proj.init(k2))

    def __call__(self, params, x, *, key=None):
        k_fc, k_proj = split_key(key, 2)  # keys: LoRA dropout in training
        with self.params_scope("/fc"):
            h = get_activation(self.activation)(self.fc(self.child(params, "fc"), x, key=k_fc))
        with self.params_scope("/proj"):
            return self.proj(self.child(params, "proj"), h, key=k_proj)


class GPT2Block(Module):
    """GPT-2's block: ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, LayerNorms with biases,
    multi-head attention with one fused ``qkv`` projection (``c_attn``) and biases, a GELU
    MLP. Params as ``nl.TransformerBlock``'s (``/ln1``, ``/attn/qkv``, ``/attn/out``,
    ``/ln2``, ``/mlp/fc``, ``/mlp/proj``); ``lora`` names projections inside the block
    (``"attn/qkv"``, ``"mlp/fc"``, ...)."""

    features: int
    num_heads: int
    hidden: int
    activation: str = "gelu"
    eps: float = 1e-5
    lora: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0

    def _sub(self, prefix):
        return tuple(n.split("/", 1)[1] for n in self.lora if n.startswith(prefix + "/"))

    @property
    def ln1(self) -> LayerNorm:
        return LayerNorm(self.features, self.eps)

    @property
    def ln2(self) -> LayerNorm:
        return self.ln1

    @property
    def attn(self) -> GroupedQueryAttention:
        return GroupedQueryAttention(
            self.features,
            self.num_heads,
            causal=True,
            qkv_bias=True,
            out_bias=True,
            fused_qkv=True,
            rotary=False,
            lora=self._sub("attn"),
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
        )

    @property
    def mlp(self) -> _GeluMLP:
        return _GeluMLP(
            self.features,
            self.hidden,
            self.activation,
            self._sub("mlp"),
            self.lora_rank,
            self.lora_alpha,
            self.lora_dropout,
        )

    def param_axes(self) -> ParamsDict:
        ln = param_axes(self.ln1)
        return ParamsDict(ln1=ln, attn=param_axes(self.attn), ln2=ln, mlp=param_axes(self.mlp))

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return ParamsDict(
            ln1=self.ln1.init(key),
            attn=self.attn.init(k1),
            ln2=self.ln2.init(key),
            mlp=self.mlp.init(k2),
        )

    def _mlp_half(self, params, x, key=None):
        return add(x, self.mlp(params.mlp, self.ln2(params.ln2, x), key=key))

    def __call__(self, params, x, *, mask=None, key=None):
        k_attn, k_mlp = split_key(key, 2)  # keys: LoRA dropout in training
        h = self.ln1(self.child(params, "ln1"), x)
        with self.params_scope("/attn"):
            x = add(x, self.attn(self.child(params, "attn"), h, mask=mask, key=k_attn))
        with self.params_scope(""):
            return self._mlp_half(params, x, k_mlp)

    def decode(self, params, x, cache, pos, *, mask=None, positions=None):
        h = self.ln1(params.ln1, x)
        o, cache = self.attn.decode(params.attn, h, cache, pos, mask=mask, positions=positions)
        return self._mlp_half(params, x + o), cache


class GPT2LM(_Decoder):
    """GPT-2 (Radford et al. 2019) as Hugging Face's ``GPT2LMHeadModel``: token and learned
    position embeddings, ``n_layer`` ``GPT2Block``s, a final LayerNorm, the head tied to the
    token table (``tie_head``) or its own.

    Params: ``/wte/W [vocab, n_embd]``, ``/wpe/W [context, n_embd]``, ``/blocks[i]/...``,
    ``/ln_f/{scale,bias}``, ``/head/W`` when untied.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> m = GPT2LM(vocab_size=50, context=16, n_layer=1, n_head=2, n_embd=8)
        >>> p = jax.jit(m.init)(jax.random.key(0))
        >>> jax.jit(m)(p, jnp.zeros((1, 5), jnp.int32)).shape
        (1, 5, 50)
    """

    vocab_size: int
    context: int
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_inner: int | None = None
    activation: str = "gelu"
    eps: float = 1e-5
    tie_head: bool = True
    lora_targets: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0

    _LINEARS = ("attn/qkv", "attn/out", "mlp/fc", "mlp/proj")
    _EMBED = "wte"

    def __post_init__(self):
        super().__post_init__()
        self._check_common()
        get_activation(self.activation)
        self.block_at(0)  # noqa: B018

    @property
    def wte(self) -> Embedding:
        return Embedding(self.vocab_size, self.n_embd)

    @property
    def wpe(self) -> Embedding:
        return Embedding(self.context, self.n_embd)

    @property
    def ln_f(self) -> LayerNorm:
        return LayerNorm(self.n_embd, self.eps)

    def block_at(self, i: int) -> GPT2Block:
        return GPT2Block(
            self.n_embd,
            self.n_head,
            self.n_inner or 4 * self.n_embd,
            self.activation,
            self.eps,
            self._block_lora(i),
            self.lora_rank,
            self.lora_alpha,
            self.lora_dropout,
        )

    def _init_embed(self, key):
        k1, k2 = jax.random.split(key)
        return ParamsDict(wte=self.wte.init(k1), wpe=self.wpe.init(k2))

    def _embed_axes(self):
        return ParamsDict(wte=param_axes(self.wte), wpe=ParamsDict(W=Axes(("position", "embed"))))

    def _packed_kwargs(self, mask, positions):
        return {"mask": mask}  # learned positions: added by _embed

    def _embed(self, params, tokens, pos):
        x = self.wte(params.wte, tokens)
        t = tokens.shape[-1]
        if getattr(pos, "ndim", 0) == 2:  # per-token positions [B, T]: packed documents, or
            # a left-padded batch (its padding's -1 read as 0: those slots are masked)
            return add(x, self.wpe(params.wpe, jnp.maximum(pos, 0)).astype(x.dtype))
        if isinstance(pos, int) and pos == 0:
            wpe = params.wpe.W[:t]
        else:
            wpe = jax.lax.dynamic_slice_in_dim(params.wpe.W, pos, t, axis=0)
        return add(x, jnp.broadcast_to(wpe.astype(x.dtype), x.shape))
