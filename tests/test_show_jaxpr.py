"""show_jaxpr: every corpus function round-trips (same outputs, same text when decompiled again)."""

import functools
import os
import shutil
import subprocess
import sys

import _jaxpr_sweep as sweep
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
from models import mlp_fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

X = jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
Y = jnp.linspace(0.5, 1.5, 20, dtype=jnp.float32).reshape(4, 5)
B3 = jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(2, 3, 4)
IX = jnp.array([[3, -7, 12, 0], [5, 2, -1, 9]], dtype=jnp.int32)
U = jnp.array([1, 2, 300, 4096], dtype=jnp.uint32)
M = jnp.array([[True, False, True], [False, False, True]])
V = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)
IDX = jnp.array([2, 0, 1], dtype=jnp.int32)


# -- custom derivatives: deliberately different from autodiff, so only a faithful rebuild
# of the rules differentiates the same way.
@jax.custom_vjp
def scaled_sin(x):
    return jnp.sin(x)


def _scaled_sin_fwd(x):
    return jnp.sin(x), (jnp.cos(x), x)


def _scaled_sin_bwd(res, g):
    cos, x = res
    return (2.0 * g * cos + x,)


scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


@jax.custom_vjp
def two_in_two_out(x, k):
    return x * k, jnp.sum(x)


def _two_fwd(x, k):
    return two_in_two_out(x, k), (k,)


def _two_bwd(res, cts):
    (k,) = res
    g1, g2 = cts
    return (g1 * k + g2, None)


two_in_two_out.defvjp(_two_fwd, _two_bwd)


@jax.custom_jvp
def clipped_exp(x):
    return jnp.exp(jnp.minimum(x, 1.0))


@clipped_exp.defjvp
def _clipped_exp_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return clipped_exp(x), 3.0 * t


# -- nnlite models ---------------------------------------------------------------------------
FFN = nl.FFN(4, (8,), 3)
FFN_PARAMS = FFN.init(jax.random.key(0))
LABELS = jnp.array([0, 2, 1], dtype=jnp.int32)


def ffn_forward(params, x):
    return FFN(params, x)


def ffn_loss(params, x, labels):
    return nl.softmax_cross_entropy(ffn_forward(params, x), labels, reduction="mean")


OPT = optax.adam(1e-2)
OPT_STATE = OPT.init(FFN_PARAMS)


def train_step(params, opt_state, x, labels):
    loss, grads = jax.value_and_grad(ffn_loss)(params, x, labels)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _scan_cumprod(x):
    def body(c, row):
        return c * row + 1.0, jnp.sum(c)

    return lax.scan(body, jnp.ones(4), x)


def _nested_jit(x):
    inner = jax.jit(lambda a: jnp.tanh(a) * 2.0)
    outer = jax.jit(lambda a: inner(a) + inner(a.T).T)
    return outer(x)


# -- multi-device: a 1-D mesh over the 8 CPU devices conftest.py asks for -----------------
MESH = jax.make_mesh((8,), ("batch",), (jax.sharding.AxisType.Auto,))
XS = jnp.linspace(-2.0, 2.0, 64, dtype=jnp.float32).reshape(16, 4)  # 2 rows per device
LABELS16 = jnp.arange(16, dtype=jnp.int32) % 3


def _smap(f, in_specs, out_specs, **kw):
    return jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs, **kw)


def _collectives(x):
    mean = lax.pmean(jnp.sum(x, axis=0), "batch")
    gathered = lax.all_gather(x, "batch", axis=1, tiled=True)  # varies: each device has all
    everyone = lax.all_gather(x[:, 0], "batch", to="invarying")  # all_gather_invariant
    return mean, gathered, everyone, lax.axis_index("batch") + x[:, 0].astype(jnp.int32)


def _more_collectives(x):  # without check_vma: psum, not psum_invariant; no pvary
    shifted = lax.ppermute(x, "batch", [(i, (i + 1) % 8) for i in range(8)])
    stacked = lax.all_gather(x[0], "batch")  # untiled: a new leading axis
    return lax.pmax(x, "batch") - lax.pmin(x, "batch") + shifted, stacked, lax.psum(x, "batch")


MESH_2D = jax.make_mesh((4, 2), ("x", "y"), (jax.sharding.AxisType.Explicit,) * 2)
# devices in reverse: jax.make_mesh would not give this order, so it prints as a Mesh
MESH_REV = jax.sharding.Mesh(
    np.array(jax.devices()[::-1]).reshape(2, 4), ("a", "b"), axis_types=(MESH.axis_types * 2)
)


def _shard_train_step(params, x, labels):
    """Gradient of pmean(local loss) w.r.t. replicated params, then an SGD step."""

    def global_loss(p):
        return lax.pmean(ffn_loss(p, x, labels), "batch")

    loss, grads = jax.value_and_grad(global_loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


CORPUS = {
    # elementwise, float
    "sin_cos_exp": (lambda x: jnp.sin(x) * jnp.cos(x) + jnp.exp(-x), X),
    "log_sqrt_rsqrt": (
        lambda x: jnp.log1p(x * x) + jnp.sqrt(jnp.abs(x)) + lax.rsqrt(x * x + 1.0),
        X,
    ),
    "tanh_logistic": (lambda x: jnp.tanh(x) - jax.nn.sigmoid(x), X),
    "pow_square": (lambda x: x**3 + jnp.power(jnp.abs(x), 0.5) + jnp.square(x), X),
    "floor_ceil_round": (lambda x: jnp.floor(x) + jnp.ceil(x) * jnp.round(x) - jnp.sign(x), X),
    "max_min_clip": (lambda x: jnp.maximum(x, 0.5) + jnp.minimum(x, -0.5) + jnp.clip(x, -1, 1), X),
    "div_rem": (lambda x: x / (jnp.abs(x) + 1.0) + jnp.remainder(x, 0.7), X),
    "erf_lgamma": (lambda x: jax.scipy.special.erf(x) + jax.lax.lgamma(x * x + 1.0), X),
    "atan2_expm1": (lambda x: jnp.arctan2(x, 1.5) + jnp.expm1(x), X),
    "isfinite": (lambda x: jnp.where(jnp.isfinite(1.0 / x), x, 0.0), X),
    "weak_scalar_arg": (lambda x, s: x * s + s, X, 3.0),
    "bf16": (lambda x: (x.astype(jnp.bfloat16) * 2).astype(jnp.float32), X),
    # elementwise, int and bool
    "int_arith": (lambda i: i * 3 - i // 2 + i % 5, IX),
    "int_bits": (lambda i: (i & 6) | (i ^ 3) + (~i), IX),
    "int_shifts": (lambda u: (u << 2) + (u >> 1) + lax.population_count(u), U),
    "int_compare": (lambda i: jnp.where(i > 2, i, -i) + jnp.abs(i) + jnp.maximum(i, 1), IX),
    "bool_logic": (lambda m: (m & ~m[::-1]) | (m ^ True), M),
    "bool_reduce": (lambda m: (jnp.all(m, axis=0), jnp.any(m, axis=1)), M),
    "convert": (lambda x: x.astype(jnp.int32) + (x > 0).astype(jnp.int32), X),
    # reductions
    "sum_mean": (lambda x: (jnp.sum(x, axis=0), jnp.mean(x), jnp.var(x, axis=1)), X),
    "max_min_prod": (lambda x: (jnp.max(x, axis=1), jnp.min(x), jnp.prod(x, axis=0)), X),
    "logsumexp": (lambda x: jax.nn.logsumexp(x, axis=-1), X),
    # dot_general
    "matmul": (lambda x, y: x @ y, X, Y),
    "dot_batch": (lambda b: jnp.einsum("bij,bkj->bik", b, b), B3),
    "tensordot": (lambda b, y: jnp.tensordot(b, y, axes=1), B3, Y),
    "dot_precision": (lambda x, y: jnp.dot(x, y, precision=lax.Precision.HIGHEST), X, Y),
    # shapes
    "reshape_transpose": (lambda b: jnp.transpose(b.reshape(6, 4)).reshape(2, 12), B3),
    "broadcast": (lambda v: jnp.broadcast_to(v[:, None], (6, 3)) + jnp.zeros((6, 3)), V),
    "concatenate": (lambda x: jnp.concatenate([x, 2 * x, x[:1]], axis=0), X),
    "pad": (
        lambda x: jnp.pad(x, ((1, 2), (0, 1))).sum() + lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 1))),
        X,
    ),
    "slice_rev": (lambda x: x[1:, ::2] + x[:0:-1, 1::2], X),
    "dynamic_slice": (lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 2)), X, jnp.int32(1)),
    "dynamic_update": (
        lambda x, i: lax.dynamic_update_slice(x, jnp.ones((1, 2)), (i, i)),
        X,
        jnp.int32(1),
    ),
    "squeeze_expand": (lambda b: jnp.squeeze(b[:1], 0)[None, :, :, None].sum(-1), B3),
    "iota_arange": (lambda x: x + (jnp.arange(4.0) + lax.iota(jnp.float32, 4))[None], X),
    # gather / scatter
    "index_array": (lambda x, i: x[i] + x[:, i[:2]].sum(), X, IDX),
    "index_dynamic": (lambda x, i: x[i[0], 1:3], X, IDX),
    "take_along_axis": (
        lambda x, i: jnp.take_along_axis(x, jnp.stack([i, i, i, i], 1), axis=0),
        X,
        IDX,
    ),
    "scatter_set_add": (lambda x, i: x.at[i].add(1.0).at[:, 0].set(-1.0), X, IDX),
    "scatter_mul_max": (lambda x, i: x.at[i, 1].multiply(3.0).at[0].max(0.5), X, IDX),
    # cumulative, sort, top_k
    "cumsum_cumprod": (lambda x: jnp.cumsum(x, axis=0) + jnp.cumprod(x, axis=1), X),
    "cummax": (lambda x: lax.cummax(x, axis=1, reverse=True), X),
    "sort_argsort": (lambda x: (jnp.sort(x, axis=0), jnp.argsort(x, axis=1)), X),
    "argmax_argmin": (lambda x: (jnp.argmax(x, axis=1), jnp.argmin(x)), X),
    "top_k": (lambda x: lax.top_k(x, 2), X),
    # select
    "where": (lambda x: jnp.where(x > 0, x, 0.1 * x), X),
    "select_n": (lambda x, i: lax.select_n(i[0] > 0, x, -x), X, IDX),
    # control flow
    "cond": (lambda x: lax.cond(x.sum() > 0, lambda a: a * 2.0, lambda a: -a, x), X),
    "cond_closure": (lambda x, y: lax.cond(x[0, 0] > 0, lambda: x @ y, lambda: -(x @ y)), X, Y),
    "switch": (lambda x, i: lax.switch(i[0], [jnp.sin, jnp.cos, lambda a: a * a], x), X, IDX),
    "while_loop": (
        lambda x: lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 0.9), (0, x)),
        X,
    ),
    "fori_static": (lambda x: lax.fori_loop(0, 4, lambda i, c: c + i * x, x), X),
    "fori_dynamic": (lambda x, i: lax.fori_loop(0, i[0], lambda j, c: c * 1.1, x), X, IDX),
    "scan": (_scan_cumprod, X),
    "scan_reverse": (lambda x: lax.scan(lambda c, r: (c + r, c), jnp.zeros(4), x, reverse=True), X),
    "nested_jit": (_nested_jit, X),
    # nn
    "relu": (jax.nn.relu, X),
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), X),
    "gelu": (lambda x: jax.nn.gelu(x) + jax.nn.gelu(x, approximate=False), X),
    "softplus_logsoftmax": (lambda x: jax.nn.softplus(x) + jax.nn.log_softmax(x), X),
    "custom_vjp": (scaled_sin, X),
    "custom_vjp_two": (two_in_two_out, X, Y[:3, :4]),
    "custom_jvp": (clipped_exp, X),
    # random
    "key_split_normal": (
        lambda k: jax.random.normal(jax.random.split(k)[1], (3, 2)),
        jax.random.key(0),
    ),
    "key_uniform_bernoulli": (
        lambda k: (jax.random.uniform(k, (4,)), jax.random.bernoulli(k, 0.3, (4,))),
        jax.random.key(1),
    ),
    "rawkey_normal": (lambda k: jax.random.normal(k, (3,)), jax.random.PRNGKey(0)),
    "rawkey_split_uniform": (
        lambda k: jax.random.uniform(jax.random.split(k, 3)[2], (2, 2)),
        jax.random.PRNGKey(2),
    ),
    "rawkey_bernoulli_fold": (
        lambda k: jax.random.bernoulli(jax.random.fold_in(k, 7), 0.5, (5,)),
        jax.random.PRNGKey(3),
    ),
    "key_from_seed": (lambda s: jax.random.randint(jax.random.key(s), (3,), 0, 10), jnp.int32(4)),
    "key_data": (lambda k: jax.random.key_data(jax.random.split(k)), jax.random.key(5)),
    # keys made inside the function from a seed of any integer type (random_seed,
    # random_unwrap for the legacy uint32 form, random_wrap, random_bits)
    "prngkey_python_int_seed": (lambda s: jax.random.normal(jax.random.PRNGKey(s), (3,)), 7),
    "prngkey_uint32_seed": (
        lambda s: jax.random.bits(jax.random.PRNGKey(s), (4,), jnp.uint32),
        np.uint32(9),
    ),
    "prngkey_literal_seed": (lambda x: x + jax.random.uniform(jax.random.PRNGKey(0), x.shape), X),
    "key_python_seed_split_fold_in": (
        lambda s: jax.random.normal(jax.random.fold_in(jax.random.split(jax.random.key(s))[1], 3)),
        11,
    ),
    "rbg_key_from_seed": (
        lambda s: jax.random.uniform(jax.random.key(s, impl="rbg"), (2,)),
        jnp.int32(2),
    ),
    # transformations
    "remat_grad": (jax.grad(jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)).sum())), X),
    "remat_forward_no_cse": (jax.checkpoint(lambda x: jnp.sin(jnp.cos(x)), prevent_cse=False), X),
    "remat_policy_grad": (
        jax.grad(
            jax.checkpoint(
                lambda x: jnp.sin(x @ x.T).sum(),
                policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            )
        ),
        X,
    ),
    "remat_named_policy_grad": (
        jax.grad(
            jax.checkpoint(
                lambda x: jnp.sum(jnp.cos(checkpoint_name(jnp.sin(x), "y")) * x),
                policy=jax.checkpoint_policies.save_only_these_names("y"),
            )
        ),
        X,
    ),
    "remat_in_scan_grad": (
        jax.grad(
            lambda x: lax.scan(jax.checkpoint(lambda c, y: (jnp.sin(c) * y, c)), x[0], x)[0].sum()
        ),
        X,
    ),
    "hessian": (jax.hessian(lambda v: jnp.sum(jnp.sin(v) ** 3)), V),
    "jacfwd": (jax.jacfwd(lambda v: jnp.tanh(v) * 2), V),
    "grad_softmax": (jax.grad(lambda x: jax.nn.softmax(x)[0, 1]), X),
    "grad_cond": (jax.grad(lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x).sum()), X),
    "grad_switch": (
        jax.grad(lambda x, i: lax.switch(i[0], [jnp.sin, jnp.tanh, jnp.cos], x).sum()),
        X,
        IDX,
    ),
    "grad_scan": (jax.grad(lambda x: _scan_cumprod(x)[1].sum()), X),
    "grad_fori": (jax.grad(lambda x: lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * x, x).sum()), X),
    "grad_custom_vjp": (jax.grad(lambda x: scaled_sin(x).sum()), X),
    "grad_custom_jvp": (jax.grad(lambda x: clipped_exp(x).sum()), X),
    "vmap_cond": (jax.vmap(lambda v: lax.cond(v.sum() > 0, jnp.sin, jnp.cos, v)), X),
    "vmap_index": (jax.vmap(lambda v, i: v[i % 4]), X, IDX),
    "vmap_matvec": (jax.vmap(lambda x, v: x @ v, in_axes=(None, 0)), X, Y.T),
    "jvp_softplus": (lambda x: jax.jvp(jax.nn.softplus, (x,), (jnp.ones_like(x),)), X),
    "jvp_while": (
        lambda x: jax.jvp(lambda a: lax.fori_loop(0, 3, lambda i, c: c * a, a), (x,), (x,)),
        X,
    ),
    # nnlite
    "ffn_forward": (ffn_forward, FFN_PARAMS, X),
    "ffn_loss": (ffn_loss, FFN_PARAMS, X, LABELS),
    "ffn_grad": (jax.grad(ffn_loss), FFN_PARAMS, X, LABELS),
    "adam_step": (train_step, FFN_PARAMS, OPT_STATE, X, LABELS),
    # the MLP loss's gradient in every gradient mode (manual and fused are custom_vjp's)
    **{
        f"mlp_grad_{mode}": (
            jax.grad(functools.partial(mlp_fused.mlp_loss, mode=mode, activation="tanh")),
            FFN_PARAMS,
            X,
            LABELS,
        )
        for mode in mlp_fused.GRAD_MODES
    },
    "mlp_fused_grad_accum": (
        functools.partial(mlp_fused.fused_grad_accum, activation="relu"),
        FFN_PARAMS,
        X,
        LABELS,
        FFN_PARAMS,
    ),
    # multi-device
    "shard_map_psum": (_smap(lambda x: lax.psum(x * 2.0, "batch"), P("batch"), P()), XS),
    "shard_map_collectives": (
        _smap(_collectives, P("batch"), (P(), P("batch"), P(), P("batch"))),
        XS,
    ),
    "shard_map_no_vma": (
        _smap(_more_collectives, P("batch"), (P("batch"), P(), P()), check_vma=False),
        XS,
    ),
    "shard_map_partial_manual": (  # only "x" manual; "y" stays Explicit
        jax.jit(
            jax.shard_map(
                lambda x: lax.psum(x, "x") * 2.0,
                mesh=MESH_2D,
                in_specs=P("x"),
                out_specs=P(),
                axis_names={"x"},
            )
        ),
        XS,
    ),
    "shard_map_reversed_devices": (
        jax.shard_map(
            lambda x: lax.psum(x, ("a", "b")), mesh=MESH_REV, in_specs=P(("a", "b")), out_specs=P()
        ),
        XS,
    ),
    # jit with shardings (pjit's sharding params), over an Auto and an Explicit mesh
    "jit_in_out_shardings": (
        jax.jit(
            lambda x, y: (x * y, x.sum()),
            in_shardings=(NamedSharding(MESH, P("batch")), None),
            out_shardings=(NamedSharding(MESH, P("batch")), NamedSharding(MESH, P())),
        ),
        XS,
        XS,
    ),
    "jit_out_sharding_2d": (
        jax.jit(lambda x: jnp.tanh(x), out_shardings=NamedSharding(MESH_2D, P("x", "y"))),
        XS[:8],
    ),
    "shard_map_custom_vjp": (_smap(scaled_sin, P("batch"), P("batch")), XS),
    "pmap_pmean": (jax.pmap(lambda x: x / lax.pmean(jnp.sum(x), "i"), axis_name="i"), XS[:8]),
    "shard_map_train_step": (
        jax.jit(_smap(_shard_train_step, (P(), P("batch"), P("batch")), P()), donate_argnums=(0,)),
        FFN_PARAMS,
        XS,
        LABELS16,
    ),
}


def _plain(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _copy(args):
    """Fresh copies, for functions that donate their arguments."""
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args)


#: every n-th corpus case runs both functions and compares their outputs even when they
#: trace to the same program (as tests/test_jaxpr_sweep.py does)
NUMERIC_EVERY = 4


def _assert_same_outputs(f, g, args, numeric=False):
    """``g`` (the printed code, on the flattened ``args``) computes what ``f`` computes: the
    same program (JAX's text of both jaxprs, every parameter and constant, function names
    aside: tests/_jaxpr_sweep.py) computes the same outputs bit for bit; where the programs
    differ, or ``numeric`` asks, both run and every output is compared."""
    leaves = jax.tree.leaves(args)
    if not numeric:
        want = sweep._program(jax.make_jaxpr(f)(*args))
        if sweep._program(jax.make_jaxpr(g)(*leaves)) == want:
            return
    # one compiled program each: running op by op would compile every operation
    want = jax.tree.leaves(jax.jit(f)(*_copy(args)))
    got = jax.jit(g)(*jax.tree.leaves(_copy(args)))
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    assert len(got) == len(want)
    for w, o in zip(want, got, strict=True):
        w, o = _plain(w), _plain(o)
        assert w.shape == o.shape and w.dtype == o.dtype
        np.testing.assert_allclose(o, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(CORPUS))
def test_roundtrip(name):
    f, *args = CORPUS[name]
    text = nl.show_jaxpr(f, *args, name="f")
    g = nl.roundtrip(f, *args, name="f")
    _assert_same_outputs(f, g, args, numeric=list(CORPUS).index(name) % NUMERIC_EVERY == 0)
    assert nl.show_jaxpr(g, *jax.tree.leaves(args), name="f") == text  # a fixed point


def test_corpus_size():
    assert len(CORPUS) >= 60


def test_source_is_self_contained_and_annotated():
    src = nl.show_jaxpr(lambda x, y: x @ y, X, Y, name="mm")
    assert src.startswith("import jax.numpy as jnp\nfrom jax import lax\n\n\ndef mm(\n")
    assert "def mm(\n    a,  # f32[3,4]\n    b,  # f32[4,5]\n):" in src
    assert (
        "a, b, dimension_numbers=(((1,), (0,)), ((), ())), preferred_element_type=jnp.float32"
        in src
    )
    namespace = {}
    exec(src, namespace)  # no names from the caller needed
    np.testing.assert_allclose(namespace["mm"](X, Y), X @ Y, rtol=1e-6)


def test_custom_rules_are_rebuilt_not_replaced_by_autodiff():
    # scaled_sin's bwd and clipped_exp's jvp disagree with autodiff of their primal
    for fn in (scaled_sin, clipped_exp):
        g = nl.roundtrip(fn, X)
        # each gradient one compiled program (op by op would compile every operation)
        want = jax.jit(jax.grad(lambda x, fn=fn: fn(x).sum()))(X)
        autodiff = jax.jit(
            jax.grad(lambda x, fn=fn: jax.jit(fn.fun if hasattr(fn, "fun") else fn)(x).sum())
        )(X)
        got = jax.jit(jax.grad(lambda x, g=g: g(x).sum()))(X)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert not np.allclose(autodiff, want)
    src = nl.show_jaxpr(scaled_sin, X)
    assert "@jax.custom_vjp" in src and "scaled_sin.defvjp(scaled_sin_fwd, scaled_sin_bwd)" in src


def test_nested_function_docstrings_name_the_source_line():
    def uses_cond(x):
        return lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)  # the line the docstring names

    line = uses_cond.__code__.co_firstlineno + 1
    src = nl.show_jaxpr(uses_cond, X)
    assert (
        src.count(f'"""cond branch, from tests/test_show_jaxpr.py:{line} (') == 2
        or src.count(
            f"test_show_jaxpr.py:{line} (" + "test_nested_function_docstrings_name_the_source_line"
        )
        == 2
    )
    g = nl.roundtrip(uses_cond, X)
    assert nl.show_jaxpr(g, X, name="uses_cond") == src  # the rebuilt function keeps them


def test_inline_jit_and_simplify():
    f = CORPUS["nested_jit"][0]
    full = nl.show_jaxpr(f, X)
    inlined = nl.show_jaxpr(f, X, inline_jit=True)
    assert full.count("jax.jit(") == 3 and "jax.jit(" not in inlined

    def where(x):  # a one-equation jit (cumsum) and an identity equation (sum over no axes)
        y = lax.reduce_sum(jnp.cumsum(x, axis=0), axes=())
        return jnp.where(y > 0, y, 0.0)

    plain, simple = nl.show_jaxpr(where, X), nl.show_jaxpr(where, X, simplify=True)
    assert "jax.jit(cumsum)" in plain and "jax.jit(cumsum)" not in simple
    assert "e = lax.reduce_sum(d, axes=())" in plain and "axes=()" not in simple
    assert len(simple.splitlines()) < len(plain.splitlines())
    for fn in (where, f, CORPUS["ffn_grad"][0]):
        args = CORPUS["ffn_grad"][1:] if fn is CORPUS["ffn_grad"][0] else (X,)
        g = nl.roundtrip(fn, *args, simplify=True)
        _assert_same_outputs(fn, g, args)
        text = nl.show_jaxpr(fn, *args, simplify=True)
        assert nl.show_jaxpr(g, *jax.tree.leaves(args), simplify=True, name=g.__name__) == text


def test_large_constants_are_supplied_by_roundtrip():
    table = jnp.arange(50.0).reshape(10, 5)
    f = lambda x: x @ table[:4] + jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0]])
    src = nl.show_jaxpr(f, X, max_const_size=20)
    assert (
        "LARGE_CONSTS['C0']" in src and "np.array([[1.0, 2.0, 3.0, 4.0, 5.0]], np.float32)" in src
    )
    g = nl.roundtrip(f, X, max_const_size=20)
    _assert_same_outputs(f, g, (X,))


def test_unsupported_primitive_names_primitive_and_params():
    fake = jax.extend.core.Primitive("nnlite_fake_op")
    fake.def_abstract_eval(lambda x, **params: x)
    line = test_unsupported_primitive_names_primitive_and_params.__code__.co_firstlineno + 9
    with pytest.raises(
        nl.UnsupportedPrimitiveError,
        match=rf"'nnlite_fake_op' from tests/test_show_jaxpr.py:{line} \([\w.<>]*<lambda>\) "
        r"\(params: alpha=3, mode='x'\)",
    ):
        nl.show_jaxpr(lambda x: fake.bind(x, alpha=3, mode="x"), X)


def test_unprintable_parameter_is_named():
    from nnlite.jaxpr._exprs import pyval

    with pytest.raises(
        nl.UnsupportedPrimitiveError, match="parameter fake=.* has no Python spelling"
    ):
        pyval(object(), "parameter fake=")


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_format_leaves_output_unchanged():
    texts = [
        nl.show_jaxpr(CORPUS[k][0], *CORPUS[k][1:])
        for k in ("adam_step", "grad_custom_vjp", "switch", "shard_map_train_step")
    ]
    for text in texts:
        out = subprocess.run(
            ["ruff", "format", "-"], input=text, capture_output=True, text=True, check=True
        )
        assert out.stdout == text


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("digits_mlp", []),  # strategy none: jit with donated params and optimizer state
        ("linreg_pmap", ["train.steps_per_call=2"]),  # pmap: jit of shard_map, scan inside
        ("digits_shard_map", ["train.steps_per_call=2"]),
    ],
)
def test_train_step_roundtrips(config, overrides):
    from train.config import load_config
    from train.loop.show import show_jaxpr, traced_function

    path = os.path.join(ROOT, "configs", f"{config}.yaml")
    cfg = load_config(path, ["train.batch_size=64", *overrides])
    f, args = traced_function(cfg, "step")
    text = nl.show_jaxpr(f, *args, name="step")
    if config == "digits_mlp":  # what python -m train --show-jaxpr step prints (one build
        assert show_jaxpr(cfg, "step") == text  # of the run more: once is enough)
    assert ("jax.shard_map(" in text) == (cfg.parallel.strategy != "none")
    g = nl.roundtrip(f, *args, name="step")
    _assert_same_outputs(f, g, args)
    assert nl.show_jaxpr(g, *jax.tree.leaves(args), name="step") == text


def test_train_cli_unsupported_primitive_is_one_line_exit_2(monkeypatch, capsys):
    import train.loop.show
    from train.__main__ import main

    def show_jaxpr(cfg, what):
        raise nl.UnsupportedPrimitiveError(
            "show_jaxpr cannot print primitive 'fake' (params: jaxpr={ lambda ; a:f32[]. let\n"
            + "    b:f32[] = fake a\n" * 50
            + "  in (b,) }): it has no rule in nnlite"
        )

    monkeypatch.setattr(train.loop.show, "show_jaxpr", show_jaxpr)
    argv = ["--config", os.path.join(ROOT, "configs", "linreg_pmap.yaml"), "--show-jaxpr", "step"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and len(err) < 400
    assert err.startswith("error: --show-jaxpr step: show_jaxpr cannot print primitive 'fake'")


def _cli(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "nnlite.jaxpr_cli", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)  # fmt: skip


def test_cli_prints_the_function():
    out = _cli("jax.nn:softplus", "--shapes", "f32[3,4]", "--name", "sp")
    assert out.returncode == 0, out.stderr
    assert "def sp(\n    a,  # f32[3,4]\n):" in out.stdout and "@jax.custom_jvp" in out.stdout
    namespace = {}
    exec(out.stdout, namespace)
    np.testing.assert_allclose(namespace["sp"](X), jax.nn.softplus(X), rtol=1e-6)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["jax.nn:no_such_fn", "--shapes", "f32[3]"], "has no attribute 'no_such_fn'"),
        (["jax.nn:relu", "--shapes", "f33[3]"], "bad --shapes entry 'f33[3]'"),
        (["jax.numpy:dot", "--shapes", "f32[3]"], "tracing jax.numpy:dot at f32[3] failed"),
    ],
)
def test_cli_bad_arguments_exit_2(argv, message, capsys):
    from nnlite import jaxpr_cli

    with pytest.raises(SystemExit) as e:
        jaxpr_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("usage: python -m nnlite.jaxpr_cli")


def test_show_jaxpr_is_the_function_and_the_cli_has_its_own_module():
    import types

    import nnlite.jaxpr_cli  # noqa: F401 -- importing the CLI changes nothing in nnlite

    assert isinstance(nl.show_jaxpr, types.FunctionType)
    package = os.path.dirname(nl.__file__)
    assert not os.path.exists(os.path.join(package, "show_jaxpr.py"))  # no module to shadow it


# -- the seed's options, show_xla, module layout ------------------------------------------------
def test_file_add_decls_add_main(tmp_path, capsys):
    def ffn(W, x):
        ((W1, b1), (W2, b2)) = W
        return jax.nn.softmax(W2 @ jax.nn.relu(W1 @ x + b1) + b2)

    rng = np.random.default_rng(0)
    W = ((rng.standard_normal((5, 3)), rng.standard_normal(5)),
         (rng.standard_normal((4, 5)), rng.standard_normal(4)))  # fmt: skip
    x = rng.standard_normal(3)
    path = tmp_path / "ffn.py"
    src = nl.show_jaxpr(ffn, W, x, file=str(path), add_main=True)
    assert path.read_text() == src and src.startswith("import jax\n")
    assert src.rstrip().endswith("))") and 'if __name__ == "__main__":' in src
    ns = {"__name__": "__main__"}
    exec(compile(src, str(path), "exec"), ns)  # runs the main block: prints the result
    assert capsys.readouterr().out.startswith("[")  # the printed softmax
    out = ns["ffn"](*[jnp.asarray(a, jnp.float32) for a in jax.tree.leaves((W, x))])
    np.testing.assert_allclose(out, ffn(W, x), rtol=1e-5)
    body = nl.show_jaxpr(ffn, W, x, add_decls=False)
    assert body.startswith("def ffn(") and body == nl.show_jaxpr(ffn, W, x).split("\n\n\n", 1)[1]
    buf = __import__("io").StringIO()
    nl.show_jaxpr(ffn, W, x, file=buf)
    assert buf.getvalue() == nl.show_jaxpr(ffn, W, x)
    with pytest.raises(TypeError, match="file must be a path or an open text file, got int"):
        nl.show_jaxpr(ffn, W, x, file=3)


def test_unknown_keywords_name_the_valid_ones():
    with pytest.raises(TypeError, match=r"show_jaxpr\(\) got an unexpected keyword argument 'flie'; valid keywords: name, simplify, inline_jit, max_const_size, file, add_decls, add_main, static_argnums, axis_env"):  # fmt: skip
        nl.show_jaxpr(jnp.sin, X, flie="x.py")
    with pytest.raises(TypeError, match=r"roundtrip\(\) got an unexpected keyword argument 'file'"):
        nl.roundtrip(jnp.sin, X, file="x.py")
    with pytest.raises(TypeError, match=r"show_xla\(\) got an unexpected keyword argument 'optimised'; valid keywords: file, optimized, in_shardings"):  # fmt: skip
        nl.show_xla(jnp.sin, X, optimised=True)


def test_show_xla_and_show_jaxpr_and_xla(tmp_path):
    hlo = nl.show_xla(lambda x, n: jnp.sin(x) * n, X, 3, static_argnums=1)
    assert hlo.startswith("HloModule jit__lambda") and "sine(" in hlo and "ENTRY" in hlo
    opt = nl.show_xla(jnp.sin, X, optimized=True)
    assert opt.startswith("HloModule jit_sin") and "is_scheduled=true" in opt
    both = nl.show_jaxpr_and_xla(jnp.sin, X, file=tmp_path / "both.txt", name="s")
    assert (tmp_path / "both.txt").read_text() == both
    assert both.index("def s(") < both.index("HloModule")


def _imports(module: str) -> set[str]:
    import ast

    with open(os.path.join(ROOT, "nnlite", "jaxpr", module + ".py")) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {a.name for a in node.names}
    return names


def test_printer_core_sits_below_the_rule_modules():
    """No import cycle: exprs <- printer <- rules, nested, parallel <- show_jaxpr (the API);
    every rule table registers into the printer, which imports none of them."""
    rule_modules = {"_rules", "_nested", "_parallel"}
    assert not _imports("_exprs")  # the bottom layer: expressions
    assert not _imports("_printer") & {*rule_modules, "_show_jaxpr"}
    for ext in rule_modules:
        assert "_printer" in _imports(ext)
        assert not _imports(ext) & {"_show_jaxpr", *rule_modules} - {ext}
    assert rule_modules <= _imports("_show_jaxpr")


# -- primitives that a public function makes print as that function, not as a bind ---------
_KEY = jax.random.key(0)
PUBLIC_SPELLINGS = {
    "iota (2-d)": (lambda a: jnp.tril(a), X, "lax.broadcasted_iota("),
    "copy": (lambda a: jnp.copy(a), X, "jnp.copy("),
    "neg (complex)": (lambda a: -a, X.astype(jnp.complex64), "lax.neg("),
    "random_bits": (lambda k: jax.random.bits(k, (3, 4)), _KEY, "jax.random.bits("),
    "random_split": (lambda k: jax.random.split(k, 2), _KEY, "jax.random.split("),
    "random_fold_in": (lambda k: jax.random.fold_in(k, 3), _KEY, "jax.random.fold_in("),
    "tile": (lambda a: jnp.tile(a, (2, 1)), X, "lax.tile("),
    "dynamic_slice": (lambda a: jnp.nanmedian(a), X, "lax.dynamic_slice("),
    "dynamic_update_slice": (
        lambda a, i: lax.dynamic_update_slice(a, V[:2], (i,)),
        (V, jnp.int32(1)),
        "lax.dynamic_update_slice(",
    ),
    "fft": (lambda a: jnp.fft.fft(a), V, "lax.fft("),
    "cholesky": (lambda a: jnp.linalg.cholesky(a), jnp.eye(3) * 2.0 + 0.1, "jnp.linalg.cholesky("),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLIC_SPELLINGS))
def test_a_primitive_with_a_public_function_prints_as_it(name):
    fn, args, spelling = PUBLIC_SPELLINGS[name]
    args = args if isinstance(args, tuple) else (args,)
    text = nl.show_jaxpr(fn, *args)
    assert spelling in text and "_p.bind" not in text, text
    outcome, detail = sweep.check(sweep.Case("t", name, fn, args), numeric=True)
    assert outcome == "ok", detail


def test_a_composite_with_keyword_attributes_runs_as_printed():
    fn = lambda a: lax.composite(lambda t, *, scale: jnp.sin(t) * scale, name="t.sc")(  # noqa: E731
        a, scale=2.0
    )
    g = nl.roundtrip(fn, V)
    np.testing.assert_array_equal(g(V), fn(V))
    assert nl.show_jaxpr(g, V) == nl.show_jaxpr(fn, V)
