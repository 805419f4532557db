"""Sharded strategies (fsdp, tensor): layers' logical axes, where each leaf goes, bytes per
device, and training equal to one device on 8 host devices and on 2 processes x 4."""

import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    assert_close_f32,
    assert_same_trajectory,
    first_step_grads,
    max_abs_diff,
)
from jax.sharding import PartitionSpec as P
from test_train import assert_same_training, grads_and_trajectory

import nnlite as nl
from train import memory, parallel
from train.build import build, init_program, prepare
from train.config import ConfigError, load_config

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


def test_fsdp_run_keeps_params_and_both_adam_moments_split_8_ways(npz):
    cfg = load_config(
        ROOT / "configs/digits_mlp.yaml",
        [npz, "data.name=npz", "model.hidden_sizes=[64]", "parallel.strategy=fsdp", ALL_LEAVES],
    )
    r = build(cfg)
    idx = np.arange(cfg.train.batch_size, dtype=np.int32)[None]
    prep = prepare(r, "stop", idx)
    st = prep.stepper
    # init creates the state sharded: its outputs already carry the plan's shardings
    p_init, o_init = init_program(r.model, r.optimizer, r.strategy.init_shardings())(cfg.seed)
    p, o, _ = st.run(
        st.put_state(jax.tree.leaves(prep.params0)),
        st.put_state(jax.tree.leaves(prep.opt0)),
        prep.X,
        prep.Y,
        st.put_indices(idx),
    )
    params = jax.tree.unflatten(prep.p_def, p)
    opt = jax.tree.unflatten(prep.o_def, o)
    mu, nu = (jax.tree.leaves(optax_get(opt, k)) for k in ("mu", "nu"))
    for tree in (params, p_init):
        w = tree.ffn.layers[0].W  # [8, 64]: split along 64
        assert w.sharding.spec == P(None, "data")
        assert {s.data.shape for s in w.addressable_shards} == {(8, 8)}
    for got, leaves in (("params", p), ("mu", mu), ("nu", nu), ("init", jax.tree.leaves(p_init))):
        specs = [v.sharding.spec for v in leaves]
        # every leaf with a dimension that 8 divides is split 8 ways; the head's 4 classes not
        assert specs == [P(None, "data"), P("data"), P("data"), P()], (got, specs)
    counts = optax.tree_utils.tree_get_all_with_path(opt, "count")  # adam's and the schedule's
    assert counts and all(v.sharding.spec == P() for _, v in counts)
    full = sum(np.asarray(v).nbytes for v in jax.tree.leaves((prep.params0, prep.opt0)))
    per_device = sum(r.strategy.bytes_per_device(t) for t in (prep.params0, prep.opt0))
    assert per_device < full / 6  # 1/8 but for the head's bias and Adam's step count


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
# (config, overrides, layers on the longest path: the rounding bound of tests/_tolerance.py)
MODELS = {
    # hidden 64: the Megatron pair (ffn column-parallel, head row-parallel); manual rules
    "mlp": (
        "configs/digits_mlp.yaml",
        ["data.name=npz", "model.hidden_sizes=[64]", "loss.grad=manual"],
        4,
    ),
    "cnn": (
        "configs/mnist1d_cnn.yaml",
        ["data.name=digits", "model.channels=[4, 8]", "model.kernel_size=3", "checkpoint.every=0"],
        7,
    ),
    "user": (
        "configs/digits_mlp.yaml",
        ["data.name=npz", "model={name: 'test_sharding:UserNet'}"],
        8,
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_training_equals_one_device(tmp_path, name, npz):
    config, overrides, layers = MODELS[name]
    common = [npz, *overrides, ALL_LEAVES]
    ref = grads_and_trajectory(
        tmp_path, config, *common, "parallel.strategy=none", "name=ref", steps=6
    )
    init = ref[1].model.init(jax.random.key(ref[1].cfg.seed))
    assert max_abs_diff(ref[1].params, init) > 1e-3  # training moved the params
    for i, layout in enumerate(LAYOUTS):
        got = grads_and_trajectory(tmp_path, config, *common, *layout, f"name=s{i}", steps=6)
        assert len(got[1].devices) == 8
        assert_same_training(got, ref, ROUNDINGS_PER_LAYER * layers, f"{name} {layout}: ")


def test_sharded_gpt_with_manual_rules_equals_one_device(tmp_path):
    from _tolerance import SAME_PROGRAMS
    from test_gpt import tiny_run

    def grads_and_run(*overrides, name):
        common = [*overrides, *SAME_PROGRAMS, ALL_LEAVES, "checkpoint.every=0"]
        one = tiny_run(tmp_path, *common, "train.steps=1", name=name)
        return first_step_grads(one), tiny_run(tmp_path, *common, "train.steps=6", name=name)

    ref = grads_and_run("parallel.strategy=none", name="ref")
    assert ref[1].cfg.loss.grad == "manual"  # the shipped config's hand rules
    for i, layout in enumerate(LAYOUTS):
        got = grads_and_run(*layout, name=f"s{i}")
        assert_close_f32(got[0], ref[0], ops=ROUNDINGS_PER_LAYER * 16, what=f"{layout}: ")
        assert_same_trajectory(got[1].params, ref[1].params, lr=ref[1].cfg.optimizer.learning_rate)


def test_two_processes_fsdp_with_tensor_equal_one_device(tmp_path, npz):
    from test_distributed import cli, env_with_devices

    from train import checkpoint as ckpt

    steps = [npz, "train.steps=6", "train.log_every=3", "train.eval_every=6", "loss.grad=manual"]
    steps += ["model.hidden_sizes=[64]", ALL_LEAVES, "checkpoint.every=1", "checkpoint.keep=6"]
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
        assert [ckpt.step_of(p) for p in paths] == [1, 2, 3, 4, 5, 6]
        _, opt1, _ = ckpt.restore(paths[0], ref.params, ref.opt_state)
        grads = jax.tree.map(lambda m: np.asarray(m, np.float64) / 0.1, optax_get(opt1, "mu"))
        return grads, ckpt.restore(paths[-1], ref.params, ref.opt_state)[0]

    (grads, params), (ref_grads, ref_params) = saved(tmp_path / "multi"), saved(ref.run_dir)
    assert_close_f32(grads, ref_grads, ops=ROUNDINGS_PER_LAYER * 4)  # linear, relu, linear, loss
    assert max_abs_diff(ref_params, ref.model.init(jax.random.key(0))) > 1e-3
    assert_same_trajectory(params, ref_params, lr=ref.cfg.optimizer.learning_rate)
