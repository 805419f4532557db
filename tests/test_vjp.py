"""nnlite.vjp and nnlite.vjp.batched: every hand rule against jax.vjp, the checker's
failures, the custom_vjp plug-in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check_many import case, check_many
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
from nnlite import vjp
from nnlite.vjp import VJPCheckError, check_vjp
from nnlite.vjp import batched as V
from nnlite.vjp.batched import hand


def _draws(seed, dtype):
    """Random arguments of ``dtype`` from one seeded generator: normal, positive (in [0.5, 2))
    and integer labels (numpy data: no per-shape compilation of random kernels)."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(dtype))

    def pos(*shape):
        return jax.device_put(rng.uniform(0.5, 2.0, shape).astype(dtype))

    def lab(*shape, n=5):
        return jax.device_put(rng.integers(0, n, shape).astype(np.int32))

    return r, pos, lab


def _check_every_case(rules, cases, **kw):
    """Every case of every rule in one check_vjp (tests/_check_many.py: one compile, not one
    per case; a failure names its rule)."""
    check_many(
        (case(f, f_vjp, *args) for name, (f, f_vjp) in rules.items() for args in cases[name]),
        **kw,
    )


def _check_last_cases(rules, cases):
    """The last (most batched) case of each rule in one check_vjp."""
    check_many(case(f, f_vjp, *cases[name][-1]) for name, (f, f_vjp) in rules.items())


def _cases(seed, dtype):
    """Argument tuples per rule: unbatched, batched and multi-batch shapes."""
    r, pos, lab = _draws(seed, dtype)
    unary = [(r(7),), (r(4, 5),), (r(2, 3, 4),)]
    return {
        "add": [(r(5), r(5)), (r(4, 3), r(4, 3))],
        "dup": [(r(5),), (r(2, 3, 4),)],
        "pair": [(r(3), r(2, 2)), (r(4, 3), r(4))],
        "mul": [(r(4, 3), r(4, 3))],
        "negate": [(r(4, 3),)],
        "scale": [(r(), r(4, 3)), (r(), r(2, 3, 4))],
        "dotall": [(r(4, 3), r(4, 3)), (r(2, 3, 4), r(2, 3, 4))],
        "mm": [(r(4, 3), r(3, 5)), (r(2, 4, 3), r(3, 5)), (r(2, 4, 3), r(2, 3, 5))],
        "axpy": [(r(4, 3), r(3), r(4)), (r(4, 3), r(3, 6), r(4, 6))],
        "mm_scaled": [(r(4, 3), r(3, 5), r(), r())],
        "bias_add": [(r(6), r(6)), (r(4, 6), r(6)), (r(2, 4, 6), r(6))],
        "xpyzt": [(r(4, 3), r(4), r(3)), (r(4, 3), r(8, 4), r(8, 3))],
        "sum": unary,
        "mean": unary,
        "index": [(r(7), 3), (r(5, 3), jnp.array([0, 2, 2])), (r(6, 2), jnp.array(4))],
        "identity": unary,
        "relu": unary,
        "tanh": unary,
        "sigmoid": unary,
        "softplus": [*unary, (10 * r(6, 5),)],
        # a tie (x1 == x2) is where JAX's own rule and the body's derivative part ways
        "logaddexp": [(r(4, 5), r(4, 5)), (tie := r(6), tie), (r(4, 5), r(1, 5))],
        "logaddexp2": [(r(4, 5), r(4, 5)), (tie, tie), (r(4, 5), r(1, 5))],
        "gelu": [*unary, (4 * r(6, 5),)],
        "exp": unary,
        "recip": [(pos(7),), (pos(4, 5),)],
        "log": [(pos(7),), (pos(4, 5),)],
        "softmax": [(r(5),), (r(4, 5),), (r(2, 3, 5),)],
        "log_softmax": [(r(5),), (r(4, 5),), (r(2, 3, 5),)],
        "softmax_cross_entropy": [(r(4, 5), lab(4)), (r(2, 3, 5), lab(2, 3)), (r(5), lab())],
    }


def test_every_rule_has_cases():
    assert set(_cases(0, np.float32)) == set(V.RULES)


def test_rules_match_jax_vjp_float32():
    _check_every_case(V.RULES, _cases(0, np.float32), key=jax.random.key(1))


def test_rules_match_jax_vjp_float64():
    with jax.enable_x64(True):
        cases = _cases(1, np.float64)
        for args in (args for name in V.RULES for args in cases[name][-1:]):
            assert all(a.dtype != jnp.float32 for a in jax.tree.leaves(args) if hasattr(a, "dtype"))
        _check_last_cases(V.RULES, cases)  # the most batched case of each rule


def test_check_vjp_catches_inverted_relu_mask(key):
    def bad_relu_vjp(x, dret):
        return jnp.where(x > 0, 0, dret)

    x = jax.random.normal(key, (4, 5))
    with pytest.raises(
        VJPCheckError, match=r"argument 0 differs from jax.vjp: max abs error .* at index \("
    ):
        check_vjp(V.relu, bad_relu_vjp, x)


def test_check_many_fails_like_check_vjp_naming_the_rule():
    """The bundled check (tests/_check_many.py) the rule tests use: a wrong rule among right
    ones fails, with its own check_vjp error."""

    def bad_relu_vjp(x, dret):
        return jnp.where(x > 0, 0, dret)

    x = jnp.linspace(-1.0, 1.0, 6)
    right = [case(V.relu, V.relu_vjp, x), case(V.index, V.index_vjp, x, jnp.array([1, 1]))]
    check_many(right)
    with pytest.raises(VJPCheckError, match=r"check_vjp\(relu, bad_relu_vjp\): .*argument 0"):
        check_many([*right, case(V.relu, bad_relu_vjp, x)])


def test_check_vjp_names_argument_and_path():
    def f(p, x):
        return p["a"] * x + p["b"]

    def wrong_b(p, x, dret):
        return ({"a": jnp.sum(dret * x), "b": 2 * jnp.sum(dret)}, p["a"] * dret)

    p, x = {"a": jnp.array(1.5), "b": jnp.array(0.5)}, jnp.arange(3.0)
    with pytest.raises(VJPCheckError, match=r"cotangent of argument 0\['b'\] differs from jax.vjp"):
        check_vjp(f, wrong_b, p, x)


def test_check_vjp_reports_structure_and_count_mistakes():
    x, y = jnp.ones(3), jnp.ones(3)
    with pytest.raises(VJPCheckError, match="tuple of 2 here; got a single array"):
        check_vjp(V.add, lambda x, y, dret: dret, x, y)
    with pytest.raises(VJPCheckError, match="tree structure"):
        check_vjp(lambda p: p["a"] * 2, lambda p, dret: {"z": 2 * dret}, {"a": x})
    with pytest.raises(VJPCheckError, match=r"has shape \(1, 3\), expected \(3,\)"):
        check_vjp(V.exp, lambda x, dret: (dret * jnp.exp(x))[None], x)
    with pytest.raises(
        VJPCheckError, match="integer array, not differentiable; the rule must return None"
    ):
        check_vjp(
            V.index, lambda x, i, dret: (jnp.zeros_like(x).at[i].add(dret), 0.0), x, jnp.array(1)
        )


def test_check_vjp_catches_nan():
    with pytest.raises(VJPCheckError, match="differs from jax.vjp"):
        check_vjp(V.exp, lambda x, dret: dret * jnp.nan, jnp.ones(3))


def test_check_vjp_tolerance_is_respected():
    def off_by_1e3(x, dret):
        return dret * jnp.cos(x) * (1 + 1e-3)

    x = jnp.linspace(0.1, 1.0, 5)
    with pytest.raises(VJPCheckError):
        check_vjp(jnp.sin, off_by_1e3, x)
    check_vjp(jnp.sin, off_by_1e3, x, rtol=1e-2)


# --- plug-in ------------------------------------------------------------------------------


def test_plugin_runs_the_hand_rule(key):
    """jax.grad of a custom_vjp function uses the rule it was given, even a wrong one."""
    x = jax.random.normal(key, (6,))
    inverted = vjp.custom_vjp(V.relu, lambda x, dret: jnp.where(x > 0, 0, dret))
    np.testing.assert_array_equal(
        jax.grad(lambda x: jnp.sum(inverted(x)))(x), (x <= 0).astype(x.dtype)
    )
    np.testing.assert_array_equal(
        jax.grad(lambda x: hand.sum(hand.relu(x)))(x), (x > 0).astype(x.dtype)
    )


def test_with_vjp_decorator_and_nondiff():
    @vjp.with_vjp(lambda x, t, dret: (dret * t, dret * x), nondiff=(1,))
    def prod(x, t):
        return x * t

    gx, gt = jax.grad(lambda x, t: jnp.sum(prod(x, t)), argnums=(0, 1))(
        jnp.ones(3), jnp.full(3, 2.0)
    )
    np.testing.assert_array_equal(gx, jnp.full(3, 2.0))
    np.testing.assert_array_equal(gt, jnp.zeros(3))


def test_plugin_static_and_integer_arguments(key):
    x = jax.random.normal(key, (5, 3))
    g = jax.grad(lambda x: hand.sum(hand.index(x, 2)))(x)  # Python int: static
    np.testing.assert_array_equal(g, jnp.zeros((5, 3)).at[2].set(1))
    i = jnp.array([0, 4, 4])  # integer array: traced, cotangent None
    g = jax.jit(jax.grad(lambda x, i: hand.sum(hand.index(x, i))))(x, i)
    np.testing.assert_array_equal(g, jnp.zeros((5, 3)).at[0].set(1).at[4].set(2))


def _params(seed=0, n_in=6, n_out=4):
    rng = np.random.default_rng(seed)
    return {
        "W": jax.device_put(rng.standard_normal((n_in, n_out)).astype(np.float32) / 3),
        "b": jax.device_put(rng.standard_normal(n_out).astype(np.float32)),
    }


def _loss_plain(p, x, labels):
    h = jnp.tanh(x @ p["W"] + p["b"][None, :])
    return nl.softmax_cross_entropy(jax.nn.gelu(h, approximate=True), labels, reduction="mean")


def _loss_hand(p, x, labels):
    h = hand.tanh(hand.bias_add(hand.mm(x, p["W"]), p["b"]))
    return hand.mean(hand.softmax_cross_entropy(hand.gelu(h), labels))


def _data(seed=1, batch=16, n_in=6, n_out=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, n_in)).astype(np.float32)
    return jax.device_put(x), jax.device_put(rng.integers(0, n_out, batch).astype(np.int32))


# The plain loss's value and gradient at the pmap and shard_map tests' batch: one compile.
_plain_value_and_grad = jax.jit(jax.value_and_grad(_loss_plain))


def _close(a, b):
    # float32 rounding of each leaf's scale: linear, tanh, gelu, cross-entropy, mean
    assert_close_f32(a, b, ops=ROUNDINGS_PER_LAYER * 5)


def test_plugin_under_jit_grad_vmap():
    p, (x, y) = _params(), _data()

    @jax.jit
    def all_grads(p, x, y):
        out = {}
        for name, loss in (("hand", _loss_hand), ("plain", _loss_plain)):
            vg = jax.value_and_grad(loss, argnums=(0, 1))(p, x, y)  # params and inputs
            # per-example gradients: vmap over a batch of one-example losses
            per = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x[:, None], y[:, None])
            out[name] = (vg, per)
        return out

    got = all_grads(p, x, y)
    _close(got["hand"], got["plain"])
    _close(jax.tree.map(lambda g: g.mean(0), got["hand"][1]), got["plain"][0][1][0])
    # eagerly, without jit, too
    _close(jax.grad(_loss_hand)(p, x, y), got["plain"][0][1][0])


def test_plugin_under_pmap():
    n = jax.device_count()
    assert n == 8
    p, (x, y) = _params(), _data(batch=4 * n)

    def step(p, x, y):
        loss, g = jax.value_and_grad(_loss_hand)(p, x, y)
        return jax.lax.pmean((loss, g), "d")

    got = jax.pmap(step, axis_name="d", in_axes=(None, 0, 0))(
        p, x.reshape(n, 4, -1), y.reshape(n, 4)
    )
    _close(jax.tree.map(lambda v: v[0], got), _plain_value_and_grad(p, x, y))


def _mesh():
    return jax.make_mesh((jax.device_count(),), ("d",))


def _shard(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P("d"))) for a in arrays]


def test_plugin_under_shard_map():
    mesh = _mesh()
    p, (x, y) = _params(), _data(batch=32)

    def local(p, x, y):  # replicated params: their gradient comes back already summed
        return jax.value_and_grad(lambda p: jax.lax.pmean(_loss_hand(p, x, y), "d"))(p)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))
    _close(f(p, *_shard(mesh, x, y)), _plain_value_and_grad(p, x, y))


# --- nnlite.vjp: the seed's column-vector library -----------------------------------------


def _column_cases(seed, dtype):
    """Argument tuples per rule of nnlite.vjp: column vectors, matrices, lists."""
    r, pos, _ = _draws(seed, dtype)
    unary = [(r(7),), (r(4, 5),)]
    return {
        "add": [(r(5), r(5)), (r(4, 3), r(4, 3))],
        "dup": [(r(5),), (r(3, 4),)],
        "pair": [(r(3), r(2, 2))],
        "mul": [(r(4, 3), r(4, 3))],
        "negate": [(r(4, 3),)],
        "scale": [(r(), r(4, 3)), (3.3, r(5))],
        "dotall": [(r(4, 3), r(4, 3))],
        # matrix @ column vector, matrix @ matrix, row vector @ matrix
        "mm": [(r(4, 3), r(3)), (r(4, 3), r(3, 5)), (r(3), r(3, 5))],
        "axpy": [(r(4, 3), r(3), r(4)), (r(4, 3), r(3, 6), r(4, 6))],
        "mm_scaled": [(r(4, 3), r(3, 5), r(), r()), (r(4, 3), r(3), 1.23, 2.34)],
        "xpyzt": [(r(4, 3), r(4), r(3))],
        "transpose": [(r(4, 3),), (r(2, 3, 4),), (r(5),)],
        "sum": [([r(4, 3), r(4, 3), r(4, 3)],), ((r(5),),)],
        "softmax": [(r(5),), (r(5, 3),)],
        "index": [(r(7), 3), (r(5, 1), 2), (r(6), jnp.array(4)), (r(6), jnp.array([0, 2, 2]))],
        "pow": [(pos(7), 3), (pos(4, 3), pos()), (pos(4, 3), pos(4, 1)), (pos(3), pos(3))],
        "identity": unary,
        "relu": unary,
        "tanh": unary,
        "sigmoid": unary,
        "softplus": unary,
        "gelu": unary,
        "exp": unary,
        "recip": [(pos(7),), (pos(4, 5),)],
        "log": [(pos(7),), (pos(4, 5),)],
    }


def test_every_column_rule_has_cases():
    assert set(_column_cases(0, np.float32)) == set(vjp.RULES)


def test_column_rules_match_jax_vjp():
    """Every case in float32, the last of each rule in float64: one check_vjp each."""
    _check_every_case(vjp.RULES, _column_cases(0, np.float32), key=jax.random.key(2))
    with jax.enable_x64(True):
        _check_last_cases(vjp.RULES, _column_cases(1, np.float64))


def test_column_conventions_differ_from_batched():
    x = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_allclose(vjp.softmax(x).sum(axis=0), [1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(V.softmax(x).sum(axis=-1), [1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(vjp.sum([x, x]), 2 * x)
    assert V.sum(x).shape == ()
    dx = vjp.index_vjp(jnp.zeros(4), 1, 2.0)
    np.testing.assert_array_equal(dx, [0.0, 2.0, 0.0, 0.0])
    assert V.index_vjp(jnp.zeros(4), 1, 2.0)[1] is None
    np.testing.assert_array_equal(vjp.mm(jnp.ones((2, 3)), jnp.ones(3)), [3.0, 3.0])


def test_column_rules_refuse_bad_shapes_clearly():
    with pytest.raises(
        ValueError, match=r"mm: expected A \[n, k\].*got shapes \(2, 3\) and \(4,\)"
    ):
        vjp.mm(jnp.ones((2, 3)), jnp.ones(4))
    with pytest.raises(ValueError, match="for vector . vector use dotall"):
        vjp.mm(jnp.ones(3), jnp.ones(3))
    with pytest.raises(TypeError, match=r"expected a non-empty list of arrays.*use jnp.sum"):
        vjp.sum(jnp.ones(3))
    with pytest.raises(ValueError, match=r"xpyzt: expected x \[m, n\], y \[m\], z \[n\]"):
        vjp.xpyzt(jnp.ones((2, 2)), jnp.ones((2, 2)), jnp.ones(2))


def test_pow_and_range_integer_arguments_get_none():
    x = jnp.array([1.0, 2.0])
    dx, dp = vjp.pow_vjp(x, 3, jnp.ones(2))
    np.testing.assert_allclose(dx, 3 * x**2)
    assert dp is None
    assert vjp.range_vjp(0, 10, 2, [1.0] * 5) == (None, None, None)
    g = jax.grad(lambda x: jnp.sum(vjp.hand.pow(x, 3)))(x)  # Python int: static
    np.testing.assert_allclose(g, 3 * x**2)


def test_tuple_results_get_one_cotangent_per_output():
    """The seed's convention: dup_vjp(x, *dret), for check_vjp and the plug-in alike."""

    def swap(x, y):
        return (y, 2 * x)

    def swap_vjp(x, y, dy, dx2):  # one argument per output
        return (2 * dx2, dy)

    x, y = jnp.ones(3), jnp.arange(3.0)
    check_vjp(swap, swap_vjp, x, y)
    hand_swap = vjp.custom_vjp(swap, swap_vjp)
    g = jax.grad(lambda x, y: jnp.sum(hand_swap(x, y)[1] * y), argnums=(0, 1))(x, y)
    np.testing.assert_allclose(g[0], 2 * y)
    gd = jax.grad(lambda x: jnp.sum(vjp.hand.dup(x)[0] * vjp.hand.dup(x)[1]))(y)
    np.testing.assert_allclose(gd, 2 * y)


def test_rule_may_leave_out_integer_arguments():
    """index_vjp returns dx alone; the plug-in fills in None for the integer index."""
    x, i = jnp.arange(5.0), jnp.array([1, 1, 3])
    g = jax.jit(jax.grad(lambda x, i: jnp.sum(vjp.hand.index(x, i))))(x, i)
    np.testing.assert_array_equal(g, [0.0, 2.0, 0.0, 1.0, 0.0])
    with pytest.raises(VJPCheckError, match=r"tuple of 2 here \(or 1, one per differentiable"):
        check_vjp(vjp.index, lambda x, i, dret: (dret, dret, dret), x, i)


def test_seed_helpers():
    a = np.ones((2, 3))
    assert vjp.allclose(a, a + 1e-9, 1e-5, 1e-7)
    assert not vjp.allclose(a, a + 1, 1e-5, 1e-7)
    assert vjp.tree_close((a, [a]), (a, [a + 1]), 1e-5, 1e-7, verbose=False) == (True, [False])
    assert vjp.tree_allclose({"w": a}, {"w": a}, 1e-5, 1e-7)
    assert vjp.randlike(a).shape == (2, 3)
    assert vjp.ensure_tuple(a)[0] is a and vjp.ensure_tuple((1, 2)) == (1, 2)
    assert vjp.check is vjp.check_vjp
