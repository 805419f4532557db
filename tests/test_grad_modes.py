"""MLP gradient modes: autodiff, manual (hand VJPs), fused (one hand pass) agree everywhere."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
from models import mlp_fused as fused

# (layer sizes, activation): several depths and widths, every hand-supported activation.
CONFIGS = [
    ((6, 16, 5), "relu"),
    ((6, 12, 12, 4), "gelu"),
    ((5, 8, 8, 8, 3), "tanh"),
    ((7, 10, 6), "sigmoid"),
    ((4, 9, 9, 3), "softplus"),
    ((4, 3), "identity"),  # a single Linear layer, no activation at all
]
assert {a for _, a in CONFIGS} == set(fused.HAND_ACTIVATIONS)


def _problem(sizes, batch=16, seed=0):
    # numpy data (no per-shape compiles of random kernels); non-zero biases so that bias
    # gradients and activation masks are exercised
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32))

    layers = [
        nl.ParamsDict(W=normal(a, b, scale=a**-0.5), b=normal(b, scale=0.1))
        for a, b in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    x = normal(batch, sizes[0])
    y = jnp.asarray(rng.integers(0, sizes[-1], batch).astype(np.int32))
    return nl.ParamsDict(layers=layers), x, y


def _close(a, b, dtype=np.float32):
    # float rounding of each leaf's scale along the deepest config's path: 4 linear
    # layers, 4 activations and the loss (tests/_tolerance.py)
    assert_close_f32(a, b, ops=ROUNDINGS_PER_LAYER * 9, eps=float(np.finfo(dtype).eps))


# one compile per (mode, activation), shared by every test
_loss_and_grad = jax.jit(fused.loss_and_grad, static_argnums=0, static_argnames="activation")


@functools.partial(jax.jit, static_argnames="act")
def _every_mode(params, x, y, act):
    """loss_and_grad per mode, and jax.value_and_grad of mlp_loss (w.r.t. params and x)."""
    out = {}
    for mode in fused.GRAD_MODES:
        out[mode] = fused.loss_and_grad(mode, params, x, y, activation=act)
        vg = jax.value_and_grad(fused.mlp_loss, argnums=(0, 1))
        out["grad_" + mode] = vg(params, x, y, activation=act, mode=mode)
    return out


@pytest.mark.parametrize(("sizes", "act"), CONFIGS)
def test_modes_agree_under_jit(sizes, act):
    params, x, y = _problem(sizes)
    got = _every_mode(params, x, y, act)
    want = got["autodiff"]
    assert float(want[0]) > 0
    assert any(float(np.abs(g).max()) > 1e-3 for g in jax.tree.leaves(want[1]))
    for mode in ("manual", "fused"):
        _close(got[mode], want)
        # the manual loss and the fused custom_vjp loss under jax.grad, incl. d/dx
        _close(got["grad_" + mode], got["grad_autodiff"])
    _close(got["grad_autodiff"][1][0], want[1])


def test_float64_agreement():
    with jax.enable_x64(True):
        params, x, y = _problem((5, 7, 7, 3))
        params, x = jax.tree.map(lambda a: a.astype(jnp.float64), (params, x))
        f = jax.jit(fused.loss_and_grad, static_argnums=0, static_argnames="activation")
        want = f("autodiff", params, x, y, activation="gelu")  # own jit: x64 traces differ
        for mode in ("manual", "fused"):
            got = f(mode, params, x, y, activation="gelu")
            assert got[1].layers[0].W.dtype == jnp.float64
            _close(got, want, dtype=np.float64)


def test_ffn_plus_head_params_keep_their_structure():
    k = jax.random.split(jax.random.key(0), 3)
    params = nl.ParamsDict(
        ffn=nl.FFN(6, (8,), 8, activation="tanh", activate_final=True).init(k[0]),
        head=nl.SoftmaxHead(8, 4).init(k[1]),
    )
    x, y = jax.random.normal(k[2], (5, 6)), jnp.array([0, 1, 2, 3, 0])
    assert [layer.W.shape for layer in fused.mlp_layers(params)] == [(6, 8), (8, 8), (8, 4)]
    f = _loss_and_grad
    want = f("autodiff", params, x, y, activation="tanh")
    for mode in ("manual", "fused"):
        loss, grads = f(mode, params, x, y, activation="tanh")
        assert jax.tree.structure(grads) == jax.tree.structure(params)
        _close((loss, grads), want)
    # a plain list of layers works too and gives a list back
    layers = fused.mlp_layers(params)
    _, g = jax.jit(fused.fused_loss_and_grad, static_argnames="activation")(
        layers, x, y, activation="tanh"
    )
    _close(g, fused.mlp_layers(want[1]))


def _pmap_step(mode, act):
    def step(params, x, y):
        loss, grads = fused.loss_and_grad(mode, params, x, y, activation=act)
        return jax.lax.pmean((loss, grads), "d")

    return jax.pmap(step, axis_name="d", in_axes=(None, 0, 0))


# One config: pmap only pmeans what each device's pass computes (the same code as on one
# device, where test_modes_agree_under_jit checks every config); the per-device program of
# a deeper net with another activation is test_modes_under_shard_map's CONFIGS[2].
@pytest.mark.parametrize(("sizes", "act"), [CONFIGS[0]])
def test_modes_under_pmap_match_one_device(sizes, act):
    n = jax.device_count()
    params, x, y = _problem(sizes, batch=4 * n)
    want = _loss_and_grad("autodiff", params, x, y, activation=act)
    xs, ys = x.reshape(n, 4, -1), y.reshape(n, 4)
    for mode in fused.GRAD_MODES:
        got = jax.tree.map(lambda v: v[0], _pmap_step(mode, act)(params, xs, ys))
        _close(got, want)


@pytest.mark.parametrize(("sizes", "act"), [CONFIGS[0], CONFIGS[2]])
def test_modes_under_shard_map_match_one_device(sizes, act):
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",))
    params, x, y = _problem(sizes, batch=4 * n)
    want = _loss_and_grad("autodiff", params, x, y, activation=act)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("d"))) for a in (x, y))
    for mode in fused.GRAD_MODES:

        def local(params, x, y, mode=mode):
            # differentiate the global mean: with check_vma the replicated params'
            # gradient comes back already summed over the mesh
            def global_loss(p):
                return jax.lax.pmean(fused.mlp_loss(p, x, y, activation=act, mode=mode), "d")

            return jax.value_and_grad(global_loss)(params)

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))
        _close(f(params, xs, ys), want)

    # the direct fused pass inside shard_map: local grads, pmean-ed by hand
    def local_fused(params, x, y):
        return jax.lax.pmean(fused.fused_loss_and_grad(params, x, y, activation=act), "d")

    f = jax.jit(
        jax.shard_map(local_fused, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P())
    )
    _close(f(params, xs, ys), want)


@pytest.mark.parametrize(("sizes", "act"), [CONFIGS[1], CONFIGS[3]])
def test_fused_grad_accum_over_microbatches_equals_one_big_batch(sizes, act):
    k, b = 4, 6
    params, x, y = _problem(sizes, batch=k * b)
    acc_fn = jax.jit(fused.fused_grad_accum, static_argnames="activation", donate_argnums=3)
    acc = jax.tree.map(jnp.zeros_like, params)
    losses = []
    for i in range(k):
        loss, acc = acc_fn(
            params, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], acc, activation=act
        )
        losses.append(loss)
    want = _loss_and_grad("autodiff", params, x, y, activation=act)
    _close((sum(losses) / k, jax.tree.map(lambda g: g / k, acc)), want)
    # and it really adds into grads_in (not just returns grads)
    ones = jax.tree.map(jnp.ones_like, params)
    _, g1 = acc_fn(params, x, y, ones, activation=act)
    _close(jax.tree.map(lambda g: g - 1, g1), want[1])


def test_autodiff_takes_any_activation_hand_modes_say_what_they_support():
    params, x, y = _problem((4, 6, 3))
    loss, _ = jax.jit(fused.loss_and_grad, static_argnums=0, static_argnames="activation")(
        "autodiff", params, x, y, activation=jnp.sin
    )
    assert np.isfinite(loss)
    for mode in ("manual", "fused"):
        with pytest.raises(
            ValueError, match=f"mode '{mode}' supports activations relu, tanh, .*gelu"
        ):
            fused.loss_and_grad(mode, params, x, y, activation=jnp.sin)
    # the library's activation functions are accepted by name or as themselves
    _close(
        _loss_and_grad("fused", params, x, y, activation=nl.tanh),
        _loss_and_grad("autodiff", params, x, y, activation="tanh"),
    )
    with pytest.raises(
        ValueError, match="unknown gradient mode 'adjoint'; valid: autodiff, manual, fused"
    ):
        fused.loss_and_grad("adjoint", params, x, y)
    with pytest.raises(ValueError, match=r"expected integer labels of shape \(16,\)"):
        fused.loss_and_grad("fused", params, x, y.astype(jnp.float32))
    with pytest.raises(ValueError, match="grads_in must have the structure of params"):
        fused.fused_grad_accum(params, x, y, fused.mlp_layers(params))


def test_mlp_fused_doctests():
    """pytest collects doctests from nnlite/ only; models/mlp_fused.py's examples run here."""
    import doctest

    assert doctest.testmod(fused, optionflags=doctest.ELLIPSIS).failed == 0
