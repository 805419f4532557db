"""Pretrained models in and out (nl.hf), checked against Hugging Face ``transformers`` itself:
tiny random checkpoints made by transformers, nnlite's logits and greedy tokens equal to its,
exports that transformers reloads; the new layers' hand rules; LoRA; the refusals."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import assert_lm_manual_grads_close, byte_bpe, import_transformers
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32
from _tolerance import check_rule as check

import nnlite as nl
from nnlite.nn import _activations, _attention, _lora, _normalisation, _rotary, _swiglu

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def tf():
    """transformers and torch, imported with their import-time warnings silenced (the suite
    turns warnings into errors)."""
    reason = "transformers and torch are test-only extras: pip install 'nnlite[hf-test]'"
    transformers, torch = import_transformers(reason)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return transformers, torch


def _save(tf, cfg, path):
    """A random-weight checkpoint made and saved by transformers; the torch model back."""
    transformers, torch = tf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        # transformers' init leaves norms at 1 and biases at 0: perturb them so the test
        # sees a norm's scale or a bias landing in the wrong place
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(path)
    return model


def _torch_logits(tf, model, tokens):
    _, torch = tf
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _reload(tf, path):
    transformers, _ = tf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _configs(transformers):
    small = dict(vocab_size=97, max_position_embeddings=64)
    dims = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    # GPT-2 and the first Llama have 2 layers: the layer index in each of the two weight-name
    # tables (gpt2's, and the llama family's that every other arch here shares); the others'
    # differences (biases, tied heads, scalings, head_dim) are in every layer, so one is enough
    one = dict(dims, num_hidden_layers=1)
    return {
        "gpt2": transformers.GPT2Config(
            vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
            eos_token_id=0,
        ),
        # grouped-query attention (4 heads, 2 kv heads), llama3 rope scaling, untied head
        "llama-gqa-llama3": transformers.LlamaConfig(
            **small, **dims, num_attention_heads=4, num_key_value_heads=2,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        ),
        # SmolLM's shape (tied head) with multi-query attention, linear scaling, another
        # theta, and every bias Llama's config can switch on
        "llama-tied-linear-biases": transformers.LlamaConfig(
            **small, **one, num_attention_heads=4, num_key_value_heads=1,
            tie_word_embeddings=True, rope_theta=500.0, attention_bias=True, mlp_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        # Qwen2: q/k/v biases, tied head
        "qwen2": transformers.Qwen2Config(
            **small, **one, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        # Mistral with a sliding window shorter than the test's sequences, YaRN scaling,
        # head_dim != hidden / heads
        "mistral-yarn-window": transformers.MistralConfig(
            **small, **one, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=7,
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 16},
        ),
        # Gemma: (1 + w) RMSNorms, embeddings times sqrt(hidden), GeGLU, head_dim 16 != 32 / 4,
        # tied head
        "gemma": transformers.GemmaConfig(
            **small, **one, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        ),
        # Gemma 2: a sliding layer then a global one, soft caps low enough to bite (and
        # larger weights, so that the logits reach them), query_pre_attn_scalar != head_dim,
        # four norms a block, and the cache_implementation key Gemma 2's configs carry
        "gemma2": transformers.Gemma2Config(
            **small, **dims, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0, initializer_range=0.3, cache_implementation="hybrid",
        ),
        # Qwen3: q/k norms, head_dim 16; Qwen's sliding window from layer max_window_layers on
        "qwen3-window": transformers.Qwen3Config(
            **small, **dims, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            use_sliding_window=True, sliding_window=5, max_window_layers=1,
        ),
    }  # fmt: skip


ARCHS = [
    "gpt2", "llama-gqa-llama3", "llama-tied-linear-biases", "qwen2", "mistral-yarn-window",
    "gemma", "gemma2", "qwen3-window",
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tf, tmp_path_factory):
    """``checkpoint(arch)``: the arch's transformers-made checkpoint directory and its torch
    model, made once for the tests that read it."""
    made = {}

    def get(arch):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            made[arch] = path, _save(tf, _configs(tf[0])[arch], path)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_generation_and_export_equal_transformers(tf, checkpoint, tmp_path, arch):
    src, ref_model = checkpoint(arch)
    model, params = nl.hf.load_pretrained(src)
    tokens = np.random.default_rng(1).integers(0, 97, (2, 20))
    ops = ROUNDINGS_PER_LAYER * (model.n_layer + 2)
    forward = jax.jit(model)  # one compile for both weights (op by op compiles each op)
    assert_close_f32(
        forward(params, jnp.asarray(tokens)), _torch_logits(tf, ref_model, tokens), ops=ops
    )

    # greedy decoding with the key/value cache: the same 50 tokens as transformers.generate
    prompt = tokens[:, :5]
    ours = jax.jit(model.generate, static_argnums=2)(
        params, jnp.asarray(prompt), 50, jax.random.key(0), 0.0
    )
    _, torch = tf
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = ref_model.generate(
            torch.tensor(prompt), max_new_tokens=50, min_new_tokens=50, do_sample=False,
            pad_token_id=0,
        ).numpy()  # fmt: skip
    np.testing.assert_array_equal(np.asarray(ours), theirs)

    # a fine-tuned run (params moved) exported back: transformers reloads the same function
    # (jitted: one compile, not one per op and weight shape)
    # (on the host: no program to compile for it)
    moved = jax.device_put(jax.tree.map(lambda a: a + 0.01 * np.sign(a), jax.device_get(params)))
    nl.hf.save_pretrained(tmp_path / "out", model, moved, source=src)
    again = _reload(tf, tmp_path / "out")
    assert_close_f32(_torch_logits(tf, again, tokens), forward(moved, jnp.asarray(tokens)), ops=ops)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["eos_token_id"] == json.loads((src / "config.json").read_text()).get("eos_token_id")


def test_sharded_files_load_onto_a_mesh(tf, checkpoint, tmp_path):
    src, ref = checkpoint("llama-gqa-llama3")
    model, params = nl.hf.load_pretrained(src)
    files = nl.hf.save_pretrained(tmp_path / "sharded", model, params, max_shard_bytes=20_000)
    index = json.loads((files / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    mesh = jax.make_mesh((8,), ("d",), (jax.sharding.AxisType.Auto,))
    P = jax.sharding.PartitionSpec

    def place(path, shape):  # shard each matrix's last axis where it divides
        spec = P(*([None] * (len(shape) - 1)), "d") if shape[-1] % 8 == 0 else P()
        return jax.sharding.NamedSharding(mesh, spec)

    m2, p2 = nl.hf.load_pretrained(files, sharding=place)
    assert p2.blocks[0].attn.q.W.sharding.spec == P(None, "d")
    tokens = np.arange(12).reshape(1, 12)
    assert_close_f32(jax.jit(m2)(p2, tokens), _torch_logits(tf, ref, tokens), ops=32)
    assert _reload(tf, files) is not None  # transformers reads the sharded index too


def test_tokenizer_round_trips_and_exports(tf, tmp_path):
    pytest.importorskip("tokenizers", reason="pip install tokenizers")
    transformers, _ = tf
    text = "the quick brown fox jumps over the lazy dog. " * 20 + "héllo wörld 123"
    tok = byte_bpe(text, 97)
    src = tmp_path / "in"
    # GPT-2 with an untied head and another activation (the other GPT-2 variants)
    cfg = _configs(transformers)["gpt2"]
    cfg.tie_word_embeddings, cfg.activation_function = False, "relu"
    cfg.vocab_size = tok.get_vocab_size()  # the byte alphabet: 257 ids, all embedded
    ref = _save(tf, cfg, src)
    tok.save(str(src / "tokenizer.json"))
    model, params, hf_tok = nl.hf.from_pretrained(src)
    assert not model.tie_head and model.activation == "relu"
    ids = np.arange(9).reshape(1, 9)
    assert_close_f32(jax.jit(model)(params, ids), _torch_logits(tf, ref, ids), ops=32)
    assert hf_tok.eos_id == 0 and hf_tok.vocab_size == tok.get_vocab_size()
    for s in ["the lazy fox", "héllo wörld 123", "unseen: ∑ ü 🦊"]:
        ids = hf_tok.encode(s)
        assert ids.dtype == np.int32 and hf_tok.decode(ids) == s
    with pytest.raises(ValueError, match="id 500 is outside the vocabulary"):
        hf_tok.decode([1, 500])
    out = nl.hf.save_pretrained(tmp_path / "out", model, params, hf_tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert theirs.encode("the lazy fox") == hf_tok.encode("the lazy fox").tolist()


# --- the new layers' hand rules ------------------------------------------------------------
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_grouped_attention_rule(rand, kv):
    q, k, v = rand(2, 5, 4, 3), rand(2, 6, kv, 3), rand(2, 6, kv, 3)
    check(_attention.grouped_attention, q, k, v, None)
    check(_attention.grouped_attention, q, k, v, nl.nn._attention.causal_mask(5, 6)[None, None])


def test_rope_swiglu_lora_rules(rand):
    freq, factor = _rotary.rope_frequencies(
        6, 100.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    )
    assert factor > 1  # yarn scales cos and sin
    check(_rotary.rope, rand(2, 5, 3, 6), jnp.arange(5)[:, None], inv_freq=freq,
          attention_factor=factor)  # fmt: skip
    check(_swiglu.swiglu, rand(3, 7), rand(3, 7))
    check(_lora.lora_linear, rand(2, 3, 5), rand(5, 4), rand(4), rand(5, 2), rand(2, 4), scale=2.0)
    check(_lora.lora_linear, rand(3, 5), rand(5, 4), None, rand(5, 2), rand(2, 4), scale=0.5)


def test_gemma_and_qwen3_rules(rand):
    """The rules Gemma, Gemma 2 and Qwen3 added: the (1 + w) RMSNorm, GeGLU, soft capping,
    and grouped attention with another scale, capped logits and a sliding window."""
    check(_normalisation.rms_norm, rand(2, 5, 6), rand(6), eps=1e-6, offset=1.0)
    check(_swiglu.geglu, rand(3, 7), rand(3, 7))
    check(_activations.softcap, 3 * rand(3, 7), cap=2.0)  # well into tanh's bend
    q, k, v = 2 * rand(2, 7, 4, 3), 2 * rand(2, 7, 2, 3), rand(2, 7, 2, 3)
    window = nl.nn._attention.causal_mask(7, 7, window=3)[None, None]
    check(_attention.grouped_attention, q, k, v, window, scale=0.7, softcap=0.8)
    # a cached decode step's query at position 5 sees keys 3, 4, 5
    assert nl.nn._attention.causal_mask(1, 8, 5, window=3).tolist() == [[0, 0, 0, 1, 1, 1, 0, 0]]
    for name in ("geglu", "softcap"):
        f, f_vjp = nl.rules.RULES[name]
        assert f.f_vjp is f_vjp and f"{name}_vjp" in nl.rules.__all__


def test_manual_grads_equal_autodiff_through_gemma2_and_qwen3_options(key):
    """Every new option at once (GeGLU, (1 + w) norms, scaled embeddings, q/k norms, post
    norms, query_pre_attn_scalar, both soft caps, a sliding layer then a full one): the
    hand rules cover the model and give autodiff's gradients."""
    model = nl.hf.LlamaLM(
        vocab_size=31, context=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, hidden=24,
        head_dim=8, tie_head=True, activation="gelu", norm_offset=1.0, scale_embeddings=True,
        qk_norm=True, post_norms=True, query_pre_attn_scalar=12.0, attn_softcap=1.0,
        logit_softcap=2.0, sliding_window=3, layer_types=("sliding_attention", "full_attention"),
    )  # fmt: skip
    params = jax.device_get(jax.jit(model.init)(key))
    rng = np.random.default_rng(0)  # norms off zero, weights large enough for the caps to bite
    params = jax.device_put(jax.tree.map(lambda a: a + np.float32(0.3) * rng.standard_normal(
        a.shape, np.float32), params))  # fmt: skip
    tokens = jnp.asarray(rng.integers(0, 31, (2, 9)), jnp.int32)
    assert_lm_manual_grads_close(model, params, tokens, ops=ROUNDINGS_PER_LAYER * 6)


def test_manual_grads_equal_autodiff_through_a_llama_with_lora(key):
    model = nl.hf.LlamaLM(vocab_size=31, context=16, n_layer=1, n_head=4, n_kv_head=2,
                          n_embd=16, hidden=24, qkv_bias=True)  # fmt: skip
    params = jax.jit(model.init)(key)
    model, params = nl.hf.add_lora(model, params, ["*/attn/[qv]", "*/mlp/down"], key, rank=2)
    # move B off zero so every adapter's gradient is non-trivial (on the host: no program
    # compiled for each weight shape)
    params = jax.device_put(jax.tree.map(lambda a: a + np.float32(0.1), jax.device_get(params)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 31, (2, 9)), jnp.int32)
    assert_lm_manual_grads_close(model, params, tokens, ops=ROUNDINGS_PER_LAYER * 4)


# --- LoRA ----------------------------------------------------------------------------------
def test_lora_trains_only_adapters_and_merges(key):
    model = nl.hf.GPT2LM(vocab_size=23, context=16, n_layer=2, n_head=2, n_embd=8)
    params = jax.jit(model.init)(key)
    tokens = np.random.default_rng(0).integers(0, 23, (2, 8)).astype(np.int32)
    lmodel, lparams = nl.hf.add_lora(model, params, ["*/attn/qkv", "/blocks[[]1]/mlp/fc"], key)
    np.testing.assert_array_equal(jax.jit(lmodel)(lparams, tokens), jax.jit(model)(params, tokens))
    assert sorted(lmodel.lora_paths) == [
        "/blocks[0]/attn/qkv", "/blocks[1]/attn/qkv", "/blocks[1]/mlp/fc",
    ]  # fmt: skip
    adapters, frozen = nl.lora_split(lparams)
    assert sorted(adapters) == sorted(f"{p}/lora_{x}" for p in lmodel.lora_paths for x in "ab")

    def loss(ad):
        p = nl.lora_join(ad, frozen)
        return jnp.mean(lmodel(p, tokens) ** 2)

    grads = jax.jit(jax.grad(loss))(adapters)
    # (the checks and the update below on the host: no program compiled for each shape)
    grads = jax.device_get(grads)
    assert all(np.abs(g).max() > 0 for k, g in grads.items() if k.endswith("lora_b"))
    # the base weights get no gradient even when differentiated: frozen inside the layer
    full = jax.jit(jax.grad(lambda p: jnp.mean(lmodel(p, tokens) ** 2)))(lparams)
    assert np.abs(full.blocks[0].attn.qkv.W).max() == 0.0
    assert np.abs(full.blocks[1].attn.out.W).max() > 0  # not a target: trainable
    mask = nl.lora_mask(lparams)
    assert mask.blocks[0].attn.qkv.lora_a is True and mask.blocks[0].attn.qkv.W is False

    moved = jax.tree.map(lambda a, g: np.asarray(a) - np.float32(0.5) * g, adapters, grads)
    trained = nl.lora_join(jax.device_put(moved), frozen)
    merged_model, merged = nl.hf.merge_lora(lmodel, trained)
    assert not merged_model.lora_targets and "lora_a" not in merged.blocks[0].attn.qkv
    assert_close_f32(
        jax.jit(merged_model)(merged, tokens), jax.jit(lmodel)(trained, tokens), ops=16
    )


def test_lora_fine_tune_exports_to_transformers(tf, checkpoint, tmp_path, key):
    model, params, _ = nl.hf.from_pretrained(
        checkpoint("qwen2")[0], lora={"rank": 4, "alpha": 8, "targets": ["*/attn/*", "*/mlp/up"]}
    )
    adapters, frozen = nl.lora_split(params)
    adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # a "trained" adapter
    params = nl.lora_join(adapters, frozen)
    tokens = np.arange(14).reshape(1, 14) % 97
    nl.hf.save_pretrained(tmp_path / "out", model, params)
    again = _reload(tf, tmp_path / "out")
    assert_close_f32(_torch_logits(tf, again, tokens), jax.jit(model)(params, tokens), ops=40)


def test_lora_layer_and_bad_targets(key):
    with pytest.raises(TypeError, match="base must be an nl.Linear"):
        nl.LoRA(nl.Conv(2, 2, 3))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        nl.LoRA(nl.Linear(3, 4), rank=0)
    model = nl.hf.LlamaLM(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=8, hidden=8)
    with pytest.raises(ValueError, match=r"target '\*/attn/query' matches no linear layer"):
        model.with_lora(["*/attn/query"])
    with pytest.raises(ValueError, match="lora names 'w1', not a projection"):
        nl.SwiGLU(4, 8, lora=("w1",))
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        nl.GroupedQueryAttention(16, 4, 3)
    with pytest.raises(ValueError, match="features=2 must be a multiple of num_heads=4"):
        nl.GroupedQueryAttention(2, 4)
    with pytest.raises(ValueError, match="rope_scaling kind 'longrope' is not supported"):
        nl.LlamaBlock(8, 2, hidden=8, rope_scaling={"rope_type": "longrope", "factor": 2})
    attn = nl.GroupedQueryAttention(8, 2)
    with pytest.raises(ValueError, match=r"expected input with last axis 8 and rank >= 2, got"):
        attn(attn.init(key), jnp.ones((3, 5)))


# --- sampling -----------------------------------------------------------------------------
def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    keys = jax.random.split(jax.random.key(0), 300)

    def seen(**kw):  # 300 draws as one compiled program (op by op compiles every op)
        draw = jax.jit(jax.vmap(lambda k: nl.hf.sample_logits(logits, k, **kw)))
        return [set(np.asarray(d).tolist()) for d in draw(keys).T]

    assert seen(top_k=2) == [{0, 1}, {2, 3}]
    assert seen(top_p=0.7) == [{0, 1}, {2, 3}]
    assert seen(top_p=0.4) == [{0}, {3}]  # the most likely token is always kept
    assert seen(temperature=0) == [{0}, {3}]
    assert seen() == [{0, 1, 2, 3}, {0, 1, 2, 3}]
    with pytest.raises(ValueError, match="top_p must be a number in"):
        nl.hf.sample_logits(logits, keys[0], top_p=1.5)
    m = nl.hf.GPT2LM(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(ValueError, match=r"= 10 exceeds the model's context of 8"):
        # refused before the params are read: their shapes are enough (no init computed)
        m.generate(jax.eval_shape(m.init, keys[0]), jnp.zeros((1, 4), jnp.int32), 6, keys[0])


# --- what is refused ------------------------------------------------------------------------
def _dir(tmp_path, cfg):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


LLAMA = dict(
    model_type="llama", vocab_size=11, hidden_size=8, intermediate_size=8,
    num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32,
)  # fmt: skip


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"model_type": "bert"},
            "model_type 'bert' is not supported; supported: gpt2, llama, mistral, qwen2, qwen3, "
            "gemma, gemma2$",
        ),
        ({"sliding_window": 8}, "transformers' llama has no sliding-window attention"),
        (
            {"model_type": "qwen3", "layer_types": ["chunked_attention"]},
            "layer_types must list 1 of full_attention, sliding_attention",
        ),
        (
            {"model_type": "gemma2", "hidden_activation": "gelu"},
            "hidden_activation 'gelu' is not supported",
        ),
        (
            {"model_type": "gemma", "hidden_act": "gelu", "hidden_activation": "silu"},
            "hidden_activation 'silu' disagrees with hidden_act 'gelu_pytorch_tanh'",
        ),
        ({"model_type": "gemma", "use_bidirectional_attention": True}, "bidirectional attention"),
        ({"num_local_experts": 8}, "num_local_experts=8: mixture-of-experts layers"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"frobnicate": 3}, r"config key 'frobnicate' \(= 3\) .* ignore_keys=\['frobnicate'\]"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_configs_are_refused_by_name(tmp_path, extra, message):
    d = _dir(tmp_path, {**LLAMA, **extra})
    with pytest.raises(nl.hf.HFConfigError, match=message):
        nl.hf.load_pretrained(d)


def test_bad_directories(tmp_path):
    with pytest.raises(nl.hf.HFConfigError, match="no config.json"):
        nl.hf.load_pretrained(tmp_path)
    d = _dir(tmp_path, LLAMA)
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(nl.hf.HFConfigError, match="nnlite reads no pickle"):
        nl.hf.load_pretrained(d)
    model = nl.hf.build_model(d)
    params = jax.jit(model.init)(jax.random.key(0))
    nl.hf.save_pretrained(tmp_path / "x", model, params)
    # a tensor the config needs is missing from the file
    from nnlite.hf._safetensors import SafetensorsDir, write_safetensors

    w = SafetensorsDir(tmp_path / "x")
    tensors = {n: np.asarray(w.tensor(n)) for n in w.names() if "up_proj" not in n}
    write_safetensors(d, tensors)
    with pytest.raises(
        nl.hf.HFConfigError, match=r"'model.layers.0.mlp.up_proj.weight' .* missing"
    ):
        nl.hf.load_pretrained(d)


def test_export_refuses_what_its_model_type_cannot_describe():
    kw = dict(vocab_size=11, context=8, n_layer=2, n_head=2, n_embd=8, hidden=8)
    with pytest.raises(ValueError, match="a llama config describes qk_norm=False; this model"):
        nl.hf.hf_config(nl.hf.LlamaLM(**kw, qk_norm=True))
    with pytest.raises(ValueError, match="a qwen3 config describes norm_offset=0.0"):
        nl.hf.hf_config(nl.hf.LlamaLM(**kw, qk_norm=True, norm_offset=1.0, model_type="qwen3"))
    with pytest.raises(ValueError, match="model_type 'llama' has no sliding-window attention"):
        nl.hf.hf_config(nl.hf.LlamaLM(**kw, sliding_window=4))
    alternate = dict(sliding_window=4, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="a mistral config slides every layer or none"):
        nl.hf.hf_config(nl.hf.LlamaLM(**kw, **alternate, model_type="mistral"))
    cfg = nl.hf.hf_config(nl.hf.LlamaLM(**kw, **alternate, qk_norm=True, model_type="qwen3"))
    assert cfg["use_sliding_window"] and cfg["layer_types"] == list(alternate["layer_types"])
    with pytest.raises(ValueError, match="layer_types has 1 entries, n_layer=2"):
        nl.hf.LlamaLM(**kw, sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="layer_types has sliding_attention but sliding_window"):
        nl.hf.LlamaLM(**kw, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="activation 'relu' is not one of silu, gelu"):
        nl.hf.LlamaLM(**kw, activation="relu")


def test_importing_nnlite_pulls_no_new_dependency():
    import subprocess
    import sys

    code = (
        "import sys, nnlite; "
        "print(any(m in sys.modules for m in ('nnlite.hf', 'tokenizers', 'torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pretrained_model_for_a_trainer(tmp_path):
    """nl.hf.Pretrained: a model built from hyperparameters whose jitted init is the
    directory's weights (read by host callbacks, so eval_shape reads nothing)."""
    base = nl.hf.LlamaLM(vocab_size=40, context=16, n_layer=1, n_head=2, n_embd=8, hidden=8)
    weights = jax.jit(base.init)(jax.random.key(3))
    nl.hf.save_pretrained(tmp_path, base, weights)
    m = nl.hf.Pretrained(tmp_path, lora={"rank": 2, "targets": ["*/mlp/up"]}, vocab_size=30)
    assert hash(m) == hash(nl.hf.Pretrained(str(tmp_path), lora=dict(m.lora), vocab_size=30))
    shapes = jax.eval_shape(m.init, jax.random.key(0))
    assert shapes.blocks[0].mlp.up.lora_b.shape == (2, 8)
    p = jax.jit(m.init)(jax.random.key(0))
    np.testing.assert_array_equal(p.blocks[0].attn.k.W, weights.blocks[0].attn.k.W)
    np.testing.assert_array_equal(p.blocks[0].mlp.up.lora_b, 0)
    tokens = np.arange(6).reshape(1, 6)
    np.testing.assert_array_equal(jax.jit(m)(p, tokens), jax.jit(base)(weights, tokens))
    m.export(tmp_path / "out", p)
    m2, p2 = nl.hf.load_pretrained(tmp_path / "out")
    assert_close_f32(jax.jit(m2)(p2, tokens), jax.jit(base)(weights, tokens), ops=24)
    with pytest.raises(ValueError, match="vocab_size=50: the data's vocabulary must fit"):
        nl.hf.Pretrained(tmp_path, vocab_size=50)
    with pytest.raises(ValueError, match="lora: targets must be a non-empty list"):
        nl.hf.Pretrained(tmp_path, lora={"rank": 2, "targets": "*/mlp/up"})
    with pytest.raises(ValueError, match="lora: unknown key 'lora_dropout'"):
        nl.hf.Pretrained(tmp_path, lora={"lora_dropout": 0.1, "targets": ["*"]})


def test_pretrained_base_kept_in_bfloat16(tmp_path):
    """Pretrained(param_dtype="bfloat16"): the frozen base is stored in bfloat16 (half its
    bytes), the adapters in float32, and the model computes in float32 from the stored
    weights: its logits, the adapters' gradients (autodiff and the hand rules), greedy
    tokens and the merged export are the float32 model's on the same rounded weights."""
    base = nl.hf.LlamaLM(vocab_size=40, context=16, n_layer=2, n_head=2, n_embd=8, hidden=16)
    nl.hf.save_pretrained(tmp_path, base, jax.jit(base.init)(jax.random.key(3)))
    lora = {"rank": 2, "targets": ["*/attn/q", "*/mlp/up"]}
    m16 = nl.hf.Pretrained(tmp_path, lora=lora, param_dtype="bfloat16")
    m32 = nl.hf.Pretrained(tmp_path, lora=lora)
    adapters, frozen = nl.lora_split(jax.jit(m16.init)(jax.random.key(0)))
    assert {str(a.dtype) for a in frozen.values()} == {"bfloat16"}
    assert {str(a.dtype) for a in adapters.values()} == {"float32"}
    frozen32 = nl.lora_split(jax.jit(m32.init)(jax.random.key(0)))[1]
    assert 2 * sum(a.nbytes for a in frozen.values()) == sum(a.nbytes for a in frozen32.values())
    rounded = {k: v.astype(jnp.float32) for k, v in frozen.items()}
    p16, p32 = nl.lora_join(adapters, frozen), nl.lora_join(adapters, rounded)
    tokens = np.arange(12).reshape(2, 6) % 40
    assert_close_f32(jax.jit(m16)(p16, tokens), jax.jit(m32)(p32, tokens), ops=4)

    def loss(m, manual):
        def f(a, fr):
            return -m.token_log_probs(nl.lora_join(a, fr), tokens[:, :-1], tokens[:, 1:]).mean()

        return nl.manual_grads(f) if manual else f

    for manual in (False, True):
        g16 = jax.jit(jax.grad(loss(m16, manual)))(adapters, frozen)
        g32 = jax.jit(jax.grad(loss(m32, manual)))(adapters, rounded)
        for k in g16:
            assert_close_f32(g16[k], g32[k], ops=8)
    greedy = [m.generate(p, tokens[:1], 4, jax.random.key(0), temperature=0)
              for m, p in ((m16, p16), (m32, p32))]  # fmt: skip
    np.testing.assert_array_equal(*greedy)
    m2, p2 = nl.hf.load_pretrained(m16.export(tmp_path / "out", p16))
    assert_close_f32(jax.jit(m2)(p2, tokens), jax.jit(m32)(p32, tokens), ops=24)
    with pytest.raises(ValueError, match="param_dtype='bfloat16' keeps the frozen base of a "
                       "LoRA run in that dtype, but this model has no lora"):  # fmt: skip
        nl.hf.Pretrained(tmp_path, param_dtype="bfloat16")
    with pytest.raises(ValueError, match="param_dtype='int8': expected one of float32, bf"):
        nl.hf.Pretrained(tmp_path, lora=lora, param_dtype="int8")


# --- the trainer: model.name "hf:DIR", model.lora, prepare --tokenizer hf:DIR, sampling ---
def _tiny_hf_dir(d):
    """A GPT-2 directory made by nnlite itself, with a BPE tokenizer.json (no transformers
    needed): what a downloaded model directory holds."""
    pytest.importorskip("tokenizers", reason="pip install tokenizers")
    text = " ".join(np.random.default_rng(0).choice(["the", "king", "shall", "love", "o"], 3000))
    tok = byte_bpe(text, 280)
    vocab = tok.get_vocab_size()
    model = nl.hf.GPT2LM(vocab_size=vocab + 3, context=32, n_layer=1, n_head=2, n_embd=16)
    nl.hf.save_pretrained(d, model, jax.jit(model.init)(jax.random.key(0)))
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 0, "bos_token_id": 0}))
    return text


def test_trainer_fine_tunes_a_pretrained_directory_with_lora(tmp_path, capsys):
    """The CLI's path end to end: prepare --tokenizer hf:DIR, model.name "hf:DIR" with
    model.lora (loss.grad auto -> the hand rules), resume, fsdp + tensor equal to one
    device, sampling with the directory's tokenizer, export back."""
    from _tolerance import assert_same_trajectory

    from train import prepare, sample
    from train.config import config_from_dict
    from train.inference import load_run
    from train.loop.trainer import train as train_run

    src = tmp_path / "gpt2"
    text = _tiny_hf_dir(src)
    (tmp_path / "t.txt").write_text(text)
    args = ["--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "tok")]
    assert prepare.main([*args, "--tokenizer", f"hf:{src}"]) == 0
    bad = ["--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "x")]
    assert prepare.main([*bad, "--tokenizer", f"hf:{tmp_path}/nope"]) == 2
    assert "nope: no tokenizer.json" in capsys.readouterr().err

    def run(name, steps, resume="fresh", **parallel):
        raw = {
            "name": name,
            "model": {"name": f"hf:{src}",
                      "lora": {"rank": 2, "alpha": 4, "targets": ["*/attn/qkv", "*/mlp/fc"]}},
            "data": {"name": "tokens", "path": str(tmp_path / "tok"), "context": 16,
                     "placement": "host", "eval_windows": 16},
            "optimizer": {"name": "adamw", "learning_rate": 0.01, "weight_decay": 0.1,
                          "schedule": "constant", "clip_norm": None},
            "train": {"batch_size": 8, "steps": steps, "eval_every": 2, "log_every": 2},
            "checkpoint": {"every": 2},
            "parallel": {"strategy": "none", **parallel},
            "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
        }  # fmt: skip
        return train_run(config_from_dict(raw), resume=resume, echo=lambda s: None)

    r = run("lora", 2)
    assert r.grad_mode == "manual"  # loss.grad: auto covers every layer with hand rules
    r = run("lora", 4, resume="require")  # resumed from step 2
    base = nl.hf.load_pretrained(src)[1]
    # the base weights are frozen (weight decay too), the adapters moved
    np.testing.assert_array_equal(r.params.blocks[0].attn.qkv.W, base.blocks[0].attn.qkv.W)
    np.testing.assert_array_equal(r.params.wte.W, base.wte.W)
    assert float(jnp.abs(r.params.blocks[0].mlp.fc.lora_b).max()) > 0
    run("fsdp", 2, strategy="fsdp", tensor=2)  # resumed onto the mesh: the base re-read there
    sharded = run("fsdp", 4, resume="require", strategy="fsdp", tensor=2)
    assert_same_trajectory(sharded.params, r.params, lr=0.01)

    loaded = load_run(r.run_dir)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the king")) == "the king"
    capsys.readouterr()
    argv = ["--run", str(r.run_dir), "--prompt", "the king", "--tokens", "6"]
    assert sample.main([*argv, "--top-p", "0.9", "--temperature", "1"]) == 0
    assert capsys.readouterr().out.startswith("the king")
    assert sample.main([*argv[:-1], "40"]) == 2
    assert "exceeds the model's 32 positions; ask for at most" in capsys.readouterr().err

    out = loaded.model.export(tmp_path / "out", loaded.params)
    m2, p2 = nl.hf.load_pretrained(out)
    tokens = np.arange(10).reshape(1, 10)
    assert_close_f32(jax.jit(m2)(p2, tokens), jax.jit(loaded.model)(loaded.params, tokens), ops=24)


def test_trainer_keeps_a_lora_base_in_bfloat16(tmp_path, capsys):
    """model.param_dtype: bfloat16 with model.lora: the run's base is stored in bfloat16 and
    stays what the directory holds (rounded), the adapters train in float32, the run
    resumes (the base read again in bfloat16) and samples; without lora, exit 2."""
    import yaml

    from train import prepare, sample
    from train.__main__ import main
    from train.config import config_from_dict
    from train.inference import load_run
    from train.loop.trainer import train as train_run

    src = tmp_path / "gpt2"
    (tmp_path / "t.txt").write_text(_tiny_hf_dir(src))
    args = ["--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "tok")]
    assert prepare.main([*args, "--tokenizer", f"hf:{src}"]) == 0
    raw = {
        "name": "bf16base",
        "model": {"name": f"hf:{src}", "param_dtype": "bfloat16",
                  "lora": {"rank": 2, "alpha": 4, "targets": ["*/attn/qkv"]}},
        "data": {"name": "tokens", "path": str(tmp_path / "tok"), "context": 16,
                 "eval_windows": 4},
        "optimizer": {"name": "adamw", "learning_rate": 0.01, "weight_decay": 0.1},
        "train": {"batch_size": 4, "steps": 2, "eval_every": 2, "log_every": 2},
        "checkpoint": {"every": 2},
        "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
    }  # fmt: skip
    train_run(config_from_dict(raw), resume="fresh", echo=lambda s: None)
    raw["train"]["steps"] = 4
    r = train_run(config_from_dict(raw), resume="require", echo=lambda s: None)
    assert r.step == 4 and r.grad_mode == "manual"
    trained = r.params.to_flat()
    for path, w in nl.hf.load_pretrained(src)[1].to_flat().items():
        got = trained[path]
        assert got.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(got, w.astype(jnp.bfloat16))
    assert r.params.blocks[0].attn.qkv.lora_b.dtype == jnp.float32
    assert float(jnp.abs(r.params.blocks[0].attn.qkv.lora_b).max()) > 0
    assert load_run(r.run_dir).params.wte.W.dtype == jnp.bfloat16
    capsys.readouterr()
    assert sample.main(["--run", str(r.run_dir), "--prompt", "the king", "--tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("the king")

    del raw["model"]["lora"]
    raw["name"] = "full"
    (tmp_path / "full.yaml").write_text(yaml.safe_dump(raw))
    assert main(["--config", str(tmp_path / "full.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "param_dtype='bfloat16' keeps the frozen base" in err
    assert not (tmp_path / "runs" / "full").exists()


def test_trainer_fine_tunes_a_gemma2_directory(tf, checkpoint, tmp_path):
    """model.name "hf:DIR" on a transformers-made Gemma 2 (windows shorter than the training
    context, soft caps, four norms a block): loss.grad auto resolves to the hand rules and
    one full fine-tuning step moves every weight."""
    from train import prepare
    from train.config import config_from_dict
    from train.loop.trainer import train as train_run

    src = checkpoint("gemma2")[0]
    text = " ".join(np.random.default_rng(0).choice(["abc", "de", "fgh", "ij"], 400))
    (tmp_path / "t.txt").write_text(text)
    assert prepare.main(["--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "tok")]) == 0
    raw = {
        "name": "gemma2",
        "model": {"name": f"hf:{src}"},
        "data": {"name": "tokens", "path": str(tmp_path / "tok"), "context": 16,
                 "placement": "host", "eval_windows": 4},
        "optimizer": {"name": "adam", "learning_rate": 0.01, "schedule": "constant",
                      "clip_norm": None},
        "train": {"batch_size": 4, "steps": 1, "eval_every": 1, "log_every": 1},
        "parallel": {"strategy": "none"},
        "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
    }  # fmt: skip
    r = train_run(config_from_dict(raw), resume="fresh", echo=lambda s: None)
    assert r.grad_mode == "manual" and r.step == 1
    base = nl.hf.load_pretrained(src)[1]
    for (path, new), (_, old) in zip(r.params.items(), base.items(), strict=True):
        assert np.isfinite(new).all() and not np.array_equal(new, old), path
