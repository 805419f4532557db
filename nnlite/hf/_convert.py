"""``load_pretrained`` and ``save_pretrained``: Hugging Face model directories in and out.

Names and layouts: Hugging Face's ``nn.Linear`` stores ``weight [out, in]`` (``y = x W^T``),
nnlite's ``Linear`` ``W [in, out]``, so every Llama-family projection and an untied head are
transposed on the way in and out; GPT-2's ``Conv1D`` already stores ``[in, out]`` and its
fused ``c_attn`` has nnlite's ``[q | k | v]`` column layout, so GPT-2's weights are copied as
they are. Rotary q/k weights need no permutation: Hugging Face's Llama checkpoints are
already in the rotate-half layout that nnlite's ``rope`` uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._params import ParamsDict
from ._config import PROFILES, HFConfigError, model_kwargs, read_config
from ._gpt2 import GPT2LM
from ._models import LlamaLM, merge_lora
from ._safetensors import SafetensorsDir, write_safetensors
from ._tokenizer import as_tokenizer, check_tokenizer, copy_tokenizer

__all__ = ["family_of", "hf_name", "load_pretrained", "plan_weights", "save_pretrained"]

# (nnlite path regex, Hugging Face name template, transposed)
_GPT2 = [
    (r"/wte/W", "transformer.wte.weight", False),
    (r"/wpe/W", "transformer.wpe.weight", False),
    (r"/blocks\[(\d+)\]/ln1/scale", "transformer.h.{0}.ln_1.weight", False),
    (r"/blocks\[(\d+)\]/ln1/bias", "transformer.h.{0}.ln_1.bias", False),
    (r"/blocks\[(\d+)\]/ln2/scale", "transformer.h.{0}.ln_2.weight", False),
    (r"/blocks\[(\d+)\]/ln2/bias", "transformer.h.{0}.ln_2.bias", False),
    (r"/blocks\[(\d+)\]/attn/qkv/W", "transformer.h.{0}.attn.c_attn.weight", False),
    (r"/blocks\[(\d+)\]/attn/qkv/b", "transformer.h.{0}.attn.c_attn.bias", False),
    (r"/blocks\[(\d+)\]/attn/out/W", "transformer.h.{0}.attn.c_proj.weight", False),
    (r"/blocks\[(\d+)\]/attn/out/b", "transformer.h.{0}.attn.c_proj.bias", False),
    (r"/blocks\[(\d+)\]/mlp/fc/W", "transformer.h.{0}.mlp.c_fc.weight", False),
    (r"/blocks\[(\d+)\]/mlp/fc/b", "transformer.h.{0}.mlp.c_fc.bias", False),
    (r"/blocks\[(\d+)\]/mlp/proj/W", "transformer.h.{0}.mlp.c_proj.weight", False),
    (r"/blocks\[(\d+)\]/mlp/proj/b", "transformer.h.{0}.mlp.c_proj.bias", False),
    (r"/ln_f/scale", "transformer.ln_f.weight", False),
    (r"/ln_f/bias", "transformer.ln_f.bias", False),
    (r"/head/W", "lm_head.weight", True),
]
_LLAMA_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"}
_LLAMA_PROJ |= {"out": "self_attn.o_proj"}
_LLAMA = [
    (r"/embed/W", "model.embed_tokens.weight", False),
    (r"/blocks\[(\d+)\]/ln1/scale", "model.layers.{0}.input_layernorm.weight", False),
    (r"/blocks\[(\d+)\]/ln2/scale", "model.layers.{0}.post_attention_layernorm.weight", False),
    *[
        (rf"/blocks\[(\d+)\]/attn/{k}/{p}", f"model.layers.{{0}}.{v}.{n}", p == "W")
        for k, v in _LLAMA_PROJ.items()
        for p, n in (("W", "weight"), ("b", "bias"))
    ],
    *[
        (rf"/blocks\[(\d+)\]/mlp/{k}/{p}", f"model.layers.{{0}}.mlp.{k}_proj.{n}", p == "W")
        for k in ("gate", "up", "down")
        for p, n in (("W", "weight"), ("b", "bias"))
    ],
    *[
        (
            rf"/blocks\[(\d+)\]/attn/{k}_norm/scale",
            f"model.layers.{{0}}.self_attn.{k}_norm.weight",
            False,
        )
        for k in ("q", "k")
    ],
    (r"/ln_f/scale", "model.norm.weight", False),
    (r"/head/W", "lm_head.weight", True),
]
# Gemma 2 normalises each half's output too, and its "post_attention_layernorm" is the norm
# after the attention, not the one before the MLP as in Llama
_GEMMA2_NORMS = {
    "ln2": "pre_feedforward_layernorm",
    "post_ln1": "post_attention_layernorm",
    "post_ln2": "post_feedforward_layernorm",
}
_GEMMA2 = [
    *[(rf"/blocks\[(\d+)\]/{k}/scale", f"model.layers.{{0}}.{v}.weight", False)
      for k, v in _GEMMA2_NORMS.items()],
    *(row for row in _LLAMA if not row[0].startswith(r"/blocks\[(\d+)\]/ln2")),
]  # fmt: skip
_TABLES = {"gpt2": _GPT2, "llama": _LLAMA, "gemma2": _GEMMA2}


def hf_name(family: str, path: str) -> tuple[str, bool]:
    """``(Hugging Face tensor name, transposed)`` of the nnlite param ``path`` in the naming
    ``family`` (``"gpt2"``, ``"llama"``, or ``"gemma2"``: Llama's with Gemma 2's four norms
    a block; ``family_of(model)``).

    Example:
        >>> hf_name("llama", "/blocks[3]/attn/q/W")
        ('model.layers.3.self_attn.q_proj.weight', True)
    """
    for pattern, template, transposed in _TABLES[family]:
        m = re.fullmatch(pattern, path)
        if m:
            return template.format(*m.groups()), transposed
    raise ValueError(f"no Hugging Face name for the {family} param {path}")


def family_of(model: Any) -> str:
    """The weight-naming family of an ``nl.hf`` model (``hf_name``'s first argument)."""
    if isinstance(model, GPT2LM):
        return "gpt2"
    if isinstance(model, LlamaLM):
        return "gemma2" if model.post_norms else "llama"
    raise TypeError(
        f"save_pretrained: expected an nl.hf.GPT2LM or nl.hf.LlamaLM, got {type(model).__name__}"
    )


def build_model(directory: str | os.PathLike, *, ignore_keys=()) -> GPT2LM | LlamaLM:
    """The nnlite model a Hugging Face directory's ``config.json`` describes (no weights)."""
    cfg = read_config(directory)
    where = f"{Path(directory) / 'config.json'}"
    try:
        family, kwargs = model_kwargs(cfg, where, ignore_keys)
    except HFConfigError:
        raise
    except (TypeError, ValueError) as e:  # e.g. "hidden_size": "big"
        raise HFConfigError(f"{where}: a key has a value of the wrong type ({e})") from None
    try:
        return GPT2LM(**kwargs) if family == "gpt2" else LlamaLM(**kwargs)
    except ValueError as e:  # a value the layers refuse (a rope kind, head sizes)
        raise HFConfigError(f"{where}: {e}") from None


def _placer(sharding: Any, like: ParamsDict) -> Callable[[str, tuple], Any]:
    """``(path, shape) -> Sharding or None`` from what the caller gave."""
    if sharding is None:
        return lambda path, shape: None
    if isinstance(sharding, jax.sharding.Sharding):
        return lambda path, shape: sharding
    if callable(sharding):
        return sharding
    flat = ParamsDict.to_flat(sharding) if isinstance(sharding, ParamsDict) else None
    if flat is None or set(flat) != set(like.to_flat()):
        raise ValueError(
            "load_pretrained: sharding must be None, a jax.sharding.Sharding, a callable "
            "(path, shape) -> Sharding, or a ParamsDict of Shardings like the params"
        )
    return lambda path, shape: flat[path]


def load_pretrained(
    directory: str | os.PathLike,
    *,
    sharding: Any = None,
    ignore_keys=(),
) -> tuple[GPT2LM | LlamaLM, ParamsDict]:
    """``(model, params)`` from a local Hugging Face model directory (``config.json`` and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``).

    Weights are read lazily: each file is memory-mapped, each tensor converted and placed
    on the device(s) one at a time (with ``sharding``, each device reads only its slice), so
    host memory holds about one tensor beyond what the devices hold.

    Args:
        directory: the model directory (downloaded beforehand: nothing is fetched).
        sharding: where each param goes: None (the default device), one
            ``jax.sharding.Sharding`` for all, a callable ``(path, shape) -> Sharding``, or
            a ParamsDict of Shardings like the params (e.g. a parallel strategy's).
        ignore_keys: config keys to pass over that nnlite does not know (after checking
            that they do not change the network).

    Returns:
        ``(model, params)``: an ``nl.hf.GPT2LM`` or ``nl.hf.LlamaLM`` and its ParamsDict.

    Raises:
        HFConfigError: one line naming the file and what is wrong: not a model directory,
            a ``config.json`` that is not JSON, lacks a key or has an unsupported
            architecture or key, a weight file or shard that is missing, empty, truncated or
            not safetensors (a PyTorch ``.bin``, text), a missing or misshapen tensor, a
            ``tokenizer.json`` with more tokens than the embedding has rows.
    """
    model = build_model(directory, ignore_keys=ignore_keys)
    check_tokenizer(directory, model.vocab_size)
    weights = SafetensorsDir(directory, HFConfigError)
    like = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    place = _placer(sharding, like)
    targets = dict(like.items())
    plan = plan_weights(directory, model, weights, like)
    out: dict[str, Any] = {}
    for file in sorted({p[0] for p in plan}):  # file by file, each map dropped after
        for _, path, name, transposed, aval in (p for p in plan if p[0] == file):
            host = weights.tensor(name)
            host = host.T if transposed else host
            # float32 params (bfloat16 and float16 checkpoints upcast), as the models' layers
            out[path] = _to_device(host, jnp.float32, place(path, aval.shape))
        weights.close(file)
    return model, ParamsDict.from_flat({p: out[p] for p in targets})


def plan_weights(directory, model, weights: SafetensorsDir, like: ParamsDict | None = None):
    """``[(file, nnlite path, tensor name, transposed, aval)]``: where each param of
    ``model`` is in the directory's files, checked from the files' headers alone (every
    file whole, every tensor there with the shape the config implies, none left over);
    nothing is read. HFConfigError (one line, naming the file) otherwise."""
    family = family_of(model)
    if like is None:
        like = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    weights.check()
    plan = []
    for path, aval in like.items():
        name, transposed = hf_name(family, path)
        found = name if name in weights else None
        if found is None and family == "gpt2":  # the original GPT-2 files: no "transformer."
            bare = name.removeprefix("transformer.")
            found = bare if bare in weights else None
        if found is None:
            raise HFConfigError(f"{directory}: tensor {name!r} (nnlite {path}) is missing")
        shape = weights.shape(found)
        want = tuple(aval.shape)[::-1] if transposed else tuple(aval.shape)
        if shape != want:
            raise HFConfigError(
                f"{weights.file_of(found)}: tensor {found!r} has shape {shape}, "
                f"{Path(directory) / 'config.json'} implies {want}"
            )
        plan.append((weights.file_of(found), path, found, transposed, aval))
    used = {p[2] for p in plan}
    extra = sorted(
        n
        for n in weights.names()
        if n not in used
        and not re.search(r"\.attn\.(masked_)?bias$|rotary_emb\.inv_freq$", n)
        and not (n == "lm_head.weight" and model.tie_head)
    )
    if extra:
        raise HFConfigError(
            f"{directory}: tensor {extra[0]!r} is not part of the {family} model nnlite builds "
            f"from config.json ({len(extra)} such tensors)"
        )
    return plan


def _to_device(host: np.ndarray, dtype: Any, sharding: Any) -> jax.Array:
    dtype = jnp.dtype(dtype)
    if sharding is None:
        return jnp.asarray(np.asarray(host, dtype))
    return jax.make_array_from_callback(
        host.shape, sharding, lambda idx: np.asarray(host[idx], dtype)
    )


_ARCH = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
_ACT_BACK = {"gelu": "gelu_new", "relu": "relu", "tanh": "tanh", "silu": "silu"}
_GATE_BACK = {"silu": "silu", "gelu": "gelu_pytorch_tanh"}


def hf_config(model: GPT2LM | LlamaLM, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` that makes ``transformers`` build ``model``."""
    if isinstance(model, GPT2LM):
        return {
            "architectures": [_ARCH["gpt2"]],
            "model_type": "gpt2",
            "vocab_size": model.vocab_size,
            "n_positions": model.context,
            "n_embd": model.n_embd,
            "n_layer": model.n_layer,
            "n_head": model.n_head,
            "n_inner": model.n_inner or 4 * model.n_embd,
            "activation_function": _ACT_BACK[model.activation],
            "layer_norm_epsilon": model.eps,
            "tie_word_embeddings": model.tie_head,
            "dtype": dtype,  # transformers 5 (torch_dtype before it)
        }
    mt = model.model_type
    _check_exportable(model)
    cfg = {
        "architectures": [_ARCH[mt]],
        "model_type": mt,
        "vocab_size": model.vocab_size,
        "hidden_size": model.n_embd,
        "intermediate_size": model.hidden,
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": model.n_kv_head or model.n_head,
        "head_dim": model.head_dim or model.n_embd // model.n_head,
        "hidden_act": _GATE_BACK[model.activation],
        "max_position_embeddings": model.context,
        "rms_norm_eps": model.eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": dict(model.rope_scaling) or None,
        "tie_word_embeddings": model.tie_head,
        "dtype": dtype,  # transformers 5 (torch_dtype before it)
    }
    if mt == "llama":
        cfg["mlp_bias"] = model.mlp_bias
    if mt != "qwen2":  # Qwen2's q/k/v biases are not a key
        cfg["attention_bias"] = model.out_bias
    if mt == "gemma2":
        cfg["hidden_activation"] = cfg.pop("hidden_act")
        scalar = model.query_pre_attn_scalar or cfg["head_dim"]  # None: head_dim's scale
        cfg["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
        cfg["attn_logit_softcapping"] = model.attn_softcap
        cfg["final_logit_softcapping"] = model.logit_softcap
    return cfg | _window_keys(model)


def _window_keys(model: LlamaLM) -> dict[str, Any]:
    """The sliding-window keys of ``model``'s type; refuses layers the type cannot slide."""
    mt, window = model.model_type, model.sliding_window
    kind = "full_attention" if window is None else "sliding_attention"
    types = list(model.layer_types) or [kind] * model.n_layer
    if mt == "mistral" and window is not None and set(types) != {"sliding_attention"}:
        raise ValueError(
            f"save_pretrained: a mistral config slides every layer or none; this model's "
            f"layer_types are {model.layer_types} (build it with model_type='qwen2' or 'gemma2')"
        )
    if mt in ("qwen2", "qwen3"):
        return {"use_sliding_window": window is not None, "sliding_window": window,
                "max_window_layers": model.n_layer, "layer_types": types}  # fmt: skip
    if mt == "gemma2":
        return {"sliding_window": window, "layer_types": types}
    if mt == "mistral":
        return {"sliding_window": window}
    if window is not None:
        raise ValueError(
            f"save_pretrained: model_type {mt!r} has no sliding-window attention; this model "
            f"has sliding_window={window} (build it with model_type mistral, qwen2, qwen3 or "
            "gemma2)"
        )
    return {}


def _check_exportable(model: LlamaLM) -> None:
    """Refuses a model whose layers its ``model_type`` cannot describe, naming the field."""
    mt = model.model_type
    if mt not in PROFILES:
        raise ValueError(f"save_pretrained: model_type {mt!r} is not one of {', '.join(PROFILES)}")
    want = dict(PROFILES[mt])
    if mt != "gemma2":
        want |= {"query_pre_attn_scalar": None, "attn_softcap": None, "logit_softcap": None}
    if mt != "llama":
        want["mlp_bias"] = False
    if mt == "mistral":
        want |= {"qkv_bias": False, "out_bias": False}
    wrong = [(k, v) for k, v in want.items() if getattr(model, k) != v]
    if wrong:
        k, v = wrong[0]
        raise ValueError(
            f"save_pretrained: a {mt} config describes {k}={v!r}; this model has "
            f"{k}={getattr(model, k)!r} (build it with the model_type whose layers it has)"
        )
    if mt == "qwen2" and (not model.qkv_bias or model.out_bias):
        raise ValueError("save_pretrained: a qwen2 model has q/k/v biases and no output bias")
    if mt != "qwen2" and model.qkv_bias != model.out_bias:
        raise ValueError(
            f"save_pretrained: a {mt} config has one attention_bias for q, k, v and the output "
            f"projection; this model has qkv_bias={model.qkv_bias}, out_bias={model.out_bias} "
            "(build it with model_type='qwen2' for q/k/v biases only)"
        )


_CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id")


def save_pretrained(
    directory: str | os.PathLike,
    model: GPT2LM | LlamaLM,
    params: ParamsDict,
    tokenizer: Any = None,
    *,
    dtype: Any = None,
    source: str | os.PathLike | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``model`` and ``params`` as a Hugging Face model directory that
    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads: ``config.json``,
    ``model.safetensors`` (or shards of at most ``max_shard_bytes`` with their index) in
    Hugging Face's names and layouts, and the tokenizer's files, which
    ``transformers.AutoTokenizer.from_pretrained(directory)`` reads. LoRA adapters are
    merged into their weights first.

    Args:
        directory: created if missing.
        model, params: an ``nl.hf.GPT2LM`` / ``nl.hf.LlamaLM`` and its params.
        tokenizer: an ``nl.hf.Tokenizer``, a ``tokenizers.Tokenizer`` or a trainer's BPE
            tokenizer, written beside the weights; None: the ``source`` directory's
            tokenizer files, where it has them.
        dtype: the tensors' dtype in the file (``"float32"``, ``"bfloat16"``, ``"float16"``);
            None: the ``source`` checkpoint's (a bfloat16 checkpoint exports as bfloat16),
            else the params'.
        source: the directory the model came from: its token ids (bos/eos/pad) go into the
            new config, its ``generation_config.json`` and tokenizer files are copied.
        max_shard_bytes: split the weights into files of at most this size.

    Returns:
        The directory.
    """
    family = family_of(model)
    model, params = merge_lora(model, params)
    dtype_name = str(jnp.dtype(dtype if dtype is not None else _dtype_of(source, params)))
    if dtype_name not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"save_pretrained: dtype must be float32, bfloat16 or float16, not {dtype!r}"
        )
    cfg = hf_config(model, dtype_name)
    if source is not None:
        old = read_config(source)
        cfg.update({k: old[k] for k in _CARRIED if k in old})
    like = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    if jax.tree.structure(like) != jax.tree.structure(params):
        raise ValueError(
            f"save_pretrained: params do not fit {type(model).__name__}: tree "
            f"{jax.tree.structure(params)} vs {jax.tree.structure(like)}"
        )
    tensors = {}
    for path, leaf in params.items():
        name, transposed = hf_name(family, path)
        host = np.asarray(jax.device_get(leaf)).astype(jnp.dtype(dtype_name))
        tensors[name] = np.ascontiguousarray(host.T if transposed else host)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(d, tensors, max_shard_bytes=max_shard_bytes)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if source is not None and (Path(source) / _GENERATION).is_file():
        if Path(source).resolve() != d.resolve():
            shutil.copyfile(Path(source) / _GENERATION, d / _GENERATION)
    if tokenizer is not None:
        as_tokenizer(tokenizer).save(d, context=model.context)
    elif source is not None:
        copy_tokenizer(source, d)
    return d


_GENERATION = "generation_config.json"


def _dtype_of(source: str | os.PathLike | None, params: ParamsDict) -> str:
    """The dtype an export keeps: the source checkpoint's (its config's ``dtype`` /
    ``torch_dtype``, else its first floating tensor's), else the params' (float32 where
    they mix)."""
    if source is not None:
        cfg = read_config(source)
        named = cfg.get("dtype") or cfg.get("torch_dtype")
        if named in ("float32", "bfloat16", "float16"):
            return named
        weights = SafetensorsDir(source, HFConfigError)
        for name in weights.names():
            kind = weights.tensor(name).dtype
            if jnp.issubdtype(kind, jnp.floating):
                return str(jnp.dtype(kind))
    kinds = {str(jnp.dtype(leaf.dtype)) for _, leaf in params.items()}
    return kinds.pop() if len(kinds) == 1 else "float32"
