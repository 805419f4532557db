"""MLP gradient modes: autodiff, manual (hand VJPs), fused (one hand pass) agree everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl

# (layer sizes, activation): several depths and widths, every hand-supported activation.
CONFIGS = [
    ((6, 16, 5), "relu"),
    ((6, 12, 12, 4), "gelu"),
    ((5, 8, 8, 8, 3), "tanh"),
    ((7, 10, 6), "sigmoid"),
    ((4, 9, 9, 3), "softplus"),
    ((4, 3), "identity"),  # a single Linear layer, no activation at all
]
assert {a for _, a in CONFIGS} == set(nl.HAND_ACTIVATIONS)


def _problem(sizes, batch=16, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = nl.FFN(sizes[0], sizes[1:-1], sizes[-1]).init(k[0])
    # non-zero biases so bias gradients and masks are exercised
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(k[1], a.shape), params)
    x = jax.random.normal(k[2], (batch, sizes[0]))
    y = jax.random.randint(k[1], (batch,), 0, sizes[-1])
    return params, x, y


def _close(a, b, rtol=1e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(v))) + 1e-7)


@pytest.mark.parametrize(("sizes", "act"), CONFIGS)
def test_modes_agree_under_jit(sizes, act):
    params, x, y = _problem(sizes)
    f = jax.jit(nl.loss_and_grad, static_argnums=0, static_argnames="activation")
    want = f("autodiff", params, x, y, activation=act)
    assert float(want[0]) > 0 and any(
        float(jnp.abs(g).max()) > 1e-3 for g in jax.tree.leaves(want[1])
    )
    for mode in ("manual", "fused"):
        _close(f(mode, params, x, y, activation=act), want)
    # the fused custom_vjp loss, differentiated by jax.grad, w.r.t. params and inputs
    vg = jax.jit(
        jax.value_and_grad(nl.mlp_loss, argnums=(0, 1)), static_argnames=("activation", "mode")
    )
    ref = vg(params, x, y, activation=act, mode="autodiff")
    for mode in ("manual", "fused"):
        _close(vg(params, x, y, activation=act, mode=mode), ref)


def test_float64_agreement():
    with jax.enable_x64(True):
        params, x, y = _problem((5, 7, 7, 3))
        params, x = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x))
        want = nl.loss_and_grad("autodiff", params, x, y, activation="gelu")
        for mode in ("manual", "fused"):
            got = nl.loss_and_grad(mode, params, x, y, activation="gelu")
            assert got[1].layers[0].W.dtype == jnp.float64
            _close(got, want, rtol=1e-12)


def test_ffn_plus_head_params_keep_their_structure():
    k = jax.random.split(jax.random.key(0), 3)
    params = nl.ParamsDict(
        ffn=nl.FFN(6, (8,), 8, activation="tanh", activate_final=True).init(k[0]),
        head=nl.SoftmaxHead(8, 4).init(k[1]),
    )
    x, y = jax.random.normal(k[2], (5, 6)), jnp.array([0, 1, 2, 3, 0])
    assert [layer.W.shape for layer in nl.mlp_layers(params)] == [(6, 8), (8, 8), (8, 4)]
    want = nl.loss_and_grad("autodiff", params, x, y, activation="tanh")
    for mode in ("manual", "fused"):
        loss, grads = nl.loss_and_grad(mode, params, x, y, activation="tanh")
        assert jax.tree.structure(grads) == jax.tree.structure(params)
        _close((loss, grads), want)
    # a plain list of layers works too and gives a list back
    layers = nl.mlp_layers(params)
    _, g = nl.fused_loss_and_grad(layers, x, y, activation="tanh")
    _close(g, nl.mlp_layers(want[1]))


def _pmap_step(mode, act):
    def step(params, x, y):
        loss, grads = nl.loss_and_grad(mode, params, x, y, activation=act)
        return jax.lax.pmean((loss, grads), "d")

    return jax.pmap(step, axis_name="d", in_axes=(None, 0, 0))


@pytest.mark.parametrize(("sizes", "act"), [CONFIGS[0], CONFIGS[1]])
def test_modes_under_pmap_match_one_device(sizes, act):
    n = jax.device_count()
    params, x, y = _problem(sizes, batch=4 * n)
    want = nl.loss_and_grad("autodiff", params, x, y, activation=act)
    xs, ys = x.reshape(n, 4, -1), y.reshape(n, 4)
    for mode in nl.GRAD_MODES:
        got = jax.tree.map(lambda v: v[0], _pmap_step(mode, act)(params, xs, ys))
        _close(got, want)


@pytest.mark.parametrize(("sizes", "act"), [CONFIGS[0], CONFIGS[2]])
def test_modes_under_shard_map_match_one_device(sizes, act):
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    params, x, y = _problem(sizes, batch=4 * n)
    want = nl.loss_and_grad("autodiff", params, x, y, activation=act)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x, y))
    for mode in nl.GRAD_MODES:

        def local(params, x, y, mode=mode):
            # differentiate the global mean: with check_vma the replicated params'
            # gradient comes back already summed over the mesh
            def global_loss(p):
                return jax.lax.pmean(nl.mlp_loss(p, x, y, activation=act, mode=mode), "d")

            return jax.value_and_grad(global_loss)(params)

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))
        _close(f(params, xs, ys), want)

    # the direct fused pass inside shard_map: local grads, pmean-ed by hand
    def local_fused(params, x, y):
        return jax.lax.pmean(nl.fused_loss_and_grad(params, x, y, activation=act), "d")

    f = jax.jit(
        jax.shard_map(local_fused, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P())
    )
    _close(f(params, xs, ys), want)


@pytest.mark.parametrize(("sizes", "act"), [CONFIGS[1], CONFIGS[3]])
def test_fused_grad_accum_over_microbatches_equals_one_big_batch(sizes, act):
    k, b = 4, 6
    params, x, y = _problem(sizes, batch=k * b)
    acc_fn = jax.jit(nl.fused_grad_accum, static_argnames="activation", donate_argnums=3)
    acc = jax.tree.map(jnp.zeros_like, params)
    losses = []
    for i in range(k):
        loss, acc = acc_fn(
            params, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], acc, activation=act
        )
        losses.append(loss)
    want = nl.loss_and_grad("autodiff", params, x, y, activation=act)
    _close((sum(losses) / k, jax.tree.map(lambda g: g / k, acc)), want)
    # and it really adds into grads_in (not just returns grads)
    ones = jax.tree.map(jnp.ones_like, params)
    _, g1 = nl.fused_grad_accum(params, x, y, ones, activation=act)
    _close(jax.tree.map(lambda g: g - 1, g1), want[1])


def test_autodiff_takes_any_activation_hand_modes_say_what_they_support():
    params, x, y = _problem((4, 6, 3))
    loss, _ = nl.loss_and_grad("autodiff", params, x, y, activation=jnp.sin)
    assert np.isfinite(loss)
    for mode in ("manual", "fused"):
        with pytest.raises(
            ValueError, match=f"mode '{mode}' supports activations relu, tanh, .*gelu"
        ):
            nl.loss_and_grad(mode, params, x, y, activation=jnp.sin)
    with pytest.raises(
        ValueError, match="unknown gradient mode 'adjoint'; valid: autodiff, manual, fused"
    ):
        nl.loss_and_grad("adjoint", params, x, y)
    with pytest.raises(ValueError, match=r"expected integer labels of shape \(16,\)"):
        nl.loss_and_grad("fused", params, x, y.astype(jnp.float32))
    with pytest.raises(ValueError, match="grads_in must have the structure of params"):
        nl.fused_grad_accum(params, x, y, nl.mlp_layers(params))
