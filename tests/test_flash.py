"""nl.flash_attention: the fused CPU attention kernel (nnlite/nn/_flash.cc) against
dot_product_attention, in every layout the layer hands it, and the ways around it (off the
CPU, partitioned programs, no compiler)."""

import functools
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
from nnlite.nn import _attention, _flash

pytestmark = pytest.mark.skipif(
    not _flash._library()[0], reason=f"no fused kernel here: {nl.flash_info()}"
)


def _qkv(b, t, s, h, kv, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d))
    k = jax.random.normal(ks[1], (b, s, kv, d))
    v = jax.random.normal(ks[2], (b, s, kv, d))
    w = jax.random.normal(ks[3], (b, t, h, d))
    return q, k, v, w


def _reference(q, k, v, causal, offset, window, scale=None, mask=None):
    t, s = q.shape[1], k.shape[1]
    full = _attention.causal_mask(t, s, offset, window)[None, None] if causal else None
    if mask is not None:
        full = mask if full is None else full & mask
    return _attention.dot_product_attention(q, k, v, full, scale=scale)


def _key_padding(b, s, seed=1):
    """``[B, 1, 1, S]``: random padding, the first row padded everywhere (its queries see
    no key: the mean of the values)."""
    valid = jax.random.uniform(jax.random.key(seed), (b, s)) > 0.3
    return valid.at[0].set(False)[:, None, None, :]


CASES = [  # b, t, s, h, kv, d, causal, q_offset, window
    (2, 100, 100, 4, 2, 32, True, None, None),  # grouped, t not a multiple of 64
    (2, 130, 130, 4, 4, 64, False, None, None),  # not causal, a partial last block
    (1, 70, 200, 6, 2, 16, True, 130, None),  # queries after a prefix of keys
    (1, 5, 9, 3, 1, 16, True, 2, None),  # an offset below S - T (a cache filled to 2)
    (2, 200, 200, 4, 1, 48, True, None, 37),  # sliding window, multi-query
    (1, 1, 7, 2, 2, 80, True, None, None),  # one query (a decode step), head_dim 80
]


MASKS = {  # name -> mask of (b, t, s, h)
    "none": lambda b, t, s, h: None,
    "key-padding": lambda b, t, s, h: _key_padding(b, s),
    "per-query": lambda b, t, s, h: jax.random.uniform(jax.random.key(2), (b, 1, t, s)) > 0.4,
    "per-head": lambda b, t, s, h: jax.random.uniform(jax.random.key(3), (1, h, t, s)) > 0.4,
}


@pytest.mark.parametrize("masking", list(MASKS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_equals_dot_product_attention(case, masking):
    b, t, s, h, kv, d, causal, q_offset, window = case
    q, k, v, w = _qkv(b, t, s, h, kv, d)
    offset = s - t if q_offset is None else q_offset
    mask = MASKS[masking](b, t, s, h)

    def fused(q, k, v):
        o = nl.flash_attention(q, k, v, causal=causal, q_offset=q_offset, window=window,
                               mask=mask)  # fmt: skip
        return jnp.sum(o * w), o

    def plain(q, k, v):
        o = _reference(q, k, v, causal, offset, window, mask=mask)
        return jnp.sum(o * w), o

    (_, o), g = jax.jit(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))(q, k, v)
    (_, o_ref), g_ref = jax.value_and_grad(plain, (0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(o, o_ref, rtol=2e-5, atol=2e-6)
    for x, y in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(y))))
    text = jax.jit(fused).lower(q, k, v).as_text()
    assert "nnlite_attention_fwd" in text  # the kernel ran, not the XLA fallback


def test_scale_and_lse():
    q, k, v, _ = _qkv(1, 20, 20, 2, 2, 16)
    o, lse = nl.flash_attention_fwd(q, k, v, scale=0.3, causal=True)
    s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.3
    s = jnp.where(_attention.causal_mask(20, 20), s, -jnp.inf)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(s, axis=-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, _reference(q, k, v, True, 0, None, 0.3), rtol=2e-5, atol=2e-6)


def test_layer_takes_the_kernel_where_it_applies():
    mha = nl.MultiHeadAttention(64, num_heads=4, causal=True)
    p = mha.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 70, 64))

    def uses_kernel(layer, *args, **kw):
        text = jax.jit(lambda p, x: layer(p, x, **kw)).lower(*args).as_text()
        return "nnlite_attention_fwd" in text

    assert uses_kernel(mha, p, x)
    # the same layer computed without it: equal to float32 rounding, gradients too
    plain = nl.MultiHeadAttention(64, num_heads=4, causal=True, implementation="plain")
    assert not uses_kernel(plain, p, x)
    np.testing.assert_allclose(mha(p, x), plain(p, x), rtol=1e-5, atol=1e-6)

    def loss(layer):
        return lambda p, x: jnp.sum(jnp.sin(layer(p, x)))

    g, g_plain = jax.grad(loss(mha))(p, x), jax.grad(loss(plain))(p, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # manual mode: the kernel's backward is the hand rule
    g_manual = jax.jit(jax.grad(nl.manual_grads(loss(mha))))(p, x)
    for a, b in zip(jax.tree.leaves(g_manual), jax.tree.leaves(g_plain), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # with a mask (here key padding, a row padded everywhere), the same as without the kernel
    valid = _key_padding(2, 70)
    assert uses_kernel(mha, p, x, mask=valid)
    np.testing.assert_allclose(mha(p, x, mask=valid), plain(p, x, mask=valid), rtol=1e-5, atol=1e-6)
    # bfloat16 and float16: widened into the float32 kernel, the output rounded back; the
    # same as XLA's attention in that dtype to its rounding, gradients too (both modes)
    for dtype in ("bfloat16", "float16"):
        half = nl.MultiHeadAttention(64, num_heads=4, causal=True, dtype=dtype)
        plain_half = nl.MultiHeadAttention(
            64, num_heads=4, causal=True, dtype=dtype, implementation="plain"
        )
        assert uses_kernel(half, p, x) and not uses_kernel(plain_half, p, x)
        out, want = half(p, x), plain_half(p, x)
        assert out.dtype == want.dtype == jnp.dtype(dtype)
        tol = dict(rtol=0.05, atol=0.02)  # a few steps of bfloat16's 8 bits
        np.testing.assert_allclose(np.float32(out), np.float32(want), **tol)
        if dtype == "float16":  # the gradients' path is the same for both dtypes
            continue
        g_half = jax.grad(loss(half))(p, x)
        g_manual = jax.jit(jax.grad(nl.manual_grads(loss(half))))(p, x)
        for a, b, c in zip(*map(jax.tree.leaves, (g_half, g_manual, g_plain)), strict=True):
            scale = float(jnp.abs(c).max())  # sums over 140 tokens of rounded products
            np.testing.assert_allclose(a, c, rtol=0.05, atol=0.03 * scale)
            np.testing.assert_allclose(b, c, rtol=0.05, atol=0.03 * scale)
    # not where it does not apply: a soft cap, attention dropout
    capped = nl.MultiHeadAttention(64, num_heads=4, causal=True, softcap=30.0)
    assert not uses_kernel(capped, p, x)
    dropping = nl.MultiHeadAttention(64, num_heads=4, causal=True, dropout_rate=0.1)
    assert not uses_kernel(dropping, p, x, key=jax.random.key(2))
    assert uses_kernel(dropping, p, x)  # inference: no key, no dropout


def test_vmap_folds_into_the_batch():
    q, k, v, w = _qkv(3, 40, 40, 2, 1, 16)
    qs, ks, vs = (jnp.stack([a, a * 0.5]) for a in (q, k, v))

    def f(q, k, v):
        return jnp.sum(nl.flash_attention(q, k, v, causal=True) * w)

    g = jax.vmap(jax.grad(f, (0, 1, 2)))(qs, ks, vs)
    for i in range(2):
        gi = jax.grad(f, (0, 1, 2))(qs[i], ks[i], vs[i])
        for a, b in zip(g, gi, strict=True):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)
    # a k/v shared by every mapped query (in_axes None)
    o = jax.vmap(lambda q: nl.flash_attention(q, k, v, causal=True))(qs)
    np.testing.assert_allclose(o[1], nl.flash_attention(qs[1], k, v, causal=True), rtol=1e-6)
    # masks: mapped (one per mapped example), and shared with a batch axis of its own
    masks = jnp.stack([_key_padding(3, 40, seed) for seed in (1, 2)])
    o = jax.vmap(lambda q, m: nl.flash_attention(q, k, v, mask=m))(qs, masks)
    np.testing.assert_allclose(o[1], nl.flash_attention(qs[1], k, v, mask=masks[1]), rtol=1e-6)
    o = jax.vmap(lambda q: nl.flash_attention(q, k, v, mask=masks[0]))(qs)
    np.testing.assert_allclose(o[1], nl.flash_attention(qs[1], k, v, mask=masks[0]), rtol=1e-6)


def test_partitioned_programs_use_xla_ops_and_shard_map_the_kernel():
    mesh = jax.make_mesh((8,), ("data",))
    q, k, v, w = _qkv(8, 40, 40, 2, 2, 16)
    shard = NamedSharding(mesh, P("data"))
    qs, ks, vs, ws = (jax.device_put(a, shard) for a in (q, k, v, w))

    valid = _key_padding(8, 40)

    def loss(q, k, v, w):
        return jnp.sum(nl.flash_attention(q, k, v, causal=True, mask=valid) * w)

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    text = grad.lower(qs, ks, vs, ws).as_text()
    assert "nnlite_attention" not in text  # XLA partitions its own ops, not a custom call
    want = jax.grad(loss, (0, 1, 2))(q, k, v, w)
    for a, b in zip(grad(qs, ks, vs, ws), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # inside shard_map each device runs the kernel on its own share
    def local(q, k, v, w, valid):
        o = nl.flash_attention(q, k, v, causal=True, mask=valid)
        return jnp.sum(o * w)

    sm = jax.jit(
        jax.shard_map(
            jax.grad(local, (0, 1, 2)), mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
    )
    vs_ = jax.device_put(valid, shard)
    assert "nnlite_attention_bwd" in sm.lower(qs, ks, vs, ws, vs_).as_text()
    for a, b in zip(sm(qs, ks, vs, ws, vs_), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_show_jaxpr_prints_the_kernel_calls():
    q, k, v, w = _qkv(1, 8, 8, 2, 2, 16)

    def f(q, k, v):
        return jnp.sum(nl.flash_attention(q, k, v, causal=True) * w)

    src = nl.show_jaxpr(jax.grad(f, (0, 1, 2)), q, k, v)
    assert "import nnlite" in src
    assert "nnlite.flash_attention_fwd(" in src and "nnlite.flash_attention_bwd(" in src
    assert "causal=True" in src
    nl.roundtrip(jax.grad(f, (0, 1, 2)), q, k, v)


def test_bad_inputs_name_the_values():
    q, k, v, _ = _qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=r"q \(1, 8, 2, 16\) and k \(1, 8, 2, 8\)"):
        nl.flash_attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="expected q \\[B, T, H, D\\]"):
        nl.flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="q_offset must be >= 0 when causal, got -3"):
        nl.flash_attention(q, k, v, causal=True, q_offset=-3)
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        nl.flash_attention(q, k, v, window=4)
    with pytest.raises(ValueError, match=r"mask must be boolean and broadcast to \[B, H, T, S\]"):
        nl.flash_attention(q, k, v, mask=jnp.ones((1, 3, 8, 8), bool))


_FALLBACK = """
import jax, jax.numpy as jnp, nnlite as nl
print(nl.flash_info())
mha = nl.MultiHeadAttention(32, num_heads=2, causal=True)
p = mha.init(jax.random.key(0)); x = jnp.ones((1, 6, 32))
print("kernel" if "nnlite_attention" in jax.jit(mha).lower(p, x).as_text() else "xla ops")
print(float(jax.grad(lambda p: mha(p, x).sum())(p).qkv.W.sum()))
"""


@pytest.mark.parametrize("how", ["env", "no-compiler"])
def test_without_the_kernel_the_layer_runs_on_xla(tmp_path, how):
    env = dict(os.environ, NNLITE_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    if how == "env":
        env[_flash.ENV] = "xla"
    else:  # a fresh cache and no compiler to build the kernel with
        env.update(CXX=str(tmp_path / "no-such-compiler"), PATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _FALLBACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    info, path, grad = done.stdout.strip().splitlines()
    assert info.startswith("XLA: ")
    assert ("NNLITE_CPU_ATTENTION=xla" in info) if how == "env" else ("no-such-compiler" in info)
    assert path == "xla ops"
    assert np.isfinite(float(grad))


def test_flops_count_the_pairs_each_query_sees():
    q, k, v, _ = _qkv(2, 8, 8, 2, 1, 16)
    pairs = 2 * 2 * (8 * 9 // 2)  # batch x heads x the causal triangle
    fwd = nl.flops(lambda q: nl.flash_attention(q, k, v, causal=True), q)
    assert fwd["unknown"] == () and fwd["matmul_flops"] == 2 * 2 * pairs * 16
    assert fwd["transcendentals"] == pairs
    both = nl.flops(jax.grad(lambda q: nl.flash_attention(q, k, v, causal=True).sum()), q)
    assert both["unknown"] == () and both["matmul_flops"] == (2 + 5) * 2 * pairs * 16
    windowed = nl.flops(lambda q: nl.flash_attention(q, k, v, causal=True, window=2), q)
    assert windowed["transcendentals"] == 2 * 2 * (1 + 2 * 7)


def test_the_rule_is_listed_and_matches_jax_vjp_and_other_dtypes_use_xla_ops():
    f, f_vjp = nl.rules.RULES["fused_attention"]
    q, k, v, _ = _qkv(2, 20, 20, 2, 1, 16)
    mask = _key_padding(2, 20)
    kw = dict(scale=0.25, causal=True, offset=0, window=0, masked=True)
    nl.rules.check_rule(functools.partial(f, **kw), functools.partial(f_vjp, **kw), q, k, v, mask)
    # float64 (and bfloat16) are not the kernel's: the same primitives run as XLA ops
    with jax.enable_x64(True):
        q64, k64, v64 = (a.astype(jnp.float64) for a in (q, k, v))
        text = jax.jit(lambda q: nl.flash_attention(q, k64, v64, causal=True)).lower(q64).as_text()
        assert "nnlite_attention" not in text
        np.testing.assert_allclose(
            nl.flash_attention(q64, k64, v64, causal=True),
            _reference(q64, k64, v64, True, 0, None),
            rtol=1e-12,
        )


def test_show_grad_prints_the_fused_rule_and_its_code_runs():
    mha = nl.MultiHeadAttention(32, num_heads=2, causal=True)
    p = mha.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 32))
    valid = _key_padding(2, 9)

    def loss(p, x):
        return jnp.sum(jnp.sin(mha(p, x, mask=valid)))

    src = nl.show_grad(loss, p, x)
    assert "fused_attention(" in src and "fused_attention_vjp(" in src
    namespace = {}
    exec(src, namespace)
    got = jax.jit(namespace["grad"])(p, x)
    want = jax.grad(loss)(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # check_manual lists it as nnlite's own rule (the trainer checks users' rules only)
    rules = nl.check_manual(loss, p, x)
    assert any(getattr(r, "__name__", "") == "fused_attention" for r in rules)
