"""Conv, MaxPool, AvgPool, Flatten against numpy loops; shapes, transforms, errors."""

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl
from nnlite import AvgPool, Conv, Flatten, MaxPool


def _same_pads(size, k, s, d=1):
    span = (k - 1) * d + 1
    out = -(-size // s)
    total = max((out - 1) * s + span - size, 0)
    return (total // 2, total - total // 2)


def _pads(padding, spatial, kernel, strides, dilation):
    n = len(spatial)
    if padding == "VALID":
        return [(0, 0)] * n
    if padding == "SAME":
        return [_same_pads(*a) for a in zip(spatial, kernel, strides, dilation, strict=True)]
    if isinstance(padding, int):
        return [(padding, padding)] * n
    return list(padding)


def np_conv(x, W, b, strides, padding, dilation, groups):
    """Reference: x [B, *spatial, Cin], W [*k, Cin/g, Cout]; explicit loops over outputs."""
    n = W.ndim - 2
    kernel = W.shape[:n]
    pads = _pads(padding, x.shape[1:-1], kernel, strides, dilation)
    xp = np.pad(x, [(0, 0), *pads, (0, 0)])
    cin_g, cout = W.shape[-2], W.shape[-1]
    cout_g = cout // groups
    out_sizes = [
        (xp.shape[1 + i] - ((kernel[i] - 1) * dilation[i] + 1)) // strides[i] + 1 for i in range(n)
    ]
    y = np.zeros((x.shape[0], *out_sizes, cout))
    for pos in itertools.product(*(range(o) for o in out_sizes)):
        for kpos in itertools.product(*(range(k) for k in kernel)):
            idx = tuple(pos[i] * strides[i] + kpos[i] * dilation[i] for i in range(n))
            patch = xp[(slice(None), *idx)]  # [B, Cin]
            for g in range(groups):
                xin = patch[:, g * cin_g : (g + 1) * cin_g]
                w = W[(*kpos, slice(None), slice(g * cout_g, (g + 1) * cout_g))]
                y[(slice(None), *pos, slice(g * cout_g, (g + 1) * cout_g))] += xin @ w
    return y + b if b is not None else y


CASES = [
    # (spatial, cin, cout, kernel, strides, padding, dilation, groups)
    ((9,), 2, 3, (3,), (1,), "SAME", (1,), 1),
    ((9,), 2, 3, (4,), (2,), "SAME", (1,), 1),
    ((10,), 4, 6, (3,), (2,), "VALID", (2,), 2),
    ((8,), 3, 3, (5,), (1,), 2, (1,), 3),  # depthwise, int padding
    ((7,), 1, 2, (2,), (3,), [(0, 2)], (1,), 1),
    ((6, 5), 2, 4, (3, 2), (1, 2), "SAME", (1, 1), 2),
    ((7, 6), 3, 2, (2, 3), (2, 1), "VALID", (2, 1), 1),
    ((5, 5), 2, 2, (3, 3), (1, 1), [(1, 0), (2, 1)], (1, 2), 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}d-{c[5]}-g{c[7]}")
def test_conv_matches_numpy_loops(case):
    spatial, cin, cout, kernel, strides, padding, dilation, groups = case
    layer = Conv(cin, cout, kernel, strides, padding, dilation, groups)
    rng = np.random.default_rng(0)
    p = nl.ParamsDict(
        W=rng.standard_normal((*kernel, cin // groups, cout)).astype(np.float32),
        b=rng.standard_normal(cout).astype(np.float32),
    )
    x = rng.standard_normal((2, *spatial, cin)).astype(np.float32)
    want = np_conv(x, p.W, p.b, strides, padding, dilation, groups)
    got = jax.jit(layer)(p, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_1d_matches_numpy_correlate():
    layer = Conv(1, 1, 3, padding="VALID", use_bias=False)
    x = np.arange(7.0, dtype=np.float32)
    w = np.array([1.0, -2.0, 0.5], np.float32)
    got = layer(nl.ParamsDict(W=w.reshape(3, 1, 1)), x[:, None])[:, 0]
    np.testing.assert_allclose(got, np.correlate(x, w, mode="valid"), rtol=1e-6)


CONVS = {
    # (3,), not 3: the grid also runs two leading batch axes, which an int size refuses.
    "conv1d": (lambda: Conv(3, 4, (3,)), (10, 3)),
    "conv1d-s2-valid": (lambda: Conv(3, 4, (5,), strides=2, padding="VALID"), (12, 3)),
    "conv2d-groups": (lambda: Conv(4, 6, (3, 3), groups=2, dilation=(1, 2)), (6, 7, 4)),
    "conv-nobias": (lambda: Conv(2, 2, (2,), use_bias=False), (5, 2)),
    "maxpool1d": (lambda: MaxPool((2,)), (10, 3)),
    "avgpool2d-same": (
        lambda: AvgPool((2, 3), strides=1, padding="SAME", count_include_pad=False),
        (5, 6, 2),
    ),
    "flatten": (lambda: Flatten(2), (5, 3)),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_grid_batched_unbatched_vmap_grad_bf16(name, key):
    make, shape = CONVS[name]
    layer = make()
    rng = np.random.default_rng(1)
    # Random values of init's shapes: eager init compiles its RNG for every new shape.
    p = jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), jax.eval_shape(layer.init, key)
    )
    x = rng.standard_normal((3, *shape)).astype(np.float32)

    @jax.jit
    def run(p, x):
        y = layer(p, x)
        rows = jax.vmap(layer, in_axes=(None, 0))(p, x)
        single = layer(p, x[0])
        many = layer(p, jnp.stack([x, x]))  # two leading batch axes
        grads = jax.grad(lambda p, x: jnp.sum(layer(p, x) ** 2), argnums=(0, 1))(p, x)
        return y, rows, single, many, grads

    y, rows, single, many, (g_p, g_x) = run(p, x)
    np.testing.assert_allclose(rows, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(single, y[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(many[1], y, rtol=1e-5, atol=1e-5)
    assert y.dtype == jnp.float32 and g_x.shape == x.shape
    assert float(jnp.abs(g_x).sum()) > 0
    assert jax.tree.structure(g_p) == jax.tree.structure(p)
    if isinstance(layer, Conv):  # bf16 compute with f32 params
        lo = Conv(**{**_fields(layer), "dtype": "bfloat16"})
        y16 = jax.jit(lo)(p, x)
        assert y16.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y16, np.float32), y, rtol=0.05, atol=0.1)
        assert {a.dtype for a in jax.tree.leaves(p)} == {jnp.dtype(jnp.float32)}


def _fields(layer):
    import dataclasses

    return {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}


def test_conv_init_fan_in_counts_the_receptive_field(key):
    @jax.jit  # one compilation for the three inits
    def inits(key):
        return Conv(16, 64, (5, 5)).init(key), Conv(16, 64, (3,), groups=4).init(key)

    p2, p1 = inits(key)
    assert p2.W.shape == (5, 5, 16, 64) and p1.W.shape == (3, 4, 64)
    assert float(np.var(p2.W)) == pytest.approx(1 / (25 * 16), rel=0.1)
    assert float(np.var(p1.W)) == pytest.approx(1 / 12, rel=0.1)  # fan-in 3 * 16 / 4
    assert not np.any(p2.b)


def test_conv_same_padding_and_params_print(key, capsys):
    layer = Conv(1, 25, 5, strides=2)
    p = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), jax.eval_shape(layer.init, key))
    p.print()
    assert capsys.readouterr().out.splitlines() == ["/W: f32[5,1,25]", "/b: f32[25]"]
    assert layer(p, jnp.ones((7, 40, 1))).shape == (7, 20, 25)


def np_pool(x, window, strides, pads, op, fill):
    n = len(window)
    xp = np.pad(x, [(0, 0), *pads, (0, 0)], constant_values=fill)
    valid = np.pad(np.ones(x.shape[1:-1]), pads)
    outs = [(xp.shape[1 + i] - window[i]) // strides[i] + 1 for i in range(n)]
    y = np.zeros((x.shape[0], *outs, x.shape[-1]))
    cnt = np.zeros(outs)
    for pos in itertools.product(*(range(o) for o in outs)):
        sl = tuple(slice(pos[i] * strides[i], pos[i] * strides[i] + window[i]) for i in range(n))
        y[(slice(None), *pos)] = op(xp[(slice(None), *sl)], axis=tuple(range(1, n + 1)))
        cnt[pos] = valid[sl].sum()
    return y, cnt


@pytest.mark.parametrize(
    ("window", "strides", "padding"),
    [((2,), None, "VALID"), ((3,), 2, "SAME"), ((2, 3), (1, 2), "VALID"), ((3, 2), 1, 1)],
)
def test_pools_match_numpy(window, strides, padding):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, *[7] * len(window), 3)).astype(np.float32)
    s = (
        window
        if strides is None
        else (strides,) * len(window)
        if isinstance(strides, int)
        else strides
    )
    pads = _pads(padding, x.shape[1:-1], window, s, (1,) * len(window))
    want_max, _ = np_pool(x, window, s, pads, np.max, -np.inf)
    got = MaxPool(window, strides, padding)(nl.ParamsDict(), x)
    np.testing.assert_allclose(got, want_max, rtol=1e-6)
    sums, cnt = np_pool(x, window, s, pads, np.sum, 0.0)
    got = AvgPool(window, strides, padding)(nl.ParamsDict(), x)
    np.testing.assert_allclose(got, sums / math.prod(window), rtol=1e-5, atol=1e-6)
    got = AvgPool(window, strides, padding, count_include_pad=False)(nl.ParamsDict(), x)
    np.testing.assert_allclose(got, sums / cnt[..., None], rtol=1e-5, atol=1e-6)


def test_flatten_merges_trailing_axes():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    assert Flatten(2)(nl.ParamsDict(), x).shape == (2, 12)
    assert Flatten(3)(nl.ParamsDict(), x).shape == (24,)
    assert Flatten(1)(nl.ParamsDict(), x).shape == (2, 3, 4)
    np.testing.assert_array_equal(Flatten(2)(nl.ParamsDict(), x)[1], np.arange(12.0, 24.0))


def test_cnn_in_sequential(key):
    net = nl.Sequential(
        (
            Conv(1, 4, 5, strides=2),
            nl.Activation("relu"),
            MaxPool(2),
            Flatten(2),
            nl.Linear(40, 3),
        )
    )
    p = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), jax.eval_shape(net.init, key))
    assert [k for k, _ in p.items()] == [
        "/layers[0]/W",
        "/layers[0]/b",
        "/layers[4]/W",
        "/layers[4]/b",
    ]
    assert jax.jit(net)(p, jnp.ones((6, 40, 1))).shape == (6, 3)


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Conv(0, 2, 3), "Conv: in_features must be a positive int, got 0"),
        (lambda: Conv(4, 6, 3, groups=4), "Conv: groups=4 must divide out_features=6"),
        (lambda: Conv(3, 6, 3, groups=2), "Conv: groups=2 must divide in_features=3"),
        (lambda: Conv(2, 2, (3, 0)), "Conv: kernel_size must hold positive ints, got (3, 0)"),
        (lambda: Conv(2, 2, "3"), "Conv: kernel_size must be a positive int or a tuple"),
        (lambda: Conv(2, 2, (3, 3), strides=(1, 2, 3)), "strides must be a positive int or 2"),
        (lambda: Conv(2, 2, 3, dilation=0), "Conv: dilation must hold positive ints, got 0"),
        (lambda: Conv(2, 2, 3, padding="FULL"), "padding must be 'SAME', 'VALID', an int"),
        (lambda: Conv(2, 2, 3, padding=-1), "got -1"),
        (lambda: Conv(2, 2, (3, 3), padding=[(1, 1)]), r"\(2 spatial axes\), got \(\(1, 1\),\)"),
        (lambda: Conv(2, 2, 3, param_dtype="int32"), "param_dtype must name a floating dtype"),
        (lambda: Conv(2, 2, 3, dtype="float"), None),  # 'float' is float64: allowed name
        (lambda: MaxPool(0), "MaxPool: window must hold positive ints, got 0"),
        (lambda: AvgPool((2, 2), strides=(1,)), "AvgPool: strides must be a positive int or 2"),
        (lambda: MaxPool(2, padding="full"), "MaxPool: padding must be"),
        (lambda: Flatten(0), "Flatten: num_axes must be a positive int, got 0"),
    ],
)
def test_invalid_hyperparameters(make, match):
    if match is None:
        make()
        return
    with pytest.raises(ValueError, match=re.escape(match) if "\\" not in match else match):
        make()


def test_bad_inputs_name_layer_and_shapes(key):
    conv = Conv(3, 4, (3, 3))
    p = nl.ParamsDict(W=jnp.ones((3, 3, 3, 4)), b=jnp.ones(4))
    msg = "Conv(in_features=3): expected input with last axis 3 and rank >= 3, got shape"
    with pytest.raises(ValueError, match=re.escape(msg + " (8, 32, 4)")):
        conv(p, jnp.ones((8, 32, 4)))
    with pytest.raises(ValueError, match=re.escape(msg + " (32, 3)")):
        conv(p, jnp.ones((32, 3)))
    with pytest.raises(ValueError, match=r"spatial size \(2, 5\), smaller .* kernel's span"):
        Conv(3, 4, (3, 3), padding="VALID")(p, jnp.ones((2, 5, 3)))
    with pytest.raises(ValueError, match=re.escape("Conv(3, 4, (3, 3)): params /W has shape")):
        conv(nl.ParamsDict(W=jnp.ones((3, 3, 3, 5)), b=jnp.ones(4)), jnp.ones((5, 5, 3)))
    with pytest.raises(ValueError, match=re.escape("MaxPool(window=(2, 2)): expected input")):
        MaxPool((2, 2))(nl.ParamsDict(), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"MaxPool\(window=\(3,\)\): .* smaller .* window"):
        MaxPool(3)(nl.ParamsDict(), jnp.ones((2, 2, 3)))
    with pytest.raises(ValueError, match=re.escape("Flatten(num_axes=3): expected input of")):
        Flatten(3)(nl.ParamsDict(), jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="expected a numeric array, got dtype <U1"):
        Conv(1, 1, 1)(nl.ParamsDict(W=jnp.ones((1, 1, 1)), b=jnp.ones(1)), np.array([["a"]]))


@pytest.mark.parametrize(
    "make, name, size",
    [
        (lambda s: MaxPool(s), "window", 2),
        (lambda s: AvgPool(s), "window", 2),
        (lambda s: nl.AdaptiveAvgPool(s), "output_size", 2),
        (lambda s: Conv(3, 4, s), "kernel_size", 3),
        (lambda s: nl.ConvTranspose(3, 4, s), "kernel_size", 3),
    ],
)
def test_an_int_size_on_images_is_refused_not_one_axis(make, name, size, key):
    # An int size means one spatial axis: on [2, 8, 8, 3] it would pool (or convolve) W
    # alone and return [2, 8, 4, 3] silently; it is refused, naming the tuple to give.
    def run(layer, x):
        return layer(layer.init(key), x) if layer.has_params else layer(x)

    x = jnp.ones((2, 8, 8, 3))
    with pytest.raises(ValueError, match=re.escape(f"{name}={(size, size)} for 2-d inputs")):
        run(make(size), x)
    assert run(make(size), x[0]).ndim == 3  # rank 3: batched 1-d, as documented
    out = run(make((size, size)), x)
    assert out.ndim == 4 and out.shape[1] == out.shape[2]  # both spatial axes
