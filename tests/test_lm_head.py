"""The language-model head and loss in chunks (``nl.label_log_probs``): equal to the
log-softmax of all the logits, its hand rule equal to autodiff, the trainer's loss computed
through it, and a compiled step's temporaries smaller than with the full logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl


def _reference(h, w, labels, vocab_axis, cap):
    z = h @ (w if vocab_axis == -1 else w.T)
    if cap is not None:
        z = cap * jnp.tanh(z / cap)
    return jnp.take_along_axis(jax.nn.log_softmax(z), labels[..., None], -1)[..., 0]


@pytest.mark.parametrize("vocab_axis", [-1, 0])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_chunks_equal_the_full_logits_and_the_rule_equals_autodiff(vocab_axis, cap):
    """7 rows in chunks of 3 (the last one padded): values, the rule (checked against
    jax.vjp) and its use under jax.grad and nl.manual_grads."""
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (1, 7, 8))
    w = jax.random.normal(k[1], (8, 30) if vocab_axis == -1 else (30, 8))
    y = jax.random.randint(k[2], (1, 7), 0, 30)
    ct = jax.random.normal(k[3], (1, 7))
    ours = lambda h, w: nl.label_log_probs(h, w, y, vocab_axis=vocab_axis, chunk=3, softcap=cap)
    ref = lambda h, w: _reference(h, w, y, vocab_axis, cap)
    f, f_vjp = nl.rules.RULES["chunked_log_probs"]
    nl.rules.check_rule(f.f, f_vjp, h, w, y, vocab_axis, 3, cap)
    fn = lambda h, w: jnp.sum(ours(h, w) * ct)

    @jax.jit
    def run(h, w):
        want = jax.grad(lambda h, w: jnp.sum(ref(h, w) * ct), (0, 1))(h, w)
        got = jax.grad(fn, (0, 1))(h, w), jax.grad(nl.manual_grads(fn), (0, 1))(h, w)
        return ours(h, w), ref(h, w), want, got

    values, ref_values, want, both = run(h, w)
    np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-5)
    for got in both:
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_one_line():
    h, w = jnp.ones((2, 4)), jnp.ones((4, 10))
    with pytest.raises(ValueError, match=r"h \(2, 4\) does not fit the head w \(4, 10\)"):
        nl.label_log_probs(h, w, jnp.zeros(2, jnp.int32), vocab_axis=0)
    with pytest.raises(ValueError, match=r"expected integer labels of shape \(2,\)"):
        nl.label_log_probs(h, w, jnp.zeros(2))
    with pytest.raises(ValueError, match="chunk must be a positive int or None, got 0"):
        nl.label_log_probs(h, w, jnp.zeros(2, jnp.int32), chunk=0)


LM = "language_model"


def _models():
    from models.gpt import GPT

    llama = nl.hf.LlamaLM(vocab_size=50, context=8, n_layer=1, n_head=2, n_embd=8, hidden=8)
    tied = nl.hf.GPT2LM(vocab_size=50, context=8, n_layer=1, n_head=2, n_embd=8)
    capped = nl.hf.LlamaLM(
        vocab_size=50, context=8, n_layer=1, n_head=2, n_embd=8, hidden=8, logit_softcap=5.0
    )
    return [llama, tied, capped, GPT(vocab_size=50, context=8, n_layer=1, n_head=2, n_embd=8)]


@pytest.mark.parametrize("i", range(4))
def test_models_token_log_probs_equal_their_logits(i):
    """Each language model's token_log_probs is the log-softmax of its own logits at the
    labels; the trainer's objective (train/model/contract.py) uses it, with the loss of the
    logits' path."""
    from train.model.contract import objective_fn, task_objective

    model = _models()[i]
    params = jax.jit(model.init)(jax.random.key(1))
    x = jax.random.randint(jax.random.key(2), (2, 8), 0, 50)
    y = jnp.roll(x, -1, axis=1)

    @jax.jit  # one program: eager op-by-op dispatch is most of a small test's time
    def both(params):
        logits = model(params, x)
        want = jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)[..., 0]
        got = model.token_log_probs(params, x, y, chunk=5)
        losses = objective_fn(model)(params, x, y)[0], task_objective(LM, logits, y)[0]
        g_chunked = jax.grad(lambda p: objective_fn(model, "manual")(p, x, y)[0])(params)
        g_logits = jax.grad(lambda p: task_objective(LM, model(p, x), y)[0])(params)
        return got, want, losses, g_chunked, g_logits

    got, want, (loss, loss_logits), g_chunked, g_logits = both(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, loss_logits, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_logits), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_training_step_holds_one_chunk_of_logits_not_all():
    """XLA's own figure for the compiled gradient: the temporaries of the loss through
    token_log_probs (chunks of 64 tokens) are under a quarter of those through the [512, 4096]
    logits (8 MB in float32, and autodiff keeps several such)."""
    model = nl.hf.LlamaLM(vocab_size=4096, context=256, n_layer=1, n_head=2, n_embd=16, hidden=16)
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def temp_bytes(loss):
        grad = jax.jit(jax.grad(loss)).lower(params, x, x).compile()
        return grad.memory_analysis().temp_size_in_bytes

    logits = 2 * 256 * 4096 * 4
    full = temp_bytes(lambda p, x, y: nl.softmax_cross_entropy(model(p, x), y, reduction="mean"))
    chunked = temp_bytes(lambda p, x, y: -jnp.mean(model.token_log_probs(p, x, y, chunk=64)))
    assert full > logits, full
    assert chunked < full / 4, (chunked, full)


def test_the_precision_policy_casts_token_log_probs():
    """train.precision: bfloat16 runs token_log_probs as it runs the model: params and
    features in bfloat16, the log-probabilities and the gradients float32."""
    from train.step.precision import Policy

    model = _models()[0]
    params = jax.jit(model.init)(jax.random.key(1))
    x = jax.random.randint(jax.random.key(2), (2, 8), 0, 50)
    bf16 = Policy(model, "bfloat16")

    @jax.jit
    def run(params):
        loss = lambda p: -jnp.mean(bf16.token_log_probs(p, x, x))
        f32 = model.token_log_probs(params, x, x)
        return bf16.token_log_probs(params, x, x), f32, jax.grad(loss)(params)

    got, f32, grads = run(params)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, f32, rtol=0.05, atol=0.05)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("i", [0, 3])
def test_token_log_probs_runs_in_the_model_frame(i):
    """The layers the loss runs are those of the model's own call, by the same paths
    (backward policies and per-layer norms name them so), but for an untied head's
    Linear: the chunked head computes it."""
    from train.model.contract import objective_fn, task_objective
    from train.step.backward import discover

    model = _models()[i]
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    chunked = discover(objective_fn(model, "manual"), params, x, x).layers
    logits = discover(lambda p, x, y: task_objective(LM, model(p, x), y), params, x, x).layers
    assert [a.key for a in chunked] == [a.key for a in logits if a.key != "head"]
    assert "blocks[0].attn" in [a.key for a in chunked]
