"""Pretrained models in and out: Hugging Face GPT-2 and Llama-family model directories
(Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2).

``model, params = nl.hf.load_pretrained(dir)`` builds an ``nl.hf.GPT2LM`` or ``nl.hf.LlamaLM``
from ``config.json`` and reads its safetensors lazily; ``nl.hf.save_pretrained(dir, model,
params, tokenizer)`` writes a directory ``transformers`` loads; ``nl.hf.load_tokenizer(dir)``
reads ``tokenizer.json``; ``nl.hf.save_adapter`` / ``nl.hf.load_adapter`` write and read LoRA
adapters in peft's format. See docs/pretrained.md.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from ..nn._lora import lora_join as lora_join
from ..nn._lora import lora_mask as lora_mask
from ..nn._lora import lora_split as lora_split
from ._adapter import AdapterError as AdapterError
from ._adapter import load_adapter as load_adapter
from ._adapter import save_adapter as save_adapter
from ._chat import ChatTemplate as ChatTemplate
from ._chat import encode_chat as encode_chat
from ._chat import load_chat_template as load_chat_template
from ._config import FAMILIES as FAMILIES
from ._config import IGNORED_KEYS as IGNORED_KEYS
from ._config import PROFILES as PROFILES
from ._config import HFConfigError as HFConfigError
from ._convert import build_model as build_model
from ._convert import family_of as family_of
from ._convert import hf_config as hf_config
from ._convert import hf_name as hf_name
from ._convert import load_pretrained as load_pretrained
from ._convert import save_pretrained as save_pretrained
from ._generate import MIN_BUCKET as MIN_BUCKET
from ._generate import bucket as bucket
from ._generate import generate as generate
from ._generate import generate_stream as generate_stream
from ._generate import sample_logits as sample_logits
from ._gpt2 import GPT2LM as GPT2LM
from ._gpt2 import GPT2Block as GPT2Block
from ._models import LlamaLM as LlamaLM
from ._models import add_lora as add_lora
from ._models import merge_lora as merge_lora
from ._pretrained import Pretrained as Pretrained
from ._tokenizer import Tokenizer as Tokenizer
from ._tokenizer import load_tokenizer as load_tokenizer
from ._tokenizer import stop_ids as stop_ids


def without_lora(model: Any, params: Any):
    """``(model, params)`` with LoRA disabled: the base decoder of an ``nl.hf`` model (or of
    an ``nl.hf.Pretrained``) and the params without their adapters, sharing the base
    weights. ``model(params, x)`` of the result is the frozen base's output (DPO's
    reference model)."""
    inner = model if isinstance(model, GPT2LM | LlamaLM) else getattr(model, "model", None)
    if not isinstance(inner, GPT2LM | LlamaLM):
        raise TypeError(f"without_lora: expected an nl.hf model, got {type(model).__name__}")
    return inner.without_lora(params)


def from_pretrained(
    directory: str | os.PathLike,
    *,
    lora: dict[str, Any] | None = None,
    key: jax.Array | None = None,
    sharding: Any = None,
    ignore_keys=(),
):
    """``(model, params, tokenizer)`` for a training run: the model and weights of
    ``directory``, with LoRA adapters when ``lora`` is given (``{"rank": 8, "alpha": 16,
    "targets": ["*/attn/q", "*/attn/v"], "dropout": 0.05}``; ``key`` draws the adapters'
    ``A``; or ``{"path": DIR}``, a peft adapter: ``load_adapter``), and the
    directory's tokenizer (None without a ``tokenizer.json``).

    The trainer's ``model.name: "hf:DIR"`` and ``model.lora`` are this call."""
    model, params = load_pretrained(directory, sharding=sharding, ignore_keys=ignore_keys)
    if lora and set(lora) <= {"path", "dropout"} and "path" in lora:  # a peft adapter
        model, params = load_adapter(lora["path"], model, params)
        if "dropout" in lora:
            model = model.with_lora(
                model.lora_targets, model.lora_rank, model.lora_alpha, lora["dropout"]
            )
    elif lora:
        unknown = sorted(set(lora) - {"rank", "alpha", "targets", "dropout"})
        if unknown or "targets" not in lora:
            raise ValueError(
                "lora: expected keys rank, alpha, targets (required), dropout, or path (a peft "
                f"adapter directory) and dropout; got {sorted(lora)}"
            )
        targets = lora["targets"]
        if isinstance(targets, str) or not targets:
            raise ValueError(f"lora.targets: a non-empty list of globs, got {targets!r}")
        model, params = add_lora(
            model,
            params,
            targets,
            jax.random.key(0) if key is None else key,
            rank=int(lora.get("rank", 8)),
            alpha=float(lora.get("alpha", 16.0)),
        )
        model = model.with_lora(
            model.lora_targets, model.lora_rank, model.lora_alpha, lora.get("dropout", 0.0)
        )
    try:
        tokenizer = load_tokenizer(directory)
    except FileNotFoundError:
        tokenizer = None
    return model, params, tokenizer


__all__ = [
    "AdapterError",
    "ChatTemplate",
    "FAMILIES",
    "GPT2Block",
    "GPT2LM",
    "HFConfigError",
    "IGNORED_KEYS",
    "LlamaLM",
    "MIN_BUCKET",
    "PROFILES",
    "Pretrained",
    "Tokenizer",
    "add_lora",
    "bucket",
    "build_model",
    "encode_chat",
    "family_of",
    "from_pretrained",
    "generate",
    "generate_stream",
    "hf_config",
    "hf_name",
    "load_adapter",
    "load_chat_template",
    "load_pretrained",
    "load_tokenizer",
    "lora_join",
    "lora_mask",
    "lora_split",
    "merge_lora",
    "sample_logits",
    "save_adapter",
    "save_pretrained",
    "stop_ids",
    "without_lora",
]
