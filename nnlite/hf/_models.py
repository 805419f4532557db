"""The decoders that ``load_pretrained`` builds: their shared base, ``LlamaLM`` (``GPT2LM`` is
in ``_gpt2.py``), and LoRA added to or merged out of them.

Both are ordinary nnlite Modules (``init``, ``__call__(params, tokens) -> logits``, ``task =
"language_model"``, logical axes for fsdp/tensor), decode with a key/value cache
(``decode_step``, ``generate``) and take LoRA adapters on projections chosen by globs over
their param paths (``lora_targets``: ``"*/attn/q"``, ``"*/mlp/*"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..core._axes import param_axes
from ..core._module import Module
from ..core._params import ParamsDict
from ..nn._embedding import Embedding
from ..nn._linear import Linear
from ..nn._llama import LlamaBlock
from ..nn._lora import adapter_axes, match_targets
from ..nn._normalisation import RMSNorm
from ..nn._segments import segment_mask, segment_positions
from ._generate import generate

__all__ = ["LlamaLM", "add_lora", "merge_lora"]


class _Decoder(Module):
    """What GPT2LM and LlamaLM share: LoRA resolution, the forward pass over the blocks, the
    cached decode step and generation. Subclasses define ``block_at(i)``, ``_embed``,
    ``ln_f`` and the head."""

    task = "language_model"

    def _check_common(self) -> None:
        self._check_positive_ints("vocab_size", "context", "n_layer", "n_head", "n_embd")
        if self.lora_targets:
            self._check_positive_ints("lora_rank")
            self.lora_paths  # every glob matches  # noqa: B018

    @property
    def linear_paths(self) -> list[str]:
        """The param paths of the projections LoRA can wrap, ``/blocks[i]/attn/q``, ..."""
        return [f"/blocks[{i}]/{name}" for i in range(self.n_layer) for name in self._LINEARS]

    @property
    def lora_paths(self) -> set[str]:
        """The projections ``lora_targets`` selects."""
        where = f"{type(self).__name__} lora_targets"
        return match_targets(self.lora_targets, self.linear_paths, where)

    def _block_lora(self, i: int) -> tuple[str, ...]:
        if not self.lora_targets:
            return ()
        prefix = f"/blocks[{i}]/"
        return tuple(sorted(p[len(prefix) :] for p in self.lora_paths if p.startswith(prefix)))

    @property
    def uses_key(self) -> bool:
        return False  # no dropout: imported models fine-tune without it

    @property
    def max_positions(self) -> int:
        """The longest sequence ``generate`` makes (prompt and new tokens): the model's
        positions; generation does not slide past them."""
        return self.context

    def init(self, key: jax.Array) -> ParamsDict:
        keys = jax.random.split(key, self.n_layer + 2)
        p = self._init_embed(keys[0])
        p.blocks = [self.block_at(i).init(keys[i + 2]) for i in range(self.n_layer)]
        p.ln_f = self.ln_f.init(keys[1])
        if not self.tie_head:
            p.head = self.head.init(keys[1])
        return p

    @property
    def head(self) -> Linear:
        return Linear(self.n_embd, self.vocab_size, use_bias=False)

    def logits(self, params: ParamsDict, h: jax.Array) -> jax.Array:
        """The head: ``h [..., n_embd] -> [..., vocab_size]`` (the token table transposed
        when ``tie_head``)."""
        h = self.ln_f(params.ln_f, h)
        if self.tie_head:
            return self.wte.attend(params[self._EMBED], h)
        return self.head(params.head, h)

    def __call__(
        self,
        params: ParamsDict,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        key: jax.Array | None = None,
    ):
        """Logits ``[batch, T, vocab_size]`` of integer ``tokens [batch, T]``, ``T <=
        context``. ``segment_ids [batch, T]``: packed documents (contiguous, equal ids per
        document), each attending only to itself with positions from 0, so its logits are
        those it has alone."""
        if getattr(tokens, "ndim", 0) != 2:
            raise ValueError(
                f"{type(self).__name__}: expected tokens [batch, T], got shape "
                f"{tuple(getattr(tokens, 'shape', ()))}"
            )
        t = tokens.shape[-1]
        if t > self.context:
            raise ValueError(f"{type(self).__name__}: {t} tokens exceed context={self.context}")
        kw, pos = {}, 0
        if segment_ids is not None:
            if tuple(getattr(segment_ids, "shape", ())) != tuple(tokens.shape):
                raise ValueError(
                    f"{type(self).__name__}: segment_ids of shape "
                    f"{tuple(getattr(segment_ids, 'shape', ()))} must match tokens {tokens.shape}"
                )
            pos = segment_positions(segment_ids)
            kw = self._packed_kwargs(segment_mask(segment_ids), pos)
        x = self._embed(params, tokens, pos)
        blocks = self.child(params, "blocks")
        if len(blocks) != self.n_layer:
            raise ValueError(
                f"{type(self).__name__}: params hold {len(blocks)} blocks, n_layer={self.n_layer}"
            )
        for i, p in enumerate(blocks):
            with self.params_scope(f"/blocks[{i}]"):
                x = self.block_at(i)(p, x, **kw)
        return self.logits(params, x)

    def _packed_kwargs(self, mask: jax.Array, positions: jax.Array) -> dict:
        """What a block takes of packed documents: the mask, and rotary positions."""
        return {"mask": mask, "positions": positions}

    def param_axes(self) -> ParamsDict:
        p = self._embed_axes()
        p.blocks = [param_axes(self.block_at(i)) for i in range(self.n_layer)]
        p.ln_f = param_axes(self.ln_f)
        if not self.tie_head:
            p.head = adapter_axes(self.head, "embed", "vocab")
        return p

    # -- decoding with a key/value cache ----------------------------------------------------
    def empty_cache(self, batch: int, length: int, dtype: Any = jnp.float32) -> list:
        """Zeroed per-layer ``(k, v)`` caches of ``length`` positions."""
        return [
            self.block_at(i).attn.empty_cache(batch, length, dtype) for i in range(self.n_layer)
        ]

    def decode_step(self, params: ParamsDict, cache: list, tokens: jax.Array, pos: Any):
        """Logits ``[batch, T, vocab]`` of ``tokens [batch, T]`` at positions ``pos ..``
        (``pos`` may be traced) given the cache of the positions before; returns the logits
        and the cache with these positions written in."""
        x = self._embed(params, tokens, pos)
        new = []
        for i, p in enumerate(params.blocks):
            x, c = self.block_at(i).decode(p, x, cache[i], pos)
            new.append(c)
        return self.logits(params, x), new

    def generate(self, params, prompt, n_tokens: int, key, temperature=1.0, top_k=None, top_p=None):
        """``prompt [batch, P]`` and ``n_tokens`` sampled tokens (``nl.hf.generate``)."""
        return generate(self, params, prompt, n_tokens, key, temperature, top_k, top_p)

    # -- LoRA -------------------------------------------------------------------------------
    def with_lora(self, targets, rank: int = 8, alpha: float = 16.0):
        """This model with LoRA adapters on the projections the globs ``targets`` select."""
        return dataclasses.replace(
            self, lora_targets=tuple(targets), lora_rank=rank, lora_alpha=float(alpha)
        )


class LlamaLM(_Decoder):
    """A Llama-family decoder as Hugging Face's ``LlamaForCausalLM`` (also Mistral without
    sliding windows, Qwen2 with its q/k/v biases, SmolLM): a token table, ``n_layer``
    ``nl.LlamaBlock``s (grouped-query attention with rotary embeddings, SwiGLU MLP), a final
    RMSNorm, the head tied to the token table or its own.

    Params: ``/embed/W [vocab, n_embd]``, ``/blocks[i]/...``, ``/ln_f/scale``, ``/head/W
    [n_embd, vocab]`` when untied.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> m = LlamaLM(vocab_size=50, context=32, n_layer=1, n_head=4, n_kv_head=2,
        ...             n_embd=16, hidden=32)
        >>> p = jax.jit(m.init)(jax.random.key(0))
        >>> jax.jit(m)(p, jnp.zeros((1, 5), jnp.int32)).shape
        (1, 5, 50)
    """

    vocab_size: int
    context: int
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 64
    hidden: int = 256
    head_dim: int | None = None
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = ()
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_head: bool = False
    model_type: str = "llama"
    lora_targets: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0

    _LINEARS = ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/gate", "mlp/up", "mlp/down")
    _EMBED = "embed"

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        super().__post_init__()
        self._check_common()
        self.block_at(0)  # noqa: B018

    @property
    def wte(self) -> Embedding:
        return Embedding(self.vocab_size, self.n_embd)

    @property
    def ln_f(self) -> RMSNorm:
        return RMSNorm(self.n_embd, self.eps)

    def block_at(self, i: int) -> LlamaBlock:
        return LlamaBlock(
            self.n_embd,
            self.n_head,
            self.n_kv_head,
            self.hidden,
            self.head_dim,
            self.eps,
            self.rope_theta,
            self.rope_scaling,
            self.context,
            self.qkv_bias,
            self.out_bias,
            self.mlp_bias,
            lora=self._block_lora(i),
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
        )

    def _init_embed(self, key):
        return ParamsDict(embed=self.wte.init(key))

    def _embed_axes(self):
        return ParamsDict(embed=param_axes(self.wte))

    def _embed(self, params, tokens, pos):
        return self.wte(params.embed, tokens)


def merge_lora(model: _Decoder, params: ParamsDict) -> tuple[_Decoder, ParamsDict]:
    """``(model without adapters, params with each adapter folded into its weight)``."""
    if not model.lora_targets:
        return model, params
    flat = dict(params.to_flat())
    for i in range(model.n_layer):
        block = model.block_at(i)
        for name in block.lora:
            owner, child = name.split("/")
            layer = getattr(block, owner).children[child]
            path = f"/blocks[{i}]/{name}"
            sub = ParamsDict.from_flat(
                {k[len(path) :]: v for k, v in flat.items() if k.startswith(path + "/")}
            )
            for k in list(flat):
                if k.startswith(path + "/"):
                    del flat[k]
            for k, v in layer.merge(sub).items():
                flat[path + k] = v
    base = dataclasses.replace(model, lora_targets=())
    return base, ParamsDict.from_flat(flat)


def add_lora(
    model: _Decoder,
    params: ParamsDict,
    targets,
    key: jax.Array,
    rank: int = 8,
    alpha: float = 16.0,
) -> tuple[_Decoder, ParamsDict]:
    """``(model with LoRA on the projections ``targets`` selects, params with fresh adapters
    beside the base weights)``; the new model computes what the old one did (``B = 0``)."""
    if model.lora_targets:
        raise ValueError(f"{type(model).__name__} already has LoRA targets {model.lora_targets}")
    wrapped = model.with_lora(targets, rank, alpha)
    flat = dict(params.to_flat())
    paths = sorted(wrapped.lora_paths)
    keys = jax.random.split(key, len(paths))
    for path, k in zip(paths, keys, strict=True):
        i = int(path.split("]")[0].split("[")[1])
        owner, child = path.split("/")[-2:]
        layer = getattr(wrapped.block_at(i), owner).children[child]
        ad = layer.adapters(k)
        flat[path + "/lora_a"], flat[path + "/lora_b"] = ad.lora_a, ad.lora_b
    return wrapped, ParamsDict.from_flat(flat)
