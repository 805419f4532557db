"""nl.matmul: nnlite's products on Intel MKL's GEMM (nnlite/core/_gemm.py, _gemm.cc) against
XLA's dot, in every layout the layers hand it, both gradient modes, vmap, partitioned
programs, and the ways around it (no MKL, NNLITE_CPU_GEMM=xla, other dtypes)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
from nnlite.core import _gemm

pytestmark = pytest.mark.skipif(not _gemm._library()[0], reason=f"no MKL here: {nl.gemm_info()}")


def _op(x, t):
    return np.swapaxes(x, -1, -2) if t else x


def _pair(m, k, n, ta, tb, batch_a=(), batch_b=(), seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((*batch_a, *((k, m) if ta else (m, k))), dtype=np.float32)
    b = rng.standard_normal((*batch_b, *((n, k) if tb else (k, n))), dtype=np.float32)
    return a, b


def _uses_mkl(f, *args) -> bool:
    # a fresh function: jit's cache is keyed by it, and the route is chosen when it traces
    return "nnlite_gemm" in jax.jit(lambda *a: f(*a)).lower(*args).as_text()


LAYOUTS = [(ta, tb) for ta in (False, True) for tb in (False, True)]
BATCHES = [((), ()), ((3,), (3,)), ((1,), (3,)), ((2, 3), (2, 1))]


@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("batch_a,batch_b", BATCHES)
def test_equals_numpy_in_every_layout_and_its_gradients_equal_xlas(ta, tb, batch_a, batch_b):
    a, b = _pair(100, 150, 160, ta, tb, batch_a, batch_b)

    def f(a, b):
        return nl.matmul(a, b, transpose_a=ta, transpose_b=tb)

    assert _uses_mkl(f, a, b)
    want = np.matmul(_op(a, ta), _op(b, tb))
    np.testing.assert_allclose(f(a, b), want, rtol=1e-4, atol=1e-4)

    w = np.random.default_rng(1).standard_normal(want.shape, dtype=np.float32)
    got = jax.grad(lambda a, b: jnp.sum(f(a, b) * w), (0, 1))(a, b)
    with _gemm.forced(False):
        assert not _uses_mkl(f, a, b)
        ref = jax.grad(lambda a, b: jnp.sum(f(a, b) * w), (0, 1))(a, b)
    for x, y in zip(got, ref, strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-3)


def test_leading_axes_fold_into_rows_forward_mode_and_float64():
    a, b = _pair(40, 64, 72, False, True, batch_a=(3, 5))
    np.testing.assert_allclose(
        nl.matmul(a, b, transpose_b=True), a @ b.T, rtol=1e-4, atol=1e-4
    )  # a 2-D b: the leading axes are more rows of one product
    da = np.ones_like(a)
    _, tangent = jax.jvp(lambda a: nl.matmul(a, b, transpose_b=True), (a,), (da,))
    np.testing.assert_allclose(tangent, da @ b.T, rtol=1e-4, atol=1e-4)
    with jax.enable_x64(True):
        a64, b64 = (np.asarray(x, np.float64) for x in _pair(100, 150, 160, True, False))
        assert _uses_mkl(lambda a, b: nl.matmul(a, b, transpose_a=True), a64, b64)
        out = nl.matmul(a64, b64, transpose_a=True)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, a64.T @ b64, rtol=1e-12)


def test_small_products_other_dtypes_and_empty_shapes_take_xlas_dot():
    a, b = _pair(64, 64, 64, False, False)  # below MIN_FLOPS: XLA may fuse it
    assert not _uses_mkl(nl.matmul, a, b)
    a, b = _pair(100, 150, 160, False, False)
    a16, b16 = (jnp.asarray(x, jnp.float16) for x in (a, b))
    assert not _uses_mkl(nl.matmul, a16, b16)
    assert nl.matmul(a16, b16).dtype == jnp.float16
    mixed = jax.jit(lambda a, b: nl.matmul(a, b))  # operands of two dtypes: XLA's dot
    assert "nnlite_gemm" not in mixed.lower(a, jnp.asarray(b, jnp.bfloat16)).as_text()
    # an empty contraction is zeros, an empty batch an empty result
    z = nl.matmul(np.ones((300, 0), np.float32), np.ones((0, 900), np.float32))
    assert z.shape == (300, 900) and not np.any(z)
    e = nl.matmul(np.ones((0, 300, 40), np.float32), np.ones((0, 40, 300), np.float32))
    assert e.shape == (0, 300, 300)


def test_vmap_folds_into_rows_or_the_batch():
    a, b = _pair(100, 64, 160, False, False, batch_a=(4,))
    out = jax.vmap(lambda a: nl.matmul(a, b))(a)
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
    bs = np.stack([b, 2 * b, -b, b])
    out = jax.vmap(lambda a, b: nl.matmul(a, b, transpose_a=True))(np.swapaxes(a, 1, 2), bs)
    np.testing.assert_allclose(out, a @ bs, rtol=1e-4, atol=1e-4)


def test_the_layers_products_run_on_mkl_in_both_gradient_modes():
    layer = nl.Linear(128, 256)
    p = layer.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 32, 128))
    w = jax.random.normal(jax.random.key(3), (4, 32, 256))

    def loss(p, x):
        return jnp.sum(layer(p, x) * w)

    assert _uses_mkl(jax.grad(loss), p, x)
    assert _uses_mkl(jax.grad(nl.manual_grads(loss)), p, x)
    with _gemm.forced(False):
        want = jax.grad(loss)(p, x)
    for g in (jax.grad(loss)(p, x), jax.grad(nl.manual_grads(loss))(p, x)):
        for leaf, ref in zip(jax.tree.leaves(g), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(leaf, ref, rtol=1e-4, atol=1e-4)
    # the hand rule's bias cotangent is the last row of [x, 1]^T dy (out > in): one product
    manual = str(jax.make_jaxpr(jax.grad(nl.manual_grads(loss)))(p, x))
    assert "concatenate" in manual and manual.count("nnlite_gemm") == 3, manual
    narrow = nl.Linear(256, 128)  # out < in: x^T dy, and the rows of dy summed apart
    pn = narrow.init(jax.random.key(4))
    xn = jax.random.normal(jax.random.key(5), (4, 32, 256))
    text = str(jax.make_jaxpr(jax.grad(nl.manual_grads(lambda p: jnp.sum(narrow(p, xn)))))(pn))
    assert "concatenate" not in text and "reduce_sum" in text
    # the tied head: x @ E^T as one product with E read transposed in place
    emb = nl.Embedding(300, 128)
    pe = emb.init(jax.random.key(2))
    text = jax.jit(emb.attend).lower(pe, x).as_text()
    assert "nnlite_gemm" in text and "transpose(" not in text


def test_partitioned_programs_use_xlas_dot_and_shard_map_keeps_mkl():
    mesh = jax.make_mesh((8,), ("data",))
    a, b = _pair(128, 96, 256, False, False, batch_a=(8,))
    shard = NamedSharding(mesh, P("data"))
    a_s = jax.device_put(a, shard)

    def loss(a, b):
        return jnp.sum(jnp.sin(nl.matmul(a, b)))

    grad = jax.jit(jax.grad(loss, (0, 1)))
    assert "nnlite_gemm" not in grad.lower(a_s, b).as_text()  # XLA partitions its own dot
    want = jax.grad(loss, (0, 1))(a, b)
    for x, y in zip(grad(a_s, b), want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-3)
    sm = jax.jit(jax.shard_map(lambda a: nl.matmul(a, b), mesh=mesh, in_specs=P("data"),
                               out_specs=P("data")))  # fmt: skip
    assert "nnlite_gemm" in sm.lower(a_s).as_text()
    np.testing.assert_allclose(sm(a_s), a @ b, rtol=1e-4, atol=1e-4)


def test_show_jaxpr_prints_the_call_and_flops_count_it():
    a, b = _pair(100, 150, 160, True, False)

    def f(a, b):
        return jnp.sum(nl.matmul(a, b, transpose_a=True) ** 2)

    src = nl.show_jaxpr(jax.grad(f, (0, 1)), a, b)
    assert "import nnlite" in src and "nnlite.matmul(" in src and "transpose_a=True" in src
    nl.roundtrip(jax.grad(f, (0, 1)), a, b)
    with _gemm.forced(False):
        xla = nl.flops(jax.grad(f, (0, 1)), a, b)
    ours = nl.flops(jax.grad(f, (0, 1)), a, b)
    assert (
        ours["unknown"] == ()
        and ours["matmul_flops"] == xla["matmul_flops"] == 3 * 2 * 100 * 150 * 160
    )


def test_bad_operands_name_the_shapes():
    with pytest.raises(ValueError, match=r"contracted sizes differ \(4 and 5\)"):
        nl.matmul(np.ones((3, 4)), np.ones((5, 6)))
    with pytest.raises(ValueError, match=r"do not broadcast"):
        nl.matmul(np.ones((2, 3, 4)), np.ones((3, 4, 5)), transpose_a=False, transpose_b=False)
    with pytest.raises(ValueError, match=r"2 or more axes, got \(4,\)"):
        nl.matmul(np.ones(4), np.ones((4, 5)))


_FALLBACK = """
import jax, jax.numpy as jnp, nnlite as nl
print(nl.gemm_info())
layer = nl.Linear(128, 256)
p = layer.init(jax.random.key(0)); x = jnp.ones((128, 128))
print("mkl" if "nnlite_gemm" in jax.jit(layer).lower(p, x).as_text() else "xla")
print(float(jax.grad(lambda p: layer(p, x).sum())(p).W.sum()))
"""


@pytest.mark.parametrize("how", ["env", "no-mkl", "bad-env", "mkl-required"])
def test_without_mkl_the_layers_run_on_xla(tmp_path, how):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if how == "env":
        env[_gemm.ENV] = "xla"
    elif how == "bad-env":
        env[_gemm.ENV] = "blas"
    else:  # the loader finds no libmkl_rt (mkl-required: NNLITE_CPU_GEMM=mkl insists)
        code = "from nnlite.core import _gemm; _gemm._mkl_candidates = lambda: []\n"
        if how == "mkl-required":
            env[_gemm.ENV] = "mkl"
    script = _FALLBACK if how in ("env", "bad-env") else code + _FALLBACK
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    if how == "bad-env":
        assert done.returncode != 0
        assert "NNLITE_CPU_GEMM='blas': expected one of auto, mkl, xla" in done.stderr
        return
    if how == "mkl-required":
        assert done.returncode != 0
        assert "NNLITE_CPU_GEMM=mkl, but OSError: no Intel MKL" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-2000:]
    info, path, grad = done.stdout.strip().splitlines()
    assert info.startswith("XLA: ")
    assert ("NNLITE_CPU_GEMM=xla" in info) if how == "env" else ("no Intel MKL" in info)
    assert path == "xla"
    assert float(grad) == 128 * 128 * 256  # d sum(x W + b) / dW = x^T 1: 128 in each entry


def test_a_bad_setting_is_an_error_even_where_no_product_takes_mkl(monkeypatch):
    monkeypatch.setenv(_gemm.ENV, "fast")
    _gemm._choice.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"NNLITE_CPU_GEMM='fast': expected one of"):
            nl.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))
    finally:
        monkeypatch.undo()
        _gemm._choice.cache_clear()
    assert nl.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)).shape == (2, 2)


@pytest.fixture
def bf16_gemm():
    """Switch the handler between MKL's bfloat16 GEMM and its widened sgemm blocks (MKL's
    bfloat16 GEMM runs on any CPU, emulated where it must); this CPU's choice after."""
    yield lambda native: _gemm.hand_blas(bf16_gemm=native)
    _gemm.hand_blas(bf16_gemm=_gemm._bf16_arithmetic())


@pytest.mark.parametrize("native", [True, False])
def test_a_bfloat16_result_is_rounded_in_the_handler_as_xla_rounds(native, bf16_gemm):
    # bfloat16 operands, a bfloat16 result: the handler rounds its float32 product (to
    # nearest even, NaN and infinities kept) instead of writing it out for XLA to convert;
    # bit for bit what rounding the float32 product after gives
    bf16_gemm(native)
    a, b = _pair(1100, 300, 2100, False, False, seed=3)
    a[5, :] = np.nan
    a[7, 0], b[0, 9] = np.inf, 1.0
    a16, b16 = jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)
    rounded = jax.jit(nl.matmul)
    wide = jax.jit(lambda a, b: nl.matmul(a, b, preferred_element_type=jnp.float32))
    text = rounded.lower(a16, b16).compile().as_text()
    call = next(ln for ln in text.splitlines() if 'custom_call_target="nnlite_gemm"' in ln)
    assert "bf16[1100,2100]" in call.split("=")[1] and "convert" not in text
    got, want = rounded(a16, b16), wide(a16, b16).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert np.isnan(np.float32(got[5])).all() and np.isinf(np.float32(got[7, 9]))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "shape",
    [(100, 150, 160, False, True), (70, 2100, 2300, True, False), (2100, 1100, 150, False, True)],
)
def test_bfloat16_operands_take_mkl_as_xlas_dot_computes_them(native, shape, bf16_gemm):
    # a CPU with bfloat16 arithmetic: MKL's bfloat16 GEMM; without: the handler widens the
    # operands block by block for sgemm (the larger shapes: several blocks along k and the
    # columns, or k and the rows; each operand read transposed in the product or its
    # gradient)
    bf16_gemm(native)
    m, k, n, ta, tb = shape
    a, b = _pair(m, k, n, ta, tb)
    a16, b16 = (jnp.asarray(x, jnp.bfloat16) for x in (a, b))
    w = jnp.asarray(np.random.default_rng(2).standard_normal((m, n)), jnp.bfloat16)
    for pref in (None, jnp.float32):

        def f(a, b, pref=pref):
            return nl.matmul(a, b, transpose_a=ta, transpose_b=tb, preferred_element_type=pref)

        def loss(a, b, f=f):
            return jnp.sum((f(a, b) * w).astype(jnp.float32))

        assert _uses_mkl(f, a16, b16)
        text = jax.jit(lambda a, b, f=f: f(a, b)).lower(a16, b16).as_text()
        assert f"tensor<{'x'.join(map(str, a.shape))}xbf16>, " in text  # no widening in XLA
        got, grads = f(a16, b16), jax.grad(loss, (0, 1))(a16, b16)
        with _gemm.forced(False):
            want, ref = f(a16, b16), jax.grad(loss, (0, 1))(a16, b16)
        assert got.dtype == want.dtype == (pref or jnp.bfloat16)
        # both are the float32 product of the bfloat16 values (summed in another order),
        # rounded the same way: equal to float32 rounding, then within one bfloat16 step
        tol = 1e-5 if pref else 2**-7
        scale = float(np.sqrt(k))  # the entries' size: sums of k products of normals
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=1e-3 * scale
        )
        for x, y in zip(grads, ref, strict=True):
            assert x.dtype == y.dtype == jnp.bfloat16
            np.testing.assert_allclose(
                np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2e-2, atol=0.1 * scale
            )
    # printed as a dot with a float32 result, as XLA computes it
    assert "preferred_element_type=jnp.float32" in nl.show_jaxpr(jax.grad(loss, (0, 1)), a16, b16)
    nl.roundtrip(jax.grad(loss, (0, 1)), a16, b16)
