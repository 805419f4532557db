"""Deep models: nl.Stack equals the unrolled loop (outputs and gradients, autodiff and
manual, dropout keys), its hand rule, the GPT's scan_layers / remat / dtype options (a
checkpoint of one block layout loading into the other: tests/test_gpt.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    assert_close_f32,
    max_abs_diff,
)

import nnlite as nl
from models.gpt import GPT, stack_blocks, unstack_blocks
from nnlite.rules import check_rule, stack_scan, stack_scan_vjp
from train.model.contract import objective_fn

BLOCK = nl.TransformerBlock(8, num_heads=2, mlp_ratio=2, dropout_rate=0.25)
STACK = nl.Stack(BLOCK, 2)
X = jax.random.normal(jax.random.key(1), (2, 5, 8))
C = jax.random.normal(jax.random.key(2), (2, 5, 8))  # a linear loss: sum(y * C)
KEY = jax.random.key(3)


@pytest.fixture(scope="module")
def stack_params():
    return jax.jit(STACK.init)(jax.random.key(0))  # one compile, not one per op


def stacked_loss(p, x):
    return jnp.sum(STACK(p, x, key=KEY) * C)


def unrolled_loss(blocks, x):
    for p, k in zip(blocks, jax.random.split(KEY, STACK.n)):
        x = BLOCK(p, x, key=k)
    return jnp.sum(x * C)


@pytest.fixture(scope="module")
def stack_autodiff(stack_params):
    """The stack's loss and autodiff gradients (params, input), compiled once for the tests
    below."""
    return jax.jit(jax.value_and_grad(stacked_loss, argnums=(0, 1)))(stack_params, X)


def test_stack_equals_the_unrolled_loop_in_both_gradient_modes(stack_params, stack_autodiff):
    p = stack_params

    def unrolled(p, x):  # the layouts converted inside the one program (not op by op)
        loss, g = jax.value_and_grad(unrolled_loss)(STACK.unstack(p), x)
        return loss, STACK.stack(g)

    ref_loss, ref = jax.jit(unrolled)(p, X)
    # one trace of the manual gradient: its program's text and its compiled run
    traced = jax.jit(jax.value_and_grad(nl.manual_grads(stacked_loss), argnums=(0, 1))).trace(p, X)
    manual = traced.lower().compile()(p, X)
    for loss, g in (stack_autodiff, manual):
        assert_close_f32(loss, ref_loss, ops=ROUNDINGS_PER_LAYER * 2 * 5)
        # 2 blocks of ~5 layers each, forward and backward
        assert_close_f32(g[0], ref, ops=ROUNDINGS_PER_LAYER * 2 * 5)
    # the manual backward pass is a reverse scan, not 3 copies of the block's rules
    text = str(traced.jaxpr)
    assert text.count("reverse=True") == 1
    # one block's matmuls, forward + backward (19), not the 2 unrolled copies' (36)
    assert text.count("dot_general") < 30


@functools.cache  # one init compile per n for the tests below
def _stack_loss(n):
    ffn = nl.FFN(4, (8,), 4)
    stack = nl.Stack(ffn, n)
    head = nl.Linear(4, 3)
    # jitted: one compile per n, not one per op (per shape) of the stack's vmapped init
    p = nl.ParamsDict(
        stack=jax.jit(stack.init)(jax.random.key(0)), head=jax.jit(head.init)(jax.random.key(1))
    )

    def loss(p, x, y):
        return nl.softmax_cross_entropy(head(p.head, stack(p.stack, x)), y, reduction="mean")

    return loss, p


def test_show_jaxpr_and_show_grad_print_the_stack_as_a_loop():
    loss, p = _stack_loss(2)
    x, y = X[0, :, :4], jnp.array([0, 1, 2, 0, 1])
    src = nl.show_jaxpr(loss, p, x, y)
    assert src.count("lax.scan(") == 1  # one loop, not two copies
    ns: dict = {}
    exec(src, ns)
    # the printed code run under jit: one compile, not one per op
    want = jax.jit(loss)(p, x, y)  # one compile (op by op would compile every op)
    assert_close_f32(jax.jit(ns["loss"])(*jax.tree.leaves(p), x, y), want, ops=8)

    # show_grad: a forward scan keeping what the copy's rules need, a reverse scan of
    # its hand VJPs, the copy's calls printed once; the code does not grow with n
    sources = {}
    for n in (2, 6):
        loss, p = _stack_loss(n)
        src = sources[n] = nl.show_grad(loss, p, x, y)
        assert src.count("lax.scan(") == 2 and src.count("reverse=True") == 1
        assert src.count("def stack_forward(") == 1 and src.count("def stack_backward(") == 1
        assert src.count("= linear(") == 3 and src.count("linear_vjp(") == 3  # 2 in the body
        ns = {}
        exec(src, ns)
        # at another batch size too (for one n: the printed code's shapes do not depend on n)
        for xb, yb in ((x, y), (X[1, :3, :4], y[:3]))[: 2 if n == 6 else 1]:
            assert_close_f32(
                jax.jit(ns["grad"])(p, xb, yb),
                jax.jit(jax.grad(loss))(p, xb, yb),
                ops=ROUNDINGS_PER_LAYER * 8,
            )
    assert len(sources[2]) == len(sources[6])


def test_show_grad_prints_a_stack_with_dropout_keys_as_a_loop(stack_params, stack_autodiff):
    # each copy's key is scanned beside its params; the dropout masks equal jax.grad's
    src = nl.show_grad(stacked_loss, stack_params, X)
    assert src.count("lax.scan(") == 2 and src.count("def stack_forward(") == 1
    assert src.count("= layer_norm(") == 2  # one block's two, not two blocks' four
    ns: dict = {}
    exec(src, ns)
    _, (ref, _) = stack_autodiff  # jax.grad's, with respect to the params
    assert_close_f32(jax.jit(ns["grad"])(stack_params, X), ref, ops=ROUNDINGS_PER_LAYER * 2 * 5)


def test_stack_rule_passes_check_vjp():
    layer = nl.FFN(4, (8,), 4)
    p = jax.jit(nl.Stack(layer, 3).init)(jax.random.key(0))
    f = functools.partial(stack_scan, layer=layer)
    f_vjp = functools.partial(stack_scan_vjp, layer=layer)
    check_rule(f, f_vjp, p, X[..., :4], None)


def test_stack_refuses_wrong_params_and_a_layer_that_changes_shape(stack_params):
    with pytest.raises(
        ValueError,
        match=r"Stack\(TransformerBlock, 4\): params must .* "
        r"leading axis of 4",
    ):
        nl.Stack(BLOCK, 4)(stack_params, X)
    grow = nl.Stack(nl.Linear(8, 6), 2)
    with pytest.raises(ValueError, match=r"must return its input's shape and dtype"):
        grow(grow.init(jax.random.key(0)), X)

    # a copy computing outside the hand rules is refused by the loss's manual-mode check
    # (what loss.grad: auto asks), not only when its backward pass is traced
    class Lgamma(nl.Module):
        def init(self, key):
            return nl.ParamsDict(w=jnp.ones(8))

        def __call__(self, params, x, *, key=None):
            return x + jnp.broadcast_to(jax.lax.lgamma(params.w), x.shape)

    sines = nl.Stack(Lgamma(), 2)
    p_sin = sines.init(jax.random.key(0))
    with pytest.raises(nl.ManualGradError, match="`lgamma`"):
        nl.check_manual(lambda p, x: jnp.sum(sines(p, x)), p_sin, X)
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        nl.Stack(BLOCK, 0)
    with pytest.raises(ValueError, match="policy must be None or one of"):
        nl.Remat(BLOCK, "most")


# -- the GPT -----------------------------------------------------------------------------------
GPT_KW = dict(vocab_size=11, context=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
TOKENS = jax.random.randint(jax.random.key(4), (2, 9), 0, 11)


def gpt_grads(model, params, manual: bool):
    def loss(p, tokens):
        return objective_fn(model)(p, tokens[:, :-1], tokens[:, 1:], key=KEY)[0]

    f = nl.manual_grads(loss) if manual else loss
    return jax.jit(jax.value_and_grad(f))(params, TOKENS)


@pytest.fixture(scope="module")
def gpt_ref():
    model = GPT(**GPT_KW)
    params = jax.jit(model.init)(jax.random.key(0))
    return model, params, gpt_grads(model, params, manual=False)


@pytest.mark.parametrize(
    "options, manual",
    [
        ({"scan_layers": True, "remat": "full"}, True),
        ({"remat": "dots_saveable"}, False),
    ],
)
def test_gpt_layouts_and_remat_give_the_same_loss_and_gradients(gpt_ref, options, manual):
    model, params, (ref_loss, ref) = gpt_ref
    other = dataclasses.replace(model, **options)
    p = jax.jit(other.init)(jax.random.key(0))
    # the layouts converted by one compiled program each (not one per op and leaf shape)
    assert max_abs_diff(jax.jit(other.convert_params)(params), p) == 0.0  # the same init
    loss, g = gpt_grads(other, p, manual)
    # dropout on: equal losses mean each block got the loop's key
    assert_close_f32(loss, ref_loss, ops=ROUNDINGS_PER_LAYER * 2 * 5)
    g = jax.jit(model.convert_params)(g)
    assert_close_f32(g, ref, ops=ROUNDINGS_PER_LAYER * (2 * 5 + 4))


def test_the_scanned_gpts_init_program_does_not_grow_with_depth():
    # one vmapped block init and one vmapped draw per block leaf, whatever n_layer: a deep
    # scanned model's start-up compiles an init the size of a shallow one's
    def n_eqns(n_layer):
        model = GPT(**{**GPT_KW, "n_layer": n_layer}, scan_layers=True)
        return len(jax.make_jaxpr(model.init)(jax.random.key(0)).jaxpr.eqns)

    assert n_eqns(2) == n_eqns(12)


def test_gpt_params_convert_both_ways(gpt_ref):
    model, params, _ = gpt_ref
    # the scanned layout's logical axes (for fsdp/tensor): the block's, the copies first
    axes = nl.param_axes(dataclasses.replace(model, scan_layers=True, remat="block"))
    assert axes.blocks.attn.qkv.W == nl.Axes((None, "embed", "qkv"))
    stacked = stack_blocks(params)
    assert stacked.blocks.attn.qkv.W.shape == (2, 16, 48)
    assert max_abs_diff(unstack_blocks(stacked), params) == 0.0
    assert jax.tree.structure(unstack_blocks(stacked)) == jax.tree.structure(params)
    scanned = dataclasses.replace(model, scan_layers=True)
    assert jax.tree.structure(scanned.convert_params(params)) == jax.tree.structure(stacked)
    with pytest.raises(ValueError, match=r"GPT\(n_layer=4\): params hold 2 blocks"):
        dataclasses.replace(model, n_layer=4).convert_params(params)
    with pytest.raises(ValueError, match="no /blocks"):
        model.convert_params(nl.ParamsDict(wte=params.wte))


def test_gpt_bfloat16_computes_in_bfloat16_with_float32_params_and_gradients(gpt_ref):
    model, params, (ref_loss, _) = gpt_ref
    bf16 = dataclasses.replace(model, dtype="bfloat16", scan_layers=True)
    p = jax.jit(bf16.init)(jax.random.key(0))
    assert {a.dtype for a in jax.tree.leaves(p)} == {jnp.dtype(jnp.float32)}
    tokens = TOKENS[:, :-1]
    # the residual stream is bfloat16 through the blocks, the logits float32
    h = jax.eval_shape(
        lambda p, t: bf16.stack(p.blocks, bf16.wte(p.wte, t).astype("bfloat16")), p, tokens
    )
    assert h.dtype == jnp.bfloat16
    assert jax.eval_shape(bf16, p, tokens).dtype == jnp.float32
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        dataclasses.replace(model, dtype="float16")
    with pytest.raises(ValueError, match="remat must be one of auto, none, block, full, "):
        dataclasses.replace(model, remat="all")
    # decoding with the key/value cache in bfloat16, each layer's params sliced out
    # (traced for its dtypes: the cache's values are tests/test_gpt.py's, in float32)
    cache = bf16.empty_cache(2, jnp.bfloat16)
    logits, cache = jax.eval_shape(bf16.decode_step, p, cache, TOKENS[:, 0], jnp.int32(0))
    assert logits.dtype == jnp.float32 and cache[0].dtype == jnp.bfloat16
    # the hand rules' backward pass in bfloat16 traced (its dtypes; the values of the
    # rules are the float32 tests'), the loss computed
    loss, g = jax.eval_shape(lambda p: gpt_grads(bf16, p, manual=True), p)
    assert {a.dtype for a in jax.tree.leaves(g)} == {jnp.dtype(jnp.float32)}
    assert loss.dtype == jnp.float32
    loss = jax.jit(lambda p, t: objective_fn(bf16)(p, t[:, :-1], t[:, 1:], key=KEY)[0])(p, TOKENS)
    assert abs(float(loss) - float(ref_loss)) < 0.02  # bfloat16 rounding, not another model


# -- checkpoints of the other layout -------------------------------------------------------------
# A checkpoint of the unrolled GPT resumed and loaded with the blocks scanned:
# tests/test_gpt.py, test_a_checkpoint_of_one_layout_resumes_and_loads_in_the_other (it
# resumes that file's one-device reference run instead of training one of its own).

# The scanned, rematted GPT under shard_map against one device: tests/test_gpt.py,
# test_gpt_parallel_equals_one_device[shard_map] (it shares that file's one-device run).
