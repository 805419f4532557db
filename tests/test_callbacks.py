"""Callbacks from a config and from train.fit: their events, the built-in early stopping,
and bad callback entries; a user's mistakes in a model are one line too."""

from pathlib import Path

import pytest
from _common import cli_sets, user_module

import train
from train.__main__ import main
from train.config import ConfigError, config_from_dict, read_yaml

ROOT = Path(__file__).resolve().parents[1]

USER = """
import jax
import jax.numpy as jnp
import nnlite as nl
import train


class Recorder(train.Callback):
    def __init__(self, tag: str = "r"):
        self.tag, self.events = tag, []

    def on_fit_start(self, loop):
        self.events.append(("start", loop.step))

    def on_step_end(self, loop, step, metrics):
        self.events.append(("step", step, sorted(metrics)))

    def on_eval_end(self, loop, step, metrics):
        self.events.append(("eval", step, sorted(metrics)))

    def on_checkpoint(self, loop, step, path):
        self.events.append(("ckpt", step, path.name))

    def on_fit_end(self, loop, summary):
        self.events.append(("end", loop.step, loop.params().num_params()))


class NoEvents:
    pass


class DictInit(nl.Module):
    in_features: int
    num_classes: int
    task: str = "classification"

    def init(self, key):
        return {"W": jnp.zeros((self.in_features, self.num_classes))}

    def __call__(self, params, x, *, key=None):
        return x @ params["W"]


class Lgamma(nl.Module):
    in_features: int
    num_classes: int
    task: str = "classification"

    def init(self, key):
        return nl.ParamsDict(W=jnp.ones((self.in_features, self.num_classes)))

    def __call__(self, params, x, *, key=None):
        return x @ jax.lax.lgamma(1.0 + jnp.abs(params.W))
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    with user_module(tmp_path_factory.mktemp("cbs"), "user_callbacks", USER) as root:
        yield root


def config(tmp_path, *overrides, **sections):
    raw = {**read_yaml(ROOT / "configs" / "digits_mlp.yaml"), **sections}
    base = [f"log.dir={tmp_path}", "model.hidden_sizes=[16]", "log.progress=false"]
    return config_from_dict(raw, [*base, "log.plot=false", *overrides])


def test_events_come_in_order_at_the_boundaries(tmp_path, user):
    from user_callbacks import Recorder

    rec = Recorder()
    cfg = config(
        tmp_path,
        "train.steps=20",
        "train.log_every=5",
        "train.eval_every=10",
        "checkpoint.every=10",
    )
    train.fit(None, cfg, callbacks=[rec], echo=lambda *_: None)
    loss_acc = ["accuracy", "loss"]
    logged = ["accuracy", "grad_norm", "loss", "param_norm", "update_norm"]  # log.norms
    assert rec.events == [
        ("start", 0),
        ("step", 5, logged),
        ("step", 10, logged),
        ("eval", 10, loss_acc),
        ("ckpt", 10, "ckpt_00000010.safetensors"),
        ("step", 15, logged),
        ("step", 20, logged),
        ("eval", 20, loss_acc),
        ("ckpt", 20, "ckpt_00000020.safetensors"),
        ("end", 20, 1210),
    ]


def test_early_stopping_from_the_config_stops_and_a_rerun_says_so(tmp_path, capsys):
    cbs = [
        {
            "name": "early_stopping",
            "monitor": "accuracy",
            "mode": "max",
            "patience": 1,
            "min_delta": 0.5,
        }
    ]
    # a small MLP, no plot or progress bar: the callback from the config is the point
    over = ["train.steps=400", "train.eval_every=20", "checkpoint.every=0"]
    over += ["model.hidden_sizes=[16]", "log.plot=false", "log.progress=false"]
    cbs_set = f"callbacks={cbs!r}".replace("'", '"')
    argv = ["--config", "configs/digits_mlp.yaml", *cli_sets(f"log.dir={tmp_path}", cbs_set, *over)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "stopped early at step 40: early stopping: accuracy has not improved" in out
    rerun = main(argv)
    assert rerun == 0 and "nothing to train" in capsys.readouterr().out


@pytest.mark.parametrize(
    "entry, message",
    [
        ("nope", "callbacks\\[0\\].name=nope is not a built-in callback \\(early_stopping\\)"),
        (
            {"name": "user_callbacks:Recorder", "tga": 1},
            "unknown key 'callbacks\\[0\\].tga'; Recorder takes tag",
        ),
        ({"name": "user_callbacks:Missing"}, "module user_callbacks .* has no Missing"),
        ({"patience": 2}, "callbacks\\[0\\]: expected a name or a mapping with a 'name' key"),
        ({"name": "early_stopping", "mode": "up"}, "mode must be 'min' or 'max'"),
    ],
)
def test_bad_callback_entries_are_one_line(tmp_path, user, entry, message):
    with pytest.raises(ConfigError, match=message):
        cfg = config(tmp_path, "train.steps=2", callbacks=[entry])
        train.fit(None, cfg, echo=lambda *_: None)


def test_an_object_with_no_event_is_refused(tmp_path, user):
    from user_callbacks import NoEvents

    with pytest.raises(ConfigError, match="NoEvents has none of the events"):
        train.fit(None, config(tmp_path, "train.steps=2"), callbacks=[NoEvents()])


def test_an_init_returning_a_dict_is_one_line_and_writes_nothing(tmp_path, user, capsys):
    model = 'model={"name": "user_callbacks:DictInit"}'
    args = ["--config", "configs/digits_mlp.yaml", *cli_sets(f"log.dir={tmp_path}", model)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "DictInit.init returned a dict, expected an nl.ParamsDict" in err
    assert err.count("\n") == 1 and not any(tmp_path.iterdir())


def test_show_grad_without_a_hand_rule_is_one_line(tmp_path, user, capsys):
    model = 'model={"name": "user_callbacks:Lgamma"}'
    args = ["--config", "configs/digits_mlp.yaml", *cli_sets(f"log.dir={tmp_path}", model)]
    args += ["--show-jaxpr", "grad"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --show-jaxpr grad: show_grad: `lgamma` at ") and err.count("\n") == 1
    )
    assert not any(tmp_path.iterdir())
