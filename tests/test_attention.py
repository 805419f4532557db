"""MultiHeadAttention and TransformerBlock against numpy; causal, padding, caches, dropout."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import ROUNDINGS_PER_LAYER, assert_close_f32

import nnlite as nl
from nnlite import MultiHeadAttention, TransformerBlock
from nnlite.nn import _attention as _blocks

F, H = 8, 2


def _random_params(module, seed=0):
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(module.init, jax.random.key(0))
    return jax.tree.map(lambda s: (0.5 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def np_mha(p, x, heads, mask=None, causal=False):
    """x: [B, T, F] -> [B, T, F]; mask [B or 1, heads or 1, T, T] boolean."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    b, t, f = x.shape
    d = f // heads
    y = x @ p.qkv.W + p.qkv.b
    q, k, v = (y[..., i * f : (i + 1) * f].reshape(b, t, heads, d) for i in range(3))
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    allowed = np.ones((b, heads, t, t), bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= np.tril(np.ones((t, t), bool))
    logits = np.where(allowed, logits, -1e30)
    o = np.einsum("bhts,bshd->bthd", np_softmax(logits), v).reshape(b, t, f)
    return o @ p.out.W + p.out.b


def np_layer_norm(x, p, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * np.asarray(
        p.scale
    ) + np.asarray(p.bias)


def np_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_numpy_with_masks(causal):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, F)).astype(np.float32)
    valid = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], bool)
    mask = valid[:, None, None, :]  # key padding
    head_mask = rng.random((1, H, 5, 5)) > 0.3  # a per-head mask broadcast over the batch
    impls = {i: MultiHeadAttention(F, H, causal=causal, implementation=i) for i in (None, "plain")}
    p = _random_params(impls[None])

    @jax.jit
    def run(p, x):
        return {
            f"{i}-{m}": layer(p, x, mask=mm)
            for i, layer in impls.items()
            for m, mm in (("none", None), ("pad", mask), ("head", head_mask))
        }

    out = run(p, x)
    for m, mm in (("none", None), ("pad", mask), ("head", head_mask)):
        want = np_mha(p, x.astype(np.float64), H, mm, causal)
        for i in impls:
            np.testing.assert_allclose(out[f"{i}-{m}"], want, rtol=1e-4, atol=1e-4, err_msg=m)
        # XLA's attention and the plain one: float32 rounding of the output's scale along
        # qkv, scores, softmax, values, projection
        assert_close_f32(out[f"None-{m}"], out[f"plain-{m}"], ops=ROUNDINGS_PER_LAYER * 5)


def test_causal_output_at_t_ignores_later_inputs():
    block = TransformerBlock(F, H, mlp_ratio=2)
    p = _random_params(block)
    x = np.random.default_rng(2).standard_normal((2, 6, F)).astype(np.float32)
    x2 = x.copy()
    x2[:, 4:] += 10.0  # change positions 4 and 5
    f = jax.jit(block)
    y, y2 = f(p, x), f(p, x2)
    np.testing.assert_allclose(y[:, :4], y2[:, :4], rtol=1e-5, atol=1e-5)
    assert not np.allclose(y[:, 4:], y2[:, 4:])
    # Without the causal mask, earlier positions do see the change.
    y3, y4 = jax.jit(TransformerBlock(F, H, mlp_ratio=2, causal=False))(p, np.stack([x, x2]))
    assert not np.allclose(y3[:, :4], y4[:, :4])


def test_padding_mask_hides_padded_keys():
    mha = MultiHeadAttention(F, H)
    p = _random_params(mha)
    x = np.random.default_rng(3).standard_normal((2, 5, F)).astype(np.float32)
    x2 = x.copy()
    x2[:, 3:] = 7.0
    valid = np.array([True] * 3 + [False] * 2)[None, None, None, :]
    f = jax.jit(lambda p, x: mha(p, x, mask=valid))
    np.testing.assert_allclose(f(p, x)[:, :3], f(p, x2)[:, :3], rtol=1e-5, atol=1e-5)


def test_kv_cache_decoding_equals_full_forward():
    """Pieces: qkv / attend / project. One token at a time into a fixed-size cache with a
    traced q_offset gives the full causal forward; so does attending with T_q < T_k."""
    mha = MultiHeadAttention(F, H, causal=True)
    p = _random_params(mha)
    T = 6
    x = np.random.default_rng(4).standard_normal((2, T, F)).astype(np.float32)
    full = jax.jit(mha)(p, x)

    @jax.jit
    def decode(p, x):
        cache_k = jnp.zeros((2, T, H, F // H))
        cache_v = jnp.zeros((2, T, H, F // H))

        def step(carry, t):
            ck, cv = carry
            q, k, v = mha.qkv(p, jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1))
            ck = jax.lax.dynamic_update_slice_in_dim(ck, k, t, axis=1)
            cv = jax.lax.dynamic_update_slice_in_dim(cv, v, t, axis=1)
            o = mha.project(p, mha.attend(q, ck, cv, q_offset=t))
            return (ck, cv), o[:, 0]

        _, ys = jax.lax.scan(step, (cache_k, cache_v), jnp.arange(T))
        return jnp.swapaxes(ys, 0, 1)

    @jax.jit  # one compile, not one per op
    def last2(p, x):
        q, k, v = mha.qkv(p, x)
        return mha.project(p, mha.attend(q[:, -2:], k, v))  # default: last query = last key

    np.testing.assert_allclose(decode(p, x), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last2(p, x), full[:, -2:], rtol=1e-5, atol=1e-5)


def test_transformer_block_matches_numpy():
    block = TransformerBlock(F, H, mlp_ratio=3)
    p = _random_params(block, seed=5)
    x = np.random.default_rng(5).standard_normal((2, 4, F))
    q = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    h = x + np_mha(q.attn, np_layer_norm(x, q.ln1), H, causal=True)
    m = np_gelu(np_layer_norm(h, q.ln2) @ q.mlp.fc.W + q.mlp.fc.b) @ q.mlp.proj.W + q.mlp.proj.b
    got = jax.jit(block)(p, x.astype(np.float32))
    np.testing.assert_allclose(got, h + m, rtol=1e-4, atol=1e-4)
    assert block.mlp.fc.out_features == 24 and block.attn.head_dim == 4
    assert block.ln1 == nl.LayerNorm(F) and block.attn.causal


def test_dropout_keys_and_determinism():
    block = TransformerBlock(F, H, dropout_rate=0.5)
    rate0 = TransformerBlock(F, H, dropout_rate=0.0)
    p = _random_params(block)
    x = np.random.default_rng(6).standard_normal((2, 5, F)).astype(np.float32)

    @jax.jit  # one compilation
    def run(p, x, k0, k1):
        g = jax.grad(lambda p: jnp.sum(block(p, x, key=k0) ** 2))(p)
        return block(p, x, key=k0), block(p, x, key=k1), block(p, x), rate0(p, x, key=k0), g

    # rbg keys: threefry's random bits take many seconds to compile on a busy CPU.
    k0, k1 = jax.random.key(0, impl="rbg"), jax.random.key(1, impl="rbg")
    y0, y1, no_drop, y_rate0, g = run(p, x, k0, k1)
    np.testing.assert_array_equal(run(p, x, k0, k1)[0], y0)  # deterministic given one key
    assert not np.allclose(y0, y1) and not np.allclose(y0, no_drop)
    np.testing.assert_allclose(y_rate0, no_drop, rtol=1e-6, atol=1e-6)  # rate 0: identity
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))


LAYERS = {
    "mha": lambda **kw: MultiHeadAttention(F, H, **kw),
    "mha-causal-nobias": lambda **kw: MultiHeadAttention(F, 1, causal=True, use_bias=False, **kw),
    "block": lambda **kw: TransformerBlock(F, H, mlp_ratio=2, **kw),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_grid(name):
    layer = LAYERS[name]()
    lo = LAYERS[name](dtype="bfloat16")
    p = _random_params(layer)
    x = np.random.default_rng(7).standard_normal((3, 4, F)).astype(np.float32)

    @jax.jit
    def run(p, x):
        y = layer(p, x)
        rows = jax.vmap(layer, in_axes=(None, 0))(p, x)
        grads = jax.grad(lambda p, x: jnp.sum(layer(p, x) ** 2), argnums=(0, 1))(p, x)
        return y, rows, layer(p, x[0]), layer(p, x[None]), grads, lo(p, x)

    y, rows, single, extra, (g_p, g_x), y16 = run(p, x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(rows, y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(single, y[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(extra[0], y, rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(g_p) == jax.tree.structure(p) and g_x.shape == x.shape
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g_p))
    # bf16 compute with f32 params (the block's residual stream follows the compute dtype).
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y, rtol=0.1, atol=0.15)
    assert {a.dtype for a in jax.tree.leaves(p)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: MultiHeadAttention(6, 4), "features=6 must be a multiple of num_heads=4"),
        (lambda: MultiHeadAttention(8, 0), "num_heads must be a positive int, got 0"),
        (
            lambda: MultiHeadAttention(8, 2, dropout_rate=1.0),
            "dropout_rate must be a float in [0, 1), got 1.0",
        ),
        (
            lambda: MultiHeadAttention(8, 2, implementation="flash"),
            "unknown implementation 'flash'; valid: None, 'xla', 'cudnn', 'plain'",
        ),
        (lambda: TransformerBlock(8, 3), "features=8 must be a multiple of num_heads=3"),
        (lambda: TransformerBlock(8, 2, mlp_ratio=0), "mlp_ratio must be a number > 0"),
        (lambda: TransformerBlock(8, 2, activation="swish"), "unknown activation 'swish'"),
        (
            lambda: TransformerBlock(8, 2, dropout_rate=-0.1),
            "dropout_rate must be a float in [0, 1)",
        ),
    ],
)
def test_invalid_hyperparameters(make, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        make()


def test_bad_inputs_masks_and_params():
    mha = MultiHeadAttention(F, H)
    p = _random_params(mha)
    x = jnp.ones((2, 5, F))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"MultiHeadAttention(features={F}): expected input with last axis {F} and rank >= 2, got shape (2, 5, 4)"
        ),
    ):
        mha(p, jnp.ones((2, 5, 4)))
    with pytest.raises(
        ValueError, match=re.escape("mask must be a boolean array (True = attend), got dtype int32")
    ):
        mha(p, x, mask=jnp.ones((5, 5), jnp.int32))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "mask of shape (2, 5) does not broadcast to [..., num_heads, T_q, T_k] = (2, 2, 5, 5); a key-padding mask"
        ),
    ):
        mha(p, x, mask=jnp.ones((2, 5), bool))
    with pytest.raises(ValueError, match=re.escape("attend: expected q [..., T_q, 2, 4]")):
        mha.attend(jnp.ones((5, 2, 3)), jnp.ones((5, 2, 3)), jnp.ones((5, 2, 3)))
    with pytest.raises(
        ValueError, match=re.escape("project: expected [..., T, 2, 4], got shape (5, 8)")
    ):
        mha.project(p, jnp.ones((5, 8)))
    block = TransformerBlock(F, H)
    bp = _random_params(block)
    bp.attn.qkv.W = jnp.ones((F, 2 * F))
    msg = f"TransformerBlock({F}, {H}): params /attn/qkv/W has shape ({F}, {2 * F}), expected ({F}, {3 * F})"
    with pytest.raises(ValueError, match=re.escape(msg)):
        block(bp, x)


# -- one attention, one rotary embedding, one block ------------------------------------------
def test_one_attention_rule_groups_caps_and_drops():
    """dot_product_attention is grouped_attention: kv heads shared by groups of query heads
    (the same as multi-head attention over kv heads repeated per group), with a scale, a
    soft cap and dropout at once; its hand rule agrees with jax.vjp."""
    from _tolerance import check_rule

    assert nl.rules.grouped_attention is nl.rules.dot_product_attention
    assert nl.rules.rotary is nl.rules.rope
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
               [(2, 5, 4, 3), (2, 6, 2, 3), (2, 6, 2, 3)])  # fmt: skip
    attn = nl.rules.dot_product_attention
    mask = nl.nn._attention.causal_mask(5, 6, window=3)[None, None]
    repeated = attn(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), mask)
    np.testing.assert_allclose(attn(q, k, v, mask), repeated, rtol=1e-6, atol=1e-6)
    kw = {"scale": 0.7, "softcap": 0.8, "key": jax.random.key(1), "dropout_rate": 0.25}
    check_rule(attn, q, k, v, mask, **kw)


def test_one_block_is_every_family_member():
    """LlamaBlock and nl.hf's GPT-2 block are TransformerBlock configurations: the same
    class, the same params and outputs as the fields spelled out."""
    llama = nl.LlamaBlock(8, 2, num_kv_heads=1, hidden=12, qk_norm=True, post_norms=True)
    spelled = TransformerBlock(8, 2, activation="silu", use_bias=False, eps=1e-6, rotary=True,
                               norm="rms", gated=True, fused_qkv=False, num_kv_heads=1,
                               hidden=12, qk_norm=True, post_norms=True)  # fmt: skip
    assert isinstance(llama, TransformerBlock) and nl.hf.GPT2Block is TransformerBlock
    p = _random_params(llama)
    assert jax.tree.structure(p) == jax.tree.structure(_random_params(spelled))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 8)), jnp.float32)
    np.testing.assert_array_equal(llama(p, x), spelled(p, x))
    assert sorted(p.attn) == ["k", "k_norm", "out", "q", "q_norm", "v"]
    assert sorted(p.mlp) == ["down", "gate", "up"] and "post_ln2" in p
    with pytest.raises(ValueError, match=r"lora names 'mlp/fc', not a projection of the block"):
        nl.LlamaBlock(8, 2, lora=("mlp/fc",))
    with pytest.raises(ValueError, match=r"norm 'batch' is not one of layer, rms"):
        TransformerBlock(8, 2, norm="batch")


def test_one_rotary_embedding_takes_its_scaling():
    """RotaryEmbedding's scaling is a parameter: linear scaling by 2 at position 2p is the
    plain rotation at p; an unsupported kind is refused by name."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 6)), jnp.float32)
    linear = nl.RotaryEmbedding(6, 100.0, scaling={"rope_type": "linear", "factor": 2.0})
    plain = nl.RotaryEmbedding(6, 100.0)
    np.testing.assert_allclose(
        linear(x, positions=2 * jnp.arange(4)), plain(x), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="rope_scaling kind 'dynamic' is not supported"):
        nl.RotaryEmbedding(6, scaling={"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize(
    "t_q, t_k, q_offset, window",
    [
        (256, 256, None, None),
        (300, 300, None, None),
        (300, 310, None, 50),
        (260, 400, 7, None),
        (2000, 2000, None, None),
    ],  # fmt: skip
)
def test_causal_blocks_cover_exactly_the_visible_keys(t_q, t_k, q_offset, window):
    # every query in one block, and each block's key range holds every key its queries may
    # see (nothing visible is cut off) and starts and ends at a visible key
    blocks = _blocks.causal_blocks(t_q, t_k, q_offset, window)
    size = max(_blocks.CAUSAL_BLOCK, -(-t_q // _blocks.MAX_BLOCKS))
    assert blocks is not None and len(blocks) == -(-t_q // size) <= _blocks.MAX_BLOCKS
    visible = np.asarray(_blocks.causal_mask(t_q, t_k, q_offset, window))
    assert [lo for lo, *_ in blocks] == list(range(0, t_q, size))
    assert blocks[-1][1] == t_q
    for lo, hi, k_lo, k_hi, offset in blocks:
        seen = visible[lo:hi]
        assert not seen[:, :k_lo].any() and not seen[:, k_hi:].any()
        assert seen[:, k_lo].any() and seen[:, k_hi - 1].any()
        assert np.array_equal(seen[:, k_lo:k_hi], np.asarray(_blocks.causal_mask(
            hi - lo, k_hi - k_lo, offset, window)))  # fmt: skip


def test_causal_blocks_only_where_they_pay(monkeypatch):
    assert _blocks.causal_blocks(2 * _blocks.CAUSAL_BLOCK - 1, 255) is None  # under two blocks
    assert _blocks.causal_blocks(256, 255) is None  # a query would see no key
    assert _blocks.causal_blocks(256, 300, jnp.int32(3)) is None  # a traced offset
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _blocks.causal_blocks(512, 512) is None  # one fused kernel there


@pytest.mark.parametrize(
    "kv, window, implementation", [(4, None, None), (2, None, "plain"), (1, 70, None)]
)
def test_blocked_causal_attention_equals_one_dense_block(monkeypatch, kv, window, implementation):
    layer = MultiHeadAttention(
        32, 4, num_kv_heads=kv, causal=True, window=window, implementation=implementation
    )
    params = _random_params(layer)
    x = jax.random.normal(jax.random.key(1), (2, 300, 32))

    def loss(p, x):
        return jnp.sum(jnp.sin(layer(p, x)))

    assert _blocks.causal_blocks(300, 300, None, window) is not None
    blocked = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    manual = jax.jit(jax.value_and_grad(nl.manual_grads(loss, check=False)))(params, x)
    monkeypatch.setattr(_blocks, "CAUSAL_BLOCK", 10**6)  # one dense block
    dense = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    assert_close_f32(blocked, dense, ops=128)  # sums over other lengths: other orders
    assert_close_f32(manual, (dense[0], dense[1][0]), ops=256)  # the hand rule: other sums
