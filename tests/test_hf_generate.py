"""``nl.hf.generate`` against ``transformers``' own ``generate``: stop ids, left-padded
batches of prompts of different lengths, the repetition penalty, prompt buckets that do
not recompile, and the streamed tokens; on tiny random models that transformers makes."""

import json
import warnings

import jax
import numpy as np
import pytest
import test_hf
from test_hf import _save

import nnlite as nl
from nnlite.hf import _generate

N = 12  # new tokens
tf = pytest.fixture(scope="module")(test_hf.tf.__wrapped__)  # transformers and torch


def _configs(transformers):
    return {
        "gpt2": transformers.GPT2Config(
            vocab_size=53, n_positions=48, n_embd=16, n_layer=1, n_head=2
        ),
        "llama": transformers.LlamaConfig(
            vocab_size=53, max_position_embeddings=48, hidden_size=16, intermediate_size=24,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        ),
    }  # fmt: skip


def _theirs(tf, model, prompt, mask=None, **kw):
    _, torch = tf
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = {} if mask is None else {"attention_mask": torch.tensor(np.asarray(mask))}
        return model.generate(
            torch.tensor(np.asarray(prompt)), max_new_tokens=N, do_sample=False, **extra, **kw
        ).numpy()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_batched_greedy_with_stop_and_penalty_equals_transformers(tf, tmp_path, arch):
    ref = _save(tf, _configs(tf[0])[arch], tmp_path)
    model, params = nl.hf.load_pretrained(tmp_path)
    rng = np.random.default_rng(3)
    rows = [rng.integers(1, 53, 3), rng.integers(1, 53, 9), rng.integers(1, 53, 6)]
    width = max(len(r) for r in rows)
    prompt = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for i, r in enumerate(rows):
        prompt[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    key = jax.random.key(0)

    def ours(**kw):
        out = model.generate(params, prompt, N, key, 0.0, attention_mask=mask, **kw)
        return np.asarray(out)

    # no stop, no penalty: the left-padded batch equals transformers' left-padded batch
    free = ours(stop_ids=())
    np.testing.assert_array_equal(free, _theirs(tf, ref, prompt, mask, pad_token_id=0))
    # a stop id the first row makes mid-way, and a repetition penalty: each row equals
    # transformers on that prompt alone (no padding), then the pad id to the end
    eos = int(free[0, width + 4])
    stopped = ours(stop_ids=[eos], repetition_penalty=1.5)
    alone = model.generate(  # nnlite on the shortest prompt alone: its row of the batch
        params, rows[0][None], N, key, 0.0, stop_ids=[eos], repetition_penalty=1.5
    )
    np.testing.assert_array_equal(np.asarray(alone)[0], stopped[0, width - len(rows[0]) :])
    for i, r in enumerate(rows):
        alone = _theirs(
            tf, ref, r[None], eos_token_id=eos, pad_token_id=eos, repetition_penalty=1.5
        )[0]
        made = stopped[i, width:]
        np.testing.assert_array_equal(made[: len(alone) - len(r)], alone[len(r) :])
        np.testing.assert_array_equal(made[len(alone) - len(r) :], eos)
        if i == 0:
            assert eos in alone[len(r) :] and len(alone) < len(r) + N  # it stopped early
    with pytest.raises(ValueError, match="row 0 of attention_mask is not left padding"):
        model.generate(params, prompt, N, key, attention_mask=mask[:, ::-1])


def test_prompt_lengths_share_a_program_and_stream_equals_generate(tmp_path):
    model = nl.hf.LlamaLM(vocab_size=40, context=64, n_layer=1, n_head=2, n_embd=8, hidden=16)
    params = jax.jit(model.init)(jax.random.key(0))
    key = jax.random.key(1)
    ids = np.random.default_rng(0).integers(0, 40, (1, 30))
    first = np.asarray(model.generate(params, ids[:, :9], 6, key, 0.7, top_k=5))
    programs = _generate._run._cache_size()
    for n in (10, 13, 16):  # the same bucket (16): nothing compiles
        out = model.generate(params, ids[:, :n], 6, key, 0.7, top_k=5)
        assert out.shape == (1, n + 6)
    assert _generate._run._cache_size() == programs
    model.generate(params, ids[:, :17], 6, key, 0.7, top_k=5)  # the next bucket (32)
    assert _generate._run._cache_size() == programs + 1
    # streamed: the same tokens, one step at a time, sampled (temperature 0.7, top-k)
    streamed = list(nl.hf.generate_stream(model, params, ids[:, :9], 6, key, 0.7, top_k=5))
    np.testing.assert_array_equal(np.stack(streamed, axis=1), first[:, 9:])
    assert nl.hf.bucket(9) == 16 and nl.hf.bucket(1) == nl.hf.MIN_BUCKET


def test_stop_ids_default_to_the_directory(tmp_path):
    """``Pretrained`` stops at its directory's eos ids (generation_config.json over
    config.json); ``stop_ids=()`` turns stopping off."""
    base = nl.hf.GPT2LM(vocab_size=30, context=32, n_layer=1, n_head=2, n_embd=8)
    weights = jax.jit(base.init)(jax.random.key(2))
    nl.hf.save_pretrained(tmp_path, base, weights)
    free = np.asarray(base.generate(weights, np.array([[1, 2, 3]]), 10, jax.random.key(0), 0.0))
    k = next(k for k in range(4, 13) if free[0, k] not in free[0, 3:k])  # a first time
    stop, other = int(free[0, k]), int(np.setdiff1d(np.arange(30), free)[0])
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 29}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [other, stop]}))
    assert nl.hf.stop_ids(tmp_path) == (other, stop)
    m = nl.hf.Pretrained(tmp_path)
    assert m.stop_ids == (other, stop)
    out = np.asarray(m.generate(weights, np.array([[1, 2, 3]]), 10, jax.random.key(0), 0.0))
    np.testing.assert_array_equal(out[0, : k + 1], free[0, : k + 1])
    np.testing.assert_array_equal(out[0, k + 1 :], other)  # the pad id: the first stop id
    again = m.generate(weights, np.array([[1, 2, 3]]), 10, jax.random.key(0), 0.0, stop_ids=())
    np.testing.assert_array_equal(again, free)


def test_sample_logits_traced_temperature_zero_is_argmax_without_the_draw():
    """A traced temperature: 0 gives each row's argmax and the program runs no draw (the
    random numbers sit in the branch not taken); > 0 gives jax.random.categorical's draw
    of the scaled logits, as before."""
    import jax.numpy as jnp

    logits = jax.random.normal(jax.random.key(0), (3, 50))
    key = jax.random.key(1)
    f = jax.jit(lambda t: nl.hf.sample_logits(logits, key, t))
    np.testing.assert_array_equal(f(jnp.float32(0)), jnp.argmax(logits, -1))
    want = jax.random.categorical(key, logits / 0.7, axis=-1)
    np.testing.assert_array_equal(f(jnp.float32(0.7)), want)
    eqns = jax.make_jaxpr(lambda t: nl.hf.sample_logits(logits, key, t))(0.0).jaxpr.eqns
    cond = [e for e in eqns if e.primitive.name == "cond"]
    branches = [str(b) for b in cond[0].params["branches"]]  # (false, true): (draw, argmax)
    assert "random_bits" in branches[0] and "random" not in branches[1]
    assert not any("random" in e.primitive.name for e in eqns)
