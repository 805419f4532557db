"""LayerNorm, RMSNorm, GroupNorm against their formulas in numpy; grid; errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl
from nnlite import GroupNorm, LayerNorm, RMSNorm


def _params(layer, rng):
    shapes = layer.param_shapes()
    return nl.ParamsDict(
        {k: (1 + 0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    )


def np_layer_norm(x, scale, bias, eps):
    x = x.astype(np.float64)
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return y * scale + bias


def np_group_norm(x, scale, bias, groups, n_spatial, eps):
    """x: [B, *spatial, C]; loop over examples and groups."""
    x = x.astype(np.float64)
    out = np.empty_like(x)
    c = x.shape[-1] // groups
    for b in range(x.shape[0]):
        for g in range(groups):
            chunk = x[b, ..., g * c : (g + 1) * c]
            out[b, ..., g * c : (g + 1) * c] = (chunk - chunk.mean()) / np.sqrt(chunk.var() + eps)
    return out * scale + bias


def test_layer_norm_and_rms_norm_match_formulas():
    rng = np.random.default_rng(0)
    x = (3 + 2 * rng.standard_normal((4, 3, 6))).astype(np.float32)
    ln, rms = LayerNorm(6), RMSNorm(6)
    bare = LayerNorm(6, eps=0.1, use_scale=False, use_bias=False)
    assert bare.init(None) == nl.ParamsDict()
    p, q = _params(ln, rng), _params(rms, rng)
    got_ln, got_bare, got_rms = jax.jit(
        lambda p, q, x: (ln(p, x), bare(nl.ParamsDict(), x), rms(q, x))
    )(p, q, x)
    np.testing.assert_allclose(
        got_ln, np_layer_norm(x, p.scale, p.bias, 1e-5), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(got_bare, np_layer_norm(x, 1, 0, 0.1), rtol=1e-4, atol=1e-5)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * q.scale
    np.testing.assert_allclose(got_rms, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("groups", "n_spatial"), [(1, 1), (2, 1), (4, 1), (2, 2), (2, 0)])
def test_group_norm_matches_formula(groups, n_spatial):
    rng = np.random.default_rng(groups)
    x = rng.standard_normal((3, *[5] * n_spatial, 4)).astype(np.float32)
    gn = GroupNorm(groups, 4, num_spatial_axes=n_spatial)
    p = _params(gn, rng)
    want = np_group_norm(x, p.scale, p.bias, groups, n_spatial, 1e-5)
    batched, unbatched = jax.jit(lambda p, x: (gn(p, x), gn(p, x[1])))(p, x)
    np.testing.assert_allclose(batched, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(unbatched, want[1], rtol=1e-4, atol=1e-5)


NORMS = {
    "LayerNorm": (lambda **kw: LayerNorm(6, **kw), (5, 6)),
    "RMSNorm": (lambda **kw: RMSNorm(6, **kw), (5, 6)),
    "GroupNorm": (lambda **kw: GroupNorm(3, 6, **kw), (5, 6)),
    "GroupNorm2d": (lambda **kw: GroupNorm(2, 6, num_spatial_axes=2, **kw), (4, 3, 6)),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_grid(name):
    make, shape = NORMS[name]
    layer = make()
    rng = np.random.default_rng(0)
    p = _params(layer, rng)
    x = (5 + 3 * rng.standard_normal((3, *shape))).astype(np.float32)
    lo = make(dtype="bfloat16")

    @jax.jit
    def run(p, x):
        y = layer(p, x)
        rows = jax.vmap(layer, in_axes=(None, 0))(p, x)
        grads = jax.grad(lambda p, x: jnp.sum(layer(p, x) ** 3), argnums=(0, 1))(p, x)
        return y, rows, layer(p, x[0]), grads, lo(p, x)

    y, rows, single, (g_p, g_x), y16 = run(p, x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(rows, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(single, y[0], rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(g_p) == jax.tree.structure(p) and g_x.shape == x.shape
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves((g_p, g_x)))
    # bf16 compute, f32 params, float32 statistics: close to the f32 result even though
    # the inputs (mean 5) would lose the variance in a bf16 sum of squares.
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y, rtol=0.05, atol=0.05)


def test_params_print_and_init(key, capsys):
    for layer in (LayerNorm(3), RMSNorm(3), GroupNorm(1, 3)):
        layer.init(key).print()
    assert capsys.readouterr().out.split() == [
        "/scale:", "f32[3]", "/bias:", "f32[3]", "/scale:", "f32[3]",
        "/scale:", "f32[3]", "/bias:", "f32[3]",
    ]  # fmt: skip
    p = LayerNorm(3, param_dtype="bfloat16").init(key)
    assert p.scale.dtype == jnp.bfloat16 and p.scale.tolist() == [1, 1, 1] and not p.bias.any()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LayerNorm(0), "LayerNorm: features must be a positive int, got 0"),
        (lambda: LayerNorm(3, eps=-1.0), "LayerNorm: eps must be a float >= 0, got -1.0"),
        (lambda: RMSNorm(3, eps="1e-6"), "RMSNorm: eps must be a float >= 0, got '1e-6'"),
        (lambda: GroupNorm(4, 6), "GroupNorm: num_groups=4 must divide features=6"),
        (lambda: GroupNorm(0, 6), "GroupNorm: num_groups must be a positive int, got 0"),
        (lambda: GroupNorm(1, 6, num_spatial_axes=-1), "num_spatial_axes must be a non-negative"),
        (lambda: RMSNorm(3, dtype="int8"), "RMSNorm: dtype must name a floating dtype"),
    ],
)
def test_invalid_hyperparameters(make, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make()


def test_bad_inputs_and_params():
    ln = LayerNorm(3)
    p = nl.ParamsDict(scale=jnp.ones(3), bias=jnp.zeros(3))
    with pytest.raises(
        ValueError,
        match=re.escape("LayerNorm(features=3): expected input with last axis 3, got shape (2, 4)"),
    ):
        ln(p, jnp.ones((2, 4)))
    with pytest.raises(
        ValueError, match=re.escape("LayerNorm(3): params /bias has shape (4,), expected (3,)")
    ):
        ln(nl.ParamsDict(scale=jnp.ones(3), bias=jnp.zeros(4)), jnp.ones((2, 3)))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "GroupNorm(features=4): expected input with last axis 4 and rank >= 3, got shape (5, 4)"
        ),
    ):
        GroupNorm(2, 4, num_spatial_axes=2)(
            nl.ParamsDict(scale=jnp.ones(4), bias=jnp.ones(4)), jnp.ones((5, 4))
        )
