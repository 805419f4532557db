"""loss.grad=manual trains every shipped model to the same params as autodiff.

100 steps, each strategy (none, pmap, shard_map over 4 host devices). The hand rules and
JAX's autodiff compute the same gradient with different float32 operation orders (a
weight gradient contracted in one matmul over the batch, a softmax VJP written as
``p * (g - sum(p g))``...), so single steps agree to a few float32 ulps and Adam carries
the differences through 100 steps. Measured worst case (params of magnitude ~1): 4.2e-7
(cnn, none), 4.4e-6 (gpt, shard_map: more ops per step, and Adam divides each update by
the gradient's running RMS, which magnifies the rounding of near-zero gradients, e.g. rows
of rare characters); mlp under none/pmap is bit-identical. TOL is 5-10x the measured worst
case (5e-6 is about 40 float32 ulps at 1.0), far below any real error: a wrong rule moves
params by ~lr per step.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from train.config import load_config
from train.loop import train

ROOT = Path(__file__).resolve().parents[1]

CNN_TINY = [
    "data.name=digits",
    "model.channels=[4, 6]",
    "model.kernel_size=3",
    "train.batch_size=64",
    "train.steps_per_call=10",
    "checkpoint.every=0",
]
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 8
GPT_TINY = [
    "data.name=text",
    "data.eval_windows=8",
    "model.context=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "model.dropout=0.1",  # the same dropout masks in both modes (keys from the step number)
    "train.batch_size=8",
    "train.steps_per_call=10",
    "optimizer.warmup_steps=2",
    "checkpoint.every=0",
]
MODELS = {
    "mlp": ("configs/digits_mlp.yaml", ["train.batch_size=64"]),
    "cnn": ("configs/mnist1d_cnn.yaml", CNN_TINY),
    "gpt": ("configs/shakespeare_gpt.yaml", GPT_TINY),
}
STEPS = ["train.steps=100", "train.eval_every=100", "train.log_every=50"]
TOL = {"mlp": 5e-6, "cnn": 5e-6, "gpt": 2e-5}


def max_abs_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run(tmp_path, config, *overrides):
    cfg = load_config(
        ROOT / config,
        [f"log.dir={tmp_path}", "log.progress=false", "log.plot=false", *overrides],
    )
    return train(cfg, resume="fresh", echo=lambda *_: None)


@pytest.mark.parametrize("strategy", ["none", "pmap", "shard_map"])
@pytest.mark.parametrize("model", list(MODELS))
def test_manual_trains_like_autodiff(tmp_path, model, strategy):
    config, extra = MODELS[model]
    if model == "gpt":
        text = tmp_path / "tiny.txt"
        text.write_text(TEXT)
        extra = [*extra, f"data.path={text}"]
    common = [*extra, *STEPS, f"parallel.strategy={strategy}", "parallel.devices=2"]
    auto = run(tmp_path, config, *common, "loss.grad=autodiff", "name=auto")
    hand = run(tmp_path, config, *common, "loss.grad=manual", "name=hand")
    diff = max_abs_diff(auto.params, hand.params)
    print(f"{model} {strategy}: max |manual - autodiff| = {diff:.3g}")
    assert diff <= TOL[model], diff
    scale = max(float(np.max(np.abs(p))) for p in jax.tree.leaves(auto.params))
    assert scale > 1000 * TOL[model]  # the params did move: the comparison means something
