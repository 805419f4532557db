"""Every primitive rule of ``nnlite.rules`` against ``jax.vjp`` (float32 and float64), and
the rules at work: ``manual_grads`` on ordinary JAX math equals ``jax.grad``, and
``show_grad`` prints it as code that equals ``jax.grad``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check_many import case, check_many
from jax import lax

import nnlite as nl
from nnlite.grad._structural import PRIMITIVE_RULES

DN2 = lax.ConvDimensionNumbers((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3))  # NCHW, OIHW
DN1_NWC = lax.ConvDimensionNumbers((0, 2, 1), (2, 1, 0), (0, 2, 1))  # NWC, WIO


def _pos(x):
    return jnp.abs(x) + 0.5


def _unit(x):
    return 0.9 * jnp.tanh(x)


def _away(x):
    return jnp.sign(x) * (jnp.abs(x) + 0.5)


def _conv(**kw):
    base = dict(
        lhs_dilation=(1, 1), rhs_dilation=(1, 1), feature_group_count=1, batch_group_count=1
    )
    return {**base, **kw}


# name -> (argument makers from rand, the primitive's parameters); several cases per name
CASES = {
    "exp": [(lambda r: [r(3, 4)], {})],
    "exp2": [(lambda r: [r(3, 4)], {})],
    "log": [(lambda r: [_pos(r(3, 4))], {})],
    "log1p": [(lambda r: [_pos(r(3, 4))], {})],
    "expm1": [(lambda r: [r(3, 4)], {})],
    "logistic": [(lambda r: [r(3, 4)], {})],
    "sqrt": [(lambda r: [_pos(r(3, 4))], {})],
    "rsqrt": [(lambda r: [_pos(r(3, 4))], {})],
    "cbrt": [(lambda r: [_away(r(3, 4))], {})],
    "square": [(lambda r: [r(3, 4)], {})],
    "integer_pow": [(lambda r: [r(3, 4)], {"y": 3}), (lambda r: [_away(r(3, 4))], {"y": -2})],
    "pow": [(lambda r: [_pos(r(3, 4)), r(3, 4)], {})],
    "sin": [(lambda r: [r(3, 4)], {})],
    "cos": [(lambda r: [r(3, 4)], {})],
    "tan": [(lambda r: [_unit(r(3, 4))], {})],
    "tanh": [(lambda r: [r(3, 4)], {})],
    "asin": [(lambda r: [_unit(r(3, 4))], {})],
    "acos": [(lambda r: [_unit(r(3, 4))], {})],
    "atan": [(lambda r: [r(3, 4)], {})],
    "atan2": [(lambda r: [r(3, 4), r(3, 4)], {})],
    "sinh": [(lambda r: [r(3, 4)], {})],
    "cosh": [(lambda r: [r(3, 4)], {})],
    "asinh": [(lambda r: [r(3, 4)], {})],
    "acosh": [(lambda r: [1.5 + jnp.abs(r(3, 4))], {})],
    "atanh": [(lambda r: [_unit(r(3, 4))], {})],
    "erf": [(lambda r: [r(3, 4)], {})],
    "erfc": [(lambda r: [r(3, 4)], {})],
    "erf_inv": [(lambda r: [_unit(r(3, 4))], {})],
    "abs": [(lambda r: [r(3, 4)], {})],
    "sign": [(lambda r: [r(3, 4)], {})],
    "floor": [(lambda r: [r(3, 4)], {})],
    "ceil": [(lambda r: [r(3, 4)], {})],
    "round": [(lambda r: [r(3, 4)], {})],
    "reduce_precision": [(lambda r: [r(3, 4)], {"exponent_bits": 5, "mantissa_bits": 10})],
    "max": [(lambda r: [r(3, 4), r(3, 4)], {})],
    "min": [(lambda r: [r(3, 4), r(3, 4)], {})],
    "clamp": [(lambda r: [r(3, 4) - 1, r(3, 4), r(3, 4) + 1], {})],
    "rem": [(lambda r: [r(3, 4), _away(r(3, 4))], {})],
    "mul": [(lambda r: [r(3, 4), r(3, 4)], {})],
    "div": [(lambda r: [r(3, 4), _away(r(3, 4))], {})],
    "dot_general": [
        (lambda r: [r(2, 3, 4), r(2, 4, 5)], {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))}),
        (lambda r: [r(3, 4), r(5, 3)], {"dimension_numbers": (((0,), (1,)), ((), ()))}),
    ],
    "select_n": [(lambda r: [r(3, 4) > 0, r(3, 4), r(3, 4)], {})],
    "reduce_max": [
        (lambda r: [r(3, 4, 5)], {"axes": (1,)}),
        (lambda r: [r(3, 4)], {"axes": (0, 1)}),
    ],
    "reduce_min": [(lambda r: [r(3, 4, 5)], {"axes": (0, 2)})],
    "reduce_prod": [
        (lambda r: [r(3, 4, 5)], {"axes": (1,)}),
        (lambda r: [r(3, 4)], {"axes": (0, 1)}),
    ],
    "cummax": [
        (lambda r: [r(3, 5)], {"axis": 1}),
        (lambda r: [r(4, 3)], {"axis": 0, "reverse": True}),
    ],
    "cummin": [(lambda r: [r(3, 5)], {"axis": 1})],
    "cumprod": [
        (lambda r: [r(3, 5)], {"axis": 1}),
        (lambda r: [r(4, 3)], {"axis": 0, "reverse": True}),
    ],
    "cumlogsumexp": [
        (lambda r: [r(3, 5)], {"axis": 1}),
        (lambda r: [r(3, 5)], {"axis": 1, "reverse": True}),
    ],
    "sort": [
        (lambda r: [r(3, 5)], {"dimension": 1}),
        (lambda r: [r(4, 3), r(4, 3)], {"dimension": 0, "num_keys": 1}),
    ],
    "top_k": [(lambda r: [r(3, 6)], {"k": 2}), (lambda r: [r(5, 3)], {"k": 3, "axis": 0})],
    "conv_general_dilated": [
        (
            lambda r: [r(2, 3, 7, 6), r(4, 3, 3, 2)],
            _conv(
                window_strides=(2, 1),
                padding=((1, 1), (0, 1)),
                lhs_dilation=(1, 2),
                rhs_dilation=(2, 1),
                dimension_numbers=DN2,
            ),
        ),
        (
            lambda r: [r(2, 7, 4), r(3, 2, 6)],
            _conv(
                window_strides=(1,),
                padding=((1, 1),),
                lhs_dilation=(1,),
                rhs_dilation=(1,),
                dimension_numbers=DN1_NWC,
                feature_group_count=2,
            ),
        ),
    ],
}

NONLINEAR = sorted(CASES)
LINEAR = {  # rules of the structural primitives, tested in test_manual_structural.py
    "add", "broadcast_in_dim", "concatenate", "convert_element_type", "copy", "copy_p",
    "cumsum", "dynamic_slice", "dynamic_update_slice", "gather", "neg", "pad", "pvary",
    "reduce_sum", "reshape", "rev", "scatter", "scatter-add", "slice", "split", "squeeze",
    "stack", "sub", "tile", "transpose",
}  # fmt: skip


def test_every_primitive_rule_is_checked_here_or_with_the_structural_ones():
    assert set(PRIMITIVE_RULES) == set(CASES) | LINEAR, set(PRIMITIVE_RULES) ^ (set(CASES) | LINEAR)


def test_primitive_rules_against_jax_vjp(rand):
    """Every case of every rule in one check_rule per dtype (tests/_check_many.py: one
    compile, not one per case; a failure names its rule)."""
    check_many(
        case(PRIMITIVE_RULES[name].f, PRIMITIVE_RULES[name].f_vjp, *make(rand), **params)
        for name in NONLINEAR
        for make, params in CASES[name]
    )


def test_ties_and_zeros_follow_jax():
    """Where the function has no derivative JAX makes a choice; the rules make the same."""
    x = jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 0.0]])
    losses = (
        lambda x: jnp.sum(jnp.max(x, axis=1) * jnp.array([1.0, 2.0])),
        lambda x: jnp.sum(jnp.maximum(x, 2.0) + jnp.minimum(x, 2.0)),
        lambda x: jnp.sum(jnp.abs(x) + jnp.clip(x, 0.0, 2.0)),
        lambda x: jnp.sum(jnp.prod(x, axis=1)),  # a zero factor: no division by it
        lambda x: jnp.sum(lax.cummax(x, 1) + lax.cumprod(x, 1)),
        lambda x: jnp.sum(jax.nn.relu(x) * x),  # relu's derivative is 0 at 0
        # jax.custom_jvp functions whose rule is not their body's derivative at a tie:
        # 1/2 each (the body's max and abs give 0 at x == 0)
        lambda x: jnp.sum(jax.nn.log_sigmoid(x) + jax.nn.softplus(x) * x),
        lambda x: jnp.sum(jnp.logaddexp(x, x[::-1]) + jnp.logaddexp2(x, 2.0)),
    )
    both = jax.jit(  # every loss, both ways, in one compile
        lambda x: [(jax.grad(f)(x), jax.grad(nl.manual_grads(f))(x)) for f in losses]
    )
    for want, got in both(x):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _math_loss(p, x):
    """Ordinary JAX on param-derived values: most of the elementwise and reduction rules."""
    h = x @ p["W"]  # [B, 6]
    g = h @ p["V"]  # a product of two differentiated values in the next lines
    a = jnp.sin(h) * jnp.cos(g) + jnp.exp(-(h**2)) + jnp.tanh(g) * jax.nn.sigmoid(h)
    a = a + jnp.log1p(h * h) + jnp.sqrt(g * g + 1.0) + jax.lax.rsqrt(h * h + 1.0)
    a = a + jax.scipy.special.erf(h) + jnp.arctan2(h, g + 3.0) + jnp.cbrt(g * g + 1.0)
    a = a + jnp.where(h > 0, h, 0.1 * g) + jnp.maximum(h, g) + jnp.clip(g, -0.5, 0.5)
    a = a + jnp.abs(h) ** 1.5 + (h * h + 1.0) ** g / 10 + jnp.expm1(h / 4) + jnp.arcsinh(g)
    s = jax.nn.logsumexp(a, axis=-1) + jnp.max(a, axis=-1) + jnp.prod(jnp.tanh(a[:, :3]), axis=-1)
    s = s + jnp.sum(jnp.sort(a, axis=-1)[:, -2:], axis=-1) + jnp.sum(lax.top_k(g, 2)[0], -1)
    s = s + jnp.sum(jax.nn.softmax(a) * jax.nn.log_softmax(g), -1) + jnp.cumsum(a, -1)[:, -1]
    return jnp.mean(s + jnp.sum(lax.cumlogsumexp(a, axis=1) + lax.cummax(g, axis=1), -1) / 10)


def _normal(seed, *shape):  # numpy: no random kernel compiled per shape
    return jax.device_put(
        np.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    )


def _math_params():
    return {"W": _normal(3, 4, 6) / 2, "V": _normal(30, 6, 6) / 3}


def _auto_and_manual(loss, *args):
    """jax.grad and the manual gradient of ``loss`` in one compiled program."""
    return jax.jit(lambda *a: (jax.grad(loss)(*a), jax.grad(nl.manual_grads(loss))(*a)))(*args)


def test_manual_grads_of_ordinary_jax_math_equals_jax_grad():
    p = _math_params()
    x = _normal(4, 5, 4)
    nl.check_manual(_math_loss, p, x)  # every operation has a rule: auto picks manual
    want, got = _auto_and_manual(_math_loss, p, x)
    for k in p:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-5)


def test_show_grad_prints_the_math_rules_as_code_equal_to_jax_grad():
    p = nl.ParamsDict(_math_params())
    src = nl.show_grad(_math_loss, p, _normal(4, 5, 4))
    for call in ("sin_vjp(", "exp_vjp(", "reduce_max_vjp(", "sort_vjp(", "top_k_vjp(", "pow_vjp("):
        assert call in src, call
    assert "nnlite.grad" not in src and "from nnlite.rules import" in src
    ns: dict = {}
    exec(src, ns)
    x7 = _normal(5, 7, 4)  # another batch size
    got, want = jax.jit(lambda p, x: (ns["grad"](p, x), jax.grad(_math_loss)(p, x)))(p, x7)
    for k in ("W", "V"):
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-5)


def test_conv_in_general_form_under_manual_grads():
    p = {"w": _normal(0, 6, 3, 2), "v": _normal(1, 4, 3, 3)}
    x = _normal(2, 2, 6, 9)  # NCW

    def loss(p, x):
        h = lax.conv_general_dilated(x, jnp.transpose(p["w"], (1, 0, 2)), (2,), "SAME",
                                     rhs_dilation=(2,))  # fmt: skip
        h = jnp.tanh(h)
        w2 = jnp.transpose(p["v"], (1, 0, 2))  # [3, 4, 3] OIW: depthwise-ish groups of 1
        return jnp.sum(lax.conv_general_dilated(h, w2[:, :3], (1,), ((1, 0),)) ** 2)

    want, got = _auto_and_manual(loss, p, x)
    for name in p:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-5)


def test_counted_while_loop_is_a_scan_and_a_data_dependent_one_is_refused():
    p = {"W": jnp.array([[0.5, -0.3], [0.2, 0.8]])}
    x = jnp.array([[1.0, 2.0], [0.5, -1.0]])

    def loss(p, x, loop):
        h = jnp.tanh(x @ p["W"])
        if loop == "while":
            h = lax.while_loop(
                lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * 1.5, c[1] + 1), (h, 0)
            )[0]
        else:
            h = lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 1.5, h)
        return jnp.sum(h**2)

    want, got = jax.jit(  # one compile; jax.grad refuses the while_loop itself
        lambda p, x: (jax.grad(loss)(p, x, "fori"), jax.grad(nl.manual_grads(loss))(p, x, "while"))
    )(p, x)
    np.testing.assert_allclose(got["W"], want["W"], rtol=1e-6, atol=1e-6)

    def until(p, x):
        h = jnp.tanh(x @ p["W"])
        return jnp.sum(lax.while_loop(lambda c: jnp.sum(c) < 10.0, lambda c: c * 2.0 + 1.0, h))

    with pytest.raises(nl.ManualGradError, match=r"`while` .*trip count depends on data"):
        nl.check_manual(until, p, x)


def test_cond_switch_and_scan_written_by_hand():
    p = {"W": _normal(1, 3, 3) / 2}
    x = _normal(2, 4, 3)

    def loss(p, x):
        h = x @ p["W"]

        def step(c, xt):
            c = jnp.tanh(c * xt + jnp.sin(c @ p["W"]))
            return c, jnp.exp(-c * c)

        c, ys = lax.scan(step, h[0], h)
        z = lax.cond(jnp.sum(c) > 0, lambda a: jnp.sin(a), lambda a: jnp.cos(a) * a, c)
        z = lax.switch(1, [jnp.exp, lambda a: a * a * p["W"][0], jnp.tanh], z)
        return jnp.sum(z) + jnp.sum(ys**2)

    nl.check_manual(loss, p, x)
    want, got = _auto_and_manual(loss, p, x)
    np.testing.assert_allclose(got["W"], want["W"], rtol=2e-5, atol=2e-5)
