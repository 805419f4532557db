"""GPT-2 (Radford et al. 2019) as Hugging Face's ``GPT2LMHeadModel``: ``GPT2Block`` and
``GPT2LM``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core._axes import Axes, param_axes
from ..core._params import ParamsDict
from ..nn._embedding import Embedding
from ..nn._names import get_activation
from ..nn._normalisation import LayerNorm
from ..nn._ops import add
from ..nn._transformer import TransformerBlock
from ._models import _Decoder

__all__ = ["GPT2LM", "GPT2Block"]


#: GPT-2's block is the one ``nl.TransformerBlock`` with its defaults (LayerNorms with biases,
#: multi-head attention with one fused ``qkv`` projection, ``c_attn``, and biases, a GELU MLP
#: of width ``hidden``); ``lora`` names projections inside it (``"attn/qkv"``, ``"mlp/fc"``).
GPT2Block = TransformerBlock


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
            hidden=self.n_inner or 4 * self.n_embd,
            activation=self.activation,
            eps=self.eps,
            lora=self._block_lora(i),
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
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
