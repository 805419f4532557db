"""ParamsDict: container behaviour, pytree behaviour under JAX transforms, seed API."""

import copy
import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import python_c
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
from nnlite import ParamsDict


def _linear_params(key, n_in=3, n_out=2):
    k1, k2 = jax.random.split(key)
    return ParamsDict(W=jax.random.normal(k1, (n_in, n_out)), b=jax.random.normal(k2, (n_out,)))


def _seed_example():
    """The seed project's example: a scalar, a nested layer, a list of layers."""
    p = ParamsDict()
    p.a = 4
    p.layer = ParamsDict()
    p.layer.W = jnp.zeros((5, 7))
    p.layers = [ParamsDict(b=jnp.zeros(10)), ParamsDict(b=jnp.ones(10))]
    return p


def _paths(tree):
    return [nl.format_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# -- container behaviour --------------------------------------------------------------------
def test_attribute_and_item_access_are_the_same_field():
    w = jnp.ones((2, 3))
    p = ParamsDict()
    p.layer = ParamsDict()
    p.layer.W = w
    assert p["layer"]["W"] is w
    p["layer"]["b"] = jnp.zeros(3)
    assert p.layer.b.shape == (3,)
    assert list(p.layer) == ["W", "b"]
    assert "W" in p.layer and "nope" not in p.layer and len(p.layer) == 2
    del p.layer.W
    assert list(p.layer) == ["b"]
    del p["layer"]["b"]
    assert len(p.layer) == 0


def test_constructor_nests_plain_mappings():
    p = ParamsDict({"enc": {"W": jnp.ones((2, 2))}}, scale=2.0)
    assert isinstance(p.enc, ParamsDict)
    assert p.enc.W.shape == (2, 2) and p.scale == 2.0
    p.dec = {"b": jnp.zeros(1)}
    assert isinstance(p.dec, ParamsDict)


def test_lists_and_tuples_of_params_dicts(key):
    p = ParamsDict(layers=[_linear_params(k) for k in jax.random.split(key, 3)])
    assert p.layers[1].b.shape == (2,)
    assert _paths(p)[2:4] == ["/layers[1]/W", "/layers[1]/b"]
    t = ParamsDict(blocks=(ParamsDict(g=jnp.ones(2)), ParamsDict(g=jnp.zeros(2))))
    assert _paths(t) == ["/blocks[0]/g", "/blocks[1]/g"]
    doubled = jax.tree.map(lambda x: 2 * x, t)
    assert isinstance(doubled.blocks, tuple)
    np.testing.assert_array_equal(doubled.blocks[0].g, [2.0, 2.0])


def test_python_scalars_are_leaves_and_strings_are_static():
    p = ParamsDict(a=4, lr=0.5, act="relu", W=jnp.ones(2))
    leaves = jax.tree.leaves(p)  # sorted field order: W, a, lr
    assert len(leaves) == 3 and leaves[0] is p.W and leaves[1:] == [4, 0.5]
    q = jax.tree.map(lambda x: x * 2, p)
    assert q.a == 8 and q.lr == 1.0 and q.act == "relu"

    @jax.jit
    def f(p):
        # A string field is an ordinary Python str under jit: usable in control flow.
        return p.W * p.a if p.act == "relu" else -p.W

    np.testing.assert_array_equal(f(p), [4.0, 4.0])
    p.act = "tanh"
    np.testing.assert_array_equal(f(p), [-1.0, -1.0])


def test_strings_are_part_of_the_treedef():
    a, b = ParamsDict(act="relu", W=jnp.ones(1)), ParamsDict(act="tanh", W=jnp.ones(1))
    assert jax.tree.structure(a) != jax.tree.structure(b)


def test_invalid_keys_are_refused():
    p = ParamsDict()
    for bad in ["", "a/b", "a[0]", 3]:
        with pytest.raises(KeyError, match="non-empty strings without"):
            p[bad] = 1


@pytest.mark.parametrize("name", ["keys", "items", "print", "values", "get", "toJSON", "summary"])
def test_method_names_are_refused_as_keys(name):
    with pytest.raises(
        KeyError, match=rf"key '{name}' is the name of a ParamsDict method: p.{name}"
    ):
        ParamsDict()[name] = 1
    with pytest.raises(KeyError, match="is the name of a ParamsDict method"):
        setattr(ParamsDict(), name, 1)
    with pytest.raises(KeyError, match="is the name of a ParamsDict method"):
        ParamsDict({"layer": {name: 1}})  # nested mappings too
    with pytest.raises(KeyError, match="is the name of a ParamsDict method"):
        ParamsDict.from_flat({f"/layer/{name}": 1})


@pytest.mark.parametrize("name", ["_data", "_aux", "_x", "__class__"])
def test_underscore_keys_are_refused(name):
    with pytest.raises(KeyError, match=r"keys starting with '_' are reserved"):
        ParamsDict(**{name: 1})


def test_keys_that_are_not_identifiers_work_by_item_access():
    p = ParamsDict({"my key": jnp.ones(2), "0": 1.0})
    assert p["my key"].shape == (2,)
    assert [path for path, _ in p.items()] == ["/my key", "/0"]
    assert ParamsDict.from_flat(p.to_flat()) == p


def test_missing_attribute_names_the_existing_keys():
    p = ParamsDict(W=jnp.ones(2), b=jnp.zeros(2))
    with pytest.raises(AttributeError, match=r"no key 'bias'; keys are: W, b"):
        p.bias  # noqa: B018
    with pytest.raises(KeyError, match=r"no key 'bias'; keys are: W, b"):
        p["bias"]
    with pytest.raises(AttributeError, match=r"keys are: \(none\)"):
        ParamsDict().W  # noqa: B018
    assert not hasattr(p, "bias")


def test_equality_compares_structure_and_values():
    p = ParamsDict(W=jnp.ones(2), layers=[ParamsDict(b=jnp.zeros(1))])
    assert p == ParamsDict(layers=[ParamsDict(b=jnp.zeros(1))], W=jnp.ones(2))
    assert p != ParamsDict(W=jnp.ones(2) * 2, layers=[ParamsDict(b=jnp.zeros(1))])
    assert p != ParamsDict(W=jnp.ones(2))


def test_copy_and_deepcopy_are_independent():
    p = ParamsDict(a=1, sub=ParamsDict(W=jnp.ones(2)))
    shallow, deep = copy.copy(p), copy.deepcopy(p)
    assert shallow == p and deep == p
    assert shallow.sub is p.sub and deep.sub is not p.sub
    shallow.extra = 2
    deep.sub.W = jnp.zeros(2)
    assert "extra" not in p
    np.testing.assert_array_equal(p.sub.W, [1.0, 1.0])


# -- pytree behaviour -----------------------------------------------------------------------
def test_key_paths_read_like_print():
    p = _seed_example()
    assert _paths(p) == ["/a", "/layer/W", "/layers[0]/b", "/layers[1]/b"]
    # Inside a plain dict: the dict's keys print the same way.
    assert _paths({"m": p})[1] == "/m/layer/W"


def test_key_paths_are_jax_standard_entries():
    """DictKey entries: keystr and tools reading key paths (orbax) understand them."""
    p = _seed_example()
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
    keystr = jax.tree_util.keystr
    assert [keystr(k, simple=True, separator="/") for k in paths] == [
        "a",
        "layer/W",
        "layers/0/b",
        "layers/1/b",
    ]
    assert keystr(paths[2]) == "['layers'][0]['b']"
    assert all(type(k) in (jax.tree_util.DictKey, jax.tree_util.SequenceKey) for k in paths[2])
    # A ParamsDict made from a plain dict has the dict's key paths.
    d = {"layer": {"W": jnp.ones(2)}, "layers": [{"b": jnp.ones(1)}]}
    assert [k for k, _ in jax.tree_util.tree_flatten_with_path(ParamsDict(d))[0]] == [
        k for k, _ in jax.tree_util.tree_flatten_with_path(d)[0]
    ]


def test_path_key_is_deprecated_for_dict_key():
    with pytest.warns(DeprecationWarning, match="use JAX's standard jax.tree_util.DictKey"):
        path_key = nl.PathKey
    assert path_key is jax.tree_util.DictKey
    (path, _), *_ = jax.tree_util.tree_flatten_with_path(ParamsDict(W=1.0))[0]
    assert path == (path_key("W"),)


def test_treedef_ignores_insertion_order_but_printing_keeps_it(capsys):
    w, b, s = jnp.ones((2, 3)), jnp.zeros(3), jnp.ones(())
    p = ParamsDict(W=w, b=b, layer=ParamsDict(W=w, b=b), scale=s)
    q = ParamsDict(scale=s, layer=ParamsDict(b=b, W=w), b=b, W=w)
    assert jax.tree.structure(p) == jax.tree.structure(q)
    assert hash(jax.tree.structure(p)) == hash(jax.tree.structure(q))
    assert jax.tree.structure(p) != jax.tree.structure(ParamsDict(W=w, b=b))
    # Same structure, so leaves of one unflatten into the other's treedef.
    assert jax.tree.unflatten(jax.tree.structure(q), jax.tree.leaves(p)) == q

    expected_q = ["/scale", "/layer/b", "/layer/W", "/b", "/W"]
    mapped = jax.tree.map(lambda x: x + 1, q)
    jitted = jax.jit(lambda t: t)(q)
    for tree in (q, mapped, jitted, jax.jit(lambda t: jax.tree.map(jnp.sin, t))(q)):
        tree.print()
        printed = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0] for line in printed] == expected_q
        assert [path for path, _ in tree.items()] == expected_q


def test_tree_map_over_two_trees_with_different_orders():
    p = ParamsDict(a=jnp.ones(2), b=jnp.full(2, 3.0))
    q = ParamsDict(b=jnp.full(2, 10.0), a=jnp.full(2, 20.0))
    r = jax.tree.map(lambda x, y: x + y, p, q)  # fields are matched by name, not position
    np.testing.assert_array_equal(r.a, [21.0, 21.0])
    np.testing.assert_array_equal(r.b, [13.0, 13.0])


def test_jit_and_grad(key):
    p = _linear_params(key)
    x = jnp.arange(6.0).reshape(2, 3)

    def loss(p):
        return jnp.sum((x @ p.W + jnp.broadcast_to(p.b, (2, 2))) ** 2)

    g = jax.jit(jax.grad(loss))(p)
    assert isinstance(g, ParamsDict) and list(g) == ["W", "b"]
    residual = x @ p.W + p.b[None]
    np.testing.assert_allclose(g.W, 2 * x.T @ residual, rtol=1e-5)
    np.testing.assert_allclose(g.b, 2 * residual.sum(0), rtol=1e-5)


def test_vmap_over_stacked_params_and_in_axes_prefix(key):
    stacked = ParamsDict(W=jax.random.normal(key, (4, 3, 2)), b=jnp.arange(8.0).reshape(4, 2))
    x = jnp.ones(3)
    out = jax.vmap(lambda p: x @ p.W + p.b)(stacked)
    for i in range(4):
        np.testing.assert_allclose(out[i], x @ stacked.W[i] + stacked.b[i], rtol=1e-6)
    # A ParamsDict as an in_axes prefix: W mapped, b shared.
    shared_b = ParamsDict(W=stacked.W, b=jnp.ones(2))
    out = jax.vmap(lambda p: x @ p.W + p.b, in_axes=(ParamsDict(b=None, W=0),))(shared_b)
    np.testing.assert_allclose(out[2], x @ stacked.W[2] + 1.0, rtol=1e-6)


def test_pmap_over_8_devices(key):
    assert jax.device_count() == 8
    p = _linear_params(key)
    replicated = jax.tree.map(lambda a: jnp.broadcast_to(a, (8, *a.shape)), p)
    xs = jnp.arange(8 * 3.0).reshape(8, 1, 3)

    def step(p, x):
        g = jax.grad(lambda p: jnp.sum(x @ p.W))(p)
        return jax.lax.pmean(g, "d")

    g = jax.pmap(step, axis_name="d")(replicated, xs)
    assert isinstance(g, ParamsDict) and g.W.shape == (8, 3, 2)
    # d/dW sum(x @ W) = x^T 1, averaged over the 8 devices.
    expected = jnp.broadcast_to(xs.mean(0).reshape(3, 1), (3, 2))
    for i in range(8):
        np.testing.assert_allclose(g.W[i], expected, rtol=1e-6)
        np.testing.assert_array_equal(g.b[i], jnp.zeros(2))


def test_shard_map_gradient_equals_one_device(key):
    layer = nl.Linear(3, 2)
    p = layer.init(key)
    x = jnp.arange(48.0).reshape(16, 3) / 10
    y = jnp.ones((16, 2))
    mesh = jax.make_mesh((8,), ("data",))

    def local_grad(p, x, y):
        return jax.grad(lambda p: jax.lax.pmean(nl.mse(layer(p, x), y, reduction="mean"), "data"))(
            p
        )

    f = jax.jit(
        jax.shard_map(local_grad, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P())
    )
    batch = NamedSharding(mesh, P("data"))
    g = f(jax.device_put(p, NamedSharding(mesh, P())), *jax.device_put((x, y), batch))
    ref = jax.grad(lambda p: nl.mse(layer(p, x), y, reduction="mean"))(p)
    assert isinstance(g, ParamsDict)
    np.testing.assert_allclose(g.W, ref.W, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.b, ref.b, rtol=1e-5, atol=1e-6)


def test_optax_adam_init_update_apply(key):
    p = ParamsDict(W=jax.random.normal(key, (3, 2)), sub=ParamsDict(b=jnp.array([1.0, -2.0])))
    opt = optax.adam(1e-2)
    state = opt.init(p)
    assert jax.tree.structure(state[0].mu) == jax.tree.structure(p)
    g = jax.tree.map(lambda a: 2 * a, p)  # gradient of sum(a^2)
    updates, state = opt.update(g, state, p)
    new = optax.apply_updates(p, updates)
    assert isinstance(new, ParamsDict) and list(new) == ["W", "sub"]
    # Adam's first step is -lr * g / (|g| + eps): lr against the gradient's sign.
    np.testing.assert_allclose(new.sub.b, [1.0 - 1e-2, -2.0 + 1e-2], rtol=1e-5)
    np.testing.assert_allclose(new.W - p.W, -1e-2 * jnp.sign(p.W), rtol=1e-4)
    assert int(state[0].count) == 1


def test_equinox_filter_jit_treats_python_scalars_as_static():
    traces = []

    @eqx.filter_jit
    def f(p):
        traces.append(None)
        return ParamsDict(y=p.W * p.n, n=p.n, act=p.act)

    p = ParamsDict(W=jnp.ones(2), n=3, act="relu")
    out = f(p)
    np.testing.assert_array_equal(out.y, [3.0, 3.0])
    assert out.n == 3 and out.act == "relu"  # n stayed a Python int
    f(ParamsDict(n=3, act="relu", W=jnp.zeros(2)))  # same structure, other order: cached
    assert len(traces) == 1
    f(ParamsDict(W=jnp.ones(2), n=4, act="relu"))  # a new static value retraces
    assert len(traces) == 2


def test_unflattened_params_stay_correct_after_mutation():
    p = ParamsDict(W=jnp.ones(2), b=jnp.zeros(2), name="x")
    q = jax.tree.map(lambda a: a + 1, p)
    np.testing.assert_array_equal(jax.tree.leaves(q)[0], [2.0, 2.0])
    q.W = jnp.full(2, 7.0)
    del q.b
    q.c = jnp.ones(1)
    assert [path for path, _ in q.items()] == ["/W", "/name", "/c"]
    assert [leaf.tolist() for leaf in jax.tree.leaves(q)] == [[7.0, 7.0], [1.0]]
    assert _paths(q) == ["/W", "/c"]
    r = copy.deepcopy(jax.tree.map(lambda a: a, p))  # copied before its dict was built
    assert r == p


# -- seed API -------------------------------------------------------------------------------
def test_print_lines(capsys):
    _seed_example().print()
    assert capsys.readouterr().out.splitlines() == [
        "/a: 4",
        "/layer/W: f32[5,7]",
        "/layers[0]/b: f32[10]",
        "/layers[1]/b: f32[10]",
    ]


@pytest.mark.parametrize(
    ("leaf", "expected"),
    [
        (jnp.zeros((2, 3), jnp.bfloat16), "bf16[2,3]"),
        (jnp.zeros(4, jnp.int32), "i32[4]"),
        (np.zeros((1, 2), np.uint8), "u8[1,2]"),
        (jnp.zeros((), jnp.float16), "f16[]"),
        (jnp.zeros(3, bool), "bool[3]"),
        (0.5, "0.5"),
        ("relu", "'relu'"),
    ],
)
def test_leaf_str(leaf, expected):
    assert nl.leaf_str(leaf) == expected


def test_print_from_a_fresh_interpreter():
    code = "from nnlite import ParamsDict; p = ParamsDict(); p.a = 4; p.print()"
    result = python_c(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "/a: 4\n"


def test_print_and_items_take_the_seeds_prefix(tmp_path, capsys):
    p = _seed_example()
    p.print("model")
    assert capsys.readouterr().out.splitlines()[:2] == ["model/a: 4", "model/layer/W: f32[5,7]"]
    assert [k for k, _ in p.items("m")] == ["m/a", "m/layer/W", "m/layers[0]/b", "m/layers[1]/b"]
    with open(tmp_path / "p.txt", "w") as f:
        p.print(file=f)
        p.print("x", file=f)
    lines = (tmp_path / "p.txt").read_text().splitlines()
    assert lines[0] == "/a: 4" and lines[4] == "x/a: 4"
    with pytest.raises(TypeError, match=r"path must be a str prefix.*use print\(file=...\)"):
        p.print(sys.stdout)


def test_to_json_alias_is_the_seeds():
    p = ParamsDict(name="mlp", lr=0.1, W=jnp.ones(2))
    assert json.loads(p.toJSON()) == {"name": "mlp", "lr": 0.1}
    assert p.toJSON() == p.to_json(indent=4)


def test_hash_of_static_params_makes_a_jit_static_argument():
    cfg = ParamsDict(act="relu", sizes=[3, 4], scale=2.0, sub=ParamsDict(n=1))
    same = ParamsDict(sub=ParamsDict(n=1), scale=2.0, sizes=[3, 4], act="relu")
    assert hash(cfg) == hash(same) and cfg == same
    assert hash(cfg) != hash(ParamsDict(act="tanh", sizes=[3, 4], scale=2.0, sub=ParamsDict(n=1)))
    traces = []

    @jax.jit
    def f(x, cfg):
        traces.append(cfg.act)
        return x * cfg.scale

    f = jax.jit(f.__wrapped__, static_argnums=1)
    assert float(f(jnp.ones(()), cfg)) == 2.0
    f(jnp.ones(()), same)  # equal and same hash: no retrace
    assert traces == ["relu"]


def test_hash_refuses_arrays_naming_the_path():
    p = ParamsDict(act="relu", layer=ParamsDict(W=jnp.ones((5, 7))))
    with pytest.raises(
        TypeError, match=r"unhashable ParamsDict: /layer/W is an array \(f32\[5,7\]\)"
    ):
        hash(p)
    with pytest.raises(TypeError, match=r"/d\[0\] is an unhashable set"):
        hash(ParamsDict(d=[set()]))


def test_items_yields_paths_and_leaves_in_insertion_order():
    p = _seed_example()
    items = list(p.items())
    assert [path for path, _ in items] == ["/a", "/layer/W", "/layers[0]/b", "/layers[1]/b"]
    assert items[1][1] is p.layer.W and items[3][1] is p.layers[1].b


def test_to_json_keeps_the_non_array_part():
    p = ParamsDict(name="mlp", lr=0.1, steps=3, flag=True, W=jnp.ones(2))
    p.layers = [ParamsDict(W=jnp.ones(1), units=8), ParamsDict(W=jnp.ones(1), units=4)]
    assert json.loads(p.to_json()) == {
        "name": "mlp",
        "lr": 0.1,
        "steps": 3,
        "flag": True,
        "layers": [{"units": 8}, {"units": 4}],
    }
    assert list(json.loads(p.to_json())) == ["name", "lr", "steps", "flag", "layers"]


def test_summary_and_num_params_count_a_shared_array_once():
    W = jnp.zeros((5, 7))
    p = ParamsDict(W=W, b=jnp.zeros(7), emb=jnp.zeros((3, 4), jnp.bfloat16))
    p.head = ParamsDict(W=W)  # tied weights: the same array under two paths
    rows = {line.split()[0]: line.split() for line in p.summary().splitlines()}
    assert rows["/W"][1:] == ["(5,", "7)", "f32", "35", "140"]
    assert rows["/b"][1:] == ["(7,)", "f32", "7", "28"]
    assert rows["/emb"][1:] == ["(3,", "4)", "bf16", "12", "24"]
    assert rows["/head/W"][1:] == ["(5,", "7)", "f32", "35", "140"]
    n_total = 5 * 7 + 7 + 3 * 4
    bytes_total = 4 * (5 * 7 + 7) + 2 * 3 * 4
    assert rows["total"][1:] == [str(n_total), str(bytes_total)]
    assert p.num_params() == n_total
    big = ParamsDict(W=jnp.zeros((1000, 1000), jnp.int8))
    assert big.summary().splitlines()[-1].split()[1:] == ["1,000,000", "1,000,000"]


def test_to_flat_from_flat_round_trip():
    p = _seed_example()
    p.act = "gelu"
    p.layers[1].scale = 0.5
    flat = p.to_flat()
    assert list(flat) == [
        "/a",
        "/layer/W",
        "/layers[0]/b",
        "/layers[1]/b",
        "/layers[1]/scale",
        "/act",
    ]
    assert flat["/layer/W"] is p.layer.W
    q = ParamsDict.from_flat(flat)
    assert q == p
    assert jax.tree.structure(q) == jax.tree.structure(p)
    assert [path for path, _ in q.items()] == list(flat)


def test_from_flat_puts_layers_without_params_back():
    """A missing index among a list's ParamsDicts is a layer without params (to_flat
    writes no path for it); one at the end comes back when given as a value."""
    flat = {"/layers[1]/W": 1.0, "/layers[3]": ParamsDict(), "/head/b": 2.0}
    q = ParamsDict.from_flat(flat)
    assert q.layers == [ParamsDict(), ParamsDict(W=1.0), ParamsDict(), ParamsDict()]
    assert q.head.b == 2.0


@pytest.mark.parametrize(
    ("flat", "match"),
    [
        ({"layer/W": 1}, "bad ParamsDict path 'layer/W'"),
        ({"/xs[1]": 1}, "gap in a list index"),
        ({"/a": 1, "/a[0]": 2}, r"index \[0\] applied to a non-list node"),
    ],
)
def test_from_flat_rejects_bad_paths(flat, match):
    with pytest.raises(ValueError, match=match):
        ParamsDict.from_flat(flat)


# -- the JAX ecosystem reads ParamsDict key paths -------------------------------------------
def test_orbax_round_trip_of_params_and_optimizer_state(tmp_path):
    import orbax.checkpoint as ocp  # test-only: the dev extra installs it

    p = ParamsDict(
        layers=[_linear_params(jax.random.key(i)) for i in range(2)], scale=jnp.float32(2)
    )
    state = optax.adam(1e-3).init(p)
    state = optax.adam(1e-3).update(jax.tree.map(jnp.ones_like, p), state, p)[1]
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "params", p)
        ckpt.save(tmp_path / "opt_state", state)
        ckpt.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, (p, state))
        p2 = ckpt.restore(tmp_path / "params", abstract[0])
        state2 = ckpt.restore(tmp_path / "opt_state", abstract[1])
    assert isinstance(p2, ParamsDict) and p2 == p
    assert jax.tree.structure(state2) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
