"""The ``cnn`` model: shapes, training, parallel equality, show_jaxpr, config errors."""

import json
import re
from pathlib import Path

import _jaxpr_sweep as sweep
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import ROUNDINGS_PER_LAYER, max_abs_diff
from test_train import assert_same_training, grads_and_trajectory, run

import nnlite as nl
from models.cnn import CNN, conv_length, conv_lengths
from train.__main__ import main
from train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/mnist1d_cnn.yaml"
# digits (x [n, 64]) as 64-long sequences: loads in a blink, unlike generating MNIST-1D.
TINY = [
    "data.name=digits",
    "model.channels=[4, 6]",
    "model.kernel_size=3",
    "train.batch_size=64",
    "train.steps=6",
    "train.eval_every=6",
    "train.log_every=2",
    "train.steps_per_call=1",
    "checkpoint.every=0",
]


@pytest.mark.parametrize("padding", [0, 1, 2, "SAME", "VALID"])
@pytest.mark.parametrize("length, kernel, stride", [(40, 5, 2), (19, 3, 2), (7, 3, 3), (5, 5, 1)])
def test_conv_length_is_what_conv_computes(key, length, kernel, stride, padding):
    conv = nl.Conv(1, 2, kernel, strides=stride, padding=padding)
    # the shape conv computes, traced (no program compiled for each of the 20 cases)
    x = jax.ShapeDtypeStruct((3, length, 1), jnp.float32)
    out = jax.eval_shape(conv, jax.eval_shape(conv.init, key), x)
    assert out.shape == (3, conv_length(length, kernel, stride, padding), 2)


def test_cnn_shapes_params_and_channels_input(key):
    model = CNN((40,), 10)
    assert model.lengths == (19, 10, 5)  # the paper's ConvBase: a 125-feature linear head
    p = jax.jit(model.init)(key)  # jitted: one compile each, not one per op
    forward = jax.jit(model)
    shapes = {path: leaf.shape for path, leaf in p.items()}
    assert shapes["/convs[0]/W"] == (5, 1, 25) and shapes["/convs[2]/W"] == (3, 25, 25)
    assert shapes["/head/W"] == (125, 10) and shapes["/head/b"] == (10,)
    x = jax.random.normal(key, (7, 40))
    logits = forward(p, x)
    assert logits.shape == (7, 10)
    # [batch, length] is one channel: the same as [batch, length, 1].
    np.testing.assert_array_equal(logits, forward(p, x[..., None]))
    # Several input channels: x [batch, length, channels] (its shapes, traced).
    multi = CNN.from_convs((12, 3), ((4, 3, 1, "SAME"),), 5)
    x3 = jax.ShapeDtypeStruct((2, 12, 3), jnp.float32)
    assert jax.eval_shape(multi, jax.eval_shape(multi.init, key), x3).shape == (2, 5)
    # Under vmap, one example at a time gives the batched logits.
    single = jax.jit(jax.vmap(lambda xi: model(p, xi[None])[0]))(x)
    np.testing.assert_allclose(single, logits, rtol=1e-5, atol=1e-6)


def test_cnn_matches_a_numpy_forward(key):
    model = CNN.from_convs((9, 2), ((3, 3, 2, 1), (2, 2, 1, 0)), 4)
    p = jax.jit(model.init)(key)
    x = np.asarray(jax.random.normal(jax.random.key(1), (5, 9, 2)))

    def conv(h, W, b, stride, pad):
        h = np.pad(h, ((0, 0), (pad, pad), (0, 0)))
        k = W.shape[0]
        n = (h.shape[1] - k) // stride + 1
        cols = np.stack([h[:, i * stride : i * stride + k] for i in range(n)], 1)
        return np.einsum("blkc,kco->blo", cols, W) + b

    h = x
    for lp, (_, _, s, pad) in zip(p.convs, model.conv_specs):
        h = np.maximum(conv(h, np.asarray(lp.W), np.asarray(lp.b), s, pad), 0)
    want = h.reshape(5, -1) @ np.asarray(p.head.W) + np.asarray(p.head.b)
    np.testing.assert_allclose(jax.jit(model)(p, x), want, rtol=1e-5, atol=1e-5)


def test_cnn_rejects_a_stack_that_shrinks_to_nothing():
    assert conv_lengths(8, ((4, 5, 2, 0), (4, 5, 2, 0))) == (2, 0)
    with pytest.raises(ValueError, match=r"sequence of length 8 to lengths \[2, 0\]"):
        CNN.from_convs((8,), ((4, 5, 2, 0), (4, 5, 2, 0)), 3)


def test_cnn_trains_in_process(tmp_path):
    sets = ["train.steps=40", "train.eval_every=40", "optimizer.learning_rate=0.02"]
    r = run(tmp_path, CONFIG, *TINY, *sets)
    lines = (r.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train_losses = [x["loss"] for x in records if x["split"] == "train"]
    evals = [x for x in records if x["split"] == "test"]
    assert train_losses[-1] < 0.5 * train_losses[0]
    assert evals[-1]["accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_cnn_strategies_match_one_device(tmp_path):
    ref = grads_and_trajectory(
        tmp_path, CONFIG, *TINY, "parallel.strategy=none", "name=ref", steps=6
    )
    init = ref[1].model.init(jax.random.key(ref[1].cfg.seed))
    assert max_abs_diff(ref[1].params, init) > 1e-3  # training moved the params
    # one device count per strategy (the MLP's test takes the others)
    for strategy, n in [("pmap", 4), ("shard_map", 8)]:
        par = [f"parallel.strategy={strategy}", f"parallel.devices={n}", f"name={strategy}{n}"]
        got = grads_and_trajectory(tmp_path, CONFIG, *TINY, *par, steps=6)
        assert len(got[1].devices) == n
        # 7 layers: 2 x (conv, relu), flatten, linear, loss
        assert_same_training(got, ref, ROUNDINGS_PER_LAYER * 7, f"{strategy} x {n}: ")


@pytest.mark.parametrize(
    "what, overrides",
    [
        ("loss", []),
        ("step", []),
        ("step", ["parallel.strategy=shard_map", "train.steps_per_call=2"]),
        # sharding constraints (the gathered params, the gradients' shards), grad's reshard
        ("step", ["parallel.strategy=fsdp", "parallel.tensor=2", "parallel.fsdp_min_bytes=0"]),
    ],
)
def test_show_jaxpr_roundtrips(what, overrides):
    from train.loop.show import traced_function

    cfg = load_config(ROOT / CONFIG, [*TINY, *overrides])
    f, args = traced_function(cfg, what)
    # what python -m train --show-jaxpr prints (train.loop.show.show_jaxpr is this line;
    # tests/test_show_jaxpr.py and tests/test_your_model.py run it and the CLI)
    text = nl.show_jaxpr(f, *args, name=what)
    assert "conv_general_dilated" in text
    assert ("jax.lax.with_sharding_constraint(" in text) == ("parallel.strategy=fsdp" in overrides)
    g = nl.roundtrip(f, *args, name=what)
    leaves = jax.tree.leaves(args)
    # the printed step traces to the original's program (JAX's text of both, every parameter
    # and constant, function names aside: tests/_jaxpr_sweep.py), so it computes the same
    # outputs bit for bit; the loss (and any step whose program differs) runs both
    same = sweep._program(jax.make_jaxpr(f)(*args)) == sweep._program(jax.make_jaxpr(g)(*leaves))
    if what == "loss" or not same:
        copy = lambda a: jax.tree.map(jnp.copy, a)  # the step donates its state
        want = jax.tree.leaves(f(*copy(args)))
        got = jax.tree.leaves(g(*jax.tree.leaves(copy(args))))
        for w, o in zip(want, got, strict=True):
            np.testing.assert_allclose(np.asarray(o), np.asarray(w), rtol=1e-6, atol=1e-6)
    assert nl.show_jaxpr(g, *leaves, name=what) == text


def test_show_jaxpr_prints_max_pool_gradients():
    # The gradient of a max pool is select_and_scatter_add, whose select_prim parameter is a
    # primitive: it prints as prims.ge_p and round-trips.
    pool = nl.MaxPool(2, strides=2)
    x = jnp.sin(jnp.arange(24.0)).reshape(2, 6, 2)
    f = jax.grad(lambda x: jnp.sum(pool(nl.ParamsDict(), x) ** 2))
    text = nl.show_jaxpr(f, x)
    assert "select_prim=prims.ge_p" in text
    np.testing.assert_allclose(nl.roundtrip(f, x)(x), f(x), rtol=1e-6)


def cli_error(capsys, tmp_path, *sets):
    # log.plot=false: no live-plot process to start and stop for a run that never begins
    argv = [
        "--config",
        str(ROOT / CONFIG),
        "--set",
        f"log.dir={tmp_path}",
        "--set",
        "log.plot=false",
    ]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "mnist1d_cnn").exists()  # nothing written for bad input
    return err


@pytest.mark.parametrize(
    "sets, message",
    [
        (["model.channels=[]"], r"model.channels must be a non-empty list of positive ints"),
        (["model.channels=[25, 0]"], r"model.channels must be .* got \[25, 0\]"),
        (
            ["model.kernel_size=[5, 3]"],
            r"model.kernel_size has 2 entries but channels has 3 layers",
        ),
        (["model.kernel_size=0"], r"model.kernel_size must be >= 1, got 0 \(layer 0\)"),
        (["model.strides=[2, 0, 2]"], r"model.strides must be >= 1, got 0 \(layer 1\)"),
        (["model.padding=-1"], r"model.padding must be >= 0, got -1"),
        (["model.padding=FULL"], r"model.padding 'FULL' is not one of SAME, VALID"),
        (["model.channels=abc"], r"model.channels: expected list of int, got 'abc'"),
    ],
)
def test_bad_cnn_config(capsys, tmp_path, sets, message):
    err = cli_error(capsys, tmp_path, *sets)
    assert re.search(message, err), err


def test_conv_stack_too_deep_for_the_data_is_a_config_error(capsys, tmp_path):
    # MNIST-1D's 40 samples through kernel 5, stride 4, no padding: 9, 2, then nothing.
    sets = ["model.kernel_size=5", "model.strides=4", "model.padding=0", "data.num_samples=200"]
    err = cli_error(capsys, tmp_path, *sets)
    assert "model.kernel_size/model.strides/model.padding" in err and "length 40" in err, err
    assert "[9, 2, 0]" in err, err
    with pytest.raises(ConfigError, match="conv layers of channels"):
        from train.loop.build import build

        build(load_config(ROOT / CONFIG, sets))
