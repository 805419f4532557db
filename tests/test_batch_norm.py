"""BatchNorm and model state: the layer's rules and modes, its statistics synchronised over
devices, and a stateful model (the ResNet, a user's model) through the trainer: state
equal to one device's under pmap/shard_map, resumed bit-identically, read back by
``train.load_run``."""

import dataclasses
import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import fit_config
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    SAME_PROGRAMS,
    assert_close_f32,
    assert_same_trajectory,
    first_step_grads,
)
from _tolerance import check_rule as check
from jax.sharding import PartitionSpec as P

import nnlite as nl
import train
from train import inference
from train.config import load_config
from train.loop.trainer import train as train_loop
from train.model import contract

ROOT = Path(__file__).resolve().parents[1]


# -- the layer -------------------------------------------------------------------------------


def test_batch_norm_rules(rand):
    x, scale, bias = rand(4, 3, 5, 3) * 2 + 1, rand(3), rand(3)  # images: [B, H, W, C]
    check(nl.rules.batch_norm_train, x, scale, bias, eps=1e-3)
    var = jnp.abs(rand(3)) + 0.5
    check(nl.rules.batch_norm_eval, x, rand(3), var, scale, bias, eps=1e-3)


def test_train_mode_normalises_over_the_batch_and_updates_the_running_statistics(key):
    bn = nl.BatchNorm(3, momentum=0.8)
    params = nl.ParamsDict(scale=jnp.array([1.0, 2.0, 0.5]), bias=jnp.array([0.0, 1.0, -1.0]))
    x = np.random.default_rng(0).normal(2.0, 3.0, (4, 5, 5, 3)).astype(np.float32)
    state = bn.init_state()
    y, new = jax.jit(functools.partial(bn, train=True))(params, x, state=state)
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))  # biased, as Flax/Equinox
    scale, bias = np.asarray(params.scale), np.asarray(params.bias)
    want = (x - mean) / np.sqrt(var + bn.eps) * scale + bias
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.mean, 0.2 * mean, rtol=1e-6)
    np.testing.assert_allclose(new.var, 0.8 + 0.2 * var, rtol=1e-6)
    assert np.all(np.asarray(state.mean) == 0)  # nothing mutated
    # Eval mode: the running statistics, and the state comes back unchanged.
    y_eval, same = bn(params, x, state=new)
    assert same is new
    y_eval = jax.jit(bn)(params, x, state=new)[0]
    r_mean, r_var = np.asarray(new.mean), np.asarray(new.var)
    want_eval = (x - r_mean) / np.sqrt(r_var + bn.eps) * scale + bias
    np.testing.assert_allclose(y_eval, want_eval, rtol=1e-5, atol=1e-5)
    # One example at a time gives the same in eval mode: no batch statistics.
    np.testing.assert_allclose(bn(params, x[0], state=new)[0], y_eval[0], rtol=1e-6)


def test_manual_gradients_equal_autodiff_in_both_modes():
    bn = nl.BatchNorm(4)
    params = bn.init(jax.random.key(0))
    params = jax.tree.map(lambda v: v + jnp.arange(4.0) / 10, params)
    x = jax.random.normal(jax.random.key(1), (8, 4)) * 3 + 1
    y = jnp.arange(8) % 4
    state = dataclasses.replace(bn).init_state()
    state = nl.ParamsDict(mean=state.mean + 0.5, var=state.var * 2)

    for train_mode in (True, False):

        def loss(p, x, train_mode=train_mode):
            out, new = bn(p, x, state=state, train=train_mode)
            return nl.reduce(nl.softmax_cross_entropy(out, y), "mean"), new

        auto = jax.jit(jax.grad(lambda p, x: loss(p, x)[0], argnums=(0, 1)))(params, x)
        hand = jax.jit(jax.grad(lambda p, x: nl.manual_grads(loss)(p, x)[0], argnums=(0, 1)))(
            params, x
        )
        assert_close_f32(hand, auto, ops=16, what=f"train={train_mode}: ")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: nl.BatchNorm(0), "features must be a positive int"),
        (lambda: nl.BatchNorm(3, momentum=1.5), r"momentum must be a float in \[0, 1\], got 1.5"),
        (lambda: nl.BatchNorm(3, eps=-1), "eps must be a float >= 0"),
        (lambda: nl.BatchNorm(3, axis_name=3), "axis_name must be a mapped axis name"),
    ],
)
def test_invalid_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_state_and_input_name_the_layer(key):
    bn = nl.BatchNorm(3)
    p = bn.init(key)
    with pytest.raises(ValueError, match=r"BatchNorm\(3\): needs its state: y, state = bn"):
        bn(p, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"state /var has shape \(4,\), expected shape \(3,\)"):
        bn(p, jnp.ones((2, 3)), state=nl.ParamsDict(mean=jnp.zeros(3), var=jnp.ones(4)))
    with pytest.raises(ValueError, match=r"expected input with last axis 3 and rank >= 2"):
        bn(p, jnp.ones(3), state=bn.init_state(), train=True)


# -- synchronised over devices ----------------------------------------------------------------


def test_statistics_and_gradients_under_pmap_and_shard_map_equal_one_device():
    """The global batch's statistics on every device: the forward, the new running
    statistics and the gradients (autodiff and the hand rule) equal one device's."""
    n = 4
    bn = nl.BatchNorm(3)
    params = jax.tree.map(lambda v: v * 1.5 + 0.1, bn.init(jax.random.key(0)))
    state = bn.init_state()
    x = jax.random.normal(jax.random.key(1), (8, 2, 3)) * 2 + 1
    # weights that follow x: the gradients are sums of like-signed terms, not cancellations
    w = x + 0.5 * jax.random.normal(jax.random.key(2), (8, 2, 3))

    def loss(p, x, w):  # the mean over the (local) batch of a nonlinear function of y
        y, new = bn(p, x, state=state, train=True)
        return jnp.mean(jnp.sum(nl.tanh(y) * w, axis=(-2, -1))), new

    def grads(mode, p, x, w, axis=None):
        fn = nl.manual_grads(loss) if mode == "manual" else loss
        with nl.batch_axis(axis):
            (value, new), g = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(p, x, w)
        return value, new, g

    devices = jax.devices()[:n]
    mesh = jax.make_mesh((n,), ("d",), (jax.sharding.AxisType.Auto,), devices=devices)
    split = lambda a: a.reshape(n, -1, *a.shape[1:])  # noqa: E731
    for mode in ("autodiff", "manual"):
        # jitted: one compile instead of op-by-op dispatch of the manual rules
        _, new1, (gp1, gx1) = jax.jit(functools.partial(grads, mode))(params, x, w)

        # pmap: each device differentiates its own loss; the param gradients are the sum
        # of the devices' pieces (the mean loss is their mean: pmean).
        def on_device(xs, ws, mode=mode):
            value, new, (gp, gx) = grads(mode, params, xs, ws, "d")
            return new, jax.lax.pmean(gp, "d"), gx / n

        results = {}
        if mode == "manual":  # (the trainer's test covers pmap with autodiff)
            new_p, gp_p, gx_p = jax.pmap(on_device, axis_name="d", devices=devices)(
                split(x), split(w)
            )
            first = lambda t: jax.tree.map(lambda v: v[0], t)  # noqa: E731
            results["pmap"] = (first(new_p), first(gp_p), gx_p.reshape(x.shape))

        # shard_map: differentiate pmean(local loss); replicated params get summed cotangents
        def sharded(xs, ws, mode=mode):
            fn = nl.manual_grads(loss) if mode == "manual" else loss

            def global_loss(p, xs):
                value, new = fn(p, xs, ws)
                return jax.lax.pmean(value, "d"), new

            with nl.batch_axis("d"):
                (_, new), g = jax.value_and_grad(global_loss, argnums=(0, 1), has_aux=True)(
                    params, xs
                )
            return new, *g

        results["shard_map"] = jax.jit(
            jax.shard_map(
                sharded, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P(), P(), P("d"))
            )
        )(x, w)
        for what, (new, gp, gx) in results.items():
            assert_close_f32(new, new1, ops=8, what=f"{mode} {what} state: ")
            assert_close_f32(gp, gp1, ops=24, what=f"{mode} {what} param grads: ")
            assert_close_f32(gx, gx1, ops=24, what=f"{mode} {what} input grads: ")
    # Without the axis each device would keep its own statistics: the check can fail.
    local = jax.pmap(lambda xs: bn(params, xs, state=state, train=True)[1], devices=devices)
    assert not np.allclose(local(split(x)).mean[0], new1.mean, atol=1e-3)


# -- through the trainer ------------------------------------------------------------------------


class BNMLP(nl.Module):
    """A user's stateful model: BatchNorm on the raw inputs, then Linear -> BatchNorm ->
    relu -> Linear. Its state holds both BatchNorms' running statistics."""

    in_features: int
    num_classes: int
    width: int = 16
    momentum: float = 0.9

    task = "classification"

    def layers(self):
        bn = functools.partial(nl.BatchNorm, momentum=self.momentum)
        # No shifts before the second BatchNorm: it would remove them (zero gradients)
        return {
            "bn_in": bn(self.in_features, use_bias=False),
            "lin": nl.Linear(self.in_features, self.width, use_bias=False),
            "bn": bn(self.width),
            "out": nl.Linear(self.width, self.num_classes),
        }

    def init(self, key):
        keys = jax.random.split(key, 4)
        return nl.ParamsDict(
            **{n: m.init(k) for (n, m), k in zip(self.layers().items(), keys, strict=True)}
        )

    def init_state(self):
        return nl.ParamsDict(
            **{n: m.init_state() for n, m in self.layers().items() if n.startswith("bn")}
        )

    def __call__(self, params, x, *, state, train=False, key=None):
        m, new = self.layers(), {}
        h, new["bn_in"] = m["bn_in"](params.bn_in, x, state=state.bn_in, train=train)
        h = m["lin"](params.lin, h)
        h, new["bn"] = m["bn"](params.bn, h, state=state.bn, train=train)
        return m["out"](params.out, nl.relu(h)), nl.ParamsDict(**new)


def fit(tmp_path, npz, *overrides, model=BNMLP, callbacks=()):
    config = fit_config("bnmlp", tmp_path)
    return train.fit(
        model,
        config,
        overrides=[npz, *overrides],
        resume="fresh",
        echo=lambda *_: None,
        callbacks=list(callbacks),
    )


class FirstStep(train.Callback):
    """The optimizer state and the model state after step 1 (a boundary: log_every=1),
    as a 1-step run ends with them (SAME_PROGRAMS: its step is the same program)."""

    one = None

    def on_step_end(self, loop, step, metrics):
        if step == 1:
            # the model state: the trainer's loop behind the callbacks' view (LoopState
            # shows params and opt_state only)
            state = loop._host_state.__self__.model_state()
            self.one = types.SimpleNamespace(
                cfg=loop.cfg, step=1, opt_state=loop.opt_state(), state=state
            )


def test_user_model_with_batch_norm_data_parallel_equals_one_device(tmp_path, npz):
    """The first step's gradients and state tightly, five steps' params and state loosely,
    on pmap over 8 devices (autodiff) and shard_map over 2 (manual gradients: the hand
    rules' pmeans too): one run each, read after its first step."""
    common = [*SAME_PROGRAMS, "train.eval_every=1"]

    def runs(name, *par):
        first = FirstStep()
        five = fit(tmp_path, npz, *common, *par, f"name={name}", "train.steps=5", callbacks=[first])
        assert first.one is not None, "no boundary after step 1"
        return first.one, five

    ref = runs("ref", "parallel.strategy=none")
    assert not np.allclose(ref[0].state.bn.var, 1, atol=1e-3)  # the step updated the state
    ops = ROUNDINGS_PER_LAYER * 5  # two BatchNorms, two Linears, the loss
    for name, par in [
        ("pmap", ["parallel.strategy=pmap", "parallel.devices=8"]),
        ("shard_map", ["parallel.strategy=shard_map", "parallel.devices=2", "loss.grad=manual"]),
    ]:
        got = runs(name, *par)
        assert_close_f32(first_step_grads(got[0]), first_step_grads(ref[0]), ops=ops, what=name)
        # (the second BatchNorm's batch means are 0 up to rounding: absolute tolerances)
        close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
        jax.tree.map(close, got[0].state, ref[0].state)
        lr = ref[1].cfg.optimizer.learning_rate
        assert_same_trajectory(got[1].params, ref[1].params, lr=lr, what=f"{name}: ")
        jax.tree.map(functools.partial(close, rtol=1e-3, atol=1e-4), got[1].state, ref[1].state)


def test_grad_accumulation_threads_the_state_through_the_microbatches(tmp_path, npz):
    from train.data.dataset import make_sampler

    r = fit(tmp_path, npz, "train.steps=1", "train.grad_accum_steps=2", "model.momentum=0.5")
    x = r.data.x[make_sampler(r.cfg.seed, r.data, 64).batch(0)]
    first, second = x[:32].mean(axis=0), x[32:].mean(axis=0)  # the raw inputs' BatchNorm
    want = 0.5 * (0.5 * 0 + 0.5 * first) + 0.5 * second
    np.testing.assert_allclose(r.state.bn_in.mean, want, rtol=1e-5, atol=1e-6)


def test_stateful_model_contract_errors(tmp_path, npz):
    class NoStateArg(BNMLP):
        def __call__(self, params, x, *, key=None):
            return x

    class ReturnsOnlyLogits(BNMLP):
        def __call__(self, params, x, *, state, train=False, key=None):
            return super().__call__(params, x, state=state, train=train)[0]

    with pytest.raises(contract.ModelError, match="must take the keyword argument.*state, train"):
        contract.check_model_class(NoStateArg, "model.name=m:NoStateArg")
    with pytest.raises(train.ConfigError, match="must return \\(output, new_state\\)"):
        fit(tmp_path, npz, "train.steps=1", model=ReturnsOnlyLogits)


def test_digits_resnet_trains_past_the_mlp_resumes_exactly_and_predicts(tmp_path):
    """The shipped config on a shorter schedule reaches the digits MLP's 97.8%
    (configs/digits_mlp.yaml, 1500 steps; the ResNet: 98.9% after its config's 600 steps,
    99.4% after 200 of them, 98.3% on a 120-step schedule, as on a 100-step one); a crash
    after step 100 resumes to the same bits, state included; ``train.load_run`` predicts
    what the evaluation measured."""
    import shutil

    common = ["train.steps=120", "train.eval_every=120", "checkpoint.every=20"]
    full = run(tmp_path, *common, "name=full")
    assert full.summary["test_accuracy"] >= 0.978

    ckpts = sorted((full.run_dir / "checkpoints").iterdir())
    assert nl.load(ckpts[-1])["state"]["blocks"][1]["bn_proj"]["var"].shape == (32,)
    shutil.copytree(full.run_dir, tmp_path / "crashed")
    (tmp_path / "crashed" / "checkpoints" / ckpts[-1].name).unlink()  # died before step 120
    resumed = run(tmp_path, *common, "name=crashed", resume="auto")
    assert resumed.step == 120
    for what in ("params", "opt_state", "state"):
        for a, b in zip(
            jax.tree.leaves(getattr(full, what)), jax.tree.leaves(getattr(resumed, what))
        ):
            np.testing.assert_array_equal(a, b, err_msg=what)

    loaded = train.load_run(full.run_dir)
    for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(full.state)):
        np.testing.assert_array_equal(a, b)
    x, y = full.data.x_test, full.data.y_test
    accuracy = float(np.mean(np.argmax(loaded.predict(x, preprocessed=True), -1) == y))  # eval
    assert accuracy == pytest.approx(full.summary["test_accuracy"], abs=1e-6)
    with pytest.raises(train.ConfigError, match="is stateful .* predicting needs its state"):
        inference.predict(loaded.model, loaded.params, x)


RESNET = "configs/digits_resnet.yaml"


def run(tmp_path, *overrides, config=RESNET, resume="fresh"):
    cfg = load_config(
        ROOT / config,
        [f"log.dir={tmp_path}", "log.progress=false", "log.plot=false", *overrides],
    )
    return train_loop(cfg, resume=resume, echo=lambda *_: None)


class BNLM(nl.Module):
    """A stateful causal language model: embeddings, BatchNorm over batch and positions,
    a linear head (each position sees only its own token: causal)."""

    vocab_size: int
    context: int
    width: int = 8

    task = "language_model"

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return nl.ParamsDict(
            tok=nl.Embedding(self.vocab_size, self.width).init(k1),
            bn=nl.BatchNorm(self.width).init(k1),
            head=nl.Linear(self.width, self.vocab_size).init(k2),
        )

    def init_state(self):
        return nl.ParamsDict(bn=nl.BatchNorm(self.width).init_state())

    def __call__(self, params, x, *, state, train=False, key=None):
        h = nl.Embedding(self.vocab_size, self.width)(params.tok, x)
        h, bn = nl.BatchNorm(self.width)(params.bn, h, state=state.bn, train=train)
        return nl.Linear(self.width, self.vocab_size)(params.head, h), nl.ParamsDict(bn=bn)


def test_a_stateful_language_model_generates_in_eval_mode():
    model = BNLM(vocab_size=7, context=4)
    params = model.init(jax.random.key(0))
    state = nl.ParamsDict(bn=nl.ParamsDict(mean=jnp.full(8, 0.3), var=jnp.full(8, 2.0)))
    out = inference.generate(
        model, params, [1, 2], 5, jax.random.key(0), temperature=0.0, state=state
    )
    # Greedy by hand: a position's logits depend on its own token only (eval mode with
    # this state), so one call gives the next token after each token.
    table, _ = jax.jit(model)(params, jnp.arange(7)[None], state=state)
    ids = [1, 2]
    for _ in range(5):
        ids.append(int(jnp.argmax(table[0, ids[-1]])))
    assert out.tolist() == ids
    with pytest.raises(train.ConfigError, match="is stateful .* needs its state"):
        inference.generate(model, params, [1], 2, jax.random.key(0))


class LocalStats(BNMLP):
    """A stateful layer of its own that stores its device's batch mean, not the global one."""

    def __call__(self, params, x, *, state, train=False, key=None):
        out, new = super().__call__(params, x, state=state, train=train)
        if train:
            mean = jax.lax.stop_gradient(jnp.mean(x, axis=0))
            new = nl.ParamsDict(bn_in=nl.ParamsDict(mean=mean, var=new.bn_in.var), bn=new.bn)
        return out, new


def test_a_state_that_differs_between_devices_is_refused_by_name(tmp_path, npz):
    with pytest.raises(train.ConfigError, match=r"state /bn_in/mean differs between devices"):
        fit(tmp_path, npz, "train.steps=1", "parallel.strategy=shard_map", model=LocalStats)
