"""Sharded strategies (fsdp, tensor): layers' logical axes, where each leaf goes, bytes per
device, and training equal to one device on 8 host devices and on 2 processes x 4."""

import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _common import TINY_GPT
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    assert_close_f32,
    assert_same_trajectory,
    max_abs_diff,
)
from jax.sharding import PartitionSpec as P

import nnlite as nl
from train import parallel
from train.config import ConfigError, load_config
from train.data.dataset import make_sampler
from train.loop import memory
from train.loop.build import build, init_program, make_stepper

ROOT = Path(__file__).resolve().parents[1]
# Every sharded layout of 8 devices: FSDP over 8, tensor parallelism in pairs with the
# batch over 4, and both. Tiny models: shard every leaf that divides, whatever its size.
LAYOUTS = [
    ["parallel.strategy=fsdp"],
    ["parallel.strategy=tensor", "parallel.tensor=2"],
    ["parallel.strategy=fsdp", "parallel.tensor=2"],
]
ALL_LEAVES = "parallel.fsdp_min_bytes=0"


# -- a user's own layer declares its axes ------------------------------------------------
class GatedMLP(nl.Module):
    """A user's layer with params of its own: ``relu(x W_in) * (x W_gate)`` then ``W_out``,
    declared Megatron-style (both inputs column-parallel, the output row-parallel)."""

    features: int
    hidden: int

    def init(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        normal = lambda k, a, b: jax.random.normal(k, (a, b)) / np.sqrt(a)  # noqa: E731
        return nl.ParamsDict(
            W_in=normal(k1, self.features, self.hidden),
            W_gate=normal(k2, self.features, self.hidden),
            W_out=normal(k3, self.hidden, self.features),
        )

    def param_axes(self):
        return nl.ParamsDict(
            W_in=nl.Axes(("embed", "mlp")),
            W_gate=nl.Axes(("embed", "mlp")),
            W_out=nl.Axes(("mlp", "embed")),
        )

    def __call__(self, params, x, *, key=None):
        return (jax.nn.relu(x @ params.W_in) * (x @ params.W_gate)) @ params.W_out


class Undeclared(nl.Module):
    """A layer that says nothing about its axes: the strategies' fallback rule places it."""

    in_features: int
    out_features: int

    def init(self, key):
        return nl.ParamsDict(M=jax.random.normal(key, (self.in_features, self.out_features)) * 0.1)

    def __call__(self, params, x, *, key=None):
        return x @ params.M


class UserNet(nl.Module):
    """``model.name=test_sharding:UserNet``: a user's model of both kinds of layer."""

    in_features: int
    num_classes: int
    width: int = 16

    task = "classification"

    @property
    def inp(self):
        return Undeclared(self.in_features, self.width)

    @property
    def block(self):
        return GatedMLP(self.width, 4 * self.width)

    @property
    def head(self):
        return nl.Linear(self.width, self.num_classes)

    def init(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return nl.ParamsDict(
            inp=self.inp.init(k1), block=self.block.init(k2), head=self.head.init(k3)
        )

    def param_axes(self):
        return nl.ParamsDict(
            inp=nl.param_axes(self.inp),
            block=nl.param_axes(self.block),
            head=nl.param_axes(self.head),
        )

    def __call__(self, params, x, *, key=None):
        h = jnp.tanh(self.inp(params.inp, x))
        h = h + self.block(params.block, h)
        return self.head(params.head, h)


def test_layers_declare_megatron_axes_and_undeclared_layers_get_unnamed_ones():
    block = nl.param_axes(nl.TransformerBlock(8, num_heads=2))
    assert block.attn.qkv.W == ("embed", "qkv") and block.attn.out.W == ("heads", "embed")
    assert block.mlp.fc.W == ("embed", "mlp") and block.mlp.proj.W == ("mlp", "embed")
    assert block.mlp.fc.b == ("mlp",) and block.ln1.scale == ("norm",)
    assert nl.param_axes(nl.Embedding(10, 4)).W == ("vocab", "embed")
    assert nl.param_axes(nl.Conv(3, 4, (5,))).W == ("kernel", "in", "out")
    ffn = nl.param_axes(nl.FFN(4, (8, 8), 2))  # Megatron pairs: column, row, column
    assert [layer.W for layer in ffn.layers] == [
        ("embed", "mlp"),
        ("mlp", "embed"),
        ("embed", "mlp"),
    ]
    user = nl.param_axes(UserNet(8, 4))
    assert user.block.W_out == ("mlp", "embed") and user.inp.M == (None, None)
    assert isinstance(user.inp.M, nl.Axes)  # a pytree leaf, not a tuple node
    assert jax.tree.structure(user) == jax.tree.structure(UserNet(8, 4).init(jax.random.key(0)))


def test_a_wrong_declaration_names_the_param():
    class Wrong(GatedMLP):
        def param_axes(self):
            return nl.ParamsDict(
                W_in=nl.Axes(("embed",)), W_gate=nl.Axes((None, None)), W_out=nl.Axes((None, None))
            )

    with pytest.raises(
        ValueError,
        match=r"Wrong.param_axes\(\): \['W_in'\] is Axes\('embed'\), expected an Axes of 2 names",
    ):
        nl.param_axes(Wrong(4, 8))


def test_placement_rules_split_by_logical_axes_then_the_largest_dimension():
    devices = jax.devices()[:8]
    fsdp = parallel.strategy_class("fsdp")(devices, tensor=2, min_bytes=64)
    both = lambda shape, axes=None: fsdp.spec(jax.ShapeDtypeStruct(shape, jnp.float32), axes)  # noqa: E731
    assert (fsdp.data, fsdp.tensor) == (4, 2)
    assert both((16, 64), ("embed", "mlp")) == P("data", "model")  # column-parallel
    assert both((64, 16), ("mlp", "embed")) == P("model", "data")  # row-parallel
    assert both((16, 64)) == P(None, "data")  # undeclared: FSDP's largest dimension
    assert both((65, 16), ("vocab", "embed")) == P(None, "data")  # 65 rows do not split
    assert both((4,)) == P()  # under min_bytes: whole on every device
    assert both(()) == P()
    tensor = parallel.strategy_class("tensor")(devices, tensor=2)
    assert tensor.spec(jax.ShapeDtypeStruct((16, 64), jnp.float32), ("embed", "mlp")) == P(
        None, "model"
    )
    fsdp8 = parallel.strategy_class("fsdp")(devices, min_bytes=0)
    placed = fsdp8.put_state([np.arange(48.0).reshape(3, 16), np.float32(2.5)])
    assert placed[0].sharding.spec == P(None, "data") and placed[1].sharding.spec == P()
    np.testing.assert_array_equal(
        np.asarray(fsdp8.get_state(placed)[0]), np.arange(48.0).reshape(3, 16)
    )
    assert fsdp8.bytes_per_device([jax.ShapeDtypeStruct((3, 16), jnp.float32)]) == 3 * 2 * 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.strategy=shard_map", "parallel.tensor=2"],
            r"parallel.tensor=2 needs a strategy that shards params over a mesh \(tensor or fsdp\); parallel.strategy=shard_map",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.tensor=3"],
            r"parallel.tensor=3 does not divide the 8 devices",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.tensor=2", "train.batch_size=66"],
            r"train.batch_size=66 does not split across the data axis of 4 devices .*64 or 68",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.tensor=0"],
            r"parallel.tensor must be a positive int, got 0",
        ),
    ],
)
def test_bad_sharding_config_names_the_key(tmp_path, overrides, message, npz):
    with pytest.raises(ConfigError, match=message):
        build(load_config(ROOT / "configs/digits_mlp.yaml", [npz, "data.name=npz", *overrides]))


def optax_get(tree, key):
    return optax.tree_utils.tree_get(tree, key)


def test_a_model_too_big_to_replicate_fits_under_fsdp(monkeypatch, npz):
    # shapes only: nothing is allocated. 2**27 floats of params (512 MiB), 2 GiB per
    # replica with gradients and Adam's moments: 8 replicas need 16 GiB, FSDP a share.
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 12 * 2**30)
    big = [npz, "data.name=npz", "model.hidden_sizes=[16777216]", "train.batch_size=8"]
    with pytest.raises(ConfigError, match="params, gradients and optimizer state"):
        build(load_config(ROOT / "configs/digits_mlp.yaml", [*big, "parallel.strategy=shard_map"]))
    r = build(load_config(ROOT / "configs/digits_mlp.yaml", [*big, "parallel.strategy=fsdp"]))
    est = memory.estimate(r.cfg, r.model, r.optimizer, r.data, r.strategy)
    assert est.total < 12 * 2**30


# -- equal to one device -----------------------------------------------------------------
def train_steps(config, overrides, steps=6):
    """``steps`` Adam steps of ``config`` by its strategy's compiled step (what the loop
    calls, without the loop's evaluation and run directory): ``(first step's gradient,
    params after steps, the placed state after them, the init's placed params, run)``."""
    cfg = load_config(ROOT / config, [*overrides, "log.progress=false", "log.plot=false"])
    r = build(cfg)
    init = init_program(r.model, r.optimizer, r.strategy.init_shardings())(np.int32(cfg.seed))
    p_def, o_def = (jax.tree.structure(t) for t in init)
    st = make_stepper(r, p_def, o_def, "stop")
    p, o = (st.put_state(jax.tree.leaves(t)) for t in init)
    p_init = jax.tree.unflatten(p_def, [np.asarray(v) for v in st.get_state(p)])
    X, Y = st.put_data(r.data.x), st.put_data(r.data.y)
    sampler = make_sampler(cfg.seed, r.data, cfg.train.batch_size)
    for step in range(steps):
        p, o, _, _ = st.run(p, o, [], X, Y, st.put_indices(sampler.batches(step, 1), step))
        if step == 0:  # Adam's first moment after one step: (1 - b1) * grad
            mu = optax_get(jax.tree.unflatten(o_def, st.get_state(o)), "mu")
            grads = jax.tree.map(lambda m: np.asarray(m, np.float64) / (1 - 0.9), mu)
    params = jax.tree.unflatten(p_def, [np.asarray(v) for v in st.get_state(p)])
    return grads, params, (p, o), p_init, r


# (config, overrides, layers on the longest path: the rounding bound of tests/_tolerance.py,
# layouts). The CNN (no tensor-parallel axes: whole along "model") and the user's model
# take the layout that exercises both rules at once, to keep the suite's time.
MODELS = {
    # hidden 64: a Megatron pair (the ffn column-parallel, the head row-parallel), by the
    # hand rules of loss.grad=manual inside the sharded jit
    "mlp": (
        "configs/digits_mlp.yaml",
        ["data.name=npz", "model.hidden_sizes=[64]", "loss.grad=manual"],
        4,
        # fsdp alone (and its per-leaf shardings) and tensor alone (the Megatron pair); the
        # two at once by hand rules is the gpt's layout below
        LAYOUTS[:2],
    ),
    "cnn": (
        "configs/mnist1d_cnn.yaml",
        ["data.name=npz", "model.channels=[4, 8]", "model.kernel_size=3", "train.batch_size=64"],
        7,
        LAYOUTS[2:],
    ),
    "user": (
        "configs/digits_mlp.yaml",
        ["data.name=npz", "model={name: 'test_sharding:UserNet'}"],
        8,
        LAYOUTS[2:],
    ),
    # the shipped config's hand rules (loss.grad=manual) inside the sharded jit; dropout
    # masks drawn for the global batch, as on one device
    "gpt": (
        "configs/shakespeare_gpt.yaml",
        [*TINY_GPT, "data.eval_windows=16", "optimizer.warmup_steps=2", "model.dropout=0.1"],
        16,
        # fsdp and tensor at once: both placement rules on the GPT's leaves (fsdp alone and
        # tensor alone: the mlp's)
        LAYOUTS[2:],
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_training_equals_one_device(tmp_path, name, npz):
    config, overrides, layers, layouts = MODELS[name]
    common = [npz, f"log.dir={tmp_path}", *overrides, ALL_LEAVES]
    if name == "gpt":
        from test_gpt import text_file

        common.append(f"data.path={text_file(tmp_path)}")
    grads, params, _, init, ref = train_steps(config, [*common, "parallel.strategy=none"])
    assert max_abs_diff(params, init) > 1e-3  # training moved the params
    lr = ref.cfg.optimizer.learning_rate
    for layout in layouts:
        got = train_steps(config, [*common, *layout])
        what = f"{name} {' '.join(layout)}: "
        assert len(got[4].devices) == 8
        # created sharded, the same values (threefry's partitionable keys)
        np.testing.assert_array_equal(
            *(np.concatenate([np.ravel(v) for v in jax.tree.leaves(t)]) for t in (got[3], init))
        )
        assert_close_f32(got[0], grads, ops=ROUNDINGS_PER_LAYER * layers, what=what)
        assert_same_trajectory(got[1], params, lr=lr, what=what)
        if name == "mlp" and layout == LAYOUTS[0]:
            check_fsdp_shardings(*got[2], got[4])


def check_fsdp_shardings(p, o, r):
    """The per-leaf shardings a fsdp run's step leaves: params and both Adam moments split
    8 ways wherever 8 divides a dimension, Adam's step count whole."""
    p_avals = jax.eval_shape(r.model.init, jax.random.key(0))
    params = jax.tree.unflatten(jax.tree.structure(p_avals), p)
    opt = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(r.optimizer.init, p_avals)), o)
    for what, tree in (
        ("params", params),
        ("mu", optax_get(opt, "mu")),
        ("nu", optax_get(opt, "nu")),
    ):
        specs = [v.sharding.spec for v in jax.tree.leaves(tree)]
        # ffn W [8, 64] and b [64], head W [64, 4] split along 64; the head's 4 biases whole
        assert specs == [P(None, "data"), P("data"), P("data"), P()], (what, specs)
        w = tree.ffn.layers[0].W
        assert {s.data.shape for s in w.addressable_shards} == {(8, 8)} and len(
            w.addressable_shards
        ) == 8
    counts = optax.tree_utils.tree_get_all_with_path(opt, "count")  # adam's and the schedule's
    assert counts and all(v.sharding.spec == P() for _, v in counts)
    per_device = r.strategy.bytes_per_device([*p, *o])
    assert per_device < sum(v.nbytes for v in [*p, *o]) / 6  # 1/8 but for biases and counts


def test_two_processes_fsdp_with_tensor_equal_one_device(tmp_path, npz):
    from test_distributed import cli, env_with_devices

    from train.checkpoint import store as ckpt

    steps = [npz, "train.steps=3", "train.log_every=3", "train.eval_every=3", "loss.grad=manual"]
    steps += ["model.hidden_sizes=[64]", ALL_LEAVES, "checkpoint.every=1", "checkpoint.keep=3"]
    par = ["parallel.strategy=fsdp", "parallel.tensor=2", "parallel.devices=4"]
    proc = subprocess.run(
        [*cli(tmp_path, *steps, *par, "name=multi"), "--processes", "2"],
        cwd=ROOT,
        env=env_with_devices(4),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "devices: 2 processes x 4 x cpu (fsdp, mesh data 4 x model 2)" in proc.stdout
    assert "per device" in proc.stdout
    from test_distributed import in_process

    ref = in_process(tmp_path, *steps, "parallel.strategy=none", "name=ref")

    def saved(run_dir):  # the first step's gradient and the final params of a run
        paths = ckpt.list_checkpoints(run_dir / "checkpoints")
        assert [ckpt.step_of(p) for p in paths] == [1, 2, 3]
        _, opt1, _, _ = ckpt.restore(paths[0], ref.params, ref.opt_state)
        grads = jax.tree.map(lambda m: np.asarray(m, np.float64) / 0.1, optax_get(opt1, "mu"))
        return grads, ckpt.restore(paths[-1], ref.params, ref.opt_state)[0]

    (grads, params), (ref_grads, ref_params) = saved(tmp_path / "multi"), saved(ref.run_dir)
    assert_close_f32(grads, ref_grads, ops=ROUNDINGS_PER_LAYER * 4)  # linear, relu, linear, loss
    assert max_abs_diff(ref_params, ref.model.init(jax.random.key(0))) > 1e-3
    assert_same_trajectory(params, ref_params, lr=ref.cfg.optimizer.learning_rate)


def test_fsdp_resume_is_bit_identical_and_restores_onto_another_mesh(tmp_path, npz):
    import shutil

    from test_train import run

    from train.checkpoint import store as ckpt

    common = [npz, "data.name=npz", "model.hidden_sizes=[64]", ALL_LEAVES, "train.log_every=3"]
    common += ["train.eval_every=3", "checkpoint.every=3", "parallel.strategy=fsdp"]
    common.append("train.steps=6")
    mlp = "configs/digits_mlp.yaml"
    whole = run(tmp_path, mlp, *common, "parallel.tensor=2", "name=whole")
    # a crash right after the step-3 checkpoint (written on the (4, 2) mesh): copies of the
    # run without the later checkpoint, resumed
    last = ckpt.list_checkpoints(whole.run_dir / "checkpoints")[-1]
    assert last.name == "ckpt_00000006.shards"  # sharded state: one file per shard
    for name in ("split", "moved", "one"):
        shutil.copytree(whole.run_dir, tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / last.name)
    resumed = run(tmp_path, mlp, *common, "parallel.tensor=2", "name=split", resume="require")
    assert resumed.step == 6 and max_abs_diff(resumed.params, whole.params) == 0.0
    # continued on another mesh of fewer devices, (4, 1), and on one device with no
    # strategy (the shards read back whole): the same training to float rounding
    lr = whole.cfg.optimizer.learning_rate
    for name, strategy in (("moved", ["parallel.devices=4"]), ("one", ["parallel.strategy=none"])):
        other = run(tmp_path, mlp, *common, *strategy, f"name={name}", resume="require")
        assert other.step == 6
        assert_same_trajectory(other.params, whole.params, lr=lr, what=f"{name}: ")


def test_the_finiteness_check_finds_a_nan_on_any_device_in_one_program():
    """The checkpoint's check of sharded params (``finite_on_devices``): one compiled
    program over every leaf where it is placed, a NaN held by the last device only found
    in its leaf and no other, replicated and host-shaped leaves checked too."""
    from jax.sharding import NamedSharding

    from train.parallel.finite import finite_flags, finite_on_devices

    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    specs = [P("data"), P(None, "model"), P("data", "model"), P()]
    leaves = []
    for i in range(24):
        a = np.full((8, 4), float(i), np.float32)
        leaves.append(jax.device_put(a, NamedSharding(mesh, specs[i % 4])))
    bad = 14  # P("data", "model"): its [-1, -1] element lives on the mesh's last device
    a = np.array(leaves[bad])
    a[-1, -1] = np.nan
    leaves[bad] = jax.device_put(a, leaves[bad].sharding)
    shards = leaves[bad].addressable_shards
    (last,) = {s.device for s in shards if (s.index[0].start, s.index[1].start) == (6, 2)}
    assert last == mesh.devices[-1, -1] and last != jax.devices()[0]

    before = finite_flags._cache_size()
    flags = finite_on_devices(leaves)
    assert flags.tolist() == [i != bad for i in range(24)]
    assert finite_flags._cache_size() == before + 1  # one program for the whole tree
    assert finite_on_devices(leaves[:bad] + leaves[bad + 1 :]).all()
    assert finite_on_devices([]).shape == (0,)
