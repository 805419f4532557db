"""Losses: golden values from hand arithmetic, stability, shapes and reductions, errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl


def _lse(*zs):
    return math.log(sum(math.exp(z) for z in zs))


# -- golden numbers -------------------------------------------------------------------------
def test_softmax_cross_entropy_golden():
    logits = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [2.0, -1.0, 0.5]])
    labels = jnp.array([2, 1, 1])
    expected = [_lse(1, 2, 3) - 3, math.log(3), _lse(2, -1, 0.5) + 1]
    np.testing.assert_allclose(nl.softmax_cross_entropy(logits, labels), expected, rtol=1e-6)


def test_nll_golden():
    probs = [[0.2, 0.5, 0.3], [0.9, 0.05, 0.05]]
    out = nl.nll(jnp.log(jnp.array(probs)), jnp.array([1, 0]))
    np.testing.assert_allclose(out, [-math.log(0.5), -math.log(0.9)], rtol=1e-6)


def test_nll_of_log_softmax_is_cross_entropy():
    logits = jnp.array([[0.3, -1.2, 2.0, 0.0]])
    labels = jnp.array([3])
    np.testing.assert_allclose(
        nl.nll(jax.nn.log_softmax(logits), labels),
        [_lse(0.3, -1.2, 2.0, 0.0) - 0.0],
        rtol=1e-6,
    )


def test_mse_golden():
    preds = jnp.array([[1.0, 2.0], [3.0, 5.0]])
    targets = jnp.array([[0.0, 0.0], [3.0, 3.0]])
    per_example = [(1**2 + 2**2) / 2, (0**2 + 2**2) / 2]
    np.testing.assert_allclose(nl.mse(preds, targets), per_example)
    np.testing.assert_allclose(nl.mse(preds, targets, reduction="mean"), sum(per_example) / 2)
    np.testing.assert_allclose(nl.mse(preds, targets, reduction="sum"), sum(per_example))
    # [batch] inputs: one value per example.
    np.testing.assert_allclose(nl.mse(jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0])), [1.0, 4.0])
    # [batch, ...]: the mean over every non-batch axis.
    x = jnp.arange(12.0).reshape(2, 3, 2)
    np.testing.assert_allclose(
        nl.mse(x, jnp.zeros_like(x)),
        [sum(i * i for i in range(6)) / 6, sum(i * i for i in range(6, 12)) / 6],
    )


def test_softmax_cross_entropy_gradient_is_softmax_minus_onehot():
    z = [0.5, -1.0, 2.0]
    logits = jnp.array([z])
    g = jax.grad(lambda z: nl.softmax_cross_entropy(z, jnp.array([0]), reduction="sum"))(logits)
    total = sum(math.exp(v) for v in z)
    expected = [math.exp(v) / total - (i == 0) for i, v in enumerate(z)]
    np.testing.assert_allclose(g[0], expected, rtol=1e-5, atol=1e-7)


# -- numerical stability --------------------------------------------------------------------
def test_softmax_cross_entropy_is_exact_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4]] * 3 + [[1e4, 1e4 - 1.0, -1e4]], np.float32)
    labels = np.array([0, 1, 2, 1], np.int32)
    # log(sum exp(z)) - z[label] with max 1e4 factored out: e^-1e4 underflows to exactly 0.
    expected = [0.0, 1e4, 2e4, math.log(1 + math.exp(-1.0)) + 1.0]
    sce = jax.jit(nl.softmax_cross_entropy)  # one compile for the shapes below (eager: many)
    out = sce(logits, labels)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(out[:3], expected[:3])
    np.testing.assert_allclose(out[3], expected[3], rtol=1e-6)
    np.testing.assert_array_equal(sce(-logits, labels)[:3], [2e4, 1e4, 0.0])
    both_max = np.array([[1e4, 1e4, -1e4]] * 4, np.float32)
    np.testing.assert_allclose(sce(both_max, labels)[0], math.log(2), rtol=1e-6)
    g = jax.jit(jax.grad(lambda z: nl.softmax_cross_entropy(z, labels, reduction="sum")))(logits)
    # softmax(z) is exactly one-hot on the max here, so the gradient is onehot(0) - onehot(y).
    np.testing.assert_array_equal(g[:3], [[0, 0, 0], [1, -1, 0], [1, 0, -1]])
    assert bool(jnp.all(jnp.isfinite(g)))


# -- shapes and reductions ------------------------------------------------------------------
LOSSES = {
    "softmax_cross_entropy": (nl.softmax_cross_entropy, "labels"),
    "nll": (nl.nll, "labels"),
    "mse": (nl.mse, "targets"),
}


def _inputs(kind, batch, rng):
    scores = rng.standard_normal((*batch, 4)).astype(np.float32)
    if kind == "labels":
        return scores, rng.integers(0, 4, batch).astype(np.int32)
    return scores, rng.standard_normal((*batch, 4)).astype(np.float32)


@pytest.mark.parametrize("batch", [(5,), (2, 3)])
@pytest.mark.parametrize("name", list(LOSSES))
def test_per_example_shape_and_reductions(name, batch):
    fn, kind = LOSSES[name]
    a, b = _inputs(kind, batch, np.random.default_rng(0))
    per_example = fn(a, b)  # the default reduction is "none"
    # mse reduces every axis after the first; the class losses only the class axis.
    assert per_example.shape == (batch[:1] if name == "mse" else batch)
    np.testing.assert_allclose(fn(a, b, reduction="none"), per_example)
    np.testing.assert_allclose(fn(a, b, reduction="mean"), np.mean(per_example), rtol=1e-6)
    np.testing.assert_allclose(fn(a, b, reduction="sum"), np.sum(per_example), rtol=1e-6)
    assert fn(a, b, reduction="mean").shape == ()
    jitted = jax.jit(fn, static_argnames="reduction")
    np.testing.assert_allclose(jitted(a, b, reduction="sum"), np.sum(per_example), rtol=1e-6)


def test_vmap_over_examples_matches_batch():
    rng = np.random.default_rng(1)
    logits, labels = _inputs("labels", (6,), rng)
    single = jax.vmap(nl.softmax_cross_entropy)(logits, labels)
    np.testing.assert_allclose(single, nl.softmax_cross_entropy(logits, labels), rtol=1e-6)


def test_softmax_cross_entropy_of_an_out_of_range_label_is_nan():
    logits = jnp.array([[1.0, 2.0, 3.0]] * 3)
    out = nl.softmax_cross_entropy(logits, jnp.array([3, -1, 0]))
    assert np.isnan(out[0]) and np.isnan(out[1])
    np.testing.assert_allclose(out[2], _lse(1, 2, 3) - 1, rtol=1e-6)


# -- accuracy -------------------------------------------------------------------------------
def test_accuracy_equals_argmax_including_ties():
    rng = np.random.default_rng(3)
    # Small integers make ties common; argmax gives the first index of the maximum.
    scores = rng.integers(0, 3, size=(500, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=500).astype(np.int32)
    expected = (np.argmax(scores, axis=-1) == labels).astype(np.float32)
    np.testing.assert_array_equal(nl.accuracy(scores, labels), expected)
    assert float(nl.accuracy(scores, labels, reduction="mean")) == pytest.approx(expected.mean())
    batched = nl.accuracy(scores.reshape(50, 10, 4), labels.reshape(50, 10))
    np.testing.assert_array_equal(batched, expected.reshape(50, 10))


def test_accuracy_golden_and_nan_rows_count_as_wrong():
    scores = jnp.array([[0.1, 0.9], [2.0, 2.0], [2.0, 2.0], [jnp.nan, 1.0]])
    out = nl.accuracy(scores, jnp.array([1, 0, 1, 1]))
    np.testing.assert_array_equal(out, [1.0, 1.0, 0.0, 0.0])
    assert out.dtype == jnp.float32
    grads = jax.grad(lambda s: nl.accuracy(s, jnp.array([1, 0, 1, 1]), reduction="sum"))(scores)
    np.testing.assert_array_equal(grads, np.zeros((4, 2)))  # a metric: no gradient


def test_accuracy_errors_are_explained():
    with pytest.raises(ValueError, match=re.escape("accuracy: expected labels of shape (3,)")):
        nl.accuracy(jnp.zeros((3, 4)), jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="accuracy: labels must be integers"):
        nl.accuracy(jnp.zeros((3, 4)), jnp.zeros(3))


# -- errors ---------------------------------------------------------------------------------
def test_bad_label_shape_is_explained():
    msg = "softmax_cross_entropy: expected labels of shape (3,) (scores shape (3, 4) minus the "
    with pytest.raises(ValueError, match=re.escape(msg) + r".*got \(3, 1\)"):
        nl.softmax_cross_entropy(jnp.zeros((3, 4)), jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=re.escape("nll: expected labels of shape (2, 5)")):
        nl.nll(jnp.zeros((2, 5, 3)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="expected scores with a class axis, got shape"):
        nl.nll(jnp.zeros(()), jnp.zeros((), jnp.int32))


def test_bad_label_dtype_is_explained():
    with pytest.raises(TypeError, match="labels must be integers .*got dtype float32"):
        nl.softmax_cross_entropy(jnp.zeros((3, 4)), jnp.zeros(3, jnp.float32))
    with pytest.raises(TypeError, match="nll: labels must be integers .*got dtype bool"):
        nl.nll(jnp.zeros((3, 4)), jnp.zeros(3, bool))


def test_mse_shape_mismatch_and_unknown_reduction():
    with pytest.raises(
        ValueError, match=re.escape("predictions shape (2, 3) != targets shape (2,)")
    ):
        nl.mse(jnp.zeros((2, 3)), jnp.zeros(2))
    with pytest.raises(ValueError, match="unknown reduction 'avg'; valid: none, mean, sum"):
        nl.softmax_cross_entropy(jnp.zeros((1, 2)), jnp.zeros(1, jnp.int32), reduction="avg")
