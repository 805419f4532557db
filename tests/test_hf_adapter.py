"""LoRA adapters in peft's format, checked against peft itself: nnlite's adapters exported
and loaded by ``PeftModel.from_pretrained``, peft-made adapters loaded by nnlite, each with
logits equal to the other's; mismatched adapters refused in one line; LoRA dropout."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tf():
    """transformers, torch and peft, imported with their import-time warnings silenced."""
    reason = "transformers, torch and peft are test-only extras: pip install 'nnlite[dev]'"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch = pytest.importorskip("torch", reason=reason)
        transformers = pytest.importorskip("transformers", reason=reason)
        peft = pytest.importorskip("peft", reason=reason)
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    return transformers, torch, peft


def _config(transformers, arch, hidden=16):
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=50, n_positions=32, n_embd=hidden, n_layer=2, n_head=2
        )
    return transformers.LlamaConfig(
        vocab_size=50, max_position_embeddings=32, hidden_size=hidden, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def _base(tf, arch, path, hidden=16):
    """A tiny random transformers model saved to ``path``."""
    transformers, torch, _ = tf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(transformers, arch, hidden))
        model.save_pretrained(path)
    return path


def _torch_model(tf, path):
    transformers, _, _ = tf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _logits(tf, model, tokens):
    torch = tf[1]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _assert_rel(got, want, rel=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= rel, f"relative difference {err:.2e} > {rel}"


TOKENS = np.arange(2, 22).reshape(2, 10) % 50


@pytest.mark.parametrize(
    "arch, targets, modules",
    [
        ("llama", ["*/attn/q", "*/attn/v", "*/mlp/*"],
         ["down_proj", "gate_proj", "q_proj", "up_proj", "v_proj"]),
        # GPT-2's Conv1D (fan_in_fan_out); one layer's fc only: full module names
        ("gpt2", ["*/attn/qkv", "blocks/1/mlp/fc"],
         ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn",
          "transformer.h.1.mlp.c_fc"]),
    ],
)  # fmt: skip
def test_exported_adapter_loads_in_peft_with_equal_logits(tf, tmp_path, arch, targets, modules):
    peft = tf[2]
    base_dir = _base(tf, arch, tmp_path / "base")
    model, params = nl.hf.load_pretrained(base_dir)
    model, params = nl.hf.add_lora(model, params, targets, jax.random.key(0), rank=2, alpha=6)
    # B starts at zero: give every adapter a value so the test sees each one's place
    flat = params.to_flat()
    keys = iter(jax.random.split(jax.random.key(1), len(flat)))
    flat = {
        k: 0.3 * jax.random.normal(next(keys), v.shape) if k.endswith("lora_b") else v
        for k, v in flat.items()
    }
    params = nl.ParamsDict.from_flat(flat)
    out = nl.hf.save_adapter(tmp_path / "adapter", model, params)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"]) == (
        "LORA", "CAUSAL_LM", 2, 6,
    )  # fmt: skip
    assert cfg["target_modules"] == modules and cfg["fan_in_fan_out"] == (arch == "gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(_torch_model(tf, base_dir), out).eval()
    want = jax.jit(model)(params, TOKENS)
    _assert_rel(_logits(tf, loaded, TOKENS), want)
    # the adapters change the logits: the test compares more than the base
    assert float(jnp.abs(want - _logits(tf, _torch_model(tf, base_dir), TOKENS)).max()) > 1e-3
    # its tensors are peft's names and layouts
    names = _header(out / "adapter_model.safetensors")
    if arch == "llama":
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
        assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names


def _header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def _peft_adapter(tf, base_dir, out, **config):
    """An adapter made by peft itself: random A and B (``init_lora_weights=False``)."""
    _, torch, peft = tf
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **config)
        model = peft.get_peft_model(_torch_model(tf, base_dir), cfg).eval()
        model.save_pretrained(out)
    return model


@pytest.mark.parametrize("arch, modules", [("llama", ["q_proj", "v_proj", "down_proj"]),
                                           ("gpt2", ["c_attn", "c_proj"])])  # fmt: skip
def test_peft_made_adapter_loads_with_logits_equal_to_peft(tf, tmp_path, arch, modules):
    base_dir = _base(tf, arch, tmp_path / "base")
    peft_model = _peft_adapter(
        tf, base_dir, tmp_path / "ad", r=2, lora_alpha=8, target_modules=modules
    )
    model, params = nl.hf.load_pretrained(base_dir)
    model, params = nl.hf.load_adapter(tmp_path / "ad", model, params)
    assert model.lora_rank == 2 and model.lora_alpha == 8
    _assert_rel(jax.jit(model)(params, TOKENS), _logits(tf, peft_model, TOKENS))
    # the model with LoRA disabled is the base
    base_model, base_params = nl.hf.without_lora(model, params)
    assert "lora_a" not in str(base_params.to_flat())
    _assert_rel(
        jax.jit(base_model)(base_params, TOKENS), _logits(tf, _torch_model(tf, base_dir), TOKENS)
    )


def test_mismatched_adapters_are_one_line(tf, tmp_path):
    base_dir = _base(tf, "llama", tmp_path / "base")
    model, params = nl.hf.load_pretrained(base_dir)
    _peft_adapter(tf, _base(tf, "llama", tmp_path / "wide", hidden=32), tmp_path / "wide_ad",
                  r=2, target_modules=["q_proj"])  # fmt: skip
    with pytest.raises(nl.hf.AdapterError, match=r"q_proj.lora_A.weight has shape \(2, 32\), "
                       r"the base model needs \(2, 16\)"):  # fmt: skip
        nl.hf.load_adapter(tmp_path / "wide_ad", model, params)
    _peft_adapter(tf, base_dir, tmp_path / "head_ad", r=2, target_modules=["lm_head"])
    with pytest.raises(nl.hf.AdapterError, match="lm_head.* is not .* projection of this LlamaLM"):
        nl.hf.load_adapter(tmp_path / "head_ad", model, params)
    with pytest.raises(nl.hf.AdapterError, match="no adapter_config.json"):
        nl.hf.load_adapter(tmp_path, model, params)
    cfg = json.loads((tmp_path / "head_ad" / "adapter_config.json").read_text())
    (tmp_path / "head_ad" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": 1}))
    with pytest.raises(nl.hf.AdapterError, match="use_dora=1 is not supported"):
        nl.hf.load_adapter(tmp_path / "head_ad", model, params)
