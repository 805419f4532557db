"""Manual gradients for models written the natural way: structural and linear primitives.

The library's rule for each primitive (``nnlite.rules``) against ``jax.vjp``; a transformer
classifier (``tok + pos``, ``jnp.mean(h, axis=-2)``) and a residual CNN with a global average
pool under ``nl.manual_grads`` against ``jax.grad``; refusals naming the source line;
``jax.checkpoint`` with hand rules; ``show_grad`` code that runs in a fresh process at
another batch size with the user's own rule.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _check_many import case, check_many
from jax import lax

import nnlite as nl
from nnlite.grad._structural import PRIMITIVE_RULES

DTYPES = ["float32", "float64"]


def _cases(x, y1, s, m, w, xb):
    """``{case id: (rule name, args, params, expected forward or None)}`` for every
    structural rule: size-1 and rank-0 broadcasting, negative axes, strides, negative and
    interior padding, repeated and clamped indices."""
    i2 = jnp.array([2, 0, 2])  # a repeated index: its cotangents add up
    gdn = lax.GatherDimensionNumbers(
        offset_dims=(0, 2), collapsed_slice_dims=(1,), start_index_map=(1,)
    )
    sdn = lax.ScatterDimensionNumbers(
        update_window_dims=(0, 2), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,)
    )
    mask, i32 = x > 0, jnp.int32
    fill, promise = lax.GatherScatterMode.FILL_OR_DROP, lax.GatherScatterMode.PROMISE_IN_BOUNDS
    cases = [
        ("bcast-size-1", "broadcast_in_dim", (m,),
         dict(shape=(2, 3, 4), broadcast_dimensions=(1, 2)), jnp.broadcast_to(m, (2, 3, 4))),
        ("bcast-scalar", "broadcast_in_dim", (s,), dict(shape=(2, 3), broadcast_dimensions=()),
         jnp.broadcast_to(s, (2, 3))),
        ("bcast-negative", "broadcast_in_dim", (x[0],),
         dict(shape=(2, 3, 4), broadcast_dimensions=(-2, -1)), jnp.broadcast_to(x[0], (2, 3, 4))),
        ("reshape", "reshape", (x,), dict(new_sizes=(6, 4)), x.reshape(6, 4)),
        ("reshape-1", "reshape", (x,), dict(new_sizes=(-1, 3)), x.reshape(-1, 3)),
        ("reshape-dims", "reshape", (x,), dict(new_sizes=(4, 6), dimensions=(2, 0, 1)),
         x.transpose(2, 0, 1).reshape(4, 6)),
        ("transpose", "transpose", (x,), dict(permutation=(2, 0, 1)), x.transpose(2, 0, 1)),
        ("transpose-negative", "transpose", (x,), dict(permutation=(-1, 0, 1)),
         x.transpose(2, 0, 1)),
        ("squeeze", "squeeze", (x[:, :1],), dict(dimensions=(-2,)), x[:, 0]),
        ("rev", "rev", (x,), dict(dimensions=(1, -1)), x[:, ::-1, ::-1]),
        ("tile", "tile", (x,), dict(reps=(1, 2, 3)), jnp.tile(x, (1, 2, 3))),
        ("copy", "copy", (x,), {}, x),
        ("convert", "convert_element_type", (x,), dict(new_dtype=jnp.float16),
         x.astype(jnp.float16)),
        ("stop_gradient", "stop_gradient", (x,), {}, x),
        ("add-size-1", "add", (x, y1), {}, x + y1),
        ("add-scalar", "add", (x, s), {}, x + s),
        ("add-lead", "add", (x, x[0]), {}, x + x[0][None]),
        ("sub", "sub", (y1, x), {}, y1 - x),
        ("neg", "neg", (x,), {}, -x),
        ("mul-size-1", "mul", (x, y1), {}, x * y1),
        ("mul-scalar", "mul", (s, x), {}, s * x),
        ("div", "div", (x, y1 * y1 + 1), {}, x / (y1 * y1 + 1)),
        ("dot", "dot_general", (x, w), dict(dimension_numbers=(((2,), (0,)), ((), ()))), x @ w),
        ("dot-batched", "dot_general", (xb, x),
         dict(dimension_numbers=(((2,), (2,)), ((0,), (0,)))), None),
        ("reduce_sum", "reduce_sum", (x,), dict(axes=(1,)), x.sum(1)),
        ("reduce_sum-negative", "reduce_sum", (x,), dict(axes=(-1, 0)), x.sum((0, 2))),
        ("cumsum", "cumsum", (x,), dict(axis=-2), jnp.cumsum(x, 1)),
        ("cumsum-reverse", "cumsum", (x,), dict(axis=1, reverse=True),
         jnp.cumsum(x[:, ::-1], 1)[:, ::-1]),
        ("concatenate", "concatenate", (x, x[:, :2]), dict(dimension=-2),
         jnp.concatenate([x, x[:, :2]], 1)),
        ("concatenate-one", "concatenate", (x,), dict(dimension=0), x),
        ("split", "split", (x,), dict(sizes=(1, 3), axis=-1), tuple(jnp.split(x, [1], axis=-1))),
        ("stack", "stack", (x, x * 2), dict(axis=1), jnp.stack([x, x * 2], 1)),
        ("slice", "slice", (x,), dict(start_indices=(0, 1, 0), limit_indices=(2, 3, 4)),
         x[:, 1:3]),
        ("slice-strides", "slice", (x,),
         dict(start_indices=(1, 0, 1), limit_indices=(2, 3, 4), strides=(1, 2, 2)),
         x[1:2, ::2, 1::2]),
        ("dynamic_slice", "dynamic_slice", (x, i32(0), i32(2), i32(1)),
         dict(slice_sizes=(2, 1, 3)), x[:, 2:3, 1:4]),
        ("dynamic_slice-clamped", "dynamic_slice", (x, i32(0), i32(5), i32(0)),
         dict(slice_sizes=(2, 2, 4)), x[:, 1:3]),
        ("dynamic_update_slice", "dynamic_update_slice",
         (x, x[:, :1, :2] * 3, i32(0), i32(1), i32(2)), {},
         x.at[:, 1:2, 2:4].set(x[:, :1, :2] * 3)),
        ("pad", "pad", (x, jnp.asarray(0.5, x.dtype)),
         dict(padding_config=((0, 0, 0), (1, 2, 0), (0, 0, 0))),
         jnp.pad(x, ((0, 0), (1, 2), (0, 0)), constant_values=0.5)),
        ("pad-negative-interior", "pad", (x, jnp.asarray(0.0, x.dtype)),
         dict(padding_config=((1, -1, 0), (-1, 2, 1), (0, 1, 2))), None),
        ("gather", "gather", (x, i2[:, None]),
         dict(dimension_numbers=gdn, slice_sizes=(2, 1, 4), mode=promise), x[:, i2]),
        ("scatter_add", "scatter_add", (x, i2[:, None], x[:, :3] * 2),
         dict(dimension_numbers=sdn, mode=fill), x.at[:, i2].add(x[:, :3] * 2)),
        ("scatter", "scatter", (x, jnp.array([[2], [0]]), x[:, :2] * 2),
         dict(dimension_numbers=sdn, unique_indices=True, mode=fill),
         x.at[:, jnp.array([2, 0])].set(x[:, :2] * 2)),
        ("select_n", "select_n", (mask, x, -x), {}, jnp.where(mask, -x, x)),
        ("select_n-scalar", "select_n", (jnp.bool_(True), x, 2 * x), {}, 2 * x),
    ]  # fmt: skip
    return {case[0]: case[1:] for case in cases}


def _case_table(*base):
    """``({case id: (rule name, params)}, {case id: (args, want)})``: the cases' arrays
    built in one compiled program (not one per eager op), or their shapes when ``base``
    holds shapes."""
    meta = {}

    def arrays(*base):
        out = {}
        for cid, (name, args, params, want) in _cases(*base).items():
            meta[cid] = (name, params)
            out[cid] = (args, want)
        return out

    if all(isinstance(b, jax.ShapeDtypeStruct) for b in base):
        return meta, jax.eval_shape(arrays, *base)
    return meta, jax.jit(arrays)(*base)


BASE_SHAPES = [(2, 3, 4), (1, 3, 1), (), (3, 1), (4, 5), (2, 5, 4)]


def test_every_primitive_rule_is_in_nnlite_rules_and_checked():
    from test_grad_primitives import CASES  # the nonlinear ones are checked there

    meta, _ = _case_table(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in BASE_SHAPES))
    checked = {name for name, _ in meta.values()}
    for prim, rule in PRIMITIVE_RULES.items():
        public = rule.f.__name__
        assert nl.rules.RULES[public][1] is rule.f_vjp, prim
        # pvary needs shard_map: checked in test_pvary_under_shard_map
        assert public in checked or prim in CASES or public == "pvary", prim


def test_structural_rules_match_jax_vjp(rand):
    """Every case's rule against jax.vjp in one check_rule (tests/_check_many.py: one compile,
    not one per case; a failure names its rule), and every forward, computed in one program,
    against the expected value."""
    meta, arrays = _case_table(*(rand(*s) for s in BASE_SHAPES))
    rules = {cid: nl.rules.RULES[name] for cid, (name, _) in meta.items()}
    check_many(case(*rules[cid], *arrays[cid][0], **params) for cid, (_, params) in meta.items())
    forwards = jax.jit(
        lambda arrays: {cid: rules[cid][0](*arrays[cid][0], **meta[cid][1]) for cid in meta}
    )(arrays)
    for cid, (_, want) in arrays.items():
        if want is None:
            continue
        for g, w in zip(jax.tree.leaves(forwards[cid]), jax.tree.leaves(want), strict=True):
            eps = np.finfo(w.dtype).eps  # the forward is the primitive: equal up to rounding
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=4 * eps, atol=4 * eps, err_msg=cid
            )


# --- models written the natural way -------------------------------------------------------


def _normal(seed, *shape):  # numpy: no random kernel compiled per shape
    return jax.device_put(
        np.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    )


class TinyTransformer(nl.Module):
    """The issue's classifier: token + position embeddings added with ``+``, two blocks,
    mean pooling with ``jnp.mean``, a linear head. No wrapping for manual gradients."""

    vocab_size: int = 13
    context: int = 6
    features: int = 8
    num_classes: int = 3
    param_dtype: str = "float32"

    def init(self, key):
        k = jax.random.split(key, 5)
        emb = functools.partial(nl.Embedding, param_dtype=self.param_dtype)
        return nl.ParamsDict(
            tok=emb(self.vocab_size, self.features).init(k[0]),
            pos=emb(self.context, self.features).init(k[1]),
            blocks=[self.block.init(k[2]), self.block.init(k[3])],
            head=self.head.init(k[4]),
        )

    @property
    def block(self):
        return nl.TransformerBlock(self.features, 2, param_dtype=self.param_dtype)

    @property
    def head(self):
        return nl.Linear(self.features, self.num_classes, param_dtype=self.param_dtype)

    def __call__(self, params, ids, *, key=None):
        tok = params.tok.W[ids]  # [B, T, F]: a gather
        pos = params.pos.W[: ids.shape[-1]]  # [T, F]: a slice
        with jax.numpy_rank_promotion("allow"):  # as a user's default JAX config has it
            h = tok + pos
        for p_block in params.blocks:
            h = self.block(p_block, h)
        return self.head(params.head, jnp.mean(h, axis=-2))


class ResidualCNN(nl.Module):
    """Conv stem, one residual block added with ``+``, a global average pool (``jnp.mean``
    over the spatial axes), a linear head."""

    channels: int = 4
    num_classes: int = 3
    param_dtype: str = "float32"

    def conv(self, cin):
        return nl.Conv(cin, self.channels, (3, 3), padding="SAME", param_dtype=self.param_dtype)

    def init(self, key):
        k = jax.random.split(key, 4)
        head = nl.Linear(self.channels, self.num_classes, param_dtype=self.param_dtype)
        return nl.ParamsDict(
            stem=self.conv(1).init(k[0]),
            a=self.conv(self.channels).init(k[1]),
            b=self.conv(self.channels).init(k[2]),
            head=head.init(k[3]),
        )

    def __call__(self, params, x, *, key=None):
        h = nl.relu(self.conv(1)(params.stem, x[..., None]))  # [B, H, W] -> [B, H, W, 1]
        r = self.conv(self.channels)(params.b, nl.relu(self.conv(self.channels)(params.a, h)))
        h = nl.relu(h + r)
        pooled = jnp.mean(h, axis=(1, 2))
        head = nl.Linear(self.channels, self.num_classes, param_dtype=self.param_dtype)
        return head(params.head, pooled)


def _grads_match_to_float32_rounding(model, batch, labels):
    """manual_grads == jax.grad, judged by float32 rounding: the hand gradient is as close
    to the exact (float64) gradient as JAX's own float32 gradient is, up to a factor of 4
    (or a few float32 ulps of the gradient's scale where autodiff is exact)."""

    def loss_of(m):
        def loss(params, x, y):
            return nl.softmax_cross_entropy(m(params, x), y, reduction="mean")

        return loss

    params = jax.jit(model.init)(jax.random.key(0))  # one compile, not one per random op
    loss = loss_of(model)
    auto, hand = jax.jit(  # both passes in one compile
        lambda *a: (jax.grad(loss)(*a), jax.grad(nl.manual_grads(loss))(*a))
    )(params, batch, labels)
    with jax.enable_x64(True):
        m64 = dataclasses.replace(model, param_dtype="float64")
        p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
        x64 = batch.astype(jnp.float64) if jnp.issubdtype(batch.dtype, jnp.floating) else batch
        exact = jax.tree.map(np.asarray, jax.jit(jax.grad(loss_of(m64)))(p64, x64, labels))
    eps = np.finfo(np.float32).eps
    for path, a, h, e in zip(
        [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]],
        jax.tree.leaves(auto),
        jax.tree.leaves(hand),
        jax.tree.leaves(exact),
        strict=True,
    ):
        err_auto = np.max(np.abs(np.asarray(a, np.float64) - e))
        err_hand = np.max(np.abs(np.asarray(h, np.float64) - e))
        tol = 4 * max(err_auto, 8 * eps * np.max(np.abs(e)))
        assert err_hand <= tol, (jax.tree_util.keystr(path), err_hand, err_auto)
    return params, loss


def test_transformer_classifier_written_the_natural_way():
    model = TinyTransformer()
    rng = np.random.default_rng(1)  # numpy: no random kernel to compile
    ids = jax.device_put(
        np.asarray(rng.integers(0, model.vocab_size, (5, model.context)), jnp.int32)
    )
    params, loss = _grads_match_to_float32_rounding(model, ids, jnp.arange(5) % 3)
    # the structural rules did the work: every tok + pos, mean, gather and slice is a
    # custom_vjp in the manual loss, none of them a bare primitive on the params
    traced = jax.make_jaxpr(nl.manual_grads(loss))(params, ids, jnp.arange(5) % 3)
    names = [e.primitive.name for e in traced.jaxpr.eqns]
    assert "reduce_sum" not in names and "gather" not in names and "div" not in names


def test_residual_cnn_with_global_average_pool():
    x = jax.device_put(np.asarray(np.random.default_rng(1).standard_normal((4, 6, 5)), jnp.float32))
    _grads_match_to_float32_rounding(ResidualCNN(), x, jnp.array([0, 1, 2, 0]))


# --- refusals name the place ---------------------------------------------------------------


class Gated(nl.Module):
    """A user layer with a step no rule covers: a Cholesky factor of a param-derived value."""

    def init(self, key):
        return nl.ParamsDict(lin=nl.Linear(3, 3).init(key))

    def __call__(self, params, x, *, key=None):
        h = nl.Linear(3, 3)(params.lin, x)
        g = h.T @ h + jnp.eye(3)
        return jax.nn.relu(h) @ jnp.linalg.cholesky(g)  # the refused line


def test_a_nonlinear_step_without_a_rule_is_refused_with_its_source_line():
    import inspect

    src, first = inspect.getsourcelines(Gated.__call__)
    line = first + next(i for i, s in enumerate(src) if "the refused line" in s)
    net = Gated()

    def loss(p, x):
        return jnp.mean(net(p, x))

    with pytest.raises(nl.ManualGradError) as e:
        jax.grad(nl.manual_grads(loss))(net.init(jax.random.key(0)), jnp.ones((2, 3)))
    msg = str(e.value)
    assert f"`cholesky` at tests/test_manual_structural.py:{line}" in msg
    assert "in layer Gated" in msg
    assert '@nl.hand_rule(f_vjp) (docs/gradients.md, "Your own rule: nl.hand_rule")' in msg
    assert "jax.grad, without nl.manual_grads" in msg
    assert "loss.grad" not in msg and "nl.with_vjp" not in msg
    assert e.value.primitive == "cholesky" and e.value.layer == "Gated"


def test_products_of_two_param_values_have_rules_and_repeated_scatter_indices_are_refused():
    w = jnp.array([1.0, -2.0, 3.0])

    def square(p):  # outside any Module: both factors differentiated
        return jnp.sum(p * p) + jnp.sum(p / (p * p + 1.0))

    got, want = jax.jit(lambda w: (jax.grad(nl.manual_grads(square))(w), jax.grad(square)(w)))(w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    def overwrite(p):
        return jnp.sum(jnp.zeros(4).at[jnp.array([1, 1, 2])].set(p))

    with pytest.raises(nl.ManualGradError, match=r"`scatter` .*indices that may repeat"):
        jax.grad(nl.manual_grads(overwrite))(w)
    # check=False: JAX's autodiff differentiates what has no rule, silently
    g = jax.grad(nl.manual_grads(overwrite, check=False))(w)
    np.testing.assert_allclose(g, jax.grad(overwrite)(w))


def test_linear_ops_with_a_constant_side_and_inputs_gradients():
    """x @ W with x the data, scaling by a data-dependent mask, a division by a constant;
    the rules are exact in every operand, so the gradient with respect to x is right too."""

    def loss(p, x):
        h = x @ p["W"]  # linear in W: x is not differentiated by the params
        h = jnp.where(x[:, :1] > 0, h, -h) / 3.0
        return jnp.sum(jnp.concatenate([h, h[:, ::-1]], axis=-1) * x[:, :1])

    p, x = {"W": _normal(0, 3, 4)}, _normal(1, 5, 3)
    want, got = jax.jit(  # one compile
        lambda p, x: (
            jax.grad(loss, argnums=(0, 1))(p, x),
            jax.grad(nl.manual_grads(loss), argnums=(0, 1))(p, x),
        )
    )(p, x)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# --- remat -----------------------------------------------------------------------------------


_RELU_VJP_TRACES = []


def _counted_relu_vjp(x, dret):
    _RELU_VJP_TRACES.append(x.shape)  # at trace time: the backward pass uses this rule
    return jnp.where(x > 0, dret, 0.0)


@nl.hand_rule(_counted_relu_vjp)
def _counted_relu(x):
    return jnp.maximum(x, 0.0)


def _stack(remat: bool, residual: bool, depth: int = 16, width: int = 128):
    """``depth`` Linear+relu layers as a ``lax.scan`` over stacked params, each layer under
    ``jax.checkpoint`` or not; ``residual`` adds ``h +`` (an add primitive inside the body,
    so manual_grads rebuilds the scan and the checkpoint around its rules)."""
    layer = nl.Linear(width, width)

    def block(h, p):
        out = _counted_relu(layer(p, h))
        return (h + out if residual else out), None

    step = jax.checkpoint(block) if remat else block

    def loss(params, x):
        h, _ = jax.lax.scan(step, x, params)
        return nl.reduce(h, "mean")

    rng = np.random.default_rng(0)  # numpy: no compile per random op of each layer's init
    shapes = jax.eval_shape(layer.init, jax.random.key(0))
    return loss, jax.tree.map(
        lambda s: jax.device_put(
            np.asarray(rng.standard_normal((depth, *s.shape)) / np.sqrt(width), s.dtype)
        ),
        shapes,
    )


@pytest.mark.parametrize("residual", [False, True])
def test_checkpoint_recomputes_with_hand_rules_and_saves_memory(residual):
    # A scan over the layers: on the CPU backend an unrolled stack shows the same temp
    # bytes with or without jax.checkpoint even in plain JAX (XLA's CSE merges the
    # recomputation back into the forward pass); across loop iterations it cannot.
    x = _normal(1, 256, 128)
    temp, grads = {}, {}
    for remat in (False, True):
        loss, params = _stack(remat, residual)
        f = jax.jit(jax.grad(nl.manual_grads(loss)))
        _RELU_VJP_TRACES.clear()
        traced = f.trace(params, x)
        assert ("remat" in str(traced.jaxpr)) == remat
        compiled = traced.lower().compile()  # one compile: measured, then run
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        assert _RELU_VJP_TRACES, "the backward pass did not run the hand rule"
        grads[remat] = compiled(params, x)
    auto = jax.jit(jax.grad(_stack(False, residual)[0]))(params, x)
    for a, plain, rematted in zip(*(jax.tree.leaves(g) for g in (auto, grads[False], grads[True]))):
        np.testing.assert_allclose(plain, a, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(rematted, plain)  # same rules, same order
    assert temp[True] < 0.6 * temp[False], temp


def test_structural_ops_inside_jit_cond_scan_and_a_counted_while():
    @jax.jit
    def pool(h):  # a user's jitted helper: walked into
        return jnp.mean(h, axis=0)

    def loss(p, x, flag):
        h = nl.linear(x, p["W"], None)
        h = jax.lax.cond(flag, lambda h: h[:, ::-1] * 2.0, lambda h: h - 1.0, h)
        h, _ = jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(4), h)  # rows summed
        return jnp.sum(pool(h[None]) * jnp.arange(4.0))

    p, x = {"W": _normal(0, 3, 4)}, _normal(1, 5, 3)
    both = jax.jit(  # both flags, both ways, one compile
        lambda p, x: [
            (jax.grad(loss)(p, x, flag), jax.grad(nl.manual_grads(loss))(p, x, flag))
            for flag in (True, False)
        ]
    )
    for want, got in both(p, x):
        np.testing.assert_allclose(got["W"], want["W"], rtol=1e-6, atol=1e-6)

    def looped(p, x):
        h = nl.linear(x, p["W"], None)
        return jnp.sum(
            jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 0.5, c[1] + 1), (h, 0))[0]
        )

    def fori(p, x):
        h = nl.linear(x, p["W"], None)
        return jnp.sum(jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5, h))

    # a while_loop counting from a constant to a constant runs as a scan
    got, want = jax.jit(
        lambda p, x: (jax.grad(nl.manual_grads(looped))(p, x), jax.grad(fori)(p, x))
    )(p, x)
    np.testing.assert_allclose(got["W"], want["W"], rtol=1e-6, atol=1e-6)

    def until(p, x):  # the trip count depends on the data: refused by name
        h = nl.linear(x, p["W"], None)
        return jnp.sum(jax.lax.while_loop(lambda c: jnp.sum(c) < 9.0, lambda c: c * 2.0, h))

    with pytest.raises(nl.ManualGradError, match=r"`while` .*trip count depends on data"):
        jax.grad(nl.manual_grads(until))(p, x)


# --- show_grad: code that runs for any model ---------------------------------------------

_USER_MODULE = '''
"""A user's model: its own hand rule (mean pooling), tok + pos, two nnlite blocks."""
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

import nnlite as nl


def seq_mean_vjp(h, dret):
    return jnp.broadcast_to(dret[..., None, :], h.shape) / h.shape[-2]


@nl.hand_rule(seq_mean_vjp)
def seq_mean(h):
    return jnp.mean(h, axis=-2)


class TinyTransformer(nl.Module):
    vocab_size: int = 13
    context: int = 16
    features: int = 32
    param_dtype: str = "float32"

    def init(self, key):
        k = jax.random.split(key, 5)
        emb = functools.partial(nl.Embedding, param_dtype=self.param_dtype)
        return nl.ParamsDict(
            tok=emb(self.vocab_size, self.features).init(k[0]),
            pos=emb(self.context, self.features).init(k[1]),
            blocks=[self.block.init(k[2]), self.block.init(k[3])],
            head=nl.Linear(self.features, 3, param_dtype=self.param_dtype).init(k[4]),
        )

    @property
    def block(self):
        return nl.TransformerBlock(self.features, 4, param_dtype=self.param_dtype)

    def __call__(self, params, ids, *, key=None):
        emb = nl.Embedding(self.vocab_size, self.features, param_dtype=self.param_dtype)
        tok = emb(params.tok, ids)
        h = tok + params.pos.W[None, : ids.shape[-1]]
        for p in params.blocks:
            h = self.block(p, h)
        head = nl.Linear(self.features, 3, param_dtype=self.param_dtype)
        return head(params.head, seq_mean(h))


def loss_of(model):
    def loss(params, ids, y):
        return nl.softmax_cross_entropy(model(params, ids), y, reduction="mean")

    return loss


def batch(n):
    ids = jax.random.randint(jax.random.key(n), (n, 16), 0, 13)
    return ids, jnp.arange(n) % 3
'''

_RUN_PRINTED = """
import sys

import jax
import jax.numpy as jnp
import numpy as np

import printed_grad
import {module} as user

model = user.TinyTransformer()
params = jax.jit(model.init)(jax.random.key(0))  # one compile, not one per random op
eps = np.finfo(np.float32).eps
batches = [user.batch(n) for n in (4, 8)]  # traced at 4; 8 is the batch the issue's code broke at
# both batches in one program per precision: two compiles, not six
got_auto = jax.jit(
    lambda p, bs: [(printed_grad.grad(p, *b), jax.grad(user.loss_of(model))(p, *b)) for b in bs]
)(params, batches)
with jax.enable_x64(True):
    m64 = user.TinyTransformer(param_dtype="float64")
    p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    exacts = jax.jit(lambda p, bs: [jax.grad(user.loss_of(m64))(p, *b) for b in bs])(p64, batches)
    exacts = jax.tree.map(np.asarray, exacts)
for n, (got, auto), exact in zip((4, 8), got_auto, exacts):
    for g, a, e in zip(*(jax.tree.leaves(t) for t in (got, auto, exact)), strict=True):
        err_printed = np.max(np.abs(np.asarray(g, np.float64) - e))
        err_auto = np.max(np.abs(np.asarray(a, np.float64) - e))
        assert err_printed <= 4 * max(err_auto, 8 * eps * np.max(np.abs(e))), (n, err_printed, err_auto)
    print("batch", n, "ok")
"""


def test_show_grad_code_runs_elsewhere_at_another_batch_size(tmp_path):
    """The issue's model with its own @nl.hand_rule in its own module: show_grad imports the
    rule from there, and the printed code, run in a fresh process, gives jax.grad's
    gradients at the traced batch size and at twice it."""
    module = "user_model_for_show_grad"
    (tmp_path / f"{module}.py").write_text(_USER_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        user = __import__(module)
        model = user.TinyTransformer()
        params = jax.jit(model.init)(jax.random.key(0))  # one compile, not one per op
        src = nl.show_grad(user.loss_of(model), params, *user.batch(4))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)
    assert f"from {module} import seq_mean, seq_mean_vjp" in src
    assert "B = ids.shape[0]" in src and "new_sizes=(B, 16, 12, 8)" in src
    assert "from nnlite.rules import " in src and " seq_mean" not in src.split(f"from {module}")[0]
    (tmp_path / "printed_grad.py").write_text(src)
    (tmp_path / "run.py").write_text(_RUN_PRINTED.format(module=module))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root])}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batch 4 ok" in done.stdout and "batch 8 ok" in done.stdout


def test_pvary_rule_and_tok_plus_pos_under_shard_map(rand):
    """pvary (a replicated value meeting a device-varying one) needs shard_map: its rule
    against jax.vjp there, and a user's tok + pos with manual_grads against one device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    w, dret = rand(3), rand(8, 3)
    f, f_vjp = nl.rules.RULES["pvary"]

    def local(w, dret):  # per device: dret is this device's cotangent
        want = jax.vjp(lambda w: f(w, axes=("d",)), w)[1](dret[0])[0]
        return want, f_vjp(w, dret[0], axes=("d",))

    want, got = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P()))
    )(w, jax.device_put(dret[:4], NamedSharding(mesh, P("d"))))
    np.testing.assert_allclose(got, want, rtol=default_rtol(w.dtype))

    pos = {"pos": rand(5, 3), "W": rand(3, 2)}
    tok = rand(8, 5, 3)

    def loss(p, tok):
        h = tok + p["pos"][None]  # tok varies per device, pos is replicated: a pvary
        return jnp.mean(nl.linear(jnp.mean(h, axis=1), p["W"], None))

    def step(p, tok):
        return jax.grad(lambda p: jax.lax.pmean(nl.manual_grads(loss)(p, tok), "d"))(p)

    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
    got = sharded(pos, jax.device_put(tok, NamedSharding(mesh, P("d"))))
    for g, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(jax.grad(loss)(pos, tok)), strict=True):
        np.testing.assert_allclose(g, w_, rtol=default_rtol(g.dtype), atol=default_rtol(g.dtype))


def default_rtol(dtype) -> float:
    return nl.vjp.default_tolerances(dtype)[0]
