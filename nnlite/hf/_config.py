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
    "PROFILES",
    "read_config",
    "model_kwargs",
]


class HFConfigError(ValueError):
    """A Hugging Face model directory or config that nnlite cannot load (one line)."""


HFConfigError.__module__ = "nnlite.hf"

#: ``model_type`` -> the family nnlite builds it as.
FAMILIES = {
    "gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "gemma": "llama", "gemma2": "llama",
}  # fmt: skip

_PLAIN = {"norm_offset": 0.0, "scale_embeddings": False, "qk_norm": False, "post_norms": False}
#: Llama-family ``model_type`` -> the ``LlamaLM`` fields the type fixes (its layers' form);
#: ``save_pretrained`` exports a model only as a type whose form it has.
PROFILES = {
    "llama": _PLAIN,
    "mistral": _PLAIN,
    "qwen2": _PLAIN,
    "qwen3": {**_PLAIN, "qk_norm": True},
    "gemma": {**_PLAIN, "norm_offset": 1.0, "scale_embeddings": True},
    "gemma2": {**_PLAIN, "norm_offset": 1.0, "scale_embeddings": True, "post_norms": True},
}

#: transformers' defaults for keys a config.json may leave out, where nnlite's generic ones
#: (``rms_norm_eps`` 1e-6, ``head_dim`` ``hidden_size // num_attention_heads``, ...) differ.
_DEFAULTS = {
    "mistral": {"sliding_window": 4096},
    "qwen3": {"head_dim": 128},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {
        "head_dim": 256, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "sliding_window": 4096,
    },
}  # fmt: skip

_WINDOW_KEYS = {"sliding_window", "layer_types", "use_sliding_window", "max_window_layers"}
#: model_type -> which layers its ``sliding_window`` applies to: every layer (Mistral) or
#: those ``layer_types`` names (derived as transformers' config class derives it when absent).
_SLIDING = {"mistral": "every", "qwen2": "types", "qwen3": "types", "gemma2": "types"}
_LAYER_KINDS = ("full_attention", "sliding_attention")

#: Activations of the gated MLP: the config's name -> nnlite's (``gelu`` is GELU's tanh form).
_GATE_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}

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
    is_llama_config quantization_config_none use_return_dict
    cache_implementation""".split()
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
#: The keys only some Llama-family types read.
_TYPE_USED = {
    "gemma": {"hidden_activation"},
    "gemma2": {"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
               "final_logit_softcapping"},
}  # fmt: skip

#: Keys accepted only at the value that means "not used": {key: (allowed values, why)}.
_ONLY_AT = {
    "scale_attn_weights": ((True,), "attention scores divided by sqrt(head_dim)"),
    "scale_attn_by_inverse_layer_idx": ((False,), "per-layer attention scaling"),
    "reorder_and_upcast_attn": ((False, True), ""),  # float32 attention, as nnlite's
    "add_cross_attention": ((False,), "cross-attention (an encoder-decoder)"),
    "use_bidirectional_attention": ((None, False), "bidirectional attention"),
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
    return read_json(path)


def read_json(path: str | os.PathLike, error: type[Exception] = HFConfigError) -> dict:
    """A JSON object file of a model or adapter directory (``config.json``,
    ``tokenizer_config.json``, ...), or ``error`` in one line naming the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise error(f"{path}: not a JSON object ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object (a {type(data).__name__})")
    return data


def _check_keys(cfg: dict, used: set, where: str, ignore_keys) -> None:
    for key, why in _REFUSED.items():
        if cfg.get(key) not in (None, 0, False):
            raise HFConfigError(f"{where}: {key}={cfg[key]!r}: {why} are not supported")
    for key, (allowed, why) in _ONLY_AT.items():
        if key in cfg and allowed is not None and cfg[key] not in allowed:
            if key == "quantization_config" and cfg[key] in (None, {}):
                continue
            raise HFConfigError(f"{where}: {key}={cfg[key]!r}: {why} is not supported")
    known = used | IGNORED_KEYS | set(_ONLY_AT) | _WINDOW_KEYS
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


def _windows(cfg: dict, model_type: str, n_layer: int, where: str) -> tuple[int | None, tuple]:
    """``(sliding_window, layer_types)`` as transformers' config class resolves them: Qwen's
    window only with ``use_sliding_window``, ``layer_types`` derived where absent (Gemma 2
    alternates, sliding first; Qwen slides from layer ``max_window_layers`` on); ``(None,
    ())`` without a window. A type without sliding windows refuses a window shorter than
    its context (a longer one never takes effect)."""
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise HFConfigError(
            f"{where}: sliding_window must be a positive int or null, got {window!r}"
        )
    types = cfg.get("layer_types")
    if types is not None:
        bad = [t for t in types if t not in _LAYER_KINDS] if isinstance(types, list) else [types]
        if bad or len(types) != n_layer:
            raise HFConfigError(
                f"{where}: layer_types must list {n_layer} of {', '.join(_LAYER_KINDS)}, got "
                f"{types!r}"
            )
    kind = _SLIDING.get(model_type)
    if kind is None:
        limit = cfg.get("max_position_embeddings", cfg.get("n_positions"))
        if (window is not None and (limit is None or window < limit)) or (
            types and "sliding_attention" in types
        ):
            raise HFConfigError(
                f"{where}: sliding_window={window}, layer_types={types}: transformers' "
                f"{model_type} has no sliding-window attention (sliding windows: "
                f"{', '.join(_SLIDING)}); set sliding_window to null"
            )
        return None, ()
    if window is None:
        return None, ()
    if kind == "every":
        if types is not None and set(types) != {"sliding_attention"}:
            raise HFConfigError(
                f"{where}: layer_types={types}: transformers' {model_type} slides every layer "
                f"(sliding_window={window})"
            )
        return window, ()
    if types is None and model_type == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layer)]
    elif types is None:
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
    return window, tuple(types)


def _activation(cfg: dict, model_type: str, where: str) -> str:
    """The gated MLP's activation: ``hidden_act`` (Gemma 2's ``hidden_activation``). Gemma's
    legacy ``gelu`` is GELU's tanh form, as transformers reads it; the other key, which
    Gemma configs also carry and transformers does not read, must not say otherwise."""
    key, other = "hidden_act", "hidden_activation"
    if model_type == "gemma2":
        key, other = other, key
    act = cfg.get(key) or "silu"
    gemma = model_type in ("gemma", "gemma2")
    legacy = {"gelu": "gelu_pytorch_tanh"} if model_type == "gemma" else {}
    act = legacy.get(act, act)
    if act not in _GATE_ACTS:
        raise HFConfigError(
            f"{where}: {key} {act!r} is not supported; supported: " + ", ".join(_GATE_ACTS)
        )
    second = cfg.get(other) if gemma else None
    if second is not None and _GATE_ACTS.get(legacy.get(second, second)) != _GATE_ACTS[act]:
        raise HFConfigError(f"{where}: {other} {second!r} disagrees with {key} {act!r}")
    return _GATE_ACTS[act]


def _llama_kwargs(cfg: dict, model_type: str, where: str, ignore_keys) -> dict:
    cfg = {**_DEFAULTS.get(model_type, {}), **cfg}
    _check_keys(cfg, _LLAMA_USED | _TYPE_USED.get(model_type, set()), where, ignore_keys)
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    n_layer = int(cfg["num_hidden_layers"])
    qwen2 = model_type == "qwen2"
    bias = bool(cfg.get("attention_bias", False))
    window, layer_types = _windows(cfg, model_type, n_layer, where)

    def number(key: str) -> float | None:  # a float, or None where absent or null
        return None if cfg.get(key) is None else float(cfg[key])

    return dict(
        vocab_size=int(cfg["vocab_size"]),
        context=int(cfg.get("max_position_embeddings", 2048)),
        n_layer=n_layer,
        n_head=heads,
        n_kv_head=int(cfg.get("num_key_value_heads") or heads),
        n_embd=int(cfg["hidden_size"]),
        hidden=int(cfg["intermediate_size"]),
        head_dim=None if cfg.get("head_dim") is None else int(cfg["head_dim"]),
        eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qwen2 or bias,
        out_bias=bias and not qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_head=bool(cfg.get("tie_word_embeddings", False)),
        activation=_activation(cfg, model_type, where),
        **PROFILES[model_type],
        query_pre_attn_scalar=number("query_pre_attn_scalar"),
        attn_softcap=number("attn_logit_softcapping"),
        logit_softcap=number("final_logit_softcapping"),
        sliding_window=window,
        layer_types=layer_types,
        model_type=model_type,
    )


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
            _windows(cfg, model_type, int(cfg.get("n_layer", 12)), where)
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
        return family, _llama_kwargs(cfg, model_type, where, ignore_keys)
    except KeyError as e:
        raise HFConfigError(f"{where}: missing key {e.args[0]!r}") from None
