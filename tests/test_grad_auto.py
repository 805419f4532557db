"""``loss.grad: auto`` (the default): manual when hand rules cover the model, else autodiff.

What it resolves to is checked on the built run (no compile); that a resolved auto
computes what autodiff computes, on one step of every shipped config at tiny sizes (the
digits MLP's and the GPT's in tests/test_manual_train.py), with gradient accumulation
under each strategy (none, pmap, shard_map). auto is then manual's
program, so test_manual_train's checks of manual under each strategy (the GPT and the CNN
too) hold for it.
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import TINY_LM
from _tolerance import ROUNDINGS_PER_LAYER, SAME_PROGRAMS, assert_close_f32, first_step_grads
from test_manual_train import CNN_TINY, GPT_TINY, STEPS, TEXT

from train.checkpoint import store as ckpt
from train.checkpoint.resume import check_resumable
from train.config import ConfigError, LossConfig, load_config
from train.loop.build import build
from train.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]

# A user's models in their own file: written the natural way (plain +, jnp.mean), covered
# by rules; and one with an operation that has none (its line is found below).
USER_MODELS = f'''
import jax
import jax.numpy as jnp
import nnlite as nl


{TINY_LM}

class MeanPoolLM(TinyLM):
    """TinyLM's layers called the natural way: tokens + positions added with +, a residual
    around the block, mean centring with jnp.mean."""

    def __call__(self, params, x, *, key=None):
        h = nl.Embedding(self.vocab_size, self.width)(params.tok, x)
        h = h + nl.Embedding(self.context, self.width)(params.pos, jnp.arange(x.shape[-1]))[None]
        h = h + nl.TransformerBlock(self.width, 2, causal=True)(params.block, h)
        h = h - jnp.mean(h, axis=-1, keepdims=True)
        return nl.Linear(self.width, self.vocab_size)(params.head, h)


class Wavy(nl.Module):
    """A layer of the user's own that computes lgamma of a linear map: no rule for lgamma."""

    in_features: int
    out_features: int

    def init(self, key):
        return nl.ParamsDict(lin=nl.Linear(self.in_features, self.out_features).init(key))

    def __call__(self, params, x, *, key=None):
        h = nl.Linear(self.in_features, self.out_features)(params.lin, x)
        return jax.lax.lgamma(h * h + 1.0)  # NO RULE (jnp.sin has one; lgamma has none)


class WavyMLP(nl.Module):
    in_features: int
    num_classes: int

    task = "classification"

    def init(self, key):
        k1, k2 = jax.random.split(key)
        return nl.ParamsDict(
            wavy=Wavy(self.in_features, 16).init(k1),
            head=nl.Linear(16, self.num_classes).init(k2),
        )

    def __call__(self, params, x, *, key=None):
        return nl.Linear(16, self.num_classes)(params.head, Wavy(self.in_features, 16)(params.wavy, x))


class AutodiffOnly(WavyMLP):
    """Lists its modes in full: no manual mode, so auto is autodiff without a word."""

    grad_modes = ("autodiff",)
'''


@pytest.fixture(scope="module")
def user_project(tmp_path_factory):
    """``(dir, text file)``: the user's models module and a tiny text beside it (one
    directory for the module's tests: Python imports a module name once)."""
    project = tmp_path_factory.mktemp("user_project")
    (project / "auto_user_models.py").write_text(USER_MODELS)
    text = project / "tiny.txt"
    text.write_text(TEXT)
    return project, text


def user_config(project: Path, model: str, *overrides: str):
    """A config file in the user's directory naming ``auto_user_models:<model>``."""
    path = project / f"{model}.yaml"
    path.write_text(f"name: {model}\nmodel:\n  name: auto_user_models:{model}\n")
    return load_config(
        path, [f"log.dir={project / 'runs'}", "log.progress=false", "log.plot=false", *overrides]
    )


def shipped(config: str, *overrides: str):
    return load_config(ROOT / config, ["log.dir=/nonexistent", *overrides])


def test_auto_is_the_default_and_picks_manual_for_every_shipped_model_and_a_users(
    user_project,
):
    project, text = user_project
    assert load_config(ROOT / "configs/mnist1d_cnn.yaml").loss.grad == "auto"
    tiny_text = ["data.name=text", f"data.path={text}", "model.context=16"]
    cfgs = {
        "mlp": shipped("configs/digits_mlp.yaml", "loss.grad=auto"),
        "linreg": shipped("configs/linreg_pmap.yaml", "parallel.devices=2"),
        "cnn": shipped("configs/mnist1d_cnn.yaml", *CNN_TINY),
        "gpt": shipped("configs/shakespeare_gpt.yaml", "loss.grad=auto", *GPT_TINY, *tiny_text),
        "user": user_config(project, "MeanPoolLM", *tiny_text),
    }
    for name, cfg in cfgs.items():
        r = build(cfg)
        got = (r.grad.mode, r.grad.describe(), r.grad.note)
        assert got == ("manual", "auto -> manual", None), (name, got)
    # a model without manual mode: autodiff, said in the banner only (no fallback line)
    r = build(user_config(project, "AutodiffOnly", "data.name=digits"))
    assert (r.grad.describe(), r.grad.note) == ("auto -> autodiff", None)
    with pytest.raises(
        ConfigError,
        match=r"loss.grad=manual is not available .* supports autodiff \(its grad_modes leave it out\)$",
    ):
        build(user_config(project, "AutodiffOnly", "data.name=digits", "loss.grad=manual"))


def test_auto_falls_back_to_autodiff_naming_the_operation(user_project):
    project, _ = user_project
    source = project / "auto_user_models.py"
    line = next(i for i, s in enumerate(source.read_text().splitlines(), 1) if "NO RULE" in s)
    lines = []
    cfg = user_config(
        project, "WavyMLP", "data.name=digits", "train.steps=1", "train.batch_size=32"
    )
    r = train(cfg, resume="fresh", echo=lambda s: lines.extend(s.splitlines()))
    said = [s.strip() for s in lines if "loss.grad auto" in s]
    assert len(said) == 1, lines
    # the file as the user would open it: relative to the current directory, or absolute
    assert re.fullmatch(
        r"loss.grad auto: autodiff \(manual needs a rule for 'lgamma' at (\S*/)?"
        + re.escape(f"{source.name}:{line}")
        + r" in layer Wavy; see docs/gradients.md\)",
        said[0],
    ), said[0]
    assert "grad: auto -> autodiff" in lines[0]
    assert r.grad_mode == "autodiff" and np.isfinite(r.summary["test_loss"])
    # the checkpoint says what auto ran; an explicit autodiff resumes it, manual does not
    last = sorted((r.run_dir / "checkpoints").glob("ckpt_*"))[-1]
    meta = ckpt.read_metadata(last)
    assert meta["grad_mode"] == "autodiff"
    check_resumable(r.cfg, meta, last, "autodiff")
    with pytest.raises(ConfigError, match="loss.grad='auto' but the config has loss.grad='manual'"):
        check_resumable(replace(r.cfg, loss=LossConfig("manual")), meta, last, "manual")


def test_a_checkpoint_of_the_old_default_resumes_under_auto_when_it_resolves_alike():
    cfg = shipped("configs/digits_mlp.yaml", "loss.grad=auto")
    old = {"config": json.dumps({**_dict(cfg), "loss": {"grad": "autodiff"}})}
    check_resumable(cfg, old, Path("ckpt"), "autodiff")  # auto runs autodiff: the same step
    with pytest.raises(ConfigError, match=r"loss.grad='auto' \(auto is manual for this model\)"):
        check_resumable(cfg, old, Path("ckpt"), "manual")


def _dict(cfg):
    from train.config import to_dict

    return to_dict(cfg)


# Each shipped config, tiny: (overrides, layers on the model's longest path for the bound:
# + 1 with accumulation, the sum over microbatches). The CNN row is test_manual_train's
# one-device programs (the compile cache has them); the others accumulate two
# microbatches, one under each strategy (none, pmap, shard_map). digits_mlp and
# shakespeare_gpt at these sizes are test_manual_train's mlp-none and gpt-none rows: the
# same two programs (auto resolves to manual for both, test_auto_is_the_default_...
# above, and a resolved auto compiles manual's step), compared to the same bound.
ACCUM = ["train.grad_accum_steps=2"]
CONFIGS = {
    "digits_shard_map": (["parallel.devices=2", *ACCUM], 5),
    "linreg_pmap": (["parallel.devices=2", "optimizer.name=adam", *ACCUM], 3),
    "mnist1d_cnn": (CNN_TINY, 7),
    "mnist1d_mlp": (["model.hidden_sizes=[32, 32]", "checkpoint.every=0", *ACCUM], 7),
}


def one_step(tmp_path, config, grad, *overrides):
    """``(loss, grads)`` of the first step of ``config`` under ``loss.grad=grad``."""
    cfg = load_config(
        ROOT / f"configs/{config}.yaml",
        [
            f"log.dir={tmp_path}",
            "log.progress=false",
            "log.plot=false",
            *overrides,
            *SAME_PROGRAMS,
            *STEPS,
            "train.steps=1",
            f"loss.grad={grad}",
            f"name={grad}",
        ],
    )
    r = train(cfg, resume="fresh", echo=lambda *_: None)
    record = json.loads((r.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["split"] == "train" and record["step"] == 1
    return r, record["loss"], first_step_grads(r)


def assert_auto_equals_autodiff(tmp_path, config, *overrides, layers):
    auto, loss, grads = one_step(tmp_path, config, "auto", *overrides)
    assert auto.grad_mode == "manual"  # so the comparison is of two programs
    _, want_loss, want = one_step(tmp_path, config, "autodiff", *overrides)
    assert_close_f32(loss, want_loss, ops=ROUNDINGS_PER_LAYER * layers, what="loss ")
    assert_close_f32(grads, want, ops=ROUNDINGS_PER_LAYER * layers)
    assert all(np.max(np.abs(g)) > 1e-6 for g in jax.tree.leaves(want))  # real gradients


@pytest.mark.parametrize("config", list(CONFIGS))
def test_auto_step_equals_autodiff_for_every_shipped_config(tmp_path, config):
    overrides, layers = CONFIGS[config]
    assert_auto_equals_autodiff(tmp_path, config, *overrides, layers=layers)
