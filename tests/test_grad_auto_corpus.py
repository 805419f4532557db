"""``loss.grad: auto`` on models written in ordinary JAX: each is covered by rules
(``nl.check_manual``, what ``auto`` asks, raises nothing: it resolves to manual), and its
manual gradient equals ``jax.grad``'s. Also the per-layer rule check, ``nl.check_rules``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nnlite as nl


def _raw_math(p, x, y):
    """Raw sin, exp, where, max and a hand-written lax.scan over the features."""
    h = jnp.sin(x @ p["W1"]) + jnp.exp(-jnp.square(x @ p["W1"]))
    h = jnp.where(h > 0.2, h, 0.05 * h)
    h = h - jnp.max(h, axis=-1, keepdims=True)

    def step(c, col):  # a running gated sum across the feature axis
        c = jnp.tanh(c * p["a"] + col)
        return c, c * c

    c, seq = lax.scan(step, jnp.zeros(h.shape[0]), h.T)
    logits = (h + seq.T) @ p["W2"] + c[:, None]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), -1))


def _raw_params(key):
    k = jax.random.split(key, 2)
    return {
        "W1": jax.random.normal(k[0], (5, 8)) / 2,
        "W2": jax.random.normal(k[1], (8, 3)) / 3,
        "a": jnp.array(0.7),
    }


def _vae(p, x, y, key):
    """A small VAE: encoder, the reparameterisation with a random key, decoder, a
    Bernoulli likelihood (softplus) and the Gaussian KL term."""
    h = jax.nn.gelu(x @ p["enc"]["W"] + p["enc"]["b"][None])
    mu, logvar = h @ p["mu"], jnp.clip(h @ p["logvar"], -5.0, 5.0)
    eps = jax.random.normal(key, mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps
    logits = jax.nn.relu(z @ p["dec1"]) @ p["dec2"]
    target = (x > 0).astype(jnp.float32)
    nll = jnp.sum(jax.nn.softplus(logits) - target * logits, -1)
    kl = -0.5 * jnp.sum(1 + logvar - mu**2 - jnp.exp(logvar), -1)
    return jnp.mean(nll + kl)


def _vae_params(key):
    k = jax.random.split(key, 5)
    n = jax.random.normal
    return {
        "enc": {"W": n(k[0], (5, 8)) / 2, "b": jnp.zeros(8)},
        "mu": n(k[1], (8, 2)) / 3,
        "logvar": n(k[2], (8, 2)) / 3,
        "dec1": n(k[3], (2, 8)),
        "dec2": n(k[4], (8, 5)) / 3,
    }


def _rnn(p, x, y):
    """An Elman RNN over a sequence, written with lax.scan, classifying the last state."""
    seq = jnp.stack([x, jnp.roll(x, 1, -1), x * x], axis=0)  # [T, B, 5]

    def cell(h, xt):
        h = jnp.tanh(xt @ p["Wx"] + h @ p["Wh"] + p["b"][None])
        return h, jnp.mean(h, -1)

    h, means = lax.scan(cell, jnp.zeros((x.shape[0], 6)), seq)
    logits = h @ p["Wo"] + means[-1][:, None]
    return jnp.mean(
        jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]
    )


def _rnn_params(key):
    k = jax.random.split(key, 3)
    n = jax.random.normal
    return {
        "Wx": n(k[0], (5, 6)) / 2,
        "Wh": n(k[1], (6, 6)) / 3,
        "b": jnp.zeros(6),
        "Wo": n(k[2], (6, 3)) / 2,
    }


def _readme_model():
    net = nl.Sequential((nl.Linear(5, 8), nl.Activation("gelu"), nl.Linear(8, 3)))

    def loss(p, x, y):
        return nl.softmax_cross_entropy(net(p, x), y, reduction="mean")

    return loss, net.init


CORPUS = {
    "raw_math_scan": (_raw_math, _raw_params, False),
    "vae": (_vae, _vae_params, True),
    "rnn_scan": (_rnn, _rnn_params, False),
    "readme": (*_readme_model(), False),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_auto_resolves_to_manual_and_equals_autodiff(name):
    loss, init, keyed = CORPUS[name]
    p = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (6, 5))
    y = jnp.arange(6) % 3
    extra = (jax.random.key(2),) if keyed else ()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, x, y))
    nl.check_manual(loss, *shapes, *extra)  # auto asks this, on shapes: manual
    want = jax.jit(jax.grad(loss))(p, x, y, *extra)
    got = jax.jit(jax.grad(nl.manual_grads(loss)))(p, x, y, *extra)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(jnp.max(jnp.abs(b))))
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5 * scale)


def test_check_rules_reports_each_layer_and_catches_a_wrong_rule():
    def bad_vjp(x, dret):  # off by a factor of two
        return 4 * x * dret

    @nl.hand_rule(bad_vjp)
    def sq(x):
        return x * x

    net = nl.FFN(5, (8,), 3, "tanh")
    p = nl.ParamsDict(net=net.init(jax.random.key(0)))

    def loss(p, x):
        return jnp.mean(sq(net(p.net, x)))

    rows = nl.check_rules(loss, p, jax.random.normal(jax.random.key(1), (4, 5)))
    table = {(r.layer, r.rule): r for r in rows}
    assert table[("params.net.layers[0]", "linear_vjp")].ok
    assert table[("tanh#1", "tanh_vjp")].roundings < 100
    wrong = table[("sq#1", "bad_vjp")]
    assert not wrong.ok and wrong.roundings > 1e5 and "WRONG" in str(wrong)


def test_check_manual_lists_the_rules_and_check_rules_checks_those_selected():
    """``nl.check_manual`` returns the hand rules a loss calls (a user's, also inside an
    ``nl.Stack``'s copies); ``check_rules(select=...)`` compares only those, names the
    argument whose cotangent is off and its relative error, and reaches into the stack."""

    def bad_vjp(x, s, dret):  # the input's cotangent off by a factor of two
        return 2 * dret * s[None], jnp.sum(dret * x, axis=0)

    @nl.hand_rule(bad_vjp)
    def gain(x, s):
        return x * s[None]

    class Gain(nl.Module):
        def init(self, key):
            return nl.ParamsDict(s=jnp.ones(4))

        def __call__(self, params, x, *, key=None):
            return gain(jnp.tanh(x), params.s)

    net = nl.Sequential((nl.Linear(3, 4), nl.Stack(Gain(), 2)))
    p = net.init(jax.random.key(0))

    def loss(p, x):
        return jnp.sum(net(p, x))

    x = jax.random.normal(jax.random.key(1), (2, 3))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, x))
    rules = nl.check_manual(loss, *shapes)
    assert [r.__name__ for r in rules] == ["linear", "gain"]
    rows = nl.check_rules(loss, p, x, select=lambda r: r is gain)
    assert [(r.layer, r.rule, r.ok, r.argument) for r in rows] == [
        ("params.layers[1]", "bad_vjp", False, 0)
    ]
    assert rows[0].fn is gain and rows[0].relative == pytest.approx(1.0, rel=1e-5)
    assert all(r.ok for r in nl.check_rules(loss, p, x, select=lambda r: r is not gain))
