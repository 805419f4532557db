"""LoRA adapters in peft's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

peft (the reference) saves a LoRA of a causal LM as tensors named ``base_model.model.<module>
.lora_A.weight [r, in]`` and ``.lora_B.weight [out, r]``, ``<module>`` the wrapped layer's
name in the transformers model (``model.layers.0.self_attn.q_proj``,
``transformer.h.0.attn.c_attn``), and its scaling is ``lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``). nnlite's ``LoRA`` holds ``lora_a [in, rank]`` and ``lora_b [rank, out]``
with scale ``alpha / rank``: the same update, each matrix transposed. GPT-2's ``Conv1D``
layers (``fan_in_fan_out``) change how peft merges, not how it stores ``A`` and ``B``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..core._params import ParamsDict
from ._config import read_json
from ._convert import family_of, hf_name
from ._gpt2 import GPT2LM
from ._models import LlamaLM
from ._safetensors import _write_one, open_file

__all__ = ["AdapterError", "load_adapter", "read_adapter", "save_adapter"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# LoraConfig options nnlite has no equivalent for: refused unless at their defaults
_UNSUPPORTED = {
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "bias": "none",
    "layer_replication": None,
}


class AdapterError(ValueError):
    """An adapter directory nnlite cannot read or that does not fit the model (one line)."""


def _decoder(model: Any) -> GPT2LM | LlamaLM:
    """The decoder of ``model`` (an ``nl.hf.Pretrained``'s ``model``)."""
    inner = model if isinstance(model, GPT2LM | LlamaLM) else getattr(model, "model", None)
    if not isinstance(inner, GPT2LM | LlamaLM):
        raise TypeError(
            f"expected an nl.hf.GPT2LM, nl.hf.LlamaLM or nl.hf.Pretrained, got "
            f"{type(model).__name__}"
        )
    return inner


def module_names(model: GPT2LM | LlamaLM) -> dict[str, str]:
    """``{nnlite path: transformers module name}`` of every projection LoRA can wrap
    (``/blocks[0]/attn/q`` -> ``model.layers.0.self_attn.q_proj``)."""
    family = family_of(model)
    return {p: hf_name(family, p + "/W")[0].removesuffix(".weight") for p in model.linear_paths}


def _target_modules(names: dict[str, str], chosen: set[str]) -> list[str]:
    """peft's ``target_modules`` for the projections ``chosen``: their short names when
    those select exactly them (``["q_proj", "v_proj"]``), else their full names."""
    full = {names[p] for p in chosen}
    short = {n.rsplit(".", 1)[-1] for n in full}
    if {n for n in names.values() if n.rsplit(".", 1)[-1] in short} == full:
        return sorted(short)
    return sorted(full)


def save_adapter(
    directory: str | os.PathLike,
    model: Any,
    params: ParamsDict,
    *,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write the LoRA adapters of ``model`` and ``params`` as peft writes them, so that
    ``peft.PeftModel.from_pretrained(transformers_model, directory)`` loads them.

    Args:
        directory: created if missing; gets ``adapter_config.json`` and
            ``adapter_model.safetensors``.
        model: an ``nl.hf.GPT2LM`` / ``nl.hf.LlamaLM`` with ``lora_targets``, or an
            ``nl.hf.Pretrained`` with ``lora`` (its directory is the base's name).
        params: the model's params (the adapters are read from them; the base is not written).
        base_model_name_or_path: the base recorded in the config (default: a
            ``Pretrained``'s directory).

    Returns:
        The directory.
    """
    dec = _decoder(model)
    if not dec.lora_targets:
        raise AdapterError(f"save_adapter: {type(dec).__name__} has no LoRA adapters to save")
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "path", None)
    names = module_names(dec)
    flat = params.to_flat()
    tensors = {}
    for path in sorted(dec.lora_paths):
        for ab, leaf in (("A", "lora_a"), ("B", "lora_b")):
            if path + "/" + leaf not in flat:
                raise AdapterError(f"save_adapter: params have no {path}/{leaf}")
            host = np.asarray(flat[path + "/" + leaf])
            name = f"base_model.model.{names[path]}.lora_{ab}.weight"
            tensors[name] = np.ascontiguousarray(host.T)
    alpha = dec.lora_alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": dec.lora_rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dec.lora_dropout,
        "target_modules": _target_modules(names, dec.lora_paths),
        "fan_in_fan_out": isinstance(dec, GPT2LM),  # GPT-2's Conv1D stores W as [in, out]
        "use_rslora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        **_UNSUPPORTED,
    }
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _write_one(d / WEIGHTS, tensors, {"format": "pt"})
    (d / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return d


def _read_config(d: Path) -> dict[str, Any]:
    where = d / CONFIG
    if not where.is_file():
        raise AdapterError(
            f"{d}: no {CONFIG}; a peft adapter directory holds {CONFIG} and {WEIGHTS}"
        )
    cfg = read_json(where, AdapterError)
    if cfg.get("peft_type") != "LORA":
        found = cfg.get("peft_type")
        raise AdapterError(f"{where}: peft_type is {found!r}; nnlite reads LORA adapters only")
    for key, default in _UNSUPPORTED.items():
        value = cfg.get(key, default)
        if value != "none" if key == "bias" else bool(value):
            raise AdapterError(
                f"{where}: {key}={cfg[key]!r} is not supported (nnlite's LoRA: {key}={default!r})"
            )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: r must be a positive int, got {r!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    dropout = cfg.get("lora_dropout", 0.0)
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise AdapterError(f"{where}: lora_dropout must be in [0, 1), got {dropout!r}")
    return cfg


def read_adapter(directory: str | os.PathLike, model: Any) -> dict[str, Any]:
    """A peft adapter directory checked against ``model`` (a base ``GPT2LM`` / ``LlamaLM``
    or ``Pretrained``): ``{"rank", "alpha", "dropout", "targets": [nnlite paths], "tensors":
    {nnlite path: (lora_a [in, rank], lora_b [rank, out])}}``; AdapterError (one line) for
    an adapter of another base (unknown module, other shapes) or options nnlite lacks."""
    d = Path(directory)
    cfg = _read_config(d)
    dec = _decoder(model)
    r = cfg["r"]
    # nnlite scales by alpha / rank; rsLoRA by lora_alpha / sqrt(r)
    alpha = cfg["lora_alpha"] * (math.sqrt(r) if cfg.get("use_rslora") else 1.0)
    paths = {name: p for p, name in module_names(dec).items()}
    file = open_file(d / WEIGHTS, AdapterError) if (d / WEIGHTS).is_file() else None
    if file is None:
        raise AdapterError(f"{d}: no {WEIGHTS} beside {CONFIG}")
    found: dict[str, dict[str, np.ndarray]] = {}
    try:
        for key in file.names():
            m = _KEY.fullmatch(key)
            if m is None or m.group(1) not in paths:
                known = sorted({n.rsplit(".", 1)[-1] for n in paths})
                what = "a LoRA A/B weight" if m is None else "an adapter"
                raise AdapterError(
                    f"{d / WEIGHTS}: tensor {key!r} is not {what} of a projection of this "
                    f"{type(dec).__name__} (its projections: {', '.join(known)}); nnlite "
                    "wraps these only, and the adapter must be made for this base model"
                )
            module, ab = m.groups()
            found.setdefault(paths[module], {})[ab] = np.asarray(file.tensor(key))
    finally:
        file.close()
    if not found:
        raise AdapterError(f"{d / WEIGHTS}: holds no LoRA weights")
    return {
        "rank": r,
        "alpha": float(alpha),
        "dropout": float(cfg.get("lora_dropout", 0.0)),
        "targets": sorted(found),
        "tensors": _checked(d / WEIGHTS, dec, found, r),
    }


def _checked(where: Path, dec, found: dict, r: int) -> dict:
    """``{path: (lora_a, lora_b)}`` in nnlite's layout, each shape checked against the base."""
    out = {}
    names = module_names(dec)
    for path, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(f"{where}: {names[path]} has no lora_{missing}.weight")
        i = int(path.split("]")[0].split("[")[1])
        owner, child = path.split("/")[-2:]
        base = getattr(dec.block_at(i), owner).children[child]
        base = getattr(base, "base", base)
        want = {"A": (r, base.in_features), "B": (base.out_features, r)}
        for k in "AB":
            if tuple(ab[k].shape) != want[k]:
                raise AdapterError(
                    f"{where}: {names[path]}.lora_{k}.weight has shape {tuple(ab[k].shape)}, "
                    f"the base model needs {want[k]} (r={r}): the adapter was made for another "
                    "base model"
                )
        out[path] = (ab["A"].T.astype(np.float32), ab["B"].T.astype(np.float32))
    return out


def load_adapter(
    directory: str | os.PathLike, model: Any, params: ParamsDict
) -> tuple[GPT2LM | LlamaLM, ParamsDict]:
    """``(model with the adapter's LoRA, params with its weights)`` from a peft adapter
    directory (``adapter_config.json`` + ``adapter_model.safetensors``, as
    ``PeftModel.save_pretrained`` writes it) and the base ``model`` and ``params`` it was
    made for (``nl.hf.load_pretrained``). Its logits equal peft's; train on from it as from
    ``nl.hf.add_lora``. An adapter of another base is one line (AdapterError)."""
    dec = _decoder(model)
    if dec.lora_targets:
        raise AdapterError(
            f"load_adapter: the model already has LoRA adapters ({list(dec.lora_targets)}); "
            "load the adapter onto the base model"
        )
    found = read_adapter(directory, dec)
    wrapped = dec.with_lora(found["targets"], found["rank"], found["alpha"], found["dropout"])
    flat = dict(params.to_flat())
    for path, (a, b) in found["tensors"].items():
        if path + "/W" not in flat:
            raise AdapterError(f"load_adapter: params have no {path}/W; give the base's params")
        dtype = flat[path + "/W"].dtype
        flat[path + "/lora_a"], flat[path + "/lora_b"] = a.astype(dtype), b.astype(dtype)
    return wrapped, ParamsDict.from_flat(flat)
