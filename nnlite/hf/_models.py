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
from ..core._compose import call_in_frame
from ..core._module import Module
from ..core._params import ParamsDict
from ..nn._activations import softcap
from ..nn._dropout import check_rate
from ..nn._embedding import Embedding
from ..nn._linear import Linear
from ..nn._llama import LlamaBlock
from ..nn._lm_head import label_log_probs
from ..nn._lora import ADAPTER_NAMES, adapter_axes, match_targets, split_key
from ..nn._normalisation import RMSNorm
from ..nn._segments import segment_mask, segment_positions
from ._generate import generate, generate_stream

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
            check_rate(type(self).__name__, "lora_dropout", self.lora_dropout)
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
        """Only LoRA dropout draws random numbers (imported models fine-tune without the
        pretraining dropout)."""
        return bool(self.lora_targets) and self.lora_dropout > 0

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
        return self.logits(params, self.features(params, tokens, segment_ids=segment_ids, key=key))

    def token_log_probs(
        self,
        params: ParamsDict,
        tokens: jax.Array,
        labels: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        key: jax.Array | None = None,
        chunk: int | None = None,
    ) -> jax.Array:
        """``log p(labels[b, t] | tokens[b, :t+1])``, ``[batch, T]`` float32: the head and
        its softmax in chunks of ``chunk`` tokens (``nl.label_log_probs``), never all the
        logits at once. The trainer's language-model loss is its negated mean.
        ``segment_ids``: packed documents, as :meth:`__call__`'s."""
        # in the decoder's own frame, as its __call__ runs: its layers find their keys there
        # (LoRA dropout), are named by their paths (backward policies) and in their errors
        with jax.named_scope(type(self).__name__):
            args = (params, tokens, labels)
            kw = {"segment_ids": segment_ids, "key": key, "chunk": chunk}
            return call_in_frame(self, type(self)._log_probs, args, kw)

    def _log_probs(self, params, tokens, labels, *, segment_ids=None, key=None, chunk=None):
        h = self.features(params, tokens, segment_ids=segment_ids, key=key)
        h = self.ln_f(params.ln_f, h)
        if self.tie_head:
            w, axis = params[self._EMBED].W, 0
        else:
            w, axis = params.head.W, -1
        dtype = jnp.result_type(h.dtype, w.dtype)
        cap = getattr(self, "logit_softcap", None)
        return label_log_probs(
            h.astype(dtype), w.astype(dtype), labels, vocab_axis=axis, chunk=chunk, softcap=cap
        )

    def features(
        self,
        params: ParamsDict,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        key: jax.Array | None = None,
    ):
        """The last block's output ``[batch, T, n_embd]`` (before the final norm and the
        head) of ``tokens [batch, T]``."""
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
        keys = split_key(key if self.uses_key else None, self.n_layer)
        for i, (p, k) in enumerate(zip(blocks, keys, strict=True)):
            with self.params_scope(f"/blocks[{i}]"):
                x = self.block_at(i)(p, x, key=k, **kw)
        return x

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

    def decode_step(
        self,
        params: ParamsDict,
        cache: list,
        tokens: jax.Array,
        pos: Any,
        *,
        mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ):
        """Logits ``[batch, T, vocab]`` of ``tokens [batch, T]`` at cache slots ``pos ..``
        (``pos`` may be traced) given the cache of the slots before; returns the logits
        and the cache with these slots written in. A left-padded batch gives ``mask [batch,
        S]`` (False: a padding slot of the cache) and ``positions [batch, T]`` (each row's
        token positions); without them a slot is its position."""
        x = self._embed(params, tokens, pos if positions is None else positions)
        new = []
        for i, p in enumerate(params.blocks):
            x, c = self.block_at(i).decode(p, x, cache[i], pos, mask=mask, positions=positions)
            new.append(c)
        return self.logits(params, x), new

    def generate(
        self, params, prompt, n_tokens: int, key, temperature=1.0, top_k=None, top_p=None, **kw
    ):
        """``prompt [batch, P]`` and ``n_tokens`` sampled tokens (``nl.hf.generate``: also
        ``attention_mask``, ``stop_ids``, ``pad_id``, ``repetition_penalty``)."""
        return generate(self, params, prompt, n_tokens, key, temperature, top_k, top_p, **kw)

    def generate_stream(self, params, prompt, n_tokens: int, key, *args, **kw):
        """``nl.hf.generate_stream``: the new tokens ``[batch]`` of each step as they come."""
        return generate_stream(self, params, prompt, n_tokens, key, *args, **kw)

    # -- LoRA -------------------------------------------------------------------------------
    def with_lora(self, targets, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        """This model with LoRA adapters on the projections the globs ``targets`` select
        (``dropout``: on each adapter's input in training, peft's ``lora_dropout``)."""
        return dataclasses.replace(
            self,
            lora_targets=tuple(targets),
            lora_rank=rank,
            lora_alpha=float(alpha),
            lora_dropout=float(dropout),
        )

    def without_lora(self, params: ParamsDict) -> tuple[_Decoder, ParamsDict]:
        """``(the base model, params without the adapters)``: the model with LoRA disabled,
        sharing the base weights (no copy); a reference model for DPO, or the base's logits
        beside the adapted ones."""
        flat = params.to_flat()
        kept = {k: v for k, v in flat.items() if k.rsplit("/", 1)[-1] not in ADAPTER_NAMES}
        return dataclasses.replace(self, lora_targets=()), ParamsDict.from_flat(kept)


class LlamaLM(_Decoder):
    """A Llama-family decoder as Hugging Face's ``LlamaForCausalLM`` (also Mistral, Qwen2 with
    its q/k/v biases, Qwen3, Gemma, Gemma 2, SmolLM): a token table, ``n_layer``
    ``nl.LlamaBlock``s (grouped-query attention with rotary embeddings, gated MLP), a final
    RMSNorm, the head tied to the token table or its own.

    The variants are fields (``model_type`` names the Hugging Face type it exports as):
    ``activation`` (``"silu"``: SwiGLU, ``"gelu"``: Gemma's GeGLU), ``norm_offset`` (1: Gemma's
    ``(1 + w)`` RMSNorms), ``scale_embeddings`` (Gemma: the embeddings times
    ``sqrt(n_embd)``), ``qk_norm`` (Qwen3), ``post_norms`` (Gemma 2's norms on each half's
    output), ``query_pre_attn_scalar`` (Gemma 2: logits scaled by its ``-1/2`` power, not
    ``head_dim``'s), ``attn_softcap`` and ``logit_softcap`` (Gemma 2's soft caps of the
    attention logits and the output logits), ``sliding_window`` with ``layer_types``
    (Mistral: every layer sees its ``sliding_window`` latest keys; Gemma 2 and Qwen: the
    layers whose type is ``"sliding_attention"``, the others ``"full_attention"``; empty:
    every layer slides when ``sliding_window`` is set).

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
    activation: str = "silu"
    norm_offset: float = 0.0
    scale_embeddings: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    model_type: str = "llama"
    lora_targets: tuple[str, ...] = ()
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0

    _LINEARS = ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/gate", "mlp/up", "mlp/down")
    _EMBED = "embed"

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()
        self._check_common()
        self._check_windows()
        if self.logit_softcap is not None and not (
            isinstance(self.logit_softcap, int | float) and self.logit_softcap > 0
        ):
            raise ValueError(
                f"LlamaLM: logit_softcap must be a number > 0 or None, got {self.logit_softcap!r}"
            )
        for i in range(self.n_layer):
            self.block_at(i)  # validates each block's fields  # noqa: B018

    def _check_windows(self) -> None:
        kinds = ("full_attention", "sliding_attention")
        if self.layer_types and len(self.layer_types) != self.n_layer:
            raise ValueError(
                f"LlamaLM: layer_types has {len(self.layer_types)} entries, n_layer={self.n_layer}"
            )
        bad = [t for t in self.layer_types if t not in kinds]
        if bad:
            raise ValueError(f"LlamaLM: layer_types entry {bad[0]!r} is not one of {kinds}")
        if self.sliding_window is None and "sliding_attention" in self.layer_types:
            raise ValueError("LlamaLM: layer_types has sliding_attention but sliding_window=None")

    def window_at(self, i: int) -> int | None:
        """Block ``i``'s sliding window, None where it attends to every earlier position."""
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def wte(self) -> Embedding:
        return Embedding(self.vocab_size, self.n_embd)

    @property
    def ln_f(self) -> RMSNorm:
        return RMSNorm(self.n_embd, self.eps, scale_offset=self.norm_offset)

    def block_at(self, i: int) -> LlamaBlock:
        scale = self.query_pre_attn_scalar
        return LlamaBlock(
            self.n_embd,
            self.n_head,
            num_kv_heads=self.n_kv_head,
            hidden=self.hidden,
            head_dim=self.head_dim,
            eps=self.eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.context,
            qkv_bias=self.qkv_bias,
            out_bias=self.out_bias,
            mlp_bias=self.mlp_bias,
            activation=self.activation,
            norm_offset=self.norm_offset,
            qk_norm=self.qk_norm,
            post_norms=self.post_norms,
            attn_scale=None if scale is None else scale**-0.5,
            attn_softcap=self.attn_softcap,
            window=self.window_at(i),
            lora=self._block_lora(i),
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
        )

    def _init_embed(self, key):
        return ParamsDict(embed=self.wte.init(key))

    def _embed_axes(self):
        return ParamsDict(embed=param_axes(self.wte))

    def _embed(self, params, tokens, pos):
        x = self.wte(params.embed, tokens)
        if self.scale_embeddings:  # Gemma: sqrt(n_embd), rounded to the table's dtype
            x = x * jnp.asarray(self.n_embd**0.5, x.dtype)
        return x

    def logits(self, params: ParamsDict, h: jax.Array) -> jax.Array:
        out = super().logits(params, h)
        if self.logit_softcap is None:
            return out
        return softcap(out, cap=float(self.logit_softcap))


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
