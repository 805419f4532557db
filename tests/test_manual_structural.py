"""Manual gradients for models written the natural way: structural and linear primitives.

The library's rule for each primitive (``nnlite.rules``) against ``jax.vjp``; a transformer
classifier (``tok + pos``, ``jnp.mean(h, axis=-2)``) and a residual CNN with a global average
pool under ``nl.manual_grads`` against ``jax.grad``; refusals naming the source line;
``jax.checkpoint`` with hand rules; ``show_grad`` code that runs in a fresh process at
another batch size with the user's own rule.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import nnlite as nl
from nnlite.grad._structural import PRIMITIVE_RULES
from nnlite.vjp import check_vjp

DTYPES = ["float32", "float64"]


@pytest.fixture(params=DTYPES)
def rand(request):
    """``rand(*shape)`` in the test's dtype (float64 with x64 on for the test only)."""
    dtype = request.param
    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng(0)
        yield lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)


def check(name, *args, **params):
    """check_vjp of ``nnlite.rules.<name>`` with the primitive's parameters bound, and its
    forward against ``want`` when given."""
    f, f_vjp = nl.rules.RULES[name]
    fp, fp_vjp = functools.partial(f, **params), functools.partial(f_vjp, **params)
    fp.__name__, fp_vjp.__name__ = name, name + "_vjp"
    check_vjp(fp, fp_vjp, *args)


def _cases(rand):
    """``{case id: (rule name, args, params, expected forward or None)}`` for every
    structural rule: size-1 and rank-0 broadcasting, negative axes, strides, negative and
    interior padding, repeated and clamped indices."""
    x, y1, s, m, w = rand(2, 3, 4), rand(1, 3, 1), rand(), rand(3, 1), rand(4, 5)
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
        ("dot-batched", "dot_general", (rand(2, 5, 4), x),
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


CASE_IDS = list(_cases(lambda *shape: jnp.ones(shape)))


def test_every_primitive_rule_is_in_nnlite_rules_and_checked():
    checked = {name for name, *_ in _cases(lambda *shape: jnp.ones(shape)).values()}
    for prim, rule in PRIMITIVE_RULES.items():
        public = rule.f.__name__
        assert nl.rules.RULES[public][1] is rule.f_vjp, prim
        # pvary needs shard_map: checked in test_pvary_under_shard_map
        assert public in checked or public == "pvary", prim


@pytest.mark.parametrize("case", CASE_IDS)
def test_structural_rule_matches_jax_vjp(rand, case):
    name, args, params, want = _cases(rand)[case]
    check(name, *args, **params)
    got = nl.rules.RULES[name][0](*args, **params)
    if want is not None:
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            eps = np.finfo(w.dtype).eps  # the forward is the primitive: equal up to rounding
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=4 * eps, atol=4 * eps)
