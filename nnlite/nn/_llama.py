"""The Llama decoder block (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, SmolLM): the one
``TransformerBlock`` with Llama's defaults."""

from __future__ import annotations

from ._transformer import TransformerBlock

__all__ = ["LlamaBlock"]


class LlamaBlock(TransformerBlock):
    """``nl.TransformerBlock`` with the defaults of Hugging Face's ``LlamaDecoderLayer``:
    ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``, RMSNorms (``eps`` 1e-6), grouped-query
    attention (``num_kv_heads``) with separate q/k/v projections and rotary embeddings, a
    SwiGLU MLP of width ``hidden`` (default ``4 * features``), no biases. Every field,
    method and param name is ``TransformerBlock``'s: ``MistralDecoderLayer`` and
    ``Qwen2DecoderLayer`` are the same block, Qwen2 with ``qkv_bias``; Qwen3's adds
    ``qk_norm``; Gemma's has ``(1 + w)`` norms, ``norm_offset=1``, and a GeGLU MLP,
    ``activation="gelu"``; Gemma 2's also ``post_norms``, soft-capped attention logits
    (``attn_softcap``), another logit scale (``attn_scale``) and sliding-window layers
    (``window``).

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

    activation: str = "silu"
    use_bias: bool = False
    eps: float = 1e-6
    rotary: bool = True
    norm: str = "rms"
    gated: bool = True
    fused_qkv: bool = False
