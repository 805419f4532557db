"""nl.flops: FLOPs counted from the jaxpr, every loop by its trip count (XLA's cost analysis
counts a loop's body once), equal to XLA's count on programs without loops."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import nnlite as nl

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def mm(m, k, n, batch=1):
    """The FLOPs of a [m, k] x [k, n] product, ``batch`` times."""
    return 2 * batch * m * k * n


def scan_matmuls(x, ws):
    return lax.scan(lambda h, w: (h @ w, None), x, ws)[0]


def test_a_scan_counts_its_body_length_times():
    x, ws = jnp.ones((64, 64)), jnp.ones((10, 64, 64))
    count = nl.flops(scan_matmuls, x, ws)
    assert count["matmul_flops"] == count["flops"] == 10 * mm(64, 64, 64)
    assert count["lower_bound"] is False and count["unknown"] == ()
    # the same from a traced program or its jaxpr, without tracing again
    traced = jax.jit(scan_matmuls).trace(x, ws)
    assert nl.flops(traced) == nl.flops(traced.jaxpr) == count
    # XLA's cost analysis counts the body once: the undercount this counter fixes
    xla = nl.cost_analysis(jax.jit(scan_matmuls).lower(x, ws))["flops"]
    assert xla < 2 * mm(64, 64, 64)


def test_nested_scans_and_static_loops_multiply():
    def nested(x, ws):  # 3 outer steps, each a scan over 4 matrices
        return lax.scan(lambda h, _: (scan_matmuls(h, ws), None), x, None, length=3)[0]

    x, ws = S((8, 16), F32), S((4, 16, 16), F32)
    assert nl.flops(nested, x, ws)["matmul_flops"] == 12 * mm(8, 16, 16)
    # fori_loop with static bounds (a scan) and a while_loop on a literal bound
    fori = nl.flops(lambda a: lax.fori_loop(2, 7, lambda i, c: c @ c, a), S((8, 8), F32))
    assert fori["matmul_flops"] == 5 * mm(8, 8, 8) and not fori["lower_bound"]

    def body(c):
        return c[0] + 1, c[1] @ c[1]

    lit = nl.flops(lambda a: lax.while_loop(lambda c: c[0] < 6, body, (1, a)), S((8, 8), F32))
    assert lit["matmul_flops"] == 5 * mm(8, 8, 8) and not lit["lower_bound"]


def test_a_loop_whose_trip_count_is_not_static_is_a_lower_bound():
    def loop(a, n):
        return lax.fori_loop(0, n, lambda i, c: c @ c, a)

    count = nl.flops(loop, S((8, 8), F32), S((), jnp.int32))
    assert count["matmul_flops"] == mm(8, 8, 8)  # the body once
    assert count["lower_bound"] is True


def test_cond_counts_its_most_expensive_branch():
    def pick(p, a):
        return lax.cond(p, lambda a: a @ a @ a, lambda a: a + 1.0, a)

    count = nl.flops(pick, S((), jnp.bool_), S((8, 8), F32))
    assert count["matmul_flops"] == 2 * mm(8, 8, 8)
    # + the predicate's cast to a branch index; the add branch (64) is the cheaper one
    assert count["flops"] == 2 * mm(8, 8, 8) + 1


def test_a_custom_vjp_counts_its_forward_and_under_grad_its_own_rule():
    @jax.custom_vjp
    def f(a, b):
        return a @ b

    def f_fwd(a, b):
        return a @ b, (a, b)

    def f_bwd(res, g):  # a deliberately wasteful rule: one product more than needed
        a, b = res
        return g @ b.T, a.T @ g + (a.T @ a) @ jnp.zeros_like(b)

    f.defvjp(f_fwd, f_bwd)
    a, b = S((8, 16), F32), S((16, 4), F32)
    assert nl.flops(f, a, b)["matmul_flops"] == mm(8, 16, 4)
    grads = nl.flops(jax.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1)), a, b)
    rule = mm(8, 4, 16) + mm(16, 8, 4) + mm(16, 8, 16) + mm(16, 16, 4)
    # the forward's product is dead under grad (nothing reads the primal output): dropped
    assert grads["matmul_flops"] == rule


def test_grad_of_a_scanned_stack_is_three_forwards_and_remat_adds_its_recompute():
    d, b, n = 16, 8, 5
    ffn = nl.FFN(d, (d,), d)
    x = S((b, d), F32)
    forward = 2 * mm(b, d, d, n)  # two linears per copy
    for layer, recomputed in ((ffn, 0), (nl.Remat(ffn), mm(b, d, d, n))):
        stack = nl.Stack(layer, n)
        p = jax.eval_shape(stack.init, jax.random.key(0))
        assert nl.flops(stack, p, x)["matmul_flops"] == forward
        grads = nl.flops(jax.grad(lambda p, x, s=stack: s(p, x).sum()), p, x)
        # forward, input cotangent and weight cotangent; under remat the first linear
        # again (its output feeds the relu's rule; the second's is not needed)
        assert grads["matmul_flops"] == 3 * forward + recomputed


def test_the_chunked_lm_head_counts_every_chunk():
    d, vocab, chunk = 16, 50, 4
    h, w, labels = S((2, 10, d), F32), S((d, vocab), F32), S((2, 10), jnp.int32)

    def head(h, w, labels):
        return nl.label_log_probs(h, w, labels, chunk=chunk)

    logits = mm(20, d, vocab)  # 20 tokens in 5 chunks of 4
    count = nl.flops(head, h, w, labels)
    assert count["matmul_flops"] == logits
    assert count["transcendentals"] > 20 * vocab  # each chunk's exp, every chunk
    xla = nl.cost_analysis(jax.jit(head).lower(h, w, labels))["flops"]
    assert xla < count["flops"] / 4  # XLA: one chunk
    grads = nl.flops(jax.grad(lambda *a: head(*a).sum(), argnums=(0, 1)), h, w, labels)
    # the rule recomputes each chunk's logits, then dh and dW (the forward is dead code)
    assert grads["matmul_flops"] == 3 * logits


def test_without_loops_matmuls_equal_xla_and_the_total_is_close():
    from models.gpt import GPT

    def convs(x, k1, k2):
        y = lax.conv_general_dilated(x, k1, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2))
        z = lax.conv_general_dilated(y, k2, (1, 1), "SAME", feature_group_count=2)
        return jnp.einsum("bchw,bdhw->bcd", z, z)

    args = S((2, 4, 11, 9), F32), S((6, 4, 3, 3), F32), S((6, 3, 3, 3), F32)
    grads = jax.grad(lambda *a: convs(*a).sum(), argnums=(0, 1, 2))
    count = nl.flops(convs, *args)  # products and convolutions only: XLA's figure exactly
    xla = nl.cost_analysis(jax.jit(convs).lower(*args))["flops"]
    assert count["flops"] == count["matmul_flops"] == xla
    # their gradients: XLA's figure, of which the products are all but the sum of z's two
    # cotangents (z: [2, 6, 6, 6])
    count = nl.flops(grads, *args)
    assert count["flops"] == nl.cost_analysis(jax.jit(grads).lower(*args))["flops"]
    assert count["flops"] - count["matmul_flops"] == 2 * 6 * 6 * 6
    model = GPT(vocab_size=17, context=8, n_layer=2, n_head=2, n_embd=16)
    p, tokens = jax.eval_shape(model.init, jax.random.key(0)), S((2, 8), jnp.int32)
    step = jax.grad(lambda p, t: -model(p, t, labels=t).mean())
    for fn in (model, step):
        count = nl.flops(fn, p, tokens)
        xla = nl.cost_analysis(jax.jit(fn).lower(p, tokens))
        assert count["flops"] == pytest.approx(xla["flops"], rel=1e-3)
        assert count["transcendentals"] == pytest.approx(xla["transcendentals"], rel=1e-3)
        assert count["unknown"] == ()


def test_dead_code_is_not_counted():
    def half_used(a, b):
        unused = a @ b @ b.T  # noqa: F841 - traced, never read
        return a + 1.0

    assert nl.flops(half_used, S((8, 8), F32), S((8, 8), F32))["flops"] == 64


def test_a_shard_map_body_counts_once_per_device():
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))
    body = jax.shard_map(lambda x: x @ x.T, mesh=mesh, in_specs=jax.P("b"), out_specs=jax.P("b"))
    # each of 4 devices multiplies its [4, 8] block by its transpose: the total over them
    assert nl.flops(body, S((16, 8), F32))["matmul_flops"] == 4 * mm(4, 8, 4)


def test_an_unknown_primitive_is_named_and_counted_as_zero():
    def solve(a, b):
        return jnp.linalg.cholesky(a) @ b

    count = nl.flops(solve, S((8, 8), F32), S((8, 2), F32))
    assert "cholesky" in count["unknown"]
    assert count["matmul_flops"] == mm(8, 8, 2)


def test_bad_input_is_one_line():
    with pytest.raises(TypeError, match="nl.flops: expected a function.*got int"):
        nl.flops(3)
