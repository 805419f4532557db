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
from _common import assert_lm_manual_grads_close

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
    # its tensors are peft's names (what peft itself would save of the loaded model)
    names = _header(out / "adapter_model.safetensors")
    assert sorted(names) == sorted(peft.get_peft_model_state_dict(loaded))
    if arch == "llama":
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
        assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names


def _data_bytes(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    return max(v["data_offsets"][1] for k, v in head.items() if k != "__metadata__")


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
    want = _logits(tf, peft_model, TOKENS)
    _assert_rel(jax.jit(model)(params, TOKENS), want)
    # the trainer's model.lora: {path: DIR}
    pre = nl.hf.Pretrained(base_dir, lora={"path": str(tmp_path / "ad")})
    _assert_rel(jax.jit(pre)(jax.jit(pre.init)(jax.random.key(0)), TOKENS), want)
    with pytest.raises(ValueError, match=r"gives rank, alpha and targets; leave out \['rank'\]"):
        nl.hf.Pretrained(base_dir, lora={"path": str(tmp_path / "ad"), "rank": 4})
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


# --- LoRA dropout -----------------------------------------------------------------------
def test_lora_dropout_is_peft_s_and_changes_training_outputs_only(key):
    from _tolerance import check_rule

    from nnlite.nn import _dropout, _lora

    layer = nl.LoRA(nl.Linear(6, 4), rank=2, alpha=4, dropout=0.5)
    p = jax.jit(layer.init)(key)
    p.lora_b = jnp.ones_like(p.lora_b)
    x = jax.random.normal(jax.random.key(1), (3, 6))
    k = jax.random.key(2)
    plain = x @ p.W + p.b[None] + 2.0 * (x @ p.lora_a) @ p.lora_b
    np.testing.assert_allclose(layer(p, x), plain, rtol=1e-6)  # inference: no dropout
    xd = _dropout.dropout(x, k, 0.5)  # peft: lora_B(lora_A(dropout(x))) * scaling, base on x
    np.testing.assert_allclose(
        layer(p, x, key=k), x @ p.W + p.b[None] + 2.0 * (xd @ p.lora_a) @ p.lora_b, rtol=1e-6
    )
    assert float(jnp.abs(layer(p, x, key=k) - plain).max()) > 1e-3
    ks = jax.random.split(jax.random.key(3), 6)
    shapes = [(3, 5), (3, 5), (5, 4), (4,), (5, 2), (2, 4)]  # x, xd, W, b, A, B
    args = [jax.random.normal(kk, s) for kk, s in zip(ks, shapes, strict=True)]
    check_rule(_lora.lora_linear_dropout, *args, scale=2.0)
    assert nl.rules.RULES["lora_linear_dropout"][1] is _lora.lora_linear_dropout_vjp
    with pytest.raises(ValueError, match="LoRA: dropout must be a float in"):
        nl.LoRA(nl.Linear(6, 4), dropout=1.0)


def test_llama_lora_dropout_and_mlp_targets_train_through_the_hand_rules(key):
    """The mlp glob wraps gate/up/down; dropout draws from the call's key only; the hand
    rules' gradients equal autodiff's with dropout on."""
    from _tolerance import ROUNDINGS_PER_LAYER

    model = nl.hf.LlamaLM(vocab_size=30, context=8, n_layer=1, n_head=2, n_embd=8, hidden=12)
    params = jax.jit(model.init)(key)
    model, params = nl.hf.add_lora(model, params, ["*/attn/q", "*/mlp/*"], key, rank=2)
    assert sorted(model.lora_paths) == [
        "/blocks[0]/attn/q", "/blocks[0]/mlp/down", "/blocks[0]/mlp/gate", "/blocks[0]/mlp/up",
    ]  # fmt: skip
    model = model.with_lora(model.lora_targets, 2, 16.0, dropout=0.3)
    flat = {k: v + 0.1 if k.endswith("lora_b") else v for k, v in params.to_flat().items()}
    params = nl.ParamsDict.from_flat(flat)
    tokens = jnp.arange(12).reshape(2, 6) % 30
    assert model.uses_key and not model.with_lora(("*/attn/q",)).uses_key
    call = jax.jit(model)
    eval_out = call(params, tokens)
    k1, k2 = jax.random.key(5), jax.random.key(6)
    train1 = call(params, tokens, key=k1)
    assert float(jnp.abs(train1 - eval_out).max()) > 1e-4  # dropout in training
    np.testing.assert_array_equal(train1, call(params, tokens, key=k1))
    assert float(jnp.abs(train1 - call(params, tokens, key=k2)).max()) > 1e-4
    base_model, base_params = nl.hf.without_lora(model, params)
    assert not base_model.uses_key
    hand = assert_lm_manual_grads_close(model, params, tokens, ops=ROUNDINGS_PER_LAYER * 4, key=k1)
    assert float(jnp.abs(hand.blocks[0].mlp.gate.lora_a).max()) > 0


# --- the trainer: a LoRA run's checkpoints hold the adapters; the base by path and hash -----
def _tokens_run(tmp_path):
    """A GPT-2 directory with its tokenizer (test_hf's) and the text prepared with it; a
    function that trains a LoRA run on it."""
    from test_hf import _tiny_hf_dir

    from train import prepare
    from train.config import config_from_dict
    from train.loop.trainer import train as train_run

    src = tmp_path / "gpt2"
    (tmp_path / "t.txt").write_text(_tiny_hf_dir(src))
    args = ["--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "tok")]
    assert prepare.main([*args, "--tokenizer", f"hf:{src}"]) == 0

    def run(name, steps, resume="fresh", lora=None, echo=lambda s: None):
        lora = lora or {"rank": 2, "alpha": 4, "targets": ["*/attn/qkv", "*/mlp/*"],
                        "dropout": 0.1}  # fmt: skip
        raw = {
            "name": name,
            "model": {"name": f"hf:{src}", "lora": lora},
            "data": {"name": "tokens", "path": str(tmp_path / "tok"), "context": 16,
                     "placement": "host", "eval_windows": 8},
            "optimizer": {"name": "adamw", "learning_rate": 0.01, "schedule": "constant"},
            "train": {"batch_size": 4, "steps": steps, "eval_every": 2, "log_every": 2},
            "checkpoint": {"every": 2},
            "parallel": {"strategy": "none"},
            "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
        }  # fmt: skip
        return train_run(config_from_dict(raw), resume=resume, echo=echo)

    return src, run


def test_lora_run_checkpoints_hold_adapters_and_refuse_a_changed_base(tf, tmp_path, capsys):
    from train import export, sample
    from train.errors import ConfigError
    from train.inference import load_run

    src, run = _tokens_run(tmp_path)
    lines = []
    whole = run("whole", 4, echo=lines.append)
    assert whole.model.uses_key  # lora.dropout: the step's key reaches the adapters
    assert whole.grad_mode == "manual"  # dropout keeps loss.grad: auto on the hand rules
    banner = next(s for s in lines if s.startswith("nnlite train:"))
    n_total = whole.params.num_params()
    n_ad = sum(v.size for k, v in whole.params.items() if k.rsplit("/", 1)[-1].startswith("lora_"))
    assert f"params: {n_ad:,} trainable of {n_total:,} ({100 * n_ad / n_total:.1f}%)" in banner
    run("resumed", 2)
    resumed = run("resumed", 4, resume="require")
    for (k, a), (_, b) in zip(whole.params.items(), resumed.params.items(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=k)  # exact resume, dropout and all

    ckpt = sorted((resumed.run_dir / "checkpoints").iterdir())[-1]
    keys = _header(ckpt)
    adapter = ("lora_a", "lora_b")
    assert all(k.split("/")[-1] in adapter for k in keys if k.startswith("params/"))
    # the optimizer state: the adapters' moments and scalars (Adam's count), nothing of the base
    opt = [k for k in keys if k.startswith("opt_state")]
    assert all(k.split("/")[-1] in adapter + ("count",) for k in opt) and len(opt) > 2
    assert {f"params{k}" for k, _ in resumed.params.items() if k.endswith(adapter)} <= set(keys)
    meta = nl.load_metadata(ckpt)
    assert meta["base_model"] == str(src) and len(meta["base_sha256"]) == 64
    # adapter-sized: the params, Adam's two moments of them, two counts
    ad_bytes = sum(v.nbytes for k, v in resumed.params.items() if k.endswith(adapter))
    assert _data_bytes(ckpt) == 3 * ad_bytes + 2 * 4 < _data_bytes(src / "model.safetensors") / 4

    loaded = load_run(resumed.run_dir)  # the base read again from its directory
    for (k, a), (_, b) in zip(loaded.params.items(), resumed.params.items(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=k)

    # the CLI's adapter export loads in peft with the run's logits; a run starts from it
    out = tmp_path / "adapter"
    assert export.main(["--run", str(resumed.run_dir), "--out", str(out), "--adapter"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = tf[2].PeftModel.from_pretrained(_torch_model(tf, src), out).eval()
    _assert_rel(_logits(tf, peft_model, TOKENS), jax.jit(loaded.model)(loaded.params, TOKENS))
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    again = run("from_peft", 2, lora={"path": str(out), "dropout": 0.0})
    assert not again.model.uses_key
    ref = resumed.params.to_flat()
    for k, v in again.params.items():  # two Adam steps of lr 0.01 from the adapter
        bound = 0.0 if not k.endswith(adapter) else 2 * 0.01 * 1.5
        assert float(jnp.abs(v - ref[k]).max()) <= bound, k
    assert export.main(["--run", str(again.run_dir), "--out", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "model.safetensors").is_file()  # merged, for transformers

    # the base changes: its last float moves
    weights = src / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-4:] = np.float32(np.frombuffer(bytes(blob[-4:]), np.float32)[0] + 1).tobytes()
    weights.write_bytes(bytes(blob))
    with pytest.raises(ConfigError, match="the base changed: restore the original base"):
        load_run(resumed.run_dir)
    capsys.readouterr()
    assert sample.main(["--run", str(resumed.run_dir), "--prompt", "the", "--tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "now hashes to" in err and len(err.splitlines()) == 1
    with pytest.raises(ConfigError, match="the base changed"):
        run("resumed", 6, resume="require")
