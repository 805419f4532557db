"""A Hugging Face ``config.json`` read into an nnlite model's fields, and written back.

Every key is accounted for: a key the model uses, a key that does not change the network's
function (token ids, initialisation, dropout rates that fine-tuning here does not apply,
bookkeeping), or a key with a value nnlite cannot honour, refused by name in one line.
A key in none of those lists is refused too (``ignore_keys=`` lets a user pass over one after
reading what it does), so a new architecture variant never loads silently wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "HFConfigError",
    "IGNORED_KEYS",
    "read_config",
    "model_kwargs",
]


class HFConfigError(ValueError):
    """A Hugging Face model directory or config that nnlite cannot load (one line)."""


HFConfigError.__module__ = "nnlite.hf"

#: ``model_type`` -> the family nnlite builds it as.
FAMILIES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama"}

#: Keys that do not change the network's function (ids, bookkeeping, initialisation,
#: generation defaults); dropout rates, which imported models train without.
IGNORED_KEYS = frozenset(
    """architectures model_type torch_dtype dtype transformers_version _name_or_path
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id
    initializer_range use_cache output_attentions output_hidden_states return_dict
    id2label label2id problem_type tokenizer_class prefix task_specific_params
    chunk_size_feed_forward is_encoder_decoder is_decoder tie_encoder_decoder pruned_heads
    torchscript finetuning_task max_length min_length do_sample temperature top_k top_p
    num_beams repetition_penalty typical_p num_return_sequences
    attention_dropout resid_pdrop embd_pdrop attn_pdrop summary_type summary_use_proj
    summary_activation summary_proj_to_labels summary_first_dropout n_ctx pretraining_tp
    is_llama_config quantization_config_none use_return_dict""".split()
)

_GPT2_USED = {
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "layer_norm_epsilon", "tie_word_embeddings",
}  # fmt: skip
_LLAMA_USED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings",
}  # fmt: skip

#: Keys accepted only at the value that means "not used": {key: (allowed values, why)}.
_ONLY_AT = {
    "scale_attn_weights": ((True,), "attention scores divided by sqrt(head_dim)"),
    "scale_attn_by_inverse_layer_idx": ((False,), "per-layer attention scaling"),
    "reorder_and_upcast_attn": ((False, True), ""),  # float32 attention, as nnlite's
    "add_cross_attention": ((False,), "cross-attention (an encoder-decoder)"),
    "use_sliding_window": ((False,), "sliding-window attention"),
    "max_window_layers": (None, ""),  # only read with use_sliding_window
    "rope_interleaved": ((False,), "interleaved rotary pairs"),
    "partial_rotary_factor": ((1, 1.0), "rotary embeddings on part of each head"),
    "tie_word_embeddings": ((True, False), ""),
    "quantization_config": ((), "quantized weights"),
}

#: Keys whose presence means an architecture nnlite does not build.
_REFUSED = {
    "num_experts": "mixture-of-experts layers",
    "num_local_experts": "mixture-of-experts layers",
    "n_routed_experts": "mixture-of-experts layers",
    "num_experts_per_tok": "mixture-of-experts layers",
    "moe_intermediate_size": "mixture-of-experts layers",
    "use_mrope": "multimodal rotary embeddings",
    "vision_config": "a vision tower",
    "text_config": "a multimodal wrapper config",
}


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory, as a dict."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise HFConfigError(f"{directory}: not a directory (a Hugging Face model directory)")
    if not path.is_file():
        raise HFConfigError(f"{directory}: no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFConfigError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path}: not a JSON object")
    return cfg


def _check_keys(cfg: dict, used: set, where: str, ignore_keys) -> None:
    for key, why in _REFUSED.items():
        if cfg.get(key) not in (None, 0, False):
            raise HFConfigError(f"{where}: {key}={cfg[key]!r}: {why} are not supported")
    for key, (allowed, why) in _ONLY_AT.items():
        if key in cfg and allowed is not None and cfg[key] not in allowed:
            if key == "quantization_config" and cfg[key] in (None, {}):
                continue
            raise HFConfigError(f"{where}: {key}={cfg[key]!r}: {why} is not supported")
    sliding = cfg.get("sliding_window")
    if sliding is not None and cfg.get("use_sliding_window", True):
        limit = cfg.get("max_position_embeddings")
        if limit is None or sliding < limit:
            raise HFConfigError(
                f"{where}: sliding_window={sliding} (< max_position_embeddings={limit}): "
                "sliding-window attention is not supported (set sliding_window to null "
                "where the checkpoint was trained with full attention)"
            )
    layer_types = cfg.get("layer_types")
    if layer_types is not None and set(layer_types) - {"full_attention"}:
        other = sorted(set(layer_types) - {"full_attention"})
        raise HFConfigError(f"{where}: layer_types has {other}: only full_attention is supported")
    known = used | IGNORED_KEYS | set(_ONLY_AT) | {"sliding_window", "layer_types"}
    unknown = sorted(k for k in cfg if k not in known and k not in set(ignore_keys))
    if unknown:
        raise HFConfigError(
            f"{where}: config key {unknown[0]!r} (= {cfg[unknown[0]]!r}) is not one nnlite "
            "knows for this architecture; if it does not change the network, pass "
            f"ignore_keys=[{unknown[0]!r}]"
        )


def _rope(cfg: dict) -> tuple[float, dict]:
    """``(rope_theta, rope_scaling)`` from either the v4 keys (``rope_theta``,
    ``rope_scaling``) or v5's ``rope_parameters``."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = {**params, **scaling}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        scaling = {}
    else:
        scaling.pop("type", None)
        scaling["rope_type"] = kind
    return float(theta), scaling


def model_kwargs(cfg: dict, where: str = "config.json", ignore_keys=()) -> tuple[str, dict]:
    """``(family, fields)``: which nnlite model a config builds and its fields; refuses what
    it cannot build."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise HFConfigError(
            f"{where}: model_type {model_type!r} is not supported; supported: "
            + ", ".join(FAMILIES)
        )
    family = FAMILIES[model_type]
    try:
        if family == "gpt2":
            _check_keys(cfg, _GPT2_USED, where, ignore_keys)
            act = cfg.get("activation_function", "gelu_new")
            acts = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
            acts |= {"tanh": "tanh", "silu": "silu", "swish": "silu"}
            if act not in acts:
                raise HFConfigError(
                    f"{where}: activation_function {act!r} is not supported; supported: "
                    + ", ".join(acts)
                )
            n_embd = int(cfg.get("n_embd", 768))
            return family, dict(
                vocab_size=int(cfg["vocab_size"]),
                context=int(cfg.get("n_positions", cfg.get("n_ctx", 1024))),
                n_layer=int(cfg.get("n_layer", 12)),
                n_head=int(cfg.get("n_head", 12)),
                n_embd=n_embd,
                n_inner=int(cfg.get("n_inner") or 4 * n_embd),
                activation=acts[act],
                eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                tie_head=bool(cfg.get("tie_word_embeddings", True)),
            )
        _check_keys(cfg, _LLAMA_USED, where, ignore_keys)
        if cfg.get("hidden_act", "silu") != "silu":
            raise HFConfigError(
                f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU uses silu)"
            )
        theta, scaling = _rope(cfg)
        heads = int(cfg["num_attention_heads"])
        qwen = model_type == "qwen2"
        bias = bool(cfg.get("attention_bias", False))
        return family, dict(
            vocab_size=int(cfg["vocab_size"]),
            context=int(cfg.get("max_position_embeddings", 2048)),
            n_layer=int(cfg["num_hidden_layers"]),
            n_head=heads,
            n_kv_head=int(cfg.get("num_key_value_heads") or heads),
            n_embd=int(cfg["hidden_size"]),
            hidden=int(cfg["intermediate_size"]),
            head_dim=None if cfg.get("head_dim") is None else int(cfg["head_dim"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qwen or bias,
            out_bias=bias and not qwen,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_head=bool(cfg.get("tie_word_embeddings", False)),
            model_type=model_type,
        )
    except KeyError as e:
        raise HFConfigError(f"{where}: missing key {e.args[0]!r}") from None
