# ruff: noqa: E741 -- l is the seed's name for the label
"""The seed project's examples (awf-jaxutils README and its VJP tests) run on nnlite.

Each example is the seed's code as it stands, changed only in its imports and in two
typos of the seed's README: ``relu(t1_long)`` (``t1_long`` is never defined: ``t1``) and
``add_vjp(dy2)`` / ``add_vjp(dt1)``, which leave out the two arguments that the seed's own
``add_vjp(x, y, dret)`` takes. Every gradient is compared with ``jax.grad`` to 1e-6.
"""

import contextlib
import io

import jax
import jax.nn as jnn
import jax.numpy as jnp
import numpy as np
from _common import python_c
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32
from jax import Array as Tensor
from numpy.random import randn

from nnlite import ParamsDict, roundtrip, show_jaxpr
from nnlite.vjp import (
    add,
    add_vjp,
    axpy,
    axpy_vjp,
    check,
    dotall,
    dotall_vjp,
    dup,
    dup_vjp,
    exp,
    exp_vjp,
    index,
    index_vjp,
    log,
    log_vjp,
    mm,
    mm_scaled,
    mm_scaled_vjp,
    mm_scaled_vjp_simple,
    mm_vjp,
    mul,
    mul_vjp,
    negate,
    negate_vjp,
    pair,
    pair_vjp,
    recip,
    recip_vjp,
    relu,
    relu_vjp,
    scale,
    scale_vjp,
    softmax,
    softmax_vjp,
    sum_vjp,
    transpose,
    transpose_vjp,
    xpyzt,
)

Pair = tuple  # the seed's README annotates with Pair[...] and Tensor, defined elsewhere


def rand(*shape):  # the seed's README uses rand(5, 7) without defining it
    return np.random.rand(*shape)


def _close(got, want):
    # float32 rounding of each leaf's scale along the README's ffn and loss: 2 linear, relu,
    # softmax, log (tests/_tolerance.py)
    assert_close_f32(got, want, ops=ROUNDINGS_PER_LAYER * 5)


# -- ParamsDict -----------------------------------------------------------------------------
def test_readme_usage_line():
    code = "from nnlite import ParamsDict ; p = ParamsDict(); p.a = 4; p.print()"
    out = python_c(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "/a: 4\n"


# The jaxutils way.  Keeps us DRY in the early development stage.
def linear_init() -> ParamsDict:
    params = ParamsDict()
    params.W = rand(5, 7)
    params.b = rand(7)
    return params


def my_init() -> ParamsDict:
    params = ParamsDict()
    params.x = jnp.ones((2, 2))
    params.y = jnp.ones((1, 2))
    params.layer = linear_init()
    return params


def test_readme_params_dict_example(capsys):
    params = my_init()
    params.print()
    params.print("test")
    assert capsys.readouterr().out.splitlines() == [
        "/x: f32[2,2]",
        "/y: f32[1,2]",
        "/layer/W: f64[5,7]",
        "/layer/b: f64[7]",
        "test/x: f32[2,2]",
        "test/y: f32[1,2]",
        "test/layer/W: f64[5,7]",
        "test/layer/b: f64[7]",
    ]
    assert [k for k, v in params.items("p")] == ["p/x", "p/y", "p/layer/W", "p/layer/b"]
    assert params.toJSON() == '{\n    "layer": {}\n}'  # arrays are not JSON
    grads = jax.grad(lambda p: jnp.sum(p.layer.W) + jnp.sum(p.x))(params)
    assert isinstance(grads, ParamsDict) and grads.layer.W.shape == (5, 7)


def test_seed_params_dict_hash_as_a_static_argument():
    cfg = ParamsDict(a=4, name="relu")
    f = jax.jit(lambda x, cfg: x * cfg.a, static_argnums=1)
    assert float(f(jnp.float32(2), cfg)) == 8.0
    assert hash(cfg) == hash(ParamsDict(name="relu", a=4))


# -- show_jaxpr -----------------------------------------------------------------------------
def ffn(W, x):
    ((W1, b1), (W2, b2)) = W
    t1 = W1 @ x + b1
    y1 = jnn.relu(t1)
    y2 = W2 @ y1 + b2
    return jnn.softmax(y2)


def test_readme_show_jaxpr_ffn(tmp_path):
    # from the seed's test_emit_readme; the seed's show_jaxpr(ffn, (W, x)) takes the
    # arguments as one tuple, nnlite's show_jaxpr(f, *args) as arguments.
    W = (
        (randn(17, 11), randn(17)),  # W1, b1
        (randn(10, 17), randn(10)),  # W2, b2
    )
    x = randn(11)
    text = show_jaxpr(ffn, W, x, file=tmp_path / "ffn.py", add_main=True)
    assert "def ffn(" in text and (tmp_path / "ffn.py").read_text() == text
    g = roundtrip(ffn, W, x)
    _close(g(*jax.tree.leaves((W, x))), ffn(W, x))

    def loss(W, x):
        return -jnp.log(ffn(W, x)[5])

    assert "def loss(" in show_jaxpr(jax.grad(loss), W, x)  # as the seed's test does


# -- the seed's VJP tests, verbatim (its duplicate test_negate once) -------------------------
def test_add():
    check(add, add_vjp, randn(13, 5), randn(13, 5))


def test_dup():
    check(dup, dup_vjp, randn(13, 7))


def test_pair():
    check(pair, pair_vjp, randn(13, 7), randn(13, 7))


def test_sum():
    check(sum, sum_vjp, [randn(13, 5), randn(13, 5), randn(13, 5)])


def test_scale():
    check(scale, scale_vjp, 3.3, randn(13, 7))


def test_axpy():
    check(axpy, axpy_vjp, randn(13, 7), randn(7), randn(13))


def test_mm():
    A = randn(13, 7).astype(np.float64)
    B = randn(7, 3).astype(np.float64)
    with jax.default_matmul_precision("highest"):
        check(mm, mm_vjp, A, B)


def test_mul():
    A = randn(13, 7).astype(np.float64)
    B = randn(13, 7).astype(np.float64)
    with jax.default_matmul_precision("highest"):
        check(mul, mul_vjp, A, B)


def test_dotall():
    check(dotall, dotall_vjp, randn(13, 7), randn(13, 7))


def test_mm_scaled_simple():
    check(
        mm_scaled,
        mm_scaled_vjp_simple,
        randn(7, 5),
        randn(5, 3),
        1.23,
        2.34,
    )


def test_mm_scaled():
    check(
        mm_scaled,
        mm_scaled_vjp,
        randn(7, 5),
        randn(5, 3),
        1.23,
        2.34,
    )


def test_recip():
    check(recip, recip_vjp, 0.001 + np.random.rand(13, 7))


def test_relu():
    check(relu, relu_vjp, randn(7))


def test_softmax():
    check(softmax, softmax_vjp, randn(13, 3))


def test_index():
    check(
        lambda x: index(x, 3),
        lambda x, dret: index_vjp(x, 3, dret),
        np.random.rand(13),
    )


def test_transpose():
    check(transpose, transpose_vjp, np.random.rand(13, 7))


def test_log():
    check(log, log_vjp, np.random.rand(13, 7))


def test_exp():
    check(exp, exp_vjp, np.random.rand(13, 7))


def test_negate():
    check(negate, negate_vjp, np.random.rand(13, 7))


# -- the README's loss walk-through ---------------------------------------------------------
def ffn_mm(W, x):  # the README's second ffn, with the VJP library's ops
    ((W1, b1), (W2, b2)) = W
    t1 = mm(W1, x) + b1
    y1 = relu(t1)
    y2 = mm(W2, y1) + b2
    return softmax(y2)


def loss(W, x, l):
    z = ffn_mm(W, x)
    return -jnp.log(z[l])


def loss0(W, x, l):
    ((W1, b1), (W2, b2)) = W
    s1 = mm(W1, x)
    t1 = add(s1, b1)
    y1 = relu(t1)
    p2 = mm(W2, y1)
    y2 = add(p2, b2)
    z = softmax(y2)
    zl = index(z, l)
    return -jnp.log(zl)


def grad_loss0_manual(W, x, l):
    ((W1, b1), (W2, b2)) = W
    s1 = mm(W1, x)
    t1 = add(s1, b1)
    y1 = relu(t1)  # the seed: relu(t1_long)
    p2 = mm(W2, y1)
    y2 = add(p2, b2)
    z = softmax(y2)
    zl = index(z, l)
    val0 = -log(zl)  # noqa: F841 -- the seed computes it and leaves it

    # Reverse..
    dzl = log_vjp(zl, -1)
    dz = index_vjp(z, l, dzl)
    dy2 = softmax_vjp(y2, dz)
    dp2, db2 = add_vjp(p2, b2, dy2)  # the seed: add_vjp(dy2)
    dW2, dy1 = mm_vjp(W2, y1, dp2)
    dt1 = relu_vjp(t1, dy1)
    ds1, db1 = add_vjp(s1, b1, dt1)  # the seed: add_vjp(dt1)
    dW1, dx = mm_vjp(W1, x, ds1)
    return ((dW1, db1), (dW2, db2))


def grad_loss2(W, x, l):
    ((W1, b1), (W2, b2)) = W
    q1 = W1 @ x + b1
    long_y1 = jnn.relu(q1)  # long lived
    t2 = W2 @ long_y1
    y2 = t2 + b2
    z = jnn.softmax(y2)
    zl = z[l]  # noqa: F841
    # Reverse..
    dy2 = z.at[l].add(-1.0)
    dW2 = jnp.outer(dy2, long_y1)  # dW2 large, rank1, but must be returned
    dy1 = W2.T @ dy2
    dq1 = (long_y1 > 0) * dy1
    dW1 = jnp.outer(dq1, x)

    return ((dW1, dq1), (dW2, dy2))


W_Type = Pair[Pair[Tensor, Tensor], Pair[Tensor, Tensor]]


def grad_loss2_accum(W: W_Type, x, l, dW_in: W_Type) -> W_Type:  # the seed's second grad_loss2
    ((W1, b1), (W2, b2)) = W
    q1 = W1 @ x + b1
    long_y1 = jnn.relu(q1)
    t2 = W2 @ long_y1
    y2 = t2 + b2
    z = jnn.softmax(y2)
    zl = z[l]  # noqa: F841
    # Reverse..
    ((dW1_in, db1_in), (dW2_in, db2_in)) = dW_in
    dy2 = z.at[l].add(-1.0)
    dW2 = xpyzt(dW2_in, dy2, long_y1)  # Efficient x + yz^T
    dy1 = W2.T @ dy2
    dq1 = jnp.sign(long_y1) * dy1
    dW1 = xpyzt(dW1_in, dq1, x)  # Efficient x + yz^T
    db1 = db1_in + dq1
    db2 = db2_in + dy2

    return ((dW1, db1), (dW2, db2))


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    W = (
        (jnp.asarray(rng.standard_normal((11, 7)) / 3, jnp.float32), jnp.zeros(11)),
        (jnp.asarray(rng.standard_normal((10, 11)) / 3, jnp.float32), jnp.zeros(10)),
    )
    x = jnp.asarray(rng.standard_normal(7), jnp.float32)
    return W, x


def test_loss0_is_the_loss():
    W, x = _problem()
    for l in range(10):
        np.testing.assert_allclose(loss0(W, x, l), loss(W, x, l), rtol=1e-6)


def test_grad_loss0_manual_and_grad_loss2_match_jax_grad():
    W, x = _problem()
    labels = jnp.array([0, 3, 9])  # traced: one compilation per function

    @jax.jit
    def all_grads(W, x, l):
        return [
            jax.grad(loss0)(W, x, l),
            jax.grad(loss)(W, x, l),
            grad_loss0_manual(W, x, l),
            grad_loss2(W, x, l),
        ]

    with jax.default_matmul_precision("highest"):
        for l in labels:
            want, *got = all_grads(W, x, l)
            for g in got:
                _close(g, want)
    _close(grad_loss0_manual(W, x, 3), jax.grad(loss0)(W, x, 3))  # eagerly, as in the seed


def test_accumulating_grad_loss2_matches_the_sum_of_jax_grads():
    W, x = _problem(1)
    xs = [x, -x, 2 * x]
    labels = [1, 4, 7]
    with jax.default_matmul_precision("highest"):
        step = jax.jit(grad_loss2_accum)
        acc = jax.tree.map(jnp.zeros_like, W)
        for xi, li in zip(xs, labels, strict=True):
            acc = step(W, xi, li, acc)
        grad = jax.jit(jax.grad(loss))
        grads = [grad(W, xi, li) for xi, li in zip(xs, labels, strict=True)]
    _close(acc, jax.tree.map(lambda *g: sum(g), *grads))


def test_check_prints_like_the_seeds():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check(relu, relu_vjp, randn(7), verbose=True)
    assert "max abs error" in out.getvalue()
