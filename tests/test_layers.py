"""Layers: shapes and dtypes over a grid, transforms, error messages, initializers."""

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl
from nnlite import FFN, Activation, Linear, Sequential, SoftmaxHead

SIZES = [(1, 1), (3, 5), (8, 2)]

LAYERS = {
    "Linear": lambda i, o: Linear(i, o),
    "Linear(use_bias=False)": lambda i, o: Linear(i, o, use_bias=False),
    "FFN()": lambda i, o: FFN(i, (), o),
    "FFN(4, tanh)": lambda i, o: FFN(i, (4,), o, activation="tanh"),
    "FFN(4, 3, gelu, final)": lambda i, o: FFN(
        i, (4, 3), o, activation="gelu", activate_final=True
    ),
    "SoftmaxHead": lambda i, o: SoftmaxHead(i, o),
    "SoftmaxHead(softmax)": lambda i, o: SoftmaxHead(i, o, output="softmax"),
    "Sequential": lambda i, o: Sequential((Linear(i, 4), Activation("tanh"), Linear(4, o))),
}


# -- the grid: shapes, dtypes, jit, grad, vmap ----------------------------------------------
@pytest.mark.parametrize(("n_in", "n_out"), SIZES)
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_grid(name, n_in, n_out, key):
    layer = LAYERS[name](n_in, n_out)
    shapes = jax.eval_shape(layer.init, key)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(shapes))
    # Random values of init's shapes: eager init compiles its RNG for every new shape, the
    # slowest part of the grid; init's values are tested with the initializers below.
    rng = np.random.default_rng(n_in)
    p = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
    x = rng.standard_normal((4, n_in)).astype(np.float32)
    for batch in [(2, 3), ()]:
        out = jax.eval_shape(layer, p, jnp.zeros((*batch, n_in)))
        assert out.shape == (*batch, n_out) and out.dtype == jnp.float32

    # Everything under one jit: tiny eager ops each compile, which would dominate the time.
    @jax.jit
    def run(p, x):
        y = layer(p, x)
        y_single = jax.vmap(layer, in_axes=(None, 0))(p, x)  # one example at a time
        grads = jax.grad(lambda p, x: jnp.sum(layer(p, x) ** 2), argnums=(0, 1))(p, x)
        return y, y_single, grads

    y, y_single, (g_p, g_x) = run(p, x)
    assert y.shape == (4, n_out) and y.dtype == jnp.float32
    np.testing.assert_allclose(y_single, y, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(g_p) == jax.tree.structure(p)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g_p))
    assert g_x.shape == x.shape
    if n_out > 1 or not name.startswith("SoftmaxHead"):  # 1-class (log-)softmax is constant
        assert float(jnp.abs(g_x).sum()) > 0  # the input reaches the output
    if (n_in, n_out) == (3, 5):  # eager and jitted agree (once: eager dispatch is slow)
        np.testing.assert_allclose(layer(p, x), y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "make", [lambda d: Linear(3, 2, param_dtype=d), lambda d: FFN(3, (4,), 2, param_dtype=d)]
)
def test_param_and_output_dtype_follow_param_dtype(make, dtype, key):
    layer = make(dtype)
    p = layer.init(key)
    assert {leaf.dtype for leaf in jax.tree.leaves(p)} == {jnp.dtype(dtype)}
    assert jax.eval_shape(layer, p, jnp.ones((2, 3), dtype)).dtype == jnp.dtype(dtype)


# -- what the layers compute ----------------------------------------------------------------
def test_linear_computes_x_at_W_plus_b(key):
    layer = Linear(3, 2)
    p = layer.init(key)
    p.b = jnp.array([1.0, -1.0])
    x = jnp.arange(6.0).reshape(2, 3)
    expected = np.asarray(x) @ np.asarray(p.W) + np.array([1.0, -1.0])
    np.testing.assert_allclose(layer(p, x), expected, rtol=1e-6)


def _dots(jaxpr):
    """Every dot_general in a closed jaxpr, nested calls included."""
    out = []
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _dots(jax.extend.core.ClosedJaxpr(sub, []))
    return out


@pytest.mark.parametrize("lead", [(), (5,), (2, 5), (2, 3, 5)])
def test_linear_multiplies_the_rows_as_one_2d_product(lead, key):
    """Any leading axes: the values of x @ W + b, and under jax.grad every product is 2-D
    (dW = x2^T dy2), never a contraction over two axes at once, which XLA:CPU lowered by
    writing the cotangent transposed."""
    layer = Linear(4, 3)
    p = layer.init(key)
    x = jax.random.normal(jax.random.key(1), (*lead, 4))
    want = np.asarray(x) @ np.asarray(p.W) + np.asarray(p.b)
    np.testing.assert_allclose(layer(p, x), want, rtol=1e-5, atol=1e-6)

    def loss(p, x):
        return jnp.sum(jnp.tanh(layer(p, x)))

    g = jax.grad(loss)(p, x)
    x2 = np.asarray(x).reshape(-1, 4)
    dy = 1 - np.tanh(x2 @ np.asarray(p.W) + np.asarray(p.b)) ** 2
    np.testing.assert_allclose(g.W, x2.T @ dy, rtol=1e-4, atol=1e-5)
    dots = _dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(p, x))
    assert len(dots) == 3  # forward, dx, dW
    for eqn in dots:
        assert all(v.aval.ndim <= 2 for v in eqn.invars), eqn


@pytest.mark.parametrize("which", ["lora", "lora_dropout", "tied_head"])
def test_lora_and_the_tied_head_multiply_the_rows_too(which, key):
    """LoRA's products and the tied head ``x @ E^T`` on a 3-D input: under jax.grad every
    product is 2-D, and the gradients are those of the plain formula."""
    x = jax.random.normal(jax.random.key(1), (2, 3, 4))
    if which == "tied_head":
        layer = nl.Embedding(6, 4)
        p = layer.init(key)

        def loss(p, x):
            return jnp.sum(jnp.tanh(layer.attend(p, x)))

        def plain(p, x):
            return jnp.sum(jnp.tanh(jnp.einsum("btd,vd->btv", x, p.W)))
    else:
        layer = nl.LoRA(Linear(4, 3), rank=2, dropout=0.5 if which == "lora_dropout" else 0.0)
        p = layer.init(key)
        p.lora_b = jnp.ones_like(p.lora_b)
        k = jax.random.key(2) if which == "lora_dropout" else None

        def loss(p, x):
            return jnp.sum(jnp.tanh(layer(p, x, key=k)))

        def plain(p, x):
            xd = x if k is None else nl.nn._dropout.dropout(x, k, 0.5)
            W, b = jax.lax.stop_gradient((p.W, p.b))  # the base is frozen
            y = jnp.einsum("bti,io->bto", x, W) + b[None, None]
            return jnp.sum(jnp.tanh(y + layer.scale * (xd @ p.lora_a) @ p.lora_b))

    got, want = jax.grad(loss, argnums=(0, 1))(p, x), jax.grad(plain, argnums=(0, 1))(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for eqn in _dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(p, x)):
        assert all(v.aval.ndim <= 2 for v in eqn.invars), eqn


def test_ffn_params_and_forward(key, capsys):
    ffn = FFN(4, (8, 3), 2, activation="tanh")
    p = ffn.init(key)
    p.print()
    assert capsys.readouterr().out.splitlines() == [
        "/layers[0]/W: f32[4,8]",
        "/layers[0]/b: f32[8]",
        "/layers[1]/W: f32[8,3]",
        "/layers[1]/b: f32[3]",
        "/layers[2]/W: f32[3,2]",
        "/layers[2]/b: f32[2]",
    ]
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    q = jax.tree.map(np.asarray, p)  # reference in numpy
    h = np.tanh(x @ q.layers[0].W + q.layers[0].b)
    h = np.tanh(h @ q.layers[1].W + q.layers[1].b)
    out = h @ q.layers[2].W + q.layers[2].b
    np.testing.assert_allclose(jax.jit(ffn)(p, x), out, rtol=1e-5, atol=1e-6)
    final = FFN(4, (8, 3), 2, activation="tanh", activate_final=True)
    np.testing.assert_allclose(jax.jit(final)(p, x), np.tanh(out), rtol=1e-5, atol=1e-6)


def test_ffn_hidden_sizes_are_normalised_and_hashable():
    assert FFN(2, [3, 4], 1).hidden_sizes == (3, 4)
    assert FFN(2, 3, 1).hidden_sizes == (3,)
    assert hash(FFN(2, [3], 1)) == hash(FFN(2, (3,), 1)) and FFN(2, [3], 1) == FFN(2, (3,), 1)


def test_softmax_head_outputs(key):
    head = SoftmaxHead(4, 3)
    p = head.init(key)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32) * 3

    @jax.jit
    def outputs(p, x):
        heads = [SoftmaxHead(4, 3, output=o) for o in ("log_softmax", "softmax", "logits")]
        return head.logits(p, x), *(h(p, x) for h in heads)

    logits, log_probs, probs, raw = outputs(p, x)
    expected = x @ np.asarray(p.W) + np.asarray(p.b)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(raw, logits)
    z = np.exp(expected - expected.max(-1, keepdims=True))
    np.testing.assert_allclose(probs, z / z.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.exp(log_probs), probs, rtol=1e-5, atol=1e-6)


def test_sequential_composes_and_splits_keys(key):
    net = Sequential([Linear(3, 4), Activation("relu"), SoftmaxHead(4, 2)])
    p = net.init(key)
    assert [path for path, _ in p.items()] == [
        "/layers[0]/W",
        "/layers[0]/b",
        "/layers[2]/W",
        "/layers[2]/b",
    ]
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    q = jax.tree.map(np.asarray, p)
    z = np.maximum(x @ q.layers[0].W + q.layers[0].b, 0) @ q.layers[2].W + q.layers[2].b
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(jax.jit(net)(p, x), log_probs, rtol=1e-5, atol=1e-6)
    # Layers get independent keys: the two Linear weights differ.
    assert not np.allclose(p.layers[0].W[:3, :2], p.layers[2].W[:3, :2])


def test_modules_are_static_hashable_hyperparameters(key):
    layer = Linear(3, 2)
    assert layer == Linear(3, 2) and hash(layer) == hash(Linear(3, 2))
    with pytest.raises(AttributeError):
        layer.in_features = 4
    f = jax.jit(lambda m, p, x: m(p, x), static_argnums=0)
    p = layer.init(key)
    expected = np.asarray(p.W).sum(0) + np.asarray(p.b)
    np.testing.assert_allclose(f(layer, p, jnp.ones((1, 3)))[0], expected, rtol=1e-5)


def test_linear_bias_is_independent_of_weights(key):
    p = Linear(4, 2000, b_init="normal").init(key)
    r = np.corrcoef(np.asarray(p.W[0]), np.asarray(p.b))[0, 1]
    assert abs(r) < 0.15, r  # same-key draws gave b == W[0] up to scale (r = 1)


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "reported"),
    [
        ("Linear", "Linear"),
        ("FFN(4, tanh)", "FFN"),
        ("SoftmaxHead", "SoftmaxHead"),
        ("Sequential", "Linear"),  # the first layer reports
    ],
)
def test_wrong_input_shape_names_layer_expected_and_actual(name, reported, key):
    layer = LAYERS[name](3, 2)
    p = layer.init(key)
    msg = f"{reported}(in_features=3): expected input with last axis 3, got shape (4, 5)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        layer(p, jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=re.escape("got shape ()")):
        layer(p, jnp.ones(()))
    with pytest.raises(ValueError, match=re.escape("got shape (4, 5)")):
        jax.jit(layer)(p, jnp.ones((4, 5)))


def test_params_of_the_wrong_depth_are_refused(key):
    p = FFN(4, (8,), 2).init(key)
    with pytest.raises(
        ValueError, match=r"FFN\(in_features=4\): params have 2 layers, the module has 3"
    ):
        FFN(4, (8, 8), 2)(p, jnp.ones((1, 4)))
    seq = Sequential((Linear(4, 2),))
    with pytest.raises(ValueError, match="Sequential: params have 2 layers, the module has 1"):
        seq(p, jnp.ones((1, 4)))


def test_invalid_hyperparameters_explain_themselves():
    with pytest.raises(ValueError, match="Linear: in_features must be a positive int, got 0"):
        Linear(0, 3)
    with pytest.raises(ValueError, match="out_features must be a positive int, got 2.0"):
        Linear(3, 2.0)
    with pytest.raises(TypeError, match="modules hold hyperparameters, not arrays"):
        Activation(jnp.ones(2))
    with pytest.raises(
        TypeError, match=r"Sequential: layers\[1\] must be an nnlite Module, got str"
    ):
        Sequential((Linear(2, 2), "relu"))
    with pytest.raises(
        ValueError, match="unknown output 'probs'; valid: log_softmax, softmax, logits"
    ):
        SoftmaxHead(3, 2, output="probs")


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown initializer 'xavier'; valid: ") as info:
        Linear(2, 3, w_init="xavier")
    for name in ["zeros", "lecun_normal", "lecun_uniform", "glorot_normal", "glorot_uniform"]:
        assert name in str(info.value)
    assert "he_normal" in str(info.value) and "he_uniform" in str(info.value)
    with pytest.raises(ValueError, match="unknown activation 'swish'; valid: relu, gelu, tanh"):
        FFN(2, (3,), 1, activation="swish")
    with pytest.raises(ValueError, match="unknown initializer 'he'"):
        nl.get_initializer("he")


# -- initializers ---------------------------------------------------------------------------
FAN_IN, FAN_OUT = 200, 800

# Target variance of W: [in, out] for each scheme (LeCun 1998, Glorot & Bengio 2010, He 2015).
VARIANCES = {
    "lecun_normal": 1 / FAN_IN,
    "lecun_uniform": 1 / FAN_IN,
    "glorot_normal": 2 / (FAN_IN + FAN_OUT),
    "glorot_uniform": 2 / (FAN_IN + FAN_OUT),
    "he_normal": 2 / FAN_IN,
    "he_uniform": 2 / FAN_IN,
    "normal": 1.0,
}


@pytest.mark.parametrize("name", list(VARIANCES))
def test_initializer_variance_and_fan(name, key):
    W = np.asarray(Linear(FAN_IN, FAN_OUT, w_init=name).init(key).W, np.float64)
    var = VARIANCES[name]
    assert abs(W.mean()) < 0.02 * np.sqrt(var)
    assert W.var() == pytest.approx(var, rel=0.05)
    bound = np.sqrt(3 * var)  # U(-a, a) has variance a^2 / 3
    if name.endswith("uniform"):
        assert 0.99 * bound < np.abs(W).max() <= bound * (1 + 1e-6)
    else:
        assert np.abs(W).max() > 1.1 * bound  # normal tails reach past the uniform bound


def test_zeros_and_default_initializers(key):
    p = Linear(FAN_IN, FAN_OUT, w_init="zeros").init(key)
    assert not np.any(p.W) and not np.any(p.b)
    assert Linear(3, 2).init(key).b.tolist() == [0.0, 0.0]
    # FFN picks He for relu-like activations and LeCun otherwise.
    relu_w = FFN(FAN_IN, (), FAN_OUT).init(key).layers[0].W
    tanh_w = FFN(FAN_IN, (), FAN_OUT, activation="tanh").init(key).layers[0].W
    assert float(jnp.var(relu_w)) == pytest.approx(2 / FAN_IN, rel=0.05)
    assert float(jnp.var(tanh_w)) == pytest.approx(1 / FAN_IN, rel=0.05)


# -- params that do not fit the module (issue 14.6) -----------------------------------------
def test_params_of_another_shape_are_refused_naming_the_path():
    W, b = jnp.zeros((5, 9)), jnp.zeros(9)
    msg = "Linear(5, 7): params /W has shape (5, 9), expected (5, 7)"
    with pytest.raises(nl.ParamsMismatchError, match=re.escape(msg)):
        Linear(5, 7)(nl.ParamsDict(W=W, b=b), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match=re.escape(msg)):  # at trace time under jit too
        jax.jit(Linear(5, 7))(nl.ParamsDict(W=W, b=b), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match=re.escape("params /b has shape (9,), expected (7,)")):
        Linear(5, 7)(nl.ParamsDict(W=jnp.zeros((5, 7)), b=b), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match=re.escape("Linear(5, 7): params /b is missing")):
        Linear(5, 7)(nl.ParamsDict(W=jnp.zeros((5, 7))), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="params /W has dtype bfloat16, expected float32"):
        Linear(5, 7)(nl.ParamsDict(W=jnp.zeros((5, 7), jnp.bfloat16), b=b[:7]), jnp.ones(5))
    # Nested layers name the full path from the outermost module.
    ffn = FFN(4, (8,), 2)
    p = nl.ParamsDict(
        layers=[
            nl.ParamsDict(W=jnp.zeros((4, 8)), b=jnp.zeros(8)),
            nl.ParamsDict(W=jnp.zeros((8, 3)), b=jnp.zeros(3)),
        ]
    )
    msg = "FFN(4, (8,), 2): params /layers[1]/W has shape (8, 3), expected (8, 2)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        ffn(p, jnp.ones((1, 4)))
    net = Sequential((FFN(4, (8,), 2), Activation("relu")))
    with pytest.raises(
        ValueError, match=re.escape("Sequential(2 layers): params /layers[0]/layers[1]/W")
    ):
        net(nl.ParamsDict(layers=[p, nl.ParamsDict()]), jnp.ones((1, 4)))


def test_string_input_is_refused_with_its_dtype():
    with pytest.raises(
        ValueError, match=r"Linear\(in_features=1\): expected a numeric array, got dtype <U1"
    ):
        Linear(1, 1)(nl.ParamsDict(W=jnp.ones((1, 1)), b=jnp.ones(1)), np.array([["a"]]))


def test_bf16_compute_with_f32_params(key):
    p = Linear(3, 2).init(key)
    x = jnp.ones((4, 3))
    y = Linear(3, 2, dtype="bfloat16")(p, x)
    assert y.dtype == jnp.bfloat16 and p.W.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float32), Linear(3, 2)(p, x), rtol=0.02, atol=0.02)
    assert Linear(3, 2)(p, x.astype(jnp.bfloat16)).dtype == jnp.float32  # promotes with params


def test_plain_dict_params_and_missing_children_are_named():
    layer = Linear(2, 3)
    p = {"W": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    assert layer(p, jnp.ones(2)).shape == (3,)  # item access: a plain dict works too
    with pytest.raises(ValueError, match=re.escape("FFN(2, (4,), 1): params /layers is missing")):
        FFN(2, (4,), 1)(nl.ParamsDict(W=jnp.ones((2, 4))), jnp.ones(2))
    block = nl.TransformerBlock(4, 2)
    with pytest.raises(
        ValueError, match=re.escape("TransformerBlock(4, 2): params /ln1 is missing")
    ):
        block(nl.ParamsDict(), jnp.ones((3, 4)))
