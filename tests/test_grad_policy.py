"""Per-layer backward policies (``nl.backward_policy``): the forward untouched, the
backward stopped, scaled, clipped or computed in float32, under ``jax.grad`` and
``manual_grads`` alike, and printed in place by ``show_grad``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl

LIN, HEAD = nl.Linear(3, 4), nl.Linear(4, 2)


def _setup(**policy):
    net = nl.Sequential((nl.backward_policy(LIN, **policy), nl.Activation("tanh"), HEAD))
    plain = nl.Sequential((LIN, nl.Activation("tanh"), HEAD))
    p = net.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 3))

    def loss(net):
        return lambda p, x: jnp.sum(net(p, x) ** 2)

    return loss(net), loss(plain), p, x


@pytest.mark.parametrize(
    "policy, factor",
    [({"scale": 0.5}, 0.5), ({"stop": True}, 0.0), ({"scale": -2.0}, -2.0)],
)
def test_stop_and_scale_change_only_the_layers_backward(policy, factor):
    loss, plain, p, x = _setup(**policy)
    np.testing.assert_array_equal(loss(p, x), plain(p, x))  # the forward is the layer's
    ref = jax.grad(plain)(p, x)
    for g in (jax.grad(loss)(p, x), jax.grad(nl.manual_grads(loss))(p, x)):
        np.testing.assert_allclose(g.layers[0].W, factor * ref.layers[0].W, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(g.layers[2].W, ref.layers[2].W, rtol=1e-6)  # after it: as is
    src = nl.show_grad(loss, p, x)
    name = "stop_cotangent" if "stop" in policy else "scale_cotangent"
    assert f"= {name}(linear_layers_0" in src and f"{name}_vjp(" in src  # printed in place
    ns: dict = {}
    exec(src, ns)
    np.testing.assert_allclose(ns["grad"](p, x).layers[0].W, factor * ref.layers[0].W, atol=1e-6)


def test_clip_bounds_the_cotangent_norm_at_the_layer_output():
    loss, plain, p, x = _setup(clip_norm=0.1)
    seen = {}

    def probe(p, x):  # the cotangent arriving at the first layer's output
        h = LIN(p.layers[0], x)
        _, pullback = jax.vjp(lambda h: jnp.sum(HEAD(p.layers[2], jnp.tanh(h)) ** 2), h)
        seen["norm"] = float(jnp.linalg.norm(pullback(jnp.ones(()))[0]))
        return h

    probe(p, x)
    ref, got = jax.grad(plain)(p, x), jax.grad(loss)(p, x)
    assert seen["norm"] > 0.1  # it is clipped: scaled down by norm / 0.1
    np.testing.assert_allclose(
        got.layers[0].b, ref.layers[0].b * (0.1 / seen["norm"]), rtol=1e-4, atol=1e-7
    )


def test_float32_backward_under_a_bfloat16_forward():
    lin = nl.Linear(16, 16, param_dtype="bfloat16")
    p16 = lin.init(jax.random.key(0))
    x16 = jax.random.normal(jax.random.key(1), (64, 16)).astype(jnp.bfloat16)
    pol = nl.backward_policy(lin, backward_dtype="float32")

    def loss(layer):
        return lambda p, x: jnp.sum(layer(p, x).astype(jnp.float32) ** 2)

    np.testing.assert_array_equal(pol(p16, x16), lin(p16, x16))  # bfloat16 forward, as it was
    g = jax.grad(loss(pol))(p16, x16)
    assert g.W.dtype == jnp.bfloat16
    # the float32 backward of the same bfloat16 values and cotangent, cast once at the end
    up = jax.tree.map(lambda a: a.astype(jnp.float32), (p16, x16))
    dret = 2 * lin(p16, x16).astype(jnp.float32)  # the loss's cotangent at the bf16 output
    _, pullback = jax.vjp(nl.Linear(16, 16), *up)
    want = pullback(dret)[0].W.astype(jnp.bfloat16)
    np.testing.assert_array_equal(g.W, want)


def test_bad_policies_are_refused_with_one_line():
    with pytest.raises(TypeError, match="expected an nnlite Module, got function"):
        nl.backward_policy(lambda p, x: x, scale=0.5)
    with pytest.raises(ValueError, match="clip_norm must be positive, got 0"):
        nl.backward_policy(LIN, clip_norm=0)
    with pytest.raises(ValueError, match="backward_dtype must be a float dtype name .* got 'int8'"):
        nl.backward_policy(LIN, backward_dtype="int8")
    with pytest.raises(TypeError, match="scale must be a number, got '2'"):
        nl.backward_policy(LIN, scale="2")
