"""Composition: children declared once (``setup``), derived ``init``/``uses_key``/
``init_state``, parameterless layers, keys and state threaded by the call, and errors that
name the user's line -- on their own and through the trainer."""

import functools
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import fit_config
from _tolerance import SAME_PROGRAMS, assert_same_trajectory

import nnlite as nl
import train


class Derived(nl.Module):
    features: int = 4

    def setup(self):
        self.inp = nl.Linear(self.features, 8)
        self.act = nl.Activation("tanh")  # no params: no key, no entry
        self.blocks = [nl.FFN(8, (16,), 8), nl.FFN(8, (16,), 8)]
        self.heads = {"a": nl.Linear(8, 2), "b": nl.Linear(8, 3)}

    def __call__(self, params, x):
        h = self.act(self.inp(params.inp, x))
        for block, p in zip(self.blocks, params.blocks, strict=True):
            h = h + block(p, h)
        return {n: head(params.heads[n], h) for n, head in self.heads.items()}


class HandWritten(nl.Module):
    features: int = 4

    def init(self, key):
        k_inp, k_blocks, k_heads = jax.random.split(key, 3)
        k_a, k_b = jax.random.split(k_heads)
        return nl.ParamsDict(
            inp=nl.Linear(self.features, 8).init(k_inp),
            blocks=[nl.FFN(8, (16,), 8).init(k) for k in jax.random.split(k_blocks, 2)],
            heads=nl.ParamsDict(a=nl.Linear(8, 2).init(k_a), b=nl.Linear(8, 3).init(k_b)),
        )

    def __call__(self, params, x, *, key=None):
        h = jnp.tanh(nl.Linear(self.features, 8)(params.inp, x))
        for p in params.blocks:
            h = h + nl.FFN(8, (16,), 8)(p, h)
        return {"a": nl.Linear(8, 2)(params.heads.a, h), "b": nl.Linear(8, 3)(params.heads.b, h)}


def test_derived_init_equals_hand_written_init(key):
    # both inits in one compile (eagerly, each random op compiles a program of its own)
    derived, hand = jax.jit(lambda k: (Derived().init(k), HandWritten().init(k)))(key)
    assert [p for p, _ in derived.items()] == [p for p, _ in hand.items()]
    jax.tree.map(np.testing.assert_array_equal, derived, hand)
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    both = jax.jit(lambda p, q, x: (Derived()(p, x), HandWritten()(q, x)))  # one compile
    out, want = both(derived, hand, x)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5), out, want)


def test_setup_modules_are_static_and_frozen():
    a, b = Derived(4), Derived(4)
    assert a == b and hash(a) == hash(b) and a != Derived(5)
    assert a.inp == nl.Linear(4, 8)
    with pytest.raises(AttributeError, match="frozen; declare children in setup"):
        a.inp = nl.Linear(4, 9)

    class Bad(nl.Module):
        features: int = 2

        def setup(self):
            self.features = 3

    with pytest.raises(AttributeError, match="'features' is a field of Bad"):
        Bad()

    class Override(Derived):  # a subclass may replace a child with a property
        @property
        def inp(self):
            return nl.Linear(self.features, 8, use_bias=False)

    assert "b" not in jax.eval_shape(Override().init, jax.random.key(0)).inp  # no compile


def test_parameterless_layers_take_no_params_and_add_none(key):
    x = jnp.arange(24.0).reshape(2, 3, 4)
    for layer in [nl.Activation("relu"), nl.Flatten(2), nl.Dropout(0.5), nl.AvgPool((3,))]:
        assert not layer.has_params and layer.init(key) == nl.ParamsDict()
        np.testing.assert_array_equal(layer(x), layer(None, x))
        np.testing.assert_array_equal(layer(x), layer(nl.ParamsDict(), x))
    with pytest.raises(TypeError, match=r"Flatten\(num_axes=2\) has no params.*keys W"):
        nl.Flatten(2)(nl.ParamsDict(W=jnp.ones(2)), x)
    # In a Sequential they keep their index with {} (the layers' paths do not move).
    net = nl.Sequential([nl.Linear(4, 4), nl.Activation("relu"), nl.Linear(4, 2)])
    assert [p for p, _ in jax.eval_shape(net.init, key).items()] == [
        "/layers[0]/W",
        "/layers[0]/b",
        "/layers[2]/W",
        "/layers[2]/b",
    ]


class Dropper(nl.Module):
    """Declares its Dropout; its __call__ takes no key at all."""

    def setup(self):
        self.fc = nl.Linear(8, 8)
        self.drop = nl.Dropout(0.5)

    def __call__(self, params, x):
        return self.drop(self.fc(params.fc, x))


def test_the_key_reaches_a_declared_random_child(key):
    model = nl.Sequential([Dropper(), nl.Linear(8, 2)])
    assert Dropper().uses_key and model.uses_key and not nl.Linear(8, 2).uses_key
    assert not nl.Sequential([nl.Linear(2, 2), nl.Dropout(0.0)]).uses_key
    p, x = jax.jit(model.init)(key), jnp.ones((16, 8))  # one compile, not one per op
    jitted = jax.jit(model)
    eval_out = jitted(p, x)
    train_a = jitted(p, x, key=jax.random.key(1))
    train_b = model(p, x, key=jax.random.key(1))  # eagerly: the same numbers
    assert not np.allclose(train_a, eval_out)  # dropout is on
    np.testing.assert_allclose(train_a, train_b, rtol=1e-6)  # deterministic in the key
    assert not np.allclose(train_a, jitted(p, x, key=jax.random.key(2)))


class Forgot(nl.Module):
    """The issue's bug: dropout built in __call__, no ``uses_key`` declared."""

    in_features: int
    num_classes: int

    task = "classification"

    def init(self, key):
        return nl.ParamsDict(fc=nl.Linear(self.in_features, self.num_classes).init(key))

    def __call__(self, params, x, *, key=None):
        h = nl.Linear(self.in_features, self.num_classes)(params.fc, x)
        return nl.Dropout(0.3)(h, key=key)


def test_a_forgotten_key_declaration_is_refused(key, tmp_path, npz):
    model = Forgot(8, 4)
    p = jax.jit(model.init)(key)  # one compile, not one per op
    msg = r"Dropout\(rate=0.3\) in Forgot draws random numbers, but Forgot.uses_key is False"
    with pytest.raises(ValueError, match=msg):
        model(p, jnp.ones((2, 8)))
    assert model(p, jnp.ones((2, 8)), key=key).shape == (2, 4)  # a key given: it is used
    with pytest.raises(train.ConfigError, match=msg):
        fit(tmp_path, npz, "train.steps=1", model=model)


class Block(nl.Module):
    def setup(self):
        self.mlp = nl.FFN(8, (8,), 8)

    def __call__(self, params, x):
        return x + self.mlp(params.mlp, x)


class Deep(nl.Module):
    in_features: int = 8
    num_classes: int = 4

    task = "classification"

    def setup(self):
        self.blocks = [Block() for _ in range(3)]
        self.out = nl.Linear(8, self.num_classes)

    def __call__(self, params, x):
        for i, (block, p) in enumerate(zip(self.blocks, params.blocks, strict=True)):
            h = x if i != 2 else x[..., :7]  # the mistake, in block 2's input
            x = block(p, h)
        return self.out(params.out, x)


def test_a_shape_mistake_names_the_layer_path_and_the_users_line(key, tmp_path, npz):
    model = Deep()
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, s in enumerate(source, 1) if "x + self.mlp(params.mlp" in s)
    want = re.escape("(in layer Deep.blocks[2].mlp") + r".*" + re.escape(f"{__file__}:{line}")
    p = jax.jit(model.init)(key)  # one compile, not one per op
    with pytest.raises(ValueError, match=r"expected input with last axis 8, got shape \(2, 7\)"):
        jax.jit(model)(p, jnp.ones((2, 8)))
    try:
        jax.jit(model)(p, jnp.ones((2, 8)))
    except ValueError as e:
        assert re.search(want, str(e).splitlines()[0]), str(e)
    with pytest.raises(train.ConfigError, match=want):
        fit(tmp_path, npz, "train.steps=1", model=model)


class SeqBN(nl.Module):
    """A stateful Sequential: BatchNorm anywhere in it, no state threaded by hand."""

    in_features: int
    num_classes: int
    width: int = 16
    dropout: float = 0.0

    task = "classification"

    def setup(self):
        self.net = nl.Sequential(
            [
                nl.BatchNorm(self.in_features, use_bias=False),
                nl.Linear(self.in_features, self.width, use_bias=False),
                nl.BatchNorm(self.width),
                nl.Activation("relu"),
                nl.Dropout(self.dropout),
                nl.Linear(self.width, self.num_classes),
            ]
        )

    def __call__(self, params, x):
        return self.net(params.net, x)


def test_a_stateful_sequential_threads_its_state(key):
    model = SeqBN(8, 4)
    p, s = jax.jit(model.init)(key), model.init_state()
    assert [q for q, _ in s.items()] == [
        "/net/layers[0]/mean",
        "/net/layers[0]/var",
        "/net/layers[2]/mean",
        "/net/layers[2]/var",
    ]
    x = np.random.default_rng(1).normal(size=(32, 8)).astype(np.float32) * 3 + 1
    y, new = jax.jit(lambda p, s, x: model(p, x, state=s, train=True))(p, s, x)

    @jax.jit  # the same by hand (one compile: eagerly, each op compiles its own)
    def by_hand(p, s, x):
        bn0, lin, bn2 = model.net.layers[:3]
        h, s0 = bn0(p.net.layers[0], x, state=s.net.layers[0], train=True)
        h, s2 = bn2(p.net.layers[2], lin(p.net.layers[1], h), state=s.net.layers[2], train=True)
        return model.net.layers[5](p.net.layers[5], nl.relu(h)), s0, s2

    want, s0, s2 = by_hand(p, s, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.net.layers[0].mean, s0.mean, rtol=1e-6)
    np.testing.assert_allclose(new.net.layers[2].var, s2.var, rtol=1e-6)
    y_eval, same = model(p, x, state=new)  # train=False: the running statistics
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, same, new))
    with pytest.raises(ValueError, match=r"SeqBN\(8, 4\) has state .* state=state, train"):
        model(p, x)


def fit(tmp_path, npz, *overrides, model):
    config = fit_config("compose", tmp_path)
    return train.fit(
        model, config, overrides=[npz, *overrides], resume="fresh", echo=lambda *_: None
    )


@pytest.fixture(scope="module")
def seqbn_one_device(tmp_path_factory, npz):
    """SeqBN trained 6 steps on one device without dropout: the reference of the
    strategies' test and the dropout-free run the resume test compares with."""
    tmp = tmp_path_factory.mktemp("compose")
    return fit(tmp, npz, *SAME_PROGRAMS, "train.steps=6", "name=none", model=SeqBN)


def test_a_stateful_sequential_trains_under_none_shard_map_and_fsdp(
    tmp_path, npz, seqbn_one_device
):
    ref = seqbn_one_device
    assert not np.allclose(ref.state.net.layers[2].var, 1, atol=1e-3)  # the state moved
    lr = ref.cfg.optimizer.learning_rate
    for strategy in ("shard_map", "fsdp"):
        par = [f"parallel.strategy={strategy}", "parallel.devices=2", f"name={strategy}"]
        got = fit(tmp_path, npz, *SAME_PROGRAMS, "train.steps=6", *par, model=SeqBN)
        assert_same_trajectory(got.params, ref.params, lr=lr, what=f"{strategy}: ")
        close = functools.partial(np.testing.assert_allclose, rtol=1e-3, atol=1e-4)
        jax.tree.map(close, got.state, ref.state)


def test_a_stateful_sequential_with_dropout_resumes_exactly(tmp_path, npz, seqbn_one_device):
    common = [*SAME_PROGRAMS, "train.steps=6", "checkpoint.every=3", "model.dropout=0.2"]
    full = fit(tmp_path, npz, *common, "name=full", model=SeqBN)
    assert SeqBN(8, 4, dropout=0.2).uses_key  # the trainer passes a key: dropout is on
    ckpts = sorted((full.run_dir / "checkpoints").iterdir())
    shutil.copytree(full.run_dir, tmp_path / "crashed")
    (tmp_path / "crashed" / "checkpoints" / ckpts[-1].name).unlink()  # died before step 6
    config = fit_config("crashed", tmp_path)
    resumed = train.fit(
        SeqBN, config, overrides=[npz, *common], resume="auto", echo=lambda *_: None
    )
    assert resumed.step == 6
    for what in ("params", "opt_state", "state"):
        for a, b in zip(
            jax.tree.leaves(getattr(full, what)),
            jax.tree.leaves(getattr(resumed, what)),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b, err_msg=what)
    # the same run without dropout (the one-device reference) went elsewhere
    no_dropout = seqbn_one_device
    assert not np.allclose(no_dropout.params.net.layers[5].W, full.params.net.layers[5].W)


ROOT = Path(__file__).resolve().parents[1]
COMPARE = ROOT / "docs" / "compare"
STYLES = ("nnlite", "nnlite_init", "equinox", "nnx")
ROWS = {"residual": "README's residual classifier", "cnn": "1-d CNN", "resnet": "ResNet"}


def _lines_of_code(path: Path) -> int:
    text = path.read_text().split("# --- model ---\n")[1].split("# --- end ---")[0]
    return sum(1 for s in text.splitlines() if s.strip() and not s.strip().startswith("#"))


@pytest.mark.parametrize("model", list(ROWS))
def test_the_line_count_table_is_the_files_and_they_run(model):
    import importlib.util

    table = (ROOT / "docs/layers.md").read_text()
    row = next(s for s in table.splitlines() if s.startswith(f"| {ROWS[model]}"))
    counts = [int(c) for c in row.strip("|").split("|")[1:]]
    assert counts == [_lines_of_code(COMPARE / f"{model}_{style}.py") for style in STYLES]
    x = {"residual": jnp.ones((4, 64)), "cnn": jnp.ones((4, 40))}.get(model, jnp.ones((4, 8, 8, 1)))
    outs = []
    for style in STYLES:
        spec = importlib.util.spec_from_file_location(
            f"compare_{model}_{style}", COMPARE / f"{model}_{style}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        outs.append(jax.eval_shape(module.forward, x))  # traced: shapes, no compiles
    assert all(o.shape == (4, 10) for o in outs)


class NormBlock(nl.Module):
    def setup(self):
        self.ln = nl.LayerNorm(8)
        self.mlp = nl.FFN(8, (16,), 8)
        self.drop = nl.Dropout(0.2)

    def __call__(self, params, x):
        return nl.add(x, self.drop(self.mlp(params.mlp, self.ln(params.ln, x))))


class Scanned(nl.Module):
    def setup(self):
        self.stack = nl.Stack(NormBlock(), 3)
        self.remat = nl.Remat(NormBlock())
        self.head = nl.Linear(8, 3)

    def __call__(self, params, x):
        return self.head(params.head, self.remat(params.remat, self.stack(params.stack, x)))


def test_setup_models_under_stack_remat_hand_rules_and_param_axes(key):
    model = Scanned()
    p, x = jax.jit(lambda k: (model.init(k), jax.random.normal(k, (4, 8))))(key)  # one compile
    y = jnp.array([0, 1, 2, 0])
    assert model.uses_key and p.stack.mlp.layers[0].W.shape == (3, 8, 16)

    def loss(p, x, y, key):
        return nl.softmax_cross_entropy(model(p, x, key=key), y, reduction="mean")

    k = jax.random.key(5)
    auto, hand = jax.jit(  # both passes in one compile
        lambda *a: (jax.grad(loss)(*a), jax.grad(nl.manual_grads(loss))(*a))
    )(p, x, y, k)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, hand, auto)
    assert nl.param_axes(model).stack.mlp.layers[0].W == nl.Axes((None, "embed", "mlp"))
    assert nl.param_axes(model).head.W == nl.Axes(("in", "out"))
    with pytest.raises(ValueError, match="Stack: Sequential has state"):
        nl.Stack(nl.Sequential([nl.BatchNorm(8)]), 2)


def test_the_librarys_composite_layers_keep_their_params_and_numbers(key):
    # FFN, Sequential, SoftmaxHead, RNN and Remat declare their children (setup() or a
    # field); their params and numbers for a key are those of the init they used to write,
    # so checkpoints and seeded runs from before load and repeat.
    lin = [nl.Linear(4, 8, w_init="he_normal"), nl.Linear(8, 3, w_init="he_normal")]
    cell = nl.GRUCell(3, 5)
    cases = [
        (nl.FFN(4, (8,), 3), lambda k: {"layers": [m.init(q) for m, q in zip(lin, split(k, 2))]}),
        (nl.Sequential(lin), lambda k: {"layers": [m.init(q) for m, q in zip(lin, split(k, 2))]}),
        (nl.SoftmaxHead(4, 3), nl.Linear(4, 3).init),
        (nl.RNN(cell), cell.init),
        (nl.Remat(nl.FFN(4, (8,), 3)), nl.FFN(4, (8,), 3).init),
    ]
    got, want = jax.jit(lambda k: ([m.init(k) for m, _ in cases], [f(k) for _, f in cases]))(key)
    for (module, _), g, w in zip(cases, got, want, strict=True):
        assert [p for p, _ in g.items()] == [p for p, _ in nl.ParamsDict(w).items()], module
        jax.tree.map(np.testing.assert_array_equal, g, nl.ParamsDict(w))


def split(key, n):
    return jax.random.split(key, n)


class Wrapper(nl.Module):
    """A layer with one child whose params are its own (params_of), here a stateful one."""

    params_of = "inner"

    def setup(self):
        self.inner = nl.Sequential([nl.Linear(3, 4), nl.BatchNorm(4), nl.Dropout(0.5)])

    def __call__(self, params, x):
        return self.inner(params, x)


class Lone(nl.Module):
    def setup(self):
        self.mlp = nl.FFN(3, (4,), 2)

    def __call__(self, params, x):
        return self.mlp(params.mlp, x)


def test_a_lone_child_takes_the_key_and_params_of_unnests_a_child(key):
    lone, wrapped = jax.jit(lambda k: (Lone().init(k), Wrapper().init(k)))(key)
    jax.tree.map(np.testing.assert_array_equal, lone.mlp, nl.FFN(3, (4,), 2).init(key))
    model = Wrapper()
    inner = model.inner.init(key)
    assert [p for p, _ in wrapped.items()] == [
        "/layers[0]/W",
        "/layers[0]/b",
        "/layers[1]/scale",
        "/layers[1]/bias",
    ]
    jax.tree.map(np.testing.assert_array_equal, wrapped, inner)
    # key, state and axes are derived from the child, found at the params' root
    assert model.uses_key and model.init_state() == model.inner.init_state()
    assert nl.param_axes(model).layers[0].W == nl.Axes(("in", "out"))
    x = jnp.arange(6.0).reshape(2, 3)
    paths = []

    def record(call):
        paths.append(call.path)
        return call.run(*call.args, **call.kwargs)

    with nl.layer_hook(record):
        out, state = model(wrapped, x, state=model.init_state(), train=True, key=key)
    k = jax.random.fold_in(key, 0)  # the key a child called without key= draws first
    want, want_state = model.inner(inner, x, state=model.init_state(), train=True, key=k)
    np.testing.assert_array_equal(out, want)
    jax.tree.map(np.testing.assert_array_equal, state, want_state)
    assert paths == ["", "inner", "inner.layers[0]", "inner.layers[1]"]


def test_params_of_must_name_the_one_child_with_params(key):
    class Missing(nl.Module):
        params_of = "fc"

        def setup(self):
            self.lin = nl.Linear(2, 2)

    class Listed(Missing):
        def setup(self):
            self.fc = [nl.Linear(2, 2)]

    class Two(Missing):
        def setup(self):
            self.fc, self.other = nl.Linear(2, 2), nl.Linear(2, 2)

    for module, why in [(Missing, r"no such module \(children: lin\)"),
                        (Listed, r"no such module \(children: fc\)"),
                        (Two, r"also other hold params \(children: fc, other\)")]:  # fmt: skip
        name = module.__name__
        with pytest.raises(TypeError, match=f"{name}.params_of = 'fc' must name .*; {why}"):
            module().init(key)


def test_sequential_needs_a_layer_and_may_have_no_params(key):
    with pytest.raises(ValueError, match="Sequential: layers is empty; give at least one layer"):
        nl.Sequential([])
    net = nl.Sequential([nl.Activation("tanh"), nl.Flatten(2)])
    x = jnp.ones((2, 3, 4))
    assert net(net.init(key), x).shape == (2, 12)
    assert net(nl.ParamsDict(layers=[{}, {}]), x).shape == (2, 12)  # the layout before
