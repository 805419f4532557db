"""Which params train and how (issue 32): ``optimizer.frozen`` and ``optimizer.param_groups``,
the params' EMA (``train.ema_decay``, ``eval.use_ema``, ``load_run(ema=True)``) and the
grad/update/param norms logged by default -- for a model in the user's own file, under
``none`` and ``fsdp``, resumed bit for bit after a crash."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from _common import user_module

import nnlite as nl
import train
from train.config import config_from_dict
from train.errors import ConfigError, UserCodeError

USER_MODEL = """
    import nnlite as nl


    class Net(nl.Module):
        in_features: int
        num_classes: int
        width: int = 16
        depth: int = 2
        task = "classification"

        def setup(self):
            self.inp = nl.Linear(self.in_features, self.width)
            self.blocks = [nl.FFN(self.width, (self.width,), self.width, "relu")] * self.depth
            self.out = nl.Linear(self.width, self.num_classes)

        def __call__(self, params, x):
            h = self.inp(params.inp, x)
            for block, p in zip(self.blocks, params.blocks):
                h = nl.add(h, block(p, h))
            return self.out(params.out, h)
"""

FROZEN = ["inp/*", "/blocks[0]/*"]  # both spellings of a list index
CONFIG = {
    "model": {"name": "paramsnet:Net"},
    "data": {"name": "digits"},
    "optimizer": {
        "name": "adamw",
        "learning_rate": 0.01,
        "weight_decay": 0.1,
        "frozen": FROZEN,
        "param_groups": [{"params": "out/*", "lr_scale": 0.1, "weight_decay": 0.0}],
    },
    "train": {"steps": 20, "batch_size": 32, "eval_every": 10, "log_every": 5, "ema_decay": 0.9},
    "eval": {"use_ema": True},
    "checkpoint": {"every": 10, "keep": 5},
    "log": {"progress": False, "plot": False},
}


class Crash(train.Callback):
    """Dies at step ``at`` (after the checkpoint at 10): what a kill leaves behind."""

    def __init__(self, at=None):
        self.at = at

    def on_step_end(self, loop, step, metrics):
        if step == self.at:
            raise RuntimeError("crashed")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("paramsproj")
    with user_module(root, "paramsnet", textwrap.dedent(USER_MODEL).lstrip()):
        yield root


def fit(project, name, crash_at=None, **overrides):
    return train.fit(
        None,
        CONFIG,
        overrides={"name": name, "log.dir": str(project / "runs"), **overrides},
        callbacks=[Crash(crash_at)],
        echo=lambda *_: None,
    )


def tensors(run, step):
    """A checkpoint's tensors by key (a file, or fsdp's directory of shards)."""
    from train.checkpoint.store import flatten_with_paths

    ckpts = run.run_dir / "checkpoints"
    path = next(ckpts.glob(f"ckpt_{step:08d}.*"))
    if path.suffix == ".safetensors":
        return safetensors.numpy.load_file(str(path))
    both = nl.load(path, {"params": run.params, "opt_state": run.opt_state})
    out = {}
    for part in ("params", "opt_state"):
        out.update({k: np.asarray(v) for k, v in flatten_with_paths(part, both[part]).items()})
    return out


def records(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(project):
    """The reference run, one that crashed at step 15 and was resumed, and the same two
    under fsdp (8 host devices; every param sharded)."""
    out = {"none": fit(project, "ref")}
    with pytest.raises(UserCodeError, match="in on_step_end: RuntimeError: crashed"):
        fit(project, "crashed", crash_at=15)
    out["resumed"] = fit(project, "crashed")
    fsdp = {"parallel.strategy": "fsdp", "parallel.fsdp_min_bytes": 0}
    out["fsdp"] = fit(project, "fsdp", **fsdp)
    with pytest.raises(UserCodeError, match="in on_step_end: RuntimeError: crashed"):
        fit(project, "fsdp_crashed", crash_at=15, **fsdp)
    out["fsdp_resumed"] = fit(project, "fsdp_crashed", **fsdp)
    return out


def test_frozen_params_get_no_update_and_no_optimizer_state(runs):
    run = runs["none"]
    at10, at20 = tensors(run, 10), tensors(run, 20)
    frozen = [k for k in at20 if k.startswith(("params/inp/", "params/blocks[0]/"))]
    assert len(frozen) == 6
    for k in frozen:
        np.testing.assert_array_equal(at10[k], at20[k], err_msg=k)
    for k in ("params/blocks[1]/layers[0]/W", "params/out/W"):
        assert not np.array_equal(at10[k], at20[k]), k
    state = [k for k in at20 if k.startswith("opt_state/")]
    assert any("/blocks[1]/" in k for k in state) and any("/out/" in k for k in state)
    assert not [k for k in state if "/inp/" in k or "/blocks[0]/" in k]  # no moments, no EMA


def test_param_groups_scale_the_learning_rate_and_set_weight_decay(project):
    from train.optim.params import make_optimizer

    cfg = config_from_dict(CONFIG, ["model.in_features=64", "model.num_classes=10"])
    model = cfg.model.cls(**cfg.model.options)
    opt, plan = make_optimizer(cfg, model)
    params = jax.jit(model.init)(jax.random.key(0))
    grads = jax.tree.map(jnp.ones_like, params)
    # jitted: one compile each instead of the optimizer chain's ops dispatched one by one
    upd, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
    # Adam's first step is lr * sign(grad); adamw adds lr * weight_decay * param
    np.testing.assert_allclose(upd.out.W, -0.1 * 0.01, rtol=1e-4)  # lr_scale, no decay
    w = params.blocks[1].layers[0].W
    np.testing.assert_allclose(upd.blocks[1].layers[0].W, -0.01 - 0.01 * 0.1 * w, rtol=1e-4)
    assert float(jnp.abs(upd.inp.W).max()) == 0.0 == float(jnp.abs(upd.blocks[0].layers[0].W).max())
    assert plan.labels["/out/W"] == "group0" and plan.labels["/blocks[0]/layers[1]/b"] == "frozen"


def test_a_crashed_run_resumes_bit_identically_under_none_and_fsdp(runs):
    for ref, resumed in (("none", "resumed"), ("fsdp", "fsdp_resumed")):
        a, b = tensors(runs[ref], 20), tensors(runs[resumed], 20)
        assert sorted(a) == sorted(b) and any(k.startswith("opt_state/ema/") for k in a)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{resumed}: {k}")
        assert records(runs[ref].run_dir)[-1] == {
            **records(runs[resumed].run_dir)[-1],
            "time": records(runs[ref].run_dir)[-1]["time"],
        }


def test_fsdp_equals_one_device_and_shards_the_average_like_the_params(runs):
    from train.optim.ema import ema_index

    a, b = tensors(runs["none"], 20), tensors(runs["fsdp"], 20)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=2e-6, err_msg=k)
    r = runs["fsdp"]
    p_leaves, o_leaves = jax.tree.leaves(r.params), jax.tree.leaves(r.opt_state)
    p_sh, o_sh = r.strategy.state_shardings(p_leaves), r.strategy.state_shardings(o_leaves)
    index = ema_index(r.params, r.opt_state)
    assert len(index) == 6  # blocks[1] (4 leaves) and out (2): the trained params only
    for o, p in index:
        assert o_sh[o].spec == p_sh[p].spec and o_leaves[o].dtype == np.float32
    assert any(o_sh[o].spec != jax.sharding.PartitionSpec() for o, _ in index)
    avg, ref = train.load_run(r.run_dir, ema=True), train.load_run(runs["none"].run_dir, ema=True)
    for x, y in zip(jax.tree.leaves(avg.params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)


def test_evaluation_load_run_and_predict_use_the_average(runs, project, tmp_path):
    from train import predict
    from train.inference import predict as infer

    run = runs["none"]
    back, avg = train.load_run(run.run_dir), train.load_run(run.run_dir, ema=True)
    x, y = run.data.x_test, run.data.y_test

    def loss(params):
        logits = infer(back.model, params, x, 1024)
        return float(nl.softmax_cross_entropy(jnp.asarray(logits), y, reduction="mean"))

    logged = [r for r in records(run.run_dir) if r["split"] == "test"][-1]["loss"]
    assert loss(avg.params) == pytest.approx(logged, rel=1e-5)
    assert loss(back.params) != pytest.approx(logged, rel=1e-3)
    np.testing.assert_array_equal(avg.params.inp.W, back.params.inp.W)  # frozen: no average
    ema = tensors(run, 20)["opt_state/ema/out/W"]
    np.testing.assert_array_equal(avg.params.out.W, ema)

    np.savez(tmp_path / "new.npz", x=np.asarray(x, np.float32) * 16.0, y=y)
    out = tmp_path / "p.npz"
    rc = predict.main(["--run", str(run.run_dir), "--data", str(tmp_path / "new.npz")]
                      + ["--out", str(out), "--ema"])  # fmt: skip
    assert rc == 0
    expect = avg.predict(np.asarray(x), preprocessed=True).argmax(-1)
    np.testing.assert_array_equal(np.load(out)["predictions"], expect)

    # a run without an average, asked for one: one clear error
    plain = tmp_path / "plain"
    (plain / "checkpoints").mkdir(parents=True)
    text = (run.run_dir / "config.yaml").read_text().replace("ema_decay: 0.9", "ema_decay: null")
    (plain / "config.yaml").write_text(text.replace("use_ema: true", "use_ema: false"))
    src = run.run_dir / "checkpoints" / "ckpt_00000020.safetensors"
    (plain / "checkpoints" / src.name).write_bytes(src.read_bytes())
    with pytest.raises(ConfigError, match="without a moving average.*ema=True"):
        train.load_run(plain, ema=True)


def test_the_average_follows_its_recurrence_in_float32():
    from train.optim.ema import with_ema

    p = nl.ParamsDict(W=jnp.array([1.0, 2.0], jnp.bfloat16))
    opt = with_ema(optax.sgd(0.5), 0.75)
    state, ema = opt.init(p), np.array([1.0, 2.0], np.float32)
    for g in (1.0, -2.0, 4.0):
        upd, state = opt.update(nl.ParamsDict(W=jnp.full(2, g, jnp.bfloat16)), state, p)
        p = optax.apply_updates(p, upd)
        ema = ema + 0.25 * (np.asarray(p.W, np.float32) - ema)
        assert state.ema.W.dtype == jnp.float32
        np.testing.assert_allclose(state.ema.W, ema, rtol=1e-6)


def test_norms_are_logged_at_the_log_cadence(runs):
    from train.step.step import global_norms

    train_records = [r for r in records(runs["none"].run_dir) if r["split"] == "train"]
    assert [r["step"] for r in train_records] == [5, 10, 15, 20]
    for r in train_records:
        assert 0 < r["grad_norm"] and 0 < r["update_norm"] < r["param_norm"]
    fsdp = [r for r in records(runs["fsdp"].run_dir) if r["split"] == "train"]
    assert fsdp[-1]["grad_norm"] == pytest.approx(train_records[-1]["grad_norm"], rel=1e-4)
    # small params: one variadic reduction each; one above VARIADIC_MAX: three plain ones;
    # trees that do not pair up by shape: one norm per tree. Each equals optax's norm.
    # Values whose squares and every partial sum are exact in float32: the sums agree in
    # any reduction order, on any CPU; only the square roots round.
    big = jnp.full(70_000, 0.5, jnp.float32)
    grads = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2), jnp.bfloat16), "c": big}
    updates = jax.tree.map(lambda a: -0.5 * a, grads)
    params = {"a": jnp.full(3, 2.0), "b": jnp.zeros((2, 2)), "c": big + 1}
    for g, u, p in [(grads, updates, params), (grads, updates, {"a": jnp.ones(5)})]:
        out = jax.jit(global_norms)(g, u, p)
        for name, tree in zip(("grad_norm", "update_norm", "param_norm"), (g, u, p)):
            assert float(out[name]) == pytest.approx(float(optax.tree.norm(tree)), rel=1e-5)


def _grads_fn(model, trainable, grad):
    from train import parallel
    from train.step.step import batch_grads_fn

    fn = batch_grads_fn(model, grad, 1, parallel.get("none", jax.devices()[:1]), trainable)
    return lambda p, x, y: fn(p, None, x, y)


def _dots(model, trainable, grad):
    """``dot_general``s in the step's traced jaxpr and in the StableHLO jit compiles, and
    that lowered program (to run: one compile instead of op-by-op dispatch)."""
    params = jax.eval_shape(model.init, jax.random.key(0))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((8,), jnp.int32)
    traced = jax.jit(_grads_fn(model, trainable, grad)).trace(params, x, y)
    lowered = traced.lower()
    return str(traced.jaxpr).count("dot_general"), lowered.as_text().count("dot_general"), lowered


def test_frozen_weight_gradients_are_not_computed(project):
    import paramsnet

    model = paramsnet.Net(in_features=64, num_classes=10)
    params = model.init(jax.random.key(0))
    # the head and the last block frozen: the backward pass runs through them (their
    # input cotangents) but computes none of their 3 weight gradients; under manual the
    # hand rules leave them out of the traced step already (nl.frozen_scope)
    trainable = jax.tree.map(lambda m: not m, nl.path_mask(params, ["out/*", "blocks/1/*"]))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    y = jnp.arange(8) % 10
    grads = {}
    for grad in ("manual", "autodiff"):
        (jaxpr_all, hlo_all, _), (jaxpr, hlo, lowered) = (
            _dots(model, None, grad),
            _dots(model, trainable, grad),
        )
        assert (jaxpr, hlo) == (jaxpr_all - 3, hlo_all - 3), grad
        grads[grad] = lowered.compile()(params, x, y)[2]
    by_hand, auto = grads["manual"], grads["autodiff"]
    for a, b, m in zip(
        jax.tree.leaves(by_hand), jax.tree.leaves(auto), jax.tree.leaves(trainable), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert m or not np.any(np.asarray(a))  # frozen: zeros


def test_bad_settings_are_one_clear_error(project):
    def bad(sections, match):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**CONFIG, **sections})

    opt = CONFIG["optimizer"]
    bad({"optimizer": {**opt, "param_groups": [{"params": "out/*", "lr": 1}]}}, "unknown key 'lr'")
    bad({"optimizer": {**opt, "param_groups": [{"params": "out/*", "lr_scale": 0}]}}, "> 0")
    bad({"optimizer": {**opt, "frozen": [3]}}, "optimizer.frozen: expected str, got 3")
    bad({"train": {"ema_decay": 1.0}}, r"train.ema_decay must be in \(0, 1\)")
    bad({"eval": {"use_ema": True}, "train": {}}, "eval.use_ema needs train.ema_decay")
    with pytest.raises(ConfigError, match=r"optimizer.frozen: 'embed/\*' matches no param.*/inp/W"):
        fit(project, "bad", **{"optimizer.frozen": ["embed/*"]})
    with pytest.raises(ConfigError, match=r"param_groups\[0\].params: 'head' matches no param"):
        fit(project, "bad", **{"optimizer.param_groups": [{"params": "head"}]})
    with pytest.raises(ConfigError, match="freezes every param"):
        fit(project, "bad", **{"optimizer.frozen": ["*"]})
