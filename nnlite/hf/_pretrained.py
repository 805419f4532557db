"""``Pretrained``: a Hugging Face model directory as a model whose ``init`` is its weights.

A trainer builds a model from hyperparameters and asks it for ``init(key)``, often inside
``jax.jit`` with output shardings, and traces ``init`` with ``jax.eval_shape`` to plan
memory. ``Pretrained(path)`` fits that contract: its ``init`` reads each weight through a
host callback (``jax.pure_callback``), so tracing reads nothing, a jitted init with
shardings places the weights where the strategy wants them, and the same seed always
gives the same params (the weights, plus LoRA adapters drawn from ``key``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._module import Module
from ..core._params import ParamsDict
from ..nn._lora import freeze_base, lora_mask
from ._convert import build_model, hf_name
from ._gpt2 import GPT2LM
from ._models import LlamaLM
from ._safetensors import SafetensorsDir

__all__ = ["Pretrained"]

_LORA_KEYS = ("rank", "alpha", "targets")


@functools.lru_cache(maxsize=8)
def _base(path: str, ignore_keys: tuple) -> GPT2LM | LlamaLM:
    return build_model(path, ignore_keys=ignore_keys)


def _lora_pairs(lora: Any) -> tuple:
    """``lora`` as sorted ``(key, value)`` pairs (hashable), from a dict or pairs."""
    if lora is None or lora == () or lora == {}:
        return ()
    items = dict(lora) if not isinstance(lora, dict) else lora
    unknown = sorted(set(items) - set(_LORA_KEYS))
    if unknown:
        raise ValueError(f"lora: unknown key {unknown[0]!r}; keys: rank, alpha, targets")
    targets = items.get("targets")
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(
            f"lora: targets must be a non-empty list of globs over param paths "
            f"(e.g. ['*/attn/q', '*/attn/v']), got {targets!r}"
        )
    rank = items.get("rank", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora: rank must be a positive int, got {rank!r}")
    alpha = items.get("alpha", 16.0)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"lora: alpha must be a number, got {alpha!r}")
    return (("alpha", float(alpha)), ("rank", rank), ("targets", tuple(targets)))


class Pretrained(Module):
    """The model of a Hugging Face directory, for a trainer: ``init(key)`` gives its
    pretrained weights (and, with ``lora``, fresh adapters drawn from ``key``).

    Everything else is the underlying ``nl.hf.GPT2LM`` / ``nl.hf.LlamaLM`` (:attr:`model`):
    ``__call__``, ``param_axes``, ``generate``, ``decode_step``.

    Args:
        path: the model directory.
        lora: ``{"rank": 8, "alpha": 16, "targets": [globs]}`` or None (full fine-tuning).
        vocab_size: the data's vocabulary size, at most the model's (a trainer fills it).
        context: the training window, at most the model's positions (a trainer fills it).
        ignore_keys: config keys to pass over (see ``load_pretrained``).

    Example:
        >>> import tempfile, jax, nnlite as nl
        >>> d = tempfile.mkdtemp()
        >>> base = nl.hf.GPT2LM(vocab_size=20, context=8, n_layer=1, n_head=2, n_embd=4)
        >>> _ = nl.hf.save_pretrained(d, base, jax.jit(base.init)(jax.random.key(0)))
        >>> m = Pretrained(d, lora={"rank": 2, "targets": ["*/attn/qkv"]})
        >>> p = jax.jit(m.init)(jax.random.key(1))
        >>> p.blocks[0].attn.qkv.lora_a.shape
        (4, 2)
    """

    path: str
    lora: Any = None
    vocab_size: int | None = None
    context: int | None = None
    ignore_keys: tuple[str, ...] = ()

    task = "language_model"

    def __post_init__(self):
        object.__setattr__(self, "lora", _lora_pairs(self.lora))
        object.__setattr__(self, "path", str(self.path))
        super().__post_init__()
        model = self.model  # reads config.json: refuses what it cannot build
        if self.vocab_size is not None and not 0 < self.vocab_size <= model.vocab_size:
            raise ValueError(
                f"vocab_size={self.vocab_size}: the data's vocabulary must fit the model's "
                f"{model.vocab_size} tokens (prepare the text with the model's tokenizer)"
            )
        if self.context is not None and not 0 < self.context <= model.context:
            raise ValueError(
                f"context={self.context}: at most the model's {model.context} positions"
            )

    @property
    def base(self) -> GPT2LM | LlamaLM:
        """The directory's model without adapters."""
        return _base(self.path, tuple(self.ignore_keys))

    @property
    def model(self) -> GPT2LM | LlamaLM:
        """The model trained: the base with LoRA on the targets when ``lora`` is set."""
        if not self.lora:
            return self.base
        lora = dict(self.lora)
        return self.base.with_lora(lora["targets"], lora["rank"], lora["alpha"])

    @property
    def uses_key(self) -> bool:
        return False

    @property
    def max_positions(self) -> int:
        """The model's positions (``context`` is the training window within them)."""
        return self.model.context

    def init(self, key: jax.Array) -> ParamsDict:
        """The directory's weights (float32), each read by a host callback, plus fresh LoRA
        adapters from ``key``."""
        base = self.base
        family = "gpt2" if isinstance(base, GPT2LM) else "llama"
        like = jax.eval_shape(base.init, jax.random.key(0))
        path = self.path

        def read(name: str, transposed: bool, shape: tuple):
            def host():
                a = SafetensorsDir(path, ValueError).tensor(name)
                a = np.asarray(a.T if transposed else a, np.float32)
                if a.shape != shape:
                    raise ValueError(f"{path}: tensor {name!r} has shape {a.shape}, not {shape}")
                return a

            return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, jnp.float32))

        names = set(SafetensorsDir(path, ValueError).names())
        flat = {}
        for p, aval in like.items():
            name, transposed = hf_name(family, p)
            if name not in names and name.removeprefix("transformer.") in names:
                name = name.removeprefix("transformer.")
            flat[p] = read(name, transposed, tuple(aval.shape))
        params = ParamsDict.from_flat(flat)
        if not self.lora:
            return params
        model = self.model
        flat = dict(params.to_flat())
        paths = sorted(model.lora_paths)
        for lpath, k in zip(paths, jax.random.split(key, len(paths)), strict=True):
            i = int(lpath.split("]")[0].split("[")[1])
            owner, child = lpath.split("/")[-2:]
            ad = getattr(model.block_at(i), owner).children[child].adapters(k)
            flat[lpath + "/lora_a"], flat[lpath + "/lora_b"] = ad.lora_a, ad.lora_b
        return ParamsDict.from_flat(flat)

    def param_axes(self) -> ParamsDict:
        return self.model.param_axes()

    def trainable(self, params):
        """Which params training updates: with ``lora`` the adapters only (``nl.lora_mask``;
        the trainer then neither differentiates nor keeps optimizer state for the rest),
        else None (all of them)."""
        return lora_mask(params) if self.lora else None

    def wrap_optimizer(self, optimizer):
        """With ``lora``: ``optimizer`` on the adapters only (``nl.freeze_base``), the base
        weights frozen with no optimizer state; without, ``optimizer`` itself."""
        return freeze_base(optimizer) if self.lora else optimizer

    def __call__(self, params: ParamsDict, tokens: jax.Array, *, segment_ids=None, key=None):
        return self.model(params, tokens, segment_ids=segment_ids)

    def decode_step(self, params, cache, tokens, pos):
        return self.model.decode_step(params, cache, tokens, pos)

    def empty_cache(self, batch: int, length: int, dtype: Any = jnp.float32):
        return self.model.empty_cache(batch, length, dtype)

    def generate(self, params, prompt, n_tokens: int, key, temperature=1.0, top_k=None, top_p=None):
        """``prompt [batch, P]`` and ``n_tokens`` sampled tokens (``nl.hf.generate``)."""
        return self.model.generate(params, prompt, n_tokens, key, temperature, top_k, top_p)

    def export(self, directory, params: ParamsDict, tokenizer: Any = None, **kwargs):
        """``nl.hf.save_pretrained`` of the trained params (adapters merged), with this
        directory's token ids."""
        from ._convert import save_pretrained

        kwargs.setdefault("source", self.path)
        return save_pretrained(directory, self.model, params, tokenizer, **kwargs)
