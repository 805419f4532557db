"""Embedding and Dropout: values, transforms, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl
from nnlite import Dropout, Embedding


def test_embedding_looks_up_rows_and_attends():
    emb = Embedding(7, 3)
    W = np.random.default_rng(0).standard_normal((7, 3)).astype(np.float32)
    p = nl.ParamsDict(W=W)
    ids = np.array([[0, 6, 2], [3, 3, 1]], np.int32)

    @jax.jit
    def run(p, ids):
        h = emb(p, ids)
        return h, emb(p, ids[0]), emb.attend(p, h), emb.as_logits(p, h[0])

    h, single, logits, logits0 = run(p, ids)
    np.testing.assert_array_equal(h, W[ids])
    np.testing.assert_array_equal(single, W[ids[0]])
    np.testing.assert_allclose(logits, W[ids] @ W.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits0, logits[0], rtol=1e-6)
    # Gradients scatter-add into the rows that were used (row 3 twice).
    g = jax.grad(lambda p: jnp.sum(emb(p, ids)))(p)
    np.testing.assert_array_equal(g.W[:, 0], [1, 1, 1, 2, 0, 0, 1])
    # Traced out-of-range ids give NaN rows, never a silently clamped one.
    assert bool(jnp.isnan(jax.jit(emb)(p, np.array([7]))).all())


def test_embedding_init_dtypes_and_bf16(key):
    @jax.jit
    def inits(key):
        return Embedding(500, 64).init(key), Embedding(500, 64, w_init="normal_0.02").init(key)

    p, q = inits(key)
    assert float(jnp.std(p.W)) == pytest.approx(1.0, rel=0.05)  # N(0, 1), as Equinox
    assert float(jnp.std(q.W)) == pytest.approx(0.02, rel=0.05)
    lo = Embedding(500, 64, dtype="bfloat16")
    h = lo(p, jnp.array([1, 2]))
    assert h.dtype == jnp.bfloat16 and lo.attend(p, h).dtype == jnp.bfloat16
    assert Embedding(5, 2, param_dtype="bfloat16").init(key).W.dtype == jnp.bfloat16


def test_embedding_errors(key):
    emb = Embedding(5, 2)
    p = nl.ParamsDict(W=jnp.zeros((5, 2)))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Embedding(num_embeddings=5, features=2): expected integer ids, got dtype float32 (shape (3,))"
        ),
    ):
        emb(p, jnp.ones(3))
    with pytest.raises(
        ValueError, match=re.escape("ids must lie in [0, 5), got values from -1 to 5")
    ):
        emb(p, np.array([-1, 5]))
    with pytest.raises(
        ValueError, match=re.escape("Embedding(5, 2): params /W has shape (6, 2), expected (5, 2)")
    ):
        emb(nl.ParamsDict(W=jnp.zeros((6, 2))), np.array([1]))
    with pytest.raises(
        ValueError, match=re.escape("expected input with last axis 2, got shape (3,)")
    ):
        emb.attend(p, jnp.ones(3))
    with pytest.raises(ValueError, match="Embedding: num_embeddings must be a positive int, got 0"):
        Embedding(0, 2)
    with pytest.raises(ValueError, match="unknown initializer 'gaussian'"):
        Embedding(3, 2, w_init="gaussian")


def test_dropout_identity_mean_and_determinism():
    x = jnp.ones((200, 100))
    drop = Dropout(0.3)
    assert drop(nl.ParamsDict(), x) is x  # no key: inference
    k = jax.random.key(1)
    run = jax.jit(lambda x, k: drop(nl.ParamsDict(), x, key=k))
    y = run(x, k)
    np.testing.assert_allclose(np.unique(np.asarray(y)), [0.0, 1 / 0.7], rtol=1e-6)
    assert float((y == 0).mean()) == pytest.approx(0.3, abs=0.02)
    assert float(y.mean()) == pytest.approx(1.0, abs=0.03)  # inverted dropout keeps the mean
    np.testing.assert_array_equal(run(x, k), y)  # same key, same mask
    assert not np.array_equal(run(x, jax.random.key(2)), y)
    np.testing.assert_array_equal(Dropout(0.0)(nl.ParamsDict(), x, key=k), x)
    assert Dropout(0.5).init(k) == nl.ParamsDict()
    # Grad, vmap, bf16: masks keep the dtype; the gradient is the mask / (1 - rate).
    g = jax.grad(lambda x: jnp.sum(drop(nl.ParamsDict(), x, key=k)))(x)
    np.testing.assert_allclose(g, y, rtol=1e-6)
    rows = jax.vmap(lambda x, k: drop(nl.ParamsDict(), x, key=k))(x[:3], jax.random.split(k, 3))
    assert rows.shape == (3, 100)
    assert drop(nl.ParamsDict(), x.astype(jnp.bfloat16), key=k).dtype == jnp.bfloat16


@pytest.mark.parametrize("rate", [1.0, -0.1, float("nan"), "0.1", True])
def test_dropout_rate_is_validated(rate):
    with pytest.raises(
        ValueError, match=re.escape(f"Dropout: rate must be a float in [0, 1), got {rate!r}")
    ):
        Dropout(rate)


def test_concrete_ids_closed_over_by_a_jit_are_checked_not_traced():
    emb = nl.Embedding(10, 4)
    p = emb.init(jax.random.key(0))
    ids = jnp.array([[1, 2, 3]])
    assert jax.jit(lambda p: emb(p, ids))(p).shape == (1, 3, 4)
    bad = jnp.array([[1, 12]])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\), got values from 1 to 12"):
        jax.jit(lambda p: emb(p, bad))(p)


def test_bf16_table_gradient_sums_in_float32():
    # 1000 positions look up row 0: summed in bfloat16 the row's gradient would stop at 256
    # (and on a GPU contend in a 16-bit compare-and-swap loop); both rules sum in float32.
    W = jnp.zeros((3, 4), jnp.bfloat16)
    ids, d = jnp.zeros(1000, jnp.int32), jnp.ones((1000, 4), jnp.bfloat16)
    hand = nl.nn._embedding.embed_vjp(W, ids, d)[0]
    auto = jax.vjp(lambda W: nl.nn._embedding.embed(W, ids), W)[1](d)[0]
    for g in (hand, auto):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32)[:, 0], [1000, 0, 0])
