"""Optimizers of the user's own: a factory by import path (its arguments from the config),
a schedule by import path, any optax GradientTransformation given to train.fit; their state
checkpoints and resumes exactly whatever its pytree, and fsdp shards it."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import user_module

from train.config import ConfigError, config_from_dict, read_yaml
from train.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]

FACTORIES = '''
import jax
import optax


def every_kind(learning_rate: float, k: int = 2):
    """MultiSteps around a multi_transform whose parts are an inject_hyperparams adam and a
    masked sgd chain: every optax state shape a user is likely to bring."""
    labels = lambda p: jax.tree.map(lambda x: "mat" if x.ndim >= 2 else "vec", p)
    inner = optax.multi_transform(
        {
            "mat": optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate),
            "vec": optax.chain(
                optax.masked(optax.sgd(learning_rate), lambda p: jax.tree.map(lambda x: True, p))
            ),
        },
        labels,
    )
    return optax.MultiSteps(inner, every_k_schedule=k)


def halving(learning_rate, total_steps):
    return optax.exponential_decay(learning_rate, total_steps, 0.5)


def not_an_optimizer(learning_rate: float):
    return "adam"


def needs_k(learning_rate: float, k: int):
    return optax.MultiSteps(optax.sgd(learning_rate), every_k_schedule=k)


def own_default(learning_rate: float = 0.5):
    return optax.sgd(learning_rate)
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    with user_module(tmp_path_factory.mktemp("opts"), "user_optimizers", FACTORIES) as root:
        yield root


def config(tmp_path, optimizer: dict, *overrides):
    raw = read_yaml(ROOT / "configs" / "digits_mlp.yaml")
    raw = {**raw, "optimizer": optimizer}
    base = [
        f"log.dir={tmp_path}",
        "model.hidden_sizes=[16]",
        "train.batch_size=32",
        "train.log_every=5",
        "train.eval_every=10",
        "log.progress=false",
        "log.plot=false",
    ]
    return config_from_dict(raw, [*base, *overrides])


def test_a_factory_optimizer_resumes_bit_identically_under_fsdp(tmp_path, factories):
    opt = {"name": "user_optimizers:every_kind", "learning_rate": 0.01, "k": 2}
    strategy = ["parallel.strategy=fsdp", "parallel.fsdp_min_bytes=0"]
    quiet = dict(echo=lambda *_: None)
    full = train(
        config(tmp_path, opt, "name=full", "train.steps=20", *strategy), resume="fresh", **quiet
    )
    train(config(tmp_path, opt, "name=cut", "train.steps=10", *strategy), resume="fresh", **quiet)
    rest = train(
        config(tmp_path, opt, "name=cut", "train.steps=20", *strategy), resume="require", **quiet
    )
    a, b = (
        jax.tree.leaves((full.params, full.opt_state)),
        jax.tree.leaves((rest.params, rest.opt_state)),
    )
    assert len(a) == len(b) > 10
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # fsdp shards the factory's state like the params: the adam moments of W are split
    shardings = full.strategy.state_shardings(
        jax.tree.leaves(jax.eval_shape(lambda: full.opt_state))
    )
    assert any(not s.is_fully_replicated for s in shardings)


def test_a_schedule_by_import_path_drives_a_named_optimizer(tmp_path, factories):
    opt = {"name": "sgd", "learning_rate": 0.1, "schedule": "user_optimizers:halving"}
    run = train(config(tmp_path, opt, "train.steps=10"), resume="fresh", echo=lambda *_: None)
    text = (tmp_path / "digits_mlp" / "metrics.jsonl").read_text()
    records = [json.loads(r) for r in text.splitlines()]
    lrs = {r["step"]: r["lr"] for r in records if r["split"] == "train"}
    assert run.step == 10
    assert lrs == pytest.approx({5: 0.1 * 0.5 ** (4 / 10), 10: 0.1 * 0.5 ** (9 / 10)})


@pytest.mark.parametrize(
    "optimizer, message",
    [
        (
            {"name": "user_optimizers:every_kind", "lr": 0.1},
            "unknown key 'optimizer.lr'; every_kind takes learning_rate, k",
        ),
        (
            {"name": "user_optimizers:needs_k"},
            "optimizer.k is required by needs_k",
        ),
        ({"name": "user_optimizers:nothing"}, "module user_optimizers .* has no nothing"),
        (
            {"name": "nope"},
            "optimizer.name=nope is not a named optimizer \\(sgd, momentum, adam, adamw, lion\\)",
        ),
        (
            {"name": "sgd", "schedule": "weekly"},
            "optimizer.schedule=weekly is not a named schedule",
        ),
        ({"name": "sgd", "options": {"a": 1}}, "optimizer.options is for a factory optimizer"),
    ],
)
def test_bad_optimizer_sections_are_one_line(tmp_path, factories, optimizer, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, optimizer)


def test_a_factory_s_learning_rate_defaults_as_the_key_table_says(tmp_path, factories):
    """optimizer.learning_rate left out: a factory that requires it gets the key's default
    (written into the run's config), one with a default of its own keeps that."""
    from train.config import OptimizerConfig, to_dict

    cfg = config(tmp_path, {"name": "user_optimizers:every_kind", "k": 3})
    assert cfg.optimizer.options == {"learning_rate": OptimizerConfig.learning_rate, "k": 3}
    assert to_dict(cfg)["optimizer"]["learning_rate"] == 0.001
    assert config(tmp_path, {"name": "user_optimizers:own_default"}).optimizer.options == {}
    given = {"name": "user_optimizers:every_kind", "learning_rate": 0.1}
    assert config(tmp_path, given).optimizer.options == {"learning_rate": 0.1}


def test_a_factory_that_returns_no_transformation_is_refused_before_training(tmp_path, factories):
    opt = {"name": "user_optimizers:not_an_optimizer", "learning_rate": 0.1}
    with pytest.raises(ConfigError, match="expected an optax.GradientTransformation .*got str"):
        train(config(tmp_path, opt, "train.steps=2"), resume="fresh", echo=lambda *_: None)
    assert not (tmp_path / "digits_mlp" / "checkpoints").exists()


def test_a_checkpoint_from_before_the_options_keys_still_resumes():
    """Checkpoints record the resolved config; ones written before ``optimizer.options``
    and ``data.options`` existed lack them, which counts as their defaults."""
    from train.checkpoint.resume import check_resumable
    from train.config import load_config, to_dict

    cfg = load_config(ROOT / "configs" / "digits_mlp.yaml")
    old = to_dict(cfg)
    old["data"].pop("options")
    old["optimizer"].pop("options")
    check_resumable(cfg, {"config": json.dumps(old)}, Path("ckpt_00000010.safetensors"))
    old["optimizer"]["learning_rate"] = 0.5  # a real change is still refused
    with pytest.raises(ConfigError, match="optimizer.learning_rate=0.5"):
        check_resumable(cfg, {"config": json.dumps(old)}, Path("ckpt_00000010.safetensors"))
