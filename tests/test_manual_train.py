"""loss.grad=manual trains every shipped model like autodiff.

Two checks (see tests/_tolerance.py for the reasoning):
- one step's gradient, under each strategy (none, pmap, shard_map over 2 host devices),
  equals autodiff's to float32 rounding: at most ``ops`` roundings of each leaf's scale,
  ``ops`` = 8 per layer on the model's longest path. Measured worst case 7 (the CNN under
  shard_map) against bounds of 32-128, and ~1e6 for a wrong rule;
- 20 Adam steps on one device stay within one learning rate of autodiff's params: rounding
  drifts them apart by up to a few % of it (measured after 100 steps: 0.029 lr for the
  GPT, 0.0084 lr for the CNN on an AVX-512 EPYC, 0 for the MLP; Adam magnifies the
  rounding of near-zero gradients), a wrong rule by ~lr per step.
``test_the_checks_catch_wrong_rules`` shows both checks failing on wrong hand rules.
"""

import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import TINY_GPT
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    SAME_PROGRAMS,
    assert_close_f32,
    assert_same_trajectory,
    first_step_grads,
    max_abs_diff,
    rounding_errors,
)
from test_train import FirstStep

import nnlite as nl
from models import mlp as mlp_model
from train.config import load_config
from train.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]

CNN_TINY = [
    "data.name=digits",
    "model.channels=[4, 6]",
    "model.kernel_size=3",
    "train.batch_size=64",
    "checkpoint.every=0",
]
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 8
GPT_TINY = [
    *TINY_GPT,
    "data.eval_windows=8",
    "model.dropout=0.1",  # the same dropout masks in both modes (keys from the step number)
    "checkpoint.every=0",
]
MODELS = {  # each under SAME_PROGRAMS: a run's first step is a 1-step run's program
    "mlp": ("configs/digits_mlp.yaml", ["train.batch_size=64"]),
    "cnn": ("configs/mnist1d_cnn.yaml", CNN_TINY),
    "gpt": ("configs/shakespeare_gpt.yaml", GPT_TINY),
}
# Layers (rule calls) on each model's longest path from the loss to a parameter: MLP
# linear, relu, linear, cross-entropy; CNN 2 x (conv, relu), flatten, linear, cross-entropy;
# GPT embeddings, layer norm, attention (qkv, scores, softmax, values, projection),
# residual, layer norm, MLP (linear, gelu, linear), residual, final norm, tied head, loss.
LAYERS = {"mlp": 4, "cnn": 7, "gpt": 16}
STEPS = ["train.eval_every=100", "train.log_every=50"]
# The trajectory check's length: a wrong rule is ~lr off per step, rounding a few % of lr
# after 100 (each step is logged, for the first step's gradient: fewer steps, less CPU)
TRAJECTORY_STEPS = 20


def run(tmp_path, config, *overrides, callbacks=()):
    cfg = load_config(
        ROOT / config,
        [f"log.dir={tmp_path}", "log.progress=false", "log.plot=false", *overrides],
    )
    return train(cfg, resume="fresh", echo=lambda *_: None, callbacks=callbacks)


def trained_with_first_step(tmp_path, config, *overrides, modes=("autodiff", "manual")):
    """``({grad mode: first step's gradient}, {grad mode: run})`` for autodiff and manual
    (or ``modes``): one run each, its gradient read after its first step
    (test_train.FirstStep; under SAME_PROGRAMS a 1-step run's step is the same program)."""
    grads, runs = {}, {}
    for g in modes:
        first = FirstStep()
        over = [*overrides, "train.log_every=1", f"loss.grad={g}", f"name={g}"]
        runs[g] = run(tmp_path, config, *over, callbacks=[first])
        one = types.SimpleNamespace(cfg=runs[g].cfg, step=1, opt_state=first.opt_state)
        grads[g] = first_step_grads(one)
    return grads, runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(model)``: each model's 20-step autodiff and manual runs on one device,
    shared by the gradient check's strategy=none row and the trajectory check (a wrong
    rule is ~10 lr off after 10 steps: test_the_checks_catch_wrong_rules)."""
    done = {}

    def get(model):
        if model not in done:
            tmp = tmp_path_factory.mktemp(f"trained_{model}")
            config, extra = model_overrides(tmp, model)
            done[model] = trained_with_first_step(
                tmp, config, *extra, f"train.steps={TRAJECTORY_STEPS}"
            )
        return done[model]

    return get


def model_overrides(tmp_path, model):
    config, extra = MODELS[model]
    if model == "gpt":
        text = tmp_path / "tiny.txt"
        text.write_text(TEXT)
        extra = [*extra, f"data.path={text}"]
    return config, [*extra, *SAME_PROGRAMS, *STEPS]


def one_step_grads(tmp_path, config, *overrides):
    """``{grad mode: gradient of the first step}`` for autodiff and manual."""
    return {
        g: first_step_grads(
            run(tmp_path, config, *overrides, "train.steps=1", f"loss.grad={g}", f"name={g}")
        )
        for g in ("autodiff", "manual")
    }


# Every strategy once, every model once: the MLP on one device and under pmap, the CNN
# under shard_map over 2 devices (its measured worst case), the GPT on one device. The
# rules are the same program on every strategy (the strategy only reduces what they
# compute, one row per strategy checks its reduction: shard_map's is the CNN's row, and
# the MLP's under shard_map test_grad_auto's digits_shard_map row, auto -> manual against
# autodiff); the CNN's and the GPT's one-device manual step is also test_grad_auto's
# mnist1d_cnn and shakespeare_gpt rows, the GPT's hand rules in a sharded step
# tests/test_sharding.py's (fsdp, tensor).
@pytest.mark.parametrize(
    "model, strategy",
    [("mlp", "none"), ("mlp", "pmap"), ("cnn", "shard_map"), ("gpt", "none")],
)
def test_manual_gradient_equals_autodiff(tmp_path, model, strategy, trained):
    if strategy == "none":  # the first step of test_manual_trains_like_autodiff's runs
        grads = trained(model)[0]
    else:
        config, extra = model_overrides(tmp_path, model)
        par = [f"parallel.strategy={strategy}", "parallel.devices=2"]
        grads = one_step_grads(tmp_path, config, *extra, *par)
    assert_close_f32(grads["manual"], grads["autodiff"], ops=ROUNDINGS_PER_LAYER * LAYERS[model])
    # a real gradient in every leaf, or the comparison would prove little
    assert all(np.max(np.abs(g)) > 1e-6 for g in jax.tree.leaves(grads["autodiff"]))


@pytest.mark.parametrize("model", list(MODELS))
def test_manual_trains_like_autodiff(model, trained):
    runs = trained(model)[1]
    auto, hand = runs["autodiff"], runs["manual"]
    lr = auto.cfg.optimizer.learning_rate
    assert_same_trajectory(hand.params, auto.params, lr=lr)
    init = jax.jit(auto.model.init)(jax.random.key(auto.cfg.seed))  # one compile, not per op
    assert max_abs_diff(auto.params, init) > 10 * lr  # the params did move


def relu_without_its_mask_vjp(x, dret):  # the classic slip: dret passes where x < 0 too
    return dret


def relu_doubled_vjp(x, dret):  # right direction, wrong scale: Adam all but ignores it
    return 2 * dret * (x > 0)


def mlp_with_relu_rule(rule):
    """The digits MLP's build, its hidden relu differentiated by ``rule`` in manual mode."""

    @nl.hand_rule(rule)
    def relu(x):
        return jax.nn.relu(x)

    class MLP(mlp_model.MLP):
        @property
        def ffn(self):
            (hidden,) = self.hidden_sizes
            return nl.FFN(self.in_features, (), hidden, "identity", activate_final=True)

        def __call__(self, params, x, *, key=None):
            return self.head.logits(params.head, relu(self.ffn(params.ffn, x)))

    # A user's model module, as `model.name: wrong_rule_models:MLP` imports it.
    module = types.ModuleType("wrong_rule_models")
    MLP.__module__, module.MLP = module.__name__, MLP
    return module


def test_the_checks_catch_wrong_rules(tmp_path, monkeypatch):
    """Both checks above fail on a wrong rule, with room to spare: the gradient check by
    ~1e6 roundings, the trajectory check for relu's VJP without its mask by 32 lr after the
    trajectory check's 20 steps (18 lr after 10, ~100 after 100; a right rule: 0.0015 lr
    for the GPT after 20). A rule off by a constant factor moves Adam's trajectory by less than
    0.1 lr in 10 steps (its updates are invariant to a gradient's scale but for its eps):
    only the gradient check sees it, which is why each model has both."""
    config, extra = model_overrides(tmp_path, "mlp")
    # trained unchecked: loss.check_rules would stop these runs before step 1 (issue 46)
    extra = [*extra, "model.name=wrong_rule_models:MLP", "loss.check_rules=false"]
    errors = {}
    # the mask slip first: its runs train as long as the trajectory check's runs, and its
    # autodiff run (which no hand rule touches) is the doubled rule's reference too
    for name, rule in [("mask", relu_without_its_mask_vjp), ("double", relu_doubled_vjp)]:
        monkeypatch.setitem(sys.modules, "wrong_rule_models", mlp_with_relu_rule(rule))
        if name == "mask":
            steps = f"train.steps={TRAJECTORY_STEPS}"
            grads, runs = trained_with_first_step(tmp_path / name, config, *extra, steps)
            auto_grads = grads["autodiff"]
        else:
            modes = ("manual",)
            grads, _ = trained_with_first_step(
                tmp_path / name, config, *extra, "train.steps=1", modes=modes
            )
        errors[name] = max(rounding_errors(grads["manual"], auto_grads).values())
        with pytest.raises(AssertionError, match="roundings of its scale"):
            assert_close_f32(grads["manual"], auto_grads, ops=ROUNDINGS_PER_LAYER * LAYERS["mlp"])
    auto, hand = runs["autodiff"], runs["manual"]
    with pytest.raises(AssertionError, match="more than rounding can explain"):
        assert_same_trajectory(hand.params, auto.params, lr=auto.cfg.optimizer.learning_rate)
    assert min(errors.values()) > 1e5, errors
