"""The layers with hand rules added after the first set: silu/leaky_relu/elu, ConvTranspose,
AdaptiveAvgPool/AdaptiveMaxPool, RotaryEmbedding (and attention with it), GRUCell,
LSTMCell and RNN.

Every rule against ``jax.vjp`` (``check_rule``) in float32 and float64; every layer's shape,
dtype, jit, grad and vmap; each layer under ``nl.manual_grads`` against ``jax.grad``;
numpy references written from PyTorch's formulas; cached rotary decoding against the full
forward.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check_many import check_many, rule_case

import nnlite as nl
from nnlite.nn import _adaptive_pool
from train.model.contract import objective_fn

DTYPES = ["float32", "float64"]
EPS32 = float(np.finfo(np.float32).eps)


def _np(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- every new rule against jax.vjp -----------------------------------------------------------
# Each test checks its cases in one check_rule (tests/_check_many.py: one compile, not one per
# case; a failure names its rule), once per dtype (the rand fixture).


def test_activation_rules(rand):
    cases = [
        ("silu", {}),
        ("leaky_relu", {}),
        ("leaky_relu", {"negative_slope": 0.2}),
        ("elu", {}),
        ("elu", {"alpha": 0.5}),
    ]
    check_many(rule_case(getattr(nl.rules, n), rand(4, 5) * 3, **st) for n, st in cases)


def test_activations_are_named_and_match_jax_nn():
    x = jax.device_put(np.linspace(-4, 4, 17, dtype=np.float32))
    refs = {"silu": jax.nn.silu, "leaky_relu": jax.nn.leaky_relu, "elu": jax.nn.elu}
    for name in refs:
        assert nl.get_activation(name) is getattr(nl, name)

    @jax.jit  # every value below in one compile
    def values(x):
        zero = jnp.zeros(3)
        return {
            name: (
                (nl.ACTIVATIONS[name](x), ref(x)),
                # at the kinks
                (
                    getattr(nl.rules, name).f_vjp(zero, jnp.ones(3)),
                    jax.grad(lambda z, n=name: jnp.sum(getattr(nl.rules, n)(z)))(zero),
                ),
            )
            for name, ref in refs.items()
        }

    for (ours, ref), (rule, auto) in values(x).values():
        np.testing.assert_allclose(ours, ref, rtol=1e-6)
        # At the kinks the rules give jax.nn's gradients, so manual and autodiff agree there.
        np.testing.assert_allclose(rule, auto)


CONV_T_CASES = [
    # kernel, strides, padding, dilation
    ((3,), (2,), "SAME", (1,)),
    ((4,), (2,), ((1, 2),), (1,)),  # explicit, asymmetric crop
    ((2,), (3,), "VALID", (1,)),  # stride > kernel: gaps in the output
    ((3,), (1,), ((2, 0),), (2,)),  # dilation
    ((1,), (3,), "SAME", (1,)),  # kernel 1, SAME pads the high side with zeros
    ((3, 2), (2, 1), "SAME", (1, 1)),  # 2-d
    ((2, 3), (2, 2), ((0, 1), (1, 1)), (1, 1)),
]


def test_conv_transpose_rule(rand):
    cases = []
    for kernel, strides, padding, dilation in CONV_T_CASES:
        n = len(kernel)
        x = rand(2, *(5, 4)[:n], 3)
        W = rand(*kernel, 3, 4)
        static = dict(strides=strides, padding=padding, dilation=dilation)
        cases.append(rule_case(nl.rules.conv_transpose, x, W, rand(4), **static))
        if padding == "SAME" and dilation[0] == 1 and kernel[0] == 3:  # the first 1-d and 2-d
            # no bias: the bias is added after the transposed conv, whatever its geometry
            cases.append(rule_case(nl.rules.conv_transpose, x, W, None, **static))
    check_many(cases)


ADAPTIVE_CASES = [
    ((2, 7, 3), (3,)),  # overlapping bins
    ((2, 9, 3), (3,)),  # exact tiling
    ((2, 3, 2), (7,)),  # more outputs than inputs: inputs repeat
    ((2, 5, 9, 3), (3, 4)),
    ((3, 6, 2), (1, 5)),
    ((4, 2), (1,)),  # unbatched, global
    ((2, 3, 4, 5, 2), (2, 3, 3)),  # 3-d
]


def test_adaptive_pool_rules(rand):
    cases = []
    for shape, out in ADAPTIVE_CASES:
        x = rand(*shape)
        cases.append(rule_case(nl.rules.adaptive_avg_pool, x, output_size=out))
        cases.append(rule_case(nl.rules.adaptive_max_pool, x, output_size=out))
    check_many(cases)


def test_adaptive_max_pool_ties_go_to_the_first_maximum():
    # After relu most entries tie at 0: the rule and JAX's autodiff both pick the first.
    x = jax.device_put(np.maximum(_np(2, 7, 6, 3) - 1.0, 0.0))
    check_many([rule_case(nl.rules.adaptive_max_pool, x, output_size=(3, 2))])
    dx = nl.rules.adaptive_max_pool.f_vjp(
        jnp.zeros((1, 4, 1)), jnp.ones((1, 2, 1)), output_size=(2,)
    )
    assert dx[0, :, 0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_rotary_rule(rand):
    rotary = nl.rules.rotary
    check_many(
        [
            rule_case(rotary, rand(2, 5, 3, 8), jax.device_put(np.arange(5)[:, None])),
            rule_case(rotary, rand(5, 6), jax.device_put(np.arange(5) + 100), base=500.0),
            rule_case(rotary, rand(2, 4, 6), jnp.array([[0, 1, 2, 3], [5, 6, 7, 8]])),  # per row
        ]
    )


def test_recurrent_rules(rand):
    F, H = 3, 4
    W3, U3, W4, U4 = rand(F, 3 * H), rand(H, 3 * H), rand(F, 4 * H), rand(H, 4 * H)
    R = nl.rules
    cases = []
    for lead in [(), (2, 3)]:  # one example; two batch axes
        x, h, c = rand(*lead, F), rand(*lead, H), rand(*lead, H)
        cases.append(rule_case(R.gru_cell, x, h, W3, U3, rand(3 * H), rand(H)))
        cases.append(rule_case(R.lstm_cell, x, h, c, W4, U4, rand(4 * H)))
    xs, h0, c0 = rand(2, 6, F), rand(2, H), rand(2, H)
    cases.append(rule_case(R.gru_scan, xs, h0, W3, U3, rand(3 * H), rand(H)))
    cases.append(rule_case(R.lstm_scan, xs, h0, c0, W4, U4, rand(4 * H)))
    index = (slice(None), -1, 1, slice(None))
    cases.append(rule_case(R.subarray, rand(2, 6, 2, H), index=index))
    # No biases and no state (a fresh sequence's zeros made inside the rule, no
    # cotangent), both optional paths in one check per rule; the LSTM scan in one step
    cases.append(rule_case(R.gru_cell, rand(2, F), None, W3, U3, None, None))
    cases.append(rule_case(R.lstm_cell, rand(2, F), None, None, W4, U4, None))
    cases.append(rule_case(R.gru_scan, xs, None, W3, U3, None, None))
    cases.append(rule_case(R.lstm_scan, rand(2, 1, F), None, None, W4, U4, None))
    check_many(cases)


def test_the_rules_are_listed():
    new = [
        "adaptive_avg_pool", "adaptive_max_pool", "conv_transpose", "elu", "gru_cell",
        "gru_scan", "leaky_relu", "lstm_cell", "lstm_scan", "rotary", "silu", "subarray", "stack_scan",
    ]  # fmt: skip
    for name in new:
        f, f_vjp = nl.rules.RULES[name]
        assert f.f_vjp is f_vjp and name in nl.rules.__all__ and f"{name}_vjp" in nl.rules.__all__


# -- numpy references (PyTorch's formulas) ----------------------------------------------------


def _conv_transpose_ref(x, W, strides, pads, dilation):
    """PyTorch's ConvTranspose as a scatter: input m and tap k land at m s + k d of the
    full output, which the padding crops."""
    n = W.ndim - 2
    in_sp, ks = x.shape[1:-1], W.shape[:n]
    full = [(m - 1) * s + (k - 1) * d + 1 for m, s, k, d in zip(in_sp, strides, ks, dilation)]
    y = np.zeros((x.shape[0], *full, W.shape[-1]))
    for m in itertools.product(*(range(v) for v in in_sp)):
        for k in itertools.product(*(range(v) for v in ks)):
            at = tuple(mi * s + ki * d for mi, s, ki, d in zip(m, strides, k, dilation))
            y[(slice(None), *at)] += x[(slice(None), *m)] @ W[k]
    crop = tuple(slice(lo, f - hi) for (lo, hi), f in zip(pads, full))
    return y[(slice(None), *crop)]


@pytest.mark.parametrize("kernel, strides, padding, dilation", CONV_T_CASES)
def test_conv_transpose_matches_pytorch_formula(kernel, strides, padding, dilation):
    n = len(kernel)
    layer = nl.ConvTranspose(3, 4, kernel, strides, padding, dilation, use_bias=False)
    x, W = _np(2, *(5, 4)[:n], 3), _np(*kernel, 3, 4, seed=1)
    y = layer(nl.ParamsDict(W=jax.device_put(W)), jax.device_put(x))
    if padding == "VALID":
        pads = ((0, 0),) * n
    elif padding == "SAME":  # out = in * stride; the conv it transposes pads as "SAME"
        spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
        totals = [max(k - s, 0) for k, s in zip(spans, strides)]
        pads = tuple((t // 2, t - t // 2) for t in totals)
    else:
        pads = padding
    ref = _conv_transpose_ref(x.astype(np.float64), W.astype(np.float64), strides, pads, dilation)
    if padding == "SAME":
        want = tuple(m * s for m, s in zip(x.shape[1:-1], strides))
        # kernel < stride: the full output is short of in * stride; the rest is zeros.
        ref = np.pad(ref, [(0, 0)] + [(0, w - r) for w, r in zip(want, ref.shape[1:-1])] + [(0, 0)])
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_conv_transpose_is_the_adjoint_of_conv(key):
    # <conv(u), x> == <u, conv_transpose(x)> with the kernel's in/out swapped.
    for kernel, strides, padding in [(3, 2, "SAME"), (4, 2, 1), (3, 2, "VALID")]:
        ct = nl.ConvTranspose(3, 5, kernel, strides, padding, use_bias=False)
        conv = nl.Conv(5, 3, kernel, strides, padding, use_bias=False)
        x = jax.device_put(_np(2, 6, 3))
        W = jax.device_put(_np(kernel, 3, 5, seed=1))
        y = ct(nl.ParamsDict(W=W), x)
        u = jax.device_put(_np(*y.shape, seed=2))
        cu = conv(nl.ParamsDict(W=jnp.swapaxes(W, -1, -2)), u)
        assert cu.shape == x.shape
        # float32 sums that cancel: the bound is float rounding of the terms' magnitude
        scale = float(jnp.sum(jnp.abs(u * y)))
        np.testing.assert_allclose(jnp.sum(cu * x), jnp.sum(u * y), rtol=0, atol=1e-5 * scale)


def _adaptive_ref(x, out, reduce):
    n = len(out)
    sp = x.shape[-n - 1 : -1]
    y = np.zeros(x.shape[: -n - 1] + tuple(out) + x.shape[-1:])
    axes = tuple(range(x.ndim - n - 1, x.ndim - 1))
    for idx in itertools.product(*(range(o) for o in out)):
        # PyTorch: start = floor(i L / O), end = ceil((i + 1) L / O)
        box = tuple(
            slice(int(np.floor(i * L / o)), int(np.ceil((i + 1) * L / o)))
            for i, L, o in zip(idx, sp, out)
        )
        y[(Ellipsis, *idx, slice(None))] = reduce(x[(Ellipsis, *box, slice(None))], axis=axes)
    return y


def test_adaptive_pools_match_pytorch_bins():
    xs = [_np(*shape) for shape, _ in ADAPTIVE_CASES]
    pools = [(nl.AdaptiveAvgPool(out), nl.AdaptiveMaxPool(out)) for _, out in ADAPTIVE_CASES]
    ys = jax.jit(  # every case's two pools in one compile
        lambda xs: [(a(nl.ParamsDict(), x), m(nl.ParamsDict(), x)) for (a, m), x in zip(pools, xs)]
    )([jax.device_put(x) for x in xs])
    for (shape, out), x, (y_avg, y_max) in zip(ADAPTIVE_CASES, xs, ys):
        for y, reduce in [(y_avg, np.mean), (y_max, np.max)]:
            want = _adaptive_ref(x, out, reduce)
            np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6, err_msg=f"{shape} {out}")
    assert _adaptive_pool.adaptive_bins(10, 4) == [(0, 3), (2, 5), (5, 8), (7, 10)]


def _sigmoid(a):
    return 1 / (1 + np.exp(-a))


def _torch_gru_step(x, h, w_ih, w_hh, b_ih, b_hh):
    """torch.nn.GRUCell's documented equations, gate order (r, z, n)."""
    gi, gh = x @ w_ih.T + b_ih, h @ w_hh.T + b_hh
    (i_r, i_z, i_n), (h_r, h_z, h_n) = np.split(gi, 3, -1), np.split(gh, 3, -1)
    r, z = _sigmoid(i_r + h_r), _sigmoid(i_z + h_z)
    n = np.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h


def _torch_lstm_step(x, h, c, w_ih, w_hh, b_ih, b_hh):
    """torch.nn.LSTMCell's documented equations, gate order (i, f, g, o)."""
    i, f, g, o = np.split(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh, 4, -1)
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    return _sigmoid(o) * np.tanh(c), c


def test_gru_and_lstm_steps_match_pytorchs_equations():
    F, H, B = 3, 5, 4
    x, h, c = _np(B, F), _np(B, H, seed=1), _np(B, H, seed=2)
    # GRU, from PyTorch's parameters: W = weight_ih.T, U = weight_hh.T, b = b_ih + b_hh
    # with b_hh's n part moved to b_n.
    w_ih, w_hh, b_ih, b_hh = (
        _np(3 * H, F, seed=3),
        _np(3 * H, H, seed=4),
        _np(3 * H, seed=5),
        _np(3 * H, seed=6),
    )
    b = b_ih + np.concatenate([b_hh[: 2 * H], np.zeros(H, np.float32)])
    p = nl.ParamsDict(W=w_ih.T, U=w_hh.T, b=b, b_n=b_hh[2 * H :])
    p = jax.tree.map(jnp.asarray, p)
    got = nl.GRUCell(F, H)(p, jax.device_put(x), jax.device_put(h))
    np.testing.assert_allclose(
        got, _torch_gru_step(x, h, w_ih, w_hh, b_ih, b_hh), rtol=1e-5, atol=1e-6
    )
    # LSTM: W = weight_ih.T, U = weight_hh.T, b = b_ih + b_hh.
    w_ih, w_hh, b_ih, b_hh = (
        _np(4 * H, F, seed=7),
        _np(4 * H, H, seed=8),
        _np(4 * H, seed=9),
        _np(4 * H, seed=10),
    )
    p = jax.tree.map(jnp.asarray, nl.ParamsDict(W=w_ih.T, U=w_hh.T, b=b_ih + b_hh))
    got_h, got_c = nl.LSTMCell(F, H)(p, jax.device_put(x), (jax.device_put(h), jax.device_put(c)))
    want_h, want_c = _torch_lstm_step(x, h, c, w_ih, w_hh, b_ih, b_hh)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell", [nl.GRUCell(3, 4), nl.LSTMCell(3, 4)], ids=["gru", "lstm"])
def test_rnn_equals_the_cell_stepped_in_python(cell, key):
    rnn = nl.RNN(cell, return_carry=True)
    p = _random_params(rnn)  # numpy-drawn: no init to compile
    x = jax.device_put(_np(2, 7, 3))

    def stepped(p, x):  # the Python loop, unrolled under jit
        state, hs = cell.zero_carry((2,)), []
        for t in range(7):
            state = cell(p, x[:, t], state)
            hs.append(_out(state))
        return state, jnp.stack(hs, axis=1)

    # The carry continues a sequence: two halves equal the whole.
    def halves(p, x):
        first, hs1 = rnn(p, x[:, :3])
        _, hs2 = rnn(p, x[:, 3:], first)
        return jnp.concatenate([hs1, hs2], axis=1)

    (carry, hs), (state, want), by_halves = jax.jit(  # the three in one compile
        lambda p, x: (rnn(p, x), stepped(p, x), halves(p, x))
    )(p, x)
    np.testing.assert_allclose(hs, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(carry), jax.tree.leaves(state)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(by_halves, hs, rtol=1e-5, atol=1e-6)


def test_rotary_matches_the_complex_rotation():
    D, T = 8, 6
    x, offset = _np(T, D), 11
    pos = np.arange(T) + offset
    theta = 10000.0 ** (-np.arange(D // 2) * 2 / D)
    z = (x[:, : D // 2] + 1j * x[:, D // 2 :]) * np.exp(1j * pos[:, None] * theta)
    want = np.concatenate([z.real, z.imag], axis=-1)
    got = nl.RotaryEmbedding(D)(nl.ParamsDict(), jax.device_put(x), offset=offset)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rotary_scores_depend_on_relative_positions_only():
    rope = nl.RotaryEmbedding(8)
    q, k = jax.device_put(_np(5, 8)), jax.device_put(_np(5, 8, seed=1))

    def scores(offset):
        p = nl.ParamsDict()
        return rope(p, q, offset=offset) @ rope(p, k, offset=offset).T

    np.testing.assert_allclose(scores(0), scores(37), rtol=1e-4, atol=1e-4)


def test_rotary_static_positions_are_constant_tables_traced_ones_are_computed(monkeypatch):
    """A static offset rotates by cos and sin tables built at trace time (constants: no
    cosine in the compiled program, with autodiff or with the hand rules); a traced offset
    computes them. Both give the same rotation and the same gradient."""
    rope = nl.RotaryEmbedding(8)
    x, w = jax.device_put(_np(2, 5, 8)), _np(1, 5, 8, seed=1)
    pos = rope.positions(5, 4)
    assert isinstance(pos, np.ndarray) and pos.tolist() == [4, 5, 6, 7, 8]

    def static(x):
        return jnp.sum(rope(nl.ParamsDict(), x, offset=4) * w)

    def traced(x, offset):
        return jnp.sum(rope(nl.ParamsDict(), x, offset=offset) * w)

    offset = jnp.asarray(4)
    np.testing.assert_allclose(jax.jit(static)(x), jax.jit(traced)(x, offset), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        jax.jit(jax.grad(static))(x), jax.jit(jax.grad(traced))(x, offset), rtol=1e-5, atol=1e-5
    )
    manual = nl.manual_grads(lambda p, x: static(x), check=False)
    hand = jax.jit(jax.grad(manual, argnums=1))
    np.testing.assert_allclose(hand(nl.ParamsDict(), x), jax.grad(static)(x), rtol=1e-5, atol=1e-5)
    for program, args in ((jax.jit(jax.grad(static)), (x,)), (hand, (nl.ParamsDict(), x))):
        text = program.lower(*args).as_text()
        assert "cosine" not in text and "sine" not in text
    assert "cosine" in jax.jit(jax.grad(traced)).lower(x, offset).as_text()
    # past MAX_TABLE entries static positions are computed in the program too, the same
    monkeypatch.setattr(nl.nn._rotary, "MAX_TABLE", 4)
    long = jax.jit(lambda x: static(x))  # a new function: jax's trace cache keeps the old one
    assert "cosine" in long.lower(x).as_text()
    np.testing.assert_allclose(long(x), jax.jit(traced)(x, offset), rtol=1e-5, atol=1e-5)


# -- every layer: shape, dtype, jit, grad, vmap -----------------------------------------------

LAYERS = {
    # name: (layer, input shape with batch axis 2 first)
    # (3,), not 3: the grid also runs two leading batch axes, which an int size refuses.
    "ConvTranspose1d": (nl.ConvTranspose(3, 4, (3,), strides=2), (2, 5, 3)),
    "ConvTranspose2d": (nl.ConvTranspose(3, 4, (2, 3), strides=(2, 1), padding=1), (2, 5, 4, 3)),
    "AdaptiveAvgPool": (nl.AdaptiveAvgPool((2, 3)), (2, 5, 7, 3)),
    "AdaptiveMaxPool": (nl.AdaptiveMaxPool((3,)), (2, 7, 3)),
    "RotaryEmbedding": (nl.RotaryEmbedding(4), (2, 5, 4)),
    "GRUCell": (nl.GRUCell(3, 4), (2, 3)),
    "LSTMCell": (nl.LSTMCell(3, 4), (2, 3)),
    "RNN(GRU)": (nl.RNN(nl.GRUCell(3, 4)), (2, 5, 3)),
    "RNN(LSTM)": (nl.RNN(nl.LSTMCell(3, 4)), (2, 5, 3)),
    "MHA(rotary)": (nl.MultiHeadAttention(8, 2, causal=True, rotary=True), (2, 5, 8)),
    "FFN(silu)": (nl.FFN(3, (4,), 2, activation="silu"), (2, 3)),
    "FFN(leaky_relu)": (nl.FFN(3, (4,), 2, activation="leaky_relu"), (2, 3)),
    "FFN(elu)": (nl.FFN(3, (4,), 2, activation="elu"), (2, 3)),
}


def _out(y):
    """A layer's result as one array (an LSTM cell returns (h, c))."""
    return y[0] if isinstance(y, tuple) else y


def _manual_vs_auto(layer, x):
    """``(both, check)``: ``both(p, x)`` gives autodiff's and the manual gradient of an MSE
    loss of the layer's output; ``check(auto, hand)`` asserts they agree to rounding."""
    p = _random_params(layer)
    out = jax.eval_shape(lambda: _out(layer(p, x)))
    target = jax.device_put(_np(*out.shape, seed=9))

    def loss(p, x):
        return nl.mse(_out(layer(p, x)), target, reduction="mean")

    def both(p, x):
        return jax.grad(loss)(p, x), jax.grad(nl.manual_grads(loss))(p, x)

    def check(auto, hand):
        _assert_grads_close(auto, hand, terms=max(x.size, out.size))

    return both, check


def _random_params(layer, seed=0):
    shapes = jax.eval_shape(layer.init, jax.random.key(0))
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jax.device_put(np.asarray(0.5 * rng.standard_normal(s.shape), s.dtype)), shapes
    )


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_grid(name):
    """Shape, dtype, jit, grad, vmap; and (but for the param-less rotary embedding) the
    layer under nl.manual_grads against jax.grad, in the same compiled program."""
    layer, shape = LAYERS[name]
    p = _random_params(layer)
    x = jax.device_put(_np(*shape))
    manual = _manual_vs_auto(layer, x) if not name.startswith("Rotary") else None

    @jax.jit  # one compile for the grid and the manual check
    def run(p, x):
        y = _out(layer(p, x))
        y_single = jax.vmap(lambda x: _out(layer(p, x)))(x)  # one example at a time
        grads = jax.grad(lambda p, x: jnp.sum(_out(layer(p, x)) ** 2), argnums=(0, 1))(p, x)
        return y, y_single, grads, manual and manual[0](p, x)

    y, y_single, (g_p, g_x), both = run(p, x)
    if manual:
        manual[1](*both)
    assert y.dtype == jnp.float32 and y.shape[0] == 2
    assert jax.eval_shape(lambda: _out(layer(p, x[0]))).shape == y.shape[1:]  # unbatched
    two = jax.eval_shape(lambda: _out(layer(p, jnp.stack([x, x]))))  # two batch axes
    assert two.shape == (2, *y.shape)
    np.testing.assert_allclose(y_single, y, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(g_p) == jax.tree.structure(p)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves((g_p, g_x)))
    assert float(jnp.abs(g_x).sum()) > 0
    # bfloat16: a layer with params computes in its dtype, one without in the input's.
    if hasattr(layer, "dtype"):
        bf = dataclasses.replace(layer, dtype="bfloat16")
        assert jax.eval_shape(lambda: _out(bf(p, x))).dtype == jnp.bfloat16
    elif not jax.tree.leaves(p):
        assert jax.eval_shape(lambda: _out(layer(p, x.astype(jnp.bfloat16)))).dtype == jnp.bfloat16


def test_rnn_cells_in_bfloat16_compute(key):
    rnn = nl.RNN(nl.LSTMCell(3, 4, dtype="bfloat16"))
    hs = jax.jit(lambda key: rnn(rnn.init(key), jnp.ones((2, 5, 3))))(key)  # one compile
    assert hs.dtype == jnp.bfloat16 and hs.shape == (2, 5, 4)


# -- manual mode: the hand rules give jax.grad's gradients --------------------------------------


def _assert_grads_close(auto, hand, terms):
    """Equal to float32 rounding. The two passes compute the same sums in different
    orders; a sum of ``terms`` products rounds by at most ``terms * eps`` relative to its
    scale (the bound for recursive summation), so that is the tolerance, with ``terms``
    the size of the largest activation a gradient entry sums over."""
    for path, a in jax.tree_util.tree_flatten_with_path(auto)[0]:
        h = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], path, hand)
        scale = float(jnp.max(jnp.abs(a)))
        err = float(jnp.max(jnp.abs(a - h)))
        assert err <= terms * EPS32 * scale, (jax.tree_util.keystr(path), err, scale)


def test_manual_grads_through_a_model_of_every_new_layer(key):
    """One model of them all (ConvTranspose, the activations, both adaptive pools, rotary
    attention, a GRU's final carry feeding an LSTM's): the manual check passes and every
    param's gradient is autodiff's."""
    layers = dict(
        up=nl.ConvTranspose(2, 4, 3, strides=2),
        pool=nl.AdaptiveAvgPool(6),
        mpool=nl.AdaptiveMaxPool(6),
        attn=nl.MultiHeadAttention(4, 2, causal=True, rotary=True),
        gru=nl.RNN(nl.GRUCell(4, 5), return_carry=True),
        lstm=nl.RNN(nl.LSTMCell(5, 3), return_carry=True),
        head_gru=nl.Linear(5, 2),
        head_lstm=nl.Linear(3, 2),
    )
    # numpy-drawn params: no compile per random op of eight inits
    p = nl.ParamsDict(**{n: _random_params(m, seed=i) for i, (n, m) in enumerate(layers.items())})
    x, y = jax.device_put(_np(3, 5, 2)), jnp.array([0, 1, 1])

    def loss(p, x):
        m = layers
        h = nl.silu(m["up"](p.up, x))  # [3, 10, 4]
        h = nl.add(nl.leaky_relu(m["pool"](p.pool, h)), nl.elu(m["mpool"](p.mpool, h)))
        h = nl.add(h, m["attn"](p.attn, h))
        gru_last, hs = m["gru"](p.gru, h)
        (h_last, c_last), _ = m["lstm"](p.lstm, hs)
        logits = nl.add(
            m["head_gru"](p.head_gru, gru_last),
            m["head_lstm"](p.head_lstm, nl.add(h_last, nl.tanh(c_last))),
        )
        return nl.softmax_cross_entropy(logits, y, reduction="mean")

    auto, hand = jax.jit(  # both passes in one compile
        lambda *a: (jax.grad(loss)(*a), jax.grad(nl.manual_grads(loss))(*a))
    )(p, x)
    _assert_grads_close(auto, hand, terms=3 * 10 * 4)  # the largest activation, [3, 10, 4]


def test_manual_grads_reach_the_initial_carry(key):
    """The scan rules' cotangent of the initial state: h0 (and c0) held as params."""
    checks = []
    for cell in (nl.GRUCell(3, 4), nl.LSTMCell(3, 4)):
        rnn = nl.RNN(cell, return_carry=True)
        p = nl.ParamsDict(cell=_random_params(rnn), h0=jax.device_put(_np(2, 4, seed=3)))
        p.c0 = jax.device_put(_np(2, 4, seed=4))
        x = jax.device_put(_np(2, 6, 3))

        def loss(p, x, rnn=rnn, cell=cell):
            carry = (p.h0, p.c0) if isinstance(cell, nl.LSTMCell) else p.h0
            last, hs = rnn(p.cell, x, carry)
            last = last[1] if isinstance(last, tuple) else last  # the LSTM's final c
            return nl.add(
                nl.reduce(nl.mse(hs, jnp.zeros_like(hs)), "mean"),
                nl.reduce(nl.mse(last, jnp.ones_like(last)), "mean"),
            )

        checks.append((cell, loss, p, x))
    results = jax.jit(  # both cells, both passes, in one compile
        lambda args: [
            (jax.grad(loss)(p, x), jax.grad(nl.manual_grads(loss))(p, x))
            for (_, loss, _, _), (p, x) in zip(checks, args)
        ]
    )([(p, x) for _, _, p, x in checks])
    for (cell, *_), (auto, hand) in zip(checks, results):
        _assert_grads_close(auto, hand, terms=2 * 6 * 4)  # hs: [2, 6, 4]
        if isinstance(cell, nl.GRUCell):
            assert not np.any(auto.c0)  # unused
        assert np.any(auto.h0)


# -- rotary attention: cached decoding is the full forward ------------------------------------


def test_rotary_cached_decoding_equals_full_forward():
    F, H, T = 16, 2, 7
    mha = nl.MultiHeadAttention(F, H, causal=True, rotary=True)
    p = _random_params(mha)
    x = jax.device_put(_np(2, T, F))
    full, plain = jax.jit(lambda p, x: (mha(p, x), nl.MultiHeadAttention(F, H, causal=True)(p, x)))(
        p, x
    )
    assert not np.allclose(full, plain, atol=1e-3)

    @jax.jit
    def decode(p, x):
        cache = jnp.zeros((2, 2, T, H, F // H))  # k, v: [2, batch, T, heads, head_dim]

        def step(cache, t):  # t traced: the rotation's positions come from it
            q, k, v = mha.qkv(p, jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1), offset=t)
            cache = jax.lax.dynamic_update_slice(
                cache, jnp.stack([k, v])[:, :, :1], (0, 0, t, 0, 0)
            )
            o = mha.project(p, mha.attend(q, cache[0], cache[1], q_offset=t))
            return cache, o[:, 0]

        _, ys = jax.lax.scan(step, cache, jnp.arange(T))
        return jnp.swapaxes(ys, 0, 1)

    np.testing.assert_allclose(decode(p, x), full, rtol=1e-5, atol=1e-5)

    @jax.jit  # one compile, not one per op
    def prompt_then_token(p, x):  # a prompt in one call, then one token: the offset places it
        q, k, v = mha.qkv(p, x[:, :-1])
        q1, k1, v1 = mha.qkv(p, x[:, -1:], offset=T - 1)
        o = mha.attend(q1, jnp.concatenate([k, k1], 1), jnp.concatenate([v, v1], 1))
        return mha.project(p, o)[:, 0]

    np.testing.assert_allclose(prompt_then_token(p, x), full[:, -1], rtol=1e-5, atol=1e-5)


def test_rotary_keeps_attention_params_and_default():
    a, b = nl.MultiHeadAttention(8, 2), nl.MultiHeadAttention(8, 2, rotary=True)
    key = jax.random.key(0)
    assert jax.eval_shape(a.init, key) == jax.eval_shape(b.init, key)
    assert not a.rotary and a == nl.MultiHeadAttention(8, 2, rotary=False)
    block = nl.TransformerBlock(8, 2, rotary=True)
    assert block.attn.rotary
    out = jax.eval_shape(block, jax.eval_shape(block.init, key), jnp.ones((2, 3, 8)))
    assert out.shape == (2, 3, 8)


# -- errors name the layer, the expected and the actual shape -----------------------------------


@pytest.mark.parametrize(
    "layer, x, match",
    [
        (
            nl.ConvTranspose(3, 4, 3),
            jnp.ones((2, 5, 2)),
            r"ConvTranspose\(in_features=3\): expected input with last axis 3.*\(2, 5, 2\)",
        ),
        (nl.ConvTranspose(3, 4, 3, padding=5), jnp.ones((2, 2, 3)), r"ConvTranspose.*crops"),
        (
            nl.AdaptiveAvgPool((2, 2)),
            jnp.ones((4, 3)),
            r"AdaptiveAvgPool\(output_size=\(2, 2\)\): expected .*rank >= 3, got shape \(4, 3\)",
        ),
        (nl.AdaptiveMaxPool(2), jnp.ones((2, 0, 3)), r"AdaptiveMaxPool.*non-empty.*\(2, 0, 3\)"),
        (
            nl.RotaryEmbedding(8),
            jnp.ones((5, 6)),
            r"RotaryEmbedding\(features=8\): expected input with last axis 8.*\(5, 6\)",
        ),
        (
            nl.GRUCell(3, 4),
            jnp.ones((2, 5)),
            r"GRUCell\(3, 4\): expected input with last axis 3, got shape \(2, 5\)",
        ),
        (
            nl.RNN(nl.LSTMCell(3, 4)),
            jnp.ones((2, 5, 2)),
            r"RNN\(LSTMCell\(3, 4\)\): expected input \[..., T >= 1, 3\].*\(2, 5, 2\)",
        ),
        (nl.RNN(nl.LSTMCell(3, 4)), jnp.ones(3), r"RNN\(LSTMCell\(3, 4\)\).*got shape \(3,\)"),
    ],
)
def test_shape_errors_name_the_layer(layer, x, match):
    with pytest.raises(ValueError, match=match):
        layer(_random_params(layer), x)


def test_state_and_hyperparameter_errors(key):
    cell = nl.LSTMCell(3, 4)
    p = _random_params(cell)  # the errors are about shapes: no init to compile
    with pytest.raises(
        ValueError, match=r"LSTMCell\(3, 4\): expected c of shape \(2, 4\).*got \(2, 5\)"
    ):
        cell(p, jnp.ones((2, 3)), (jnp.zeros((2, 4)), jnp.zeros((2, 5))))
    with pytest.raises(ValueError, match=r"LSTMCell\(3, 4\): the carry is the pair \(h, c\)"):
        cell(p, jnp.ones((2, 3)), jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"GRUCell\(3, 4\): expected h of shape \(2, 4\)"):
        nl.GRUCell(3, 4)(_random_params(nl.GRUCell(3, 4)), jnp.ones((2, 3)), jnp.zeros(4))
    gru = nl.GRUCell(3, 4)
    p_gru = _random_params(gru)
    p_gru.U = jnp.zeros((4, 10))
    with pytest.raises(
        nl.ParamsMismatchError,
        match=r"GRUCell\(3, 4\): params /U has shape \(4, 10\), expected \(4, 12\)",
    ):
        gru(p_gru, jnp.ones(3))
    with pytest.raises(ValueError, match=r"RNN\(GRUCell\(3, 4\)\): each carry array"):
        nl.RNN(nl.GRUCell(3, 4))(_random_params(gru), jnp.ones((2, 5, 3)), jnp.zeros((3, 4)))
    with pytest.raises(TypeError, match="RNN: cell must be an nnlite cell"):
        nl.RNN(nl.Linear(3, 4))
    with pytest.raises(ValueError, match="rotary=True needs an even head_dim"):
        nl.MultiHeadAttention(6, 2, rotary=True)
    with pytest.raises(ValueError, match="RotaryEmbedding: features must be even"):
        nl.RotaryEmbedding(5)
    with pytest.raises(ValueError, match="rotary: positions must be an integer array"):
        nl.RotaryEmbedding(4)(nl.ParamsDict(), jnp.ones((3, 4)), positions=jnp.ones(3))
    with pytest.raises(ValueError, match=r"AdaptiveAvgPool: output_size must hold positive ints"):
        nl.AdaptiveAvgPool((2, 0))
    with pytest.raises(ValueError, match=r"ConvTranspose: padding must be"):
        nl.ConvTranspose(3, 4, 3, padding="FULL")


def test_recurrent_init(key):
    cell = nl.GRUCell(5, 6)
    rnn = nl.RNN(nl.GRUCell(5, 6, use_bias=False))
    p, p_rnn = jax.jit(lambda key: (cell.init(key), rnn.init(key)))(key)  # one compile
    assert not np.any(p.b) and not np.any(p.b_n)
    for g in range(3):  # each gate's recurrent block is orthogonal
        block = np.asarray(p.U[:, 6 * g : 6 * (g + 1)], np.float64)
        np.testing.assert_allclose(block.T @ block, np.eye(6), atol=1e-5)
    assert set(jax.eval_shape(nl.LSTMCell(5, 6, use_bias=False).init, key)) == {"W", "U"}
    assert rnn(p_rnn, jnp.ones((5, 5))).shape == (5, 6)  # unbatched, no biases


def test_gpt_with_rotary_positions(key):
    """The GPT's rotary option: no position table, and its cached decoding (each token's
    q and k rotated at its position) equals the full forward; manual == autodiff."""
    from models.gpt import GPT

    gpt = GPT(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=16, positional="rotary")
    p = jax.jit(gpt.init)(key)
    assert "wpe" not in p and gpt.block.attn.rotary
    tokens = jax.device_put(np.asarray(np.random.default_rng(0).integers(0, 11, (2, 8)), jnp.int32))

    def decode(p, tokens):
        def step(cache, pos):
            logits, cache = gpt.decode_step(p, cache, tokens[:, pos], pos)
            return cache, logits

        return jnp.swapaxes(jax.lax.scan(step, gpt.empty_cache(2), jnp.arange(8))[1], 0, 1)

    def loss(p, x, y):
        return objective_fn(gpt)(p, x, y)[0]

    y = jax.device_put(np.roll(np.asarray(tokens), -1, axis=1))
    full, decoded, auto, hand = jax.jit(  # the forward, decoding and both passes: one compile
        lambda p, x, y: (
            gpt(p, x),
            decode(p, x),
            jax.grad(loss)(p, x, y),
            jax.grad(nl.manual_grads(loss))(p, x, y),
        )
    )(p, tokens, y)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    _assert_grads_close(auto, hand, terms=2 * 8 * 4 * 16)  # the MLP's [2, 8, 64] activations
    with pytest.raises(ValueError, match="positional must be one of learned, rotary, got 'alibi'"):
        GPT(vocab_size=11, context=8, positional="alibi")


def test_rnn_scans_any_cell_plainly_for_autodiff(key):
    """A cell without a scan rule (here a user's Elman cell) is scanned by lax.scan."""

    class Elman(nl.Module):
        in_features: int = 3
        hidden: int = 4

        def init(self, key):
            return nl.Linear(self.in_features + self.hidden, self.hidden).init(key)

        def zero_carry(self, batch_shape=(), dtype=None):
            return jnp.zeros((*batch_shape, self.hidden), dtype or jnp.float32)

        def __call__(self, params, x, h, *, key=None):
            lin = nl.Linear(self.in_features + self.hidden, self.hidden)
            return jnp.tanh(lin(params, jnp.concatenate([x, h], axis=-1)))

    rnn = nl.RNN(Elman(), return_carry=True)
    p = rnn.init(key)
    x = jax.device_put(_np(2, 5, 3))
    h, hs = jax.jit(rnn)(p, x)
    assert hs.shape == (2, 5, 4)
    np.testing.assert_allclose(h, hs[:, -1], rtol=1e-6)
    grads = jax.grad(lambda p: jnp.sum(rnn(p, x)[1]))(p)
    assert np.any(grads.W)


def test_show_grad_prints_the_new_rules(key):
    """nl.show_grad writes a model of the new layers as hand-rule calls, and the code runs
    to jax.grad's gradients."""
    lstm = nl.RNN(nl.LSTMCell(2, 4), return_carry=True)
    gru = nl.RNN(nl.GRUCell(4, 4))
    attn = nl.MultiHeadAttention(4, 2, causal=True, rotary=True)
    up = nl.ConvTranspose(4, 2, 3, strides=2)
    # numpy-drawn params: no compile per random op of four inits
    p = nl.ParamsDict(lstm=_random_params(lstm), gru=_random_params(gru, 1))
    p.attn, p.up = _random_params(attn, 2), _random_params(up, 3)

    def loss(p, x, t):
        (h, c), hs = lstm(p.lstm, x)
        hs = nl.add(hs, attn(p.attn, gru(p.gru, hs)))
        y = nl.AdaptiveMaxPool(4)(nl.ParamsDict(), nl.elu(up(p.up, nl.silu(hs))))
        return nl.add(nl.mse(y, t, reduction="mean"), nl.mse(c, h, reduction="mean"))

    x, t = jax.device_put(_np(2, 5, 2)), jnp.zeros((2, 4, 2))
    src = nl.show_grad(loss, p, x, t)
    for rule in ("lstm_scan_vjp(", "gru_scan_vjp(", "rope_vjp(", "conv_transpose_vjp("):
        assert rule in src
    namespace: dict = {}
    exec(src, namespace)  # noqa: S102 -- the point: the printed code runs
    got, auto = jax.jit(  # both in one compile
        lambda *a: (namespace["grad"](*a), jax.grad(loss)(*a))
    )(p, x, t)
    _assert_grads_close(auto, got, terms=2 * 10 * 4)
