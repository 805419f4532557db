"""A character-level GPT as nanoGPT builds it: a decoder-only transformer.

Token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
multi-head self-attention, then a GELU MLP four times wider), a final LayerNorm and a
head that is the token embedding transposed (``tie_head``) or a matrix of its own;
dropout after the embeddings and inside the blocks. Initialised as GPT-2 is: every matrix
``N(0, 0.02)``, the two residual projections of each block scaled by ``1/sqrt(2 n_layer)``.

Generation (:meth:`GPT.generate`) is one compiled program: a ``lax.fori_loop`` feeds one
token at a time through the blocks against a fixed-size key/value cache
(``[n_layer, batch, context, n_head, head_dim]``), so each new token costs one position's
work instead of a forward pass over the whole context. The prompt goes through the same
step (its tokens are forced instead of sampled). When the text reaches the context length
the window slides by half: the last ``context // 2`` tokens are fed again at positions
``0 ..`` and generation goes on, so the model always sees between ``context // 2`` and
``context`` tokens of history (nanoGPT's loop instead re-runs the last ``context`` tokens
for every new token).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl


class GPT(nl.Module):
    """``tokens [..., T] -> logits [..., T, vocab_size]`` for ``T <= context``.

    Params: ``/wte/W [vocab, n_embd]``, ``/wpe/W [context, n_embd]``,
    ``/blocks[i]/...`` (one ``nl.TransformerBlock`` each), ``/ln_f/{scale,bias}`` and,
    unless ``tie_head``, ``/head/W [n_embd, vocab]``.

    Positions (``positional``): ``"learned"`` (GPT-2's ``wpe`` table added to the token
    embeddings) or ``"rotary"`` (no ``wpe``; every attention layer rotates its queries and
    keys by position, ``nl.MultiHeadAttention(rotary=True)``).

    Deep-model options (docs/deep.md):

    * ``scan_layers``: the blocks as one ``nl.Stack`` (``/blocks/...`` with a leading
      axis ``n_layer``, applied by ``lax.scan``: compile time flat in depth) instead of a
      list (``/blocks[i]/...``). Same init, same outputs, same dropout keys;
      :func:`stack_blocks` / :func:`unstack_blocks` (and :meth:`convert_params`) convert
      params, and a checkpoint of one layout loads into the other.
    * ``remat``: ``"auto"`` (the default: ``"dots_saveable"`` with ``scan_layers``,
      ``"none"`` without; see :attr:`remat_policy`); ``"none"``; ``"block"`` (each block
      under ``jax.checkpoint``: only the residual stream between blocks is kept for the
      backward pass, each block's forward recomputed); ``"full"`` (``block``, and inside
      it the attention half and the MLP half checkpointed separately: the recomputation
      holds one half's internals at a time); or a ``jax.checkpoint_policies`` name
      (each block checkpointed with that policy, e.g. ``"dots_saveable"``: keep the
      matmul results).
    * ``dtype``: compute dtype, ``"float32"`` or ``"bfloat16"``. The params (and so the
      optimizer state and the gradients) stay float32; the embeddings' sum is cast to
      ``dtype`` and the residual stream stays in it through the blocks (LayerNorm
      statistics and the attention softmax in float32 inside); the final LayerNorm, the
      head, the logits and the loss are float32.
    """

    vocab_size: int
    context: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_head: bool = True
    positional: str = "learned"
    scan_layers: bool = False
    remat: str = "auto"
    dtype: str = "float32"

    task = "language_model"
    # Options that change neither the params' values nor the math: a run may resume with
    # them changed (the checkpoint's params are converted to the new layout).
    resume_may_change = ("scan_layers", "remat")

    def __post_init__(self):
        super().__post_init__()
        for key in ("vocab_size", "context", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.positional not in POSITIONAL:
            raise ValueError(
                f"positional must be one of {', '.join(POSITIONAL)}, got {self.positional!r}"
            )
        if self.remat not in REMAT:
            raise ValueError(f"remat must be one of {', '.join(REMAT)}, got {self.remat!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def setup(self):  # the children (init stays written: GPT-2's scaled init, two layouts)
        self.wte = nl.Embedding(self.vocab_size, self.n_embd)
        self.wpe = nl.Embedding(self.context, self.n_embd)
        self.drop = nl.Dropout(self.dropout)  # uses_key is derived: true when dropout > 0
        self.block = nl.TransformerBlock(
            self.n_embd,
            self.n_head,
            mlp_ratio=4,
            dropout_rate=self.dropout,
            causal=True,
            rotary=self.positional == "rotary",
            dtype=None if self.dtype == "float32" else self.dtype,
            remat=self.remat == "full",
        )
        # One block as the model applies it: under nl.Remat unless remat_policy is "none";
        # the stack is the blocks as one nl.Stack (the scan_layers layout).
        remat = self.remat_policy
        policy = remat if remat in nl.REMAT_POLICIES else None
        self.layer = self.block if remat == "none" else nl.Remat(self.block, policy)
        self.stack = nl.Stack(self.layer, self.n_layer)
        self.ln_f = nl.LayerNorm(self.n_embd)
        self.head = nl.Linear(self.n_embd, self.vocab_size, use_bias=False)

    @property
    def remat_policy(self) -> str:
        """``remat`` with ``"auto"`` resolved: ``"dots_saveable"`` when the blocks are
        scanned, else ``"none"``.

        Why scanned blocks rematerialise by default: a ``lax.scan`` keeps each block's
        residuals for the backward pass as slices of stacked buffers (zero-filled, copied
        in by the forward loop, copied out by the backward one), where unrolled blocks
        keep them where they were computed. Keeping only the matmul results and
        recomputing the elementwise work (LayerNorms, GELU, softmax, the adds) from them
        moves far fewer bytes: on a 2-core CPU the scanned GPT's step is then faster than
        the unrolled one, and without it slower (benchmarks/README.md, deep models)."""
        if self.remat == "auto":
            return "dots_saveable" if self.scan_layers else "none"
        return self.remat

    # -- parameters -------------------------------------------------------------------------
    def init(self, key: jax.Array) -> nl.ParamsDict:
        keys = jax.random.split(key, self.n_layer + 3)
        p = nl.ParamsDict(wte=self.wte.init(keys[0]))
        if self.positional == "learned":
            p.wpe = self.wpe.init(keys[1])
        if self.scan_layers:  # one vmapped init, not n_layer copies in the init program
            p.blocks = jax.vmap(self.block.init)(keys[3:])
        else:
            p.blocks = [self.block.init(k) for k in keys[3:]]
        p.ln_f = self.ln_f.init(keys[2])
        if not self.tie_head:
            p.head = self.head.init(keys[2])
        return gpt2_init(p, self.n_layer, jax.random.fold_in(key, 1))  # the same numbers either way

    def convert_params(self, params: nl.ParamsDict) -> nl.ParamsDict:
        """``params`` in this model's block layout, from either layout (a list of
        ``n_layer`` blocks or one stacked block); other params are refused."""
        blocks = params.blocks if "blocks" in params else None
        if isinstance(blocks, list | tuple):
            if len(blocks) != self.n_layer:
                raise ValueError(f"GPT(n_layer={self.n_layer}): params hold {len(blocks)} blocks")
            return stack_blocks(params) if self.scan_layers else params
        if isinstance(blocks, nl.ParamsDict):
            n = {a.shape[0] for a in jax.tree.leaves(blocks)}
            if n != {self.n_layer}:
                raise ValueError(
                    f"GPT(n_layer={self.n_layer}): stacked blocks with leading axes {sorted(n)}"
                )
            return params if self.scan_layers else unstack_blocks(params)
        raise ValueError(
            "GPT: params have no /blocks (a list of blocks or a stacked block); they are "
            "not a GPT's"
        )

    def other_layout(self) -> GPT:
        """This model with the other block layout (``scan_layers`` flipped): what a
        checkpoint written by it holds, for :meth:`convert_params`."""
        return dataclasses.replace(self, scan_layers=not self.scan_layers)

    def param_axes(self) -> nl.ParamsDict:
        """Where each param's dimensions shard: the blocks' Megatron layout, the token table
        by vocabulary rows, the position table by positions (never split by a tensor axis)."""
        p = nl.ParamsDict(wte=nl.param_axes(self.wte))
        if self.positional == "learned":
            p.wpe = nl.ParamsDict(W=nl.Axes(("position", "embed")))
        if self.scan_layers:
            p.blocks = nl.param_axes(self.stack)  # the block's, with the copies' axis first
        else:
            p.blocks = [nl.param_axes(self.block)] * self.n_layer
        p.ln_f = nl.param_axes(self.ln_f)
        if not self.tie_head:
            p.head = nl.linear_axes(self.head, "embed", "vocab")
        return p

    # -- forward ----------------------------------------------------------------------------
    def __call__(self, params, tokens, *, key=None, labels=None, chunk=None):
        """Logits ``[..., T, vocab_size]`` of integer ``tokens [..., T]``, ``T <= context``;
        ``key`` turns dropout on (training). With ``labels [..., T]``: their
        log-probabilities ``[..., T]`` instead (:meth:`token_log_probs`)."""
        h = self.features(params, tokens, key=key)
        if labels is None:
            return self.logits(params, h)
        w, axis = (params.wte.W, 0) if self.tie_head else (params.head.W, -1)
        return nl.label_log_probs(h, w.astype(h.dtype), labels, vocab_axis=axis, chunk=chunk)

    def token_log_probs(self, params, tokens, labels, *, key=None, chunk=None):
        """``log p(labels | tokens)`` per token ``[..., T]`` (float32), the head and its
        softmax a chunk of ``chunk`` tokens at a time (``nl.label_log_probs``): the
        training loss never holds all the logits."""
        return self(params, tokens, key=key, labels=labels, chunk=chunk)

    def features(self, params, tokens, *, key=None):
        """The final LayerNorm's output ``[..., T, n_embd]``: what the head reads."""
        t = tokens.shape[-1]
        if t > self.context:
            raise ValueError(f"GPT: sequence length {t} exceeds context={self.context}")
        keys = [None] * (self.n_layer + 1)
        if key is not None and self.dropout > 0:
            keys = jax.random.split(key, self.n_layer + 1)
        x = self.wte(params.wte, tokens)
        if self.positional == "learned":
            x = nl.add(x, self.wpe(params.wpe, np.arange(t)))  # position embeddings
        if self.dtype != "float32":
            x = x.astype(self.dtype)  # the residual stream in the compute dtype
        x = self.drop(x, key=keys[-1])
        if self.scan_layers:
            # block i gets keys[i], as in the loop below
            x = self.stack.scan(params.blocks, x, None if keys[0] is None else keys[:-1])
        else:
            for i, p_block in enumerate(params.blocks):
                x = self.layer(p_block, x, key=keys[i])
        # ln_f's float32 params promote the stream back: the head and logits in float32
        return self.ln_f(params.ln_f, x)

    def logits(self, params, h):
        """The head: ``h [..., n_embd] -> [..., vocab_size]``."""
        if self.tie_head:
            return self.wte.attend(params.wte, h)
        return self.head(params.head, h)

    # -- incremental decoding ---------------------------------------------------------------
    def empty_cache(self, batch: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
        """Zeroed key and value caches ``[n_layer, batch, context, n_head, head_dim]``."""
        shape = (self.n_layer, batch, self.context, self.n_head, self.n_embd // self.n_head)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def decode_step(self, params, cache, token, pos):
        """Logits ``[batch, vocab]`` for ``token [batch]`` at position ``pos`` (a traced
        int), given ``cache`` (keys and values of positions ``< pos``); returns the cache
        with this position's keys and values written in. Inference: no dropout."""
        ck, cv = cache
        block = self.block
        attn = block.attn
        x = self.wte(params.wte, token[:, None])  # [batch, 1, n_embd]
        if self.positional == "learned":
            x = x + jnp.broadcast_to(params.wpe.W[pos].astype(x.dtype), x.shape)
        if self.dtype != "float32":
            x = x.astype(self.dtype)  # as in __call__: the residual stream in the compute dtype
        blocks = params.blocks
        if self.scan_layers:
            blocks = self.stack.unstack(blocks)  # decoding indexes the cache per layer
        for i, p in enumerate(blocks):
            # [batch, 1, heads, head_dim]; rotary: q and k rotated at position pos
            q, k, v = attn.qkv(p.attn, block.ln1(p.ln1, x), offset=pos)
            at = (i, 0, pos, 0, 0)  # layer i, every row, position pos
            ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), at)
            cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), at)
            # causal with q_offset=pos: the query sees cache slots 0..pos, not the unfilled rest
            o = attn.attend(q, ck[i], cv[i], q_offset=pos)
            x = x + attn.project(p.attn, o)
            x = x + block.mlp(p.mlp, block.ln2(p.ln2, x))
        return self.logits(params, self.ln_f(params.ln_f, x[:, 0])), (ck, cv)

    def generate(self, params, prompt, n_tokens: int, key, temperature=1.0, top_k=None):
        """``prompt [batch, P]`` followed by ``n_tokens`` sampled tokens: ``[batch, P + n]``.

        One traceable program (jit it with ``n_tokens`` and ``top_k`` static): a
        ``lax.fori_loop`` of :meth:`decode_step` with a fixed-size cache, sliding by half a
        context when full (see the module docstring). ``temperature`` 0 is greedy decoding;
        ``top_k`` keeps the k most likely tokens before sampling. Step ``i`` samples with
        ``fold_in(key, i)``, so the output is a function of the key.
        """
        batch, p_len = prompt.shape
        total = p_len + n_tokens
        buf = jnp.zeros((batch, total), prompt.dtype).at[:, :p_len].set(prompt)
        half = self.context // 2

        def feed(i, state):
            """Feed ``buf[:, i]`` at cache position ``pos``; sample ``buf[:, i + 1]``."""
            buf, cache, pos = state
            cache, pos = jax.lax.cond(
                pos == self.context, lambda: slide(buf, cache, i), lambda: (cache, pos)
            )
            logits, cache = self.decode_step(params, cache, buf[:, i], pos)
            nxt = sample(logits, jax.random.fold_in(key, i), temperature, top_k)
            keep = i + 1 < p_len  # still inside the prompt: its own token, not a sample
            nxt = jnp.where(keep, buf[:, jnp.minimum(i + 1, total - 1)], nxt.astype(buf.dtype))
            buf = jax.lax.dynamic_update_slice_in_dim(buf, nxt[:, None], i + 1, axis=1)
            return buf, cache, pos + 1

        def slide(buf, cache, i):
            """Re-feed the last ``half`` tokens before ``i`` at positions ``0 .. half-1``."""

            def refeed(j, cache):
                tok = jax.lax.dynamic_index_in_dim(buf, i - half + j, axis=1, keepdims=False)
                return self.decode_step(params, cache, tok, j)[1]

            return jax.lax.fori_loop(0, half, refeed, cache), jnp.int32(half)

        dtype = params.wte.W.dtype if self.dtype == "float32" else jnp.dtype(self.dtype)
        cache = self.empty_cache(batch, dtype)
        buf, _, _ = jax.lax.fori_loop(0, total - 1, feed, (buf, cache, jnp.int32(0)))
        return buf


def sample(logits, key, temperature, top_k: int | None):
    """One token per row of ``logits [batch, vocab]``: argmax at ``temperature == 0``, else
    a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` largest."""
    logits = logits.astype(jnp.float32)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1)
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    drawn = jax.random.categorical(key, logits / t, axis=-1)
    return jnp.where(temperature == 0, greedy, drawn)


def gpt2_init(params: nl.ParamsDict, n_layer: int, key) -> nl.ParamsDict:
    """GPT-2's initialisation of ``params``: matrices (and embeddings) ``N(0, 0.02)``, the
    blocks' residual output projections ``N(0, 0.02 / sqrt(2 n_layer))``; vectors (biases,
    LayerNorm scales and offsets) as their layers made them.

    Either layout: a stacked block's leaf ``/blocks/X`` draws layer ``i`` with the key that
    ``/blocks[i]/X`` has in the list layout (one vmapped draw), so both give the same numbers.
    """
    stacked = "blocks" in params and isinstance(params.blocks, nl.ParamsDict)
    listed = jax.eval_shape(unstack_blocks, params) if stacked else params
    paths = [nl.format_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(listed)]
    order = {p: i for i, p in enumerate(paths)}
    keys = jax.random.split(key, len(order))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in leaves:
        name = nl.format_path(path)
        layered = stacked and name.startswith("/blocks/")
        if leaf.ndim - layered == 2:
            std = 0.02
            if name.endswith(RESIDUAL_OUT):
                std /= math.sqrt(2 * n_layer)
            if layered:
                rest = name[len("/blocks") :]
                ks = keys[jnp.array([order[f"/blocks[{i}]{rest}"] for i in range(n_layer)])]
                normal = functools.partial(
                    jax.random.normal, shape=leaf.shape[1:], dtype=leaf.dtype
                )
                leaf = std * jax.vmap(normal)(ks)
            else:
                leaf = std * jax.random.normal(keys[order[name]], leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def stack_blocks(params: nl.ParamsDict) -> nl.ParamsDict:
    """GPT params with ``/blocks[i]/...`` (a list) turned into ``/blocks/...`` stacked
    along a leading axis (the ``scan_layers`` layout); the other params shared."""
    out = nl.ParamsDict(**{k: params[k] for k in params})
    out.blocks = jax.tree.map(lambda *a: jnp.stack(a), *params.blocks)
    return out


def unstack_blocks(params: nl.ParamsDict) -> nl.ParamsDict:
    """The inverse of :func:`stack_blocks`: a list of one ParamsDict per block."""
    out = nl.ParamsDict(**{k: params[k] for k in params})
    n = jax.tree.leaves(params.blocks)[0].shape[0]
    out.blocks = [jax.tree.map(lambda a, i=i: a[i], params.blocks) for i in range(n)]
    return out


POSITIONAL = ("learned", "rotary")
REMAT = ("auto", "none", "block", "full", *nl.REMAT_POLICIES)
DTYPES = ("float32", "bfloat16")

# Paths (suffixes) of the matrices that write into the residual stream.
RESIDUAL_OUT = ("/attn/out/W", "/mlp/proj/W")
