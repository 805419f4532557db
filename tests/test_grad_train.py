"""The trainer's side of the per-layer backward pass (issue 34): train.check_grads /
--check-grads, log.grad_by_layer, the non-finite guard naming the first layer whose
backward went non-finite, and loss.backward_policies by path glob -- each with a model in
a user's own file, under ``none`` and ``fsdp`` (8 host devices)."""

import importlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nnlite as nl
import train
from train import faults
from train.data.dataset import host_batch, make_sampler
from train.errors import ConfigError

USER_MODELS = """
import jax.numpy as jnp

import nnlite as nl


def gain_vjp(x, s, dret):
    return dret * s[None], jnp.sum(dret * x, axis=0)


def gain_vjp_wrong(x, s, dret):  # a slip: twice the input's cotangent
    return 2 * dret * s[None], jnp.sum(dret * x, axis=0)


def gain_vjp_nan(x, s, dret):  # right at init; non-finite once s has moved (step 2 on)
    dx = jnp.where(jnp.any(s != 1.0), jnp.nan, dret * s[None])
    return dx, jnp.sum(dret * x, axis=0)


@nl.hand_rule(gain_vjp)
def gain(x, s):
    return x * s[None]


@nl.hand_rule(gain_vjp_wrong)
def gain_wrong(x, s):
    return x * s[None]


@nl.hand_rule(gain_vjp_nan)
def gain_nan(x, s):
    return x * s[None]


RULES = {"right": gain, "wrong": gain_wrong, "nan": gain_nan}


class Gain(nl.Module):
    features: int
    rule: str = "right"

    def init(self, key):
        return nl.ParamsDict(s=jnp.ones(self.features))

    def __call__(self, params, x, *, key=None):
        return RULES[self.rule](x, params.s)


class Block(nl.Module):
    features: int
    rule: str = "right"

    def setup(self):
        self.lin = nl.Linear(self.features, self.features)
        self.gain = Gain(self.features, self.rule)

    def __call__(self, params, x, *, key=None):
        return self.gain(params.gain, jnp.tanh(self.lin(params.lin, x)))


class Net(nl.Module):
    task = "classification"
    in_features: int | None = None
    num_classes: int | None = None
    width: int = 16
    depth: int = 3
    rule: str = "right"  # the gain rule of block `at`
    at: int = 1

    def setup(self):
        self.embed = nl.Linear(self.in_features, self.width)
        self.blocks = [
            Block(self.width, self.rule if i == self.at else "right") for i in range(self.depth)
        ]
        self.head = nl.Linear(self.width, self.num_classes)

    def __call__(self, params, x, *, key=None):
        h = self.embed(params.embed, x)
        for block, p in zip(self.blocks, params.blocks):
            h = block(p, h)
        return self.head(params.head, h)
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's project: gtmodels.py (imported) and a config beside it."""
    root = tmp_path_factory.mktemp("gradtrain")
    (root / "gtmodels.py").write_text(USER_MODELS)
    sys.path.insert(0, str(root))
    try:
        yield root, importlib.import_module("gtmodels")
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("gtmodels", None)


def config(root, strategy="none", steps=1, **sections):
    cfg = {
        "model": {"name": "gtmodels:Net"},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "learning_rate": 1.0},
        "train": {"steps": steps, "batch_size": 32, "log_every": steps, "eval_every": steps},
        "log": {"dir": str(root / "runs"), "progress": False, "plot": False},
        "parallel": {"strategy": strategy},
        "loss": {"grad": "manual"},
    }
    for section, keys in sections.items():
        cfg[section] = {**cfg.get(section, {}), **keys}
    return cfg


def fit(root, mod, name, cfg, lines=None, **model):
    echo = (lambda *a: None) if lines is None else lines.append
    cfg = {**cfg, "name": name, "model": {**cfg["model"], **model}}
    return train.fit(mod.Net, cfg, resume="fresh", echo=echo)


def records(run):
    import json

    with open(run.run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def first_batch(run):
    idx = make_sampler(run.cfg.seed, run.data, run.cfg.train.batch_size).batch(0)
    return host_batch(run.data, idx)


def plain_loss(model):
    def loss(p, x, y):
        return nl.softmax_cross_entropy(model(p, x), y, reduction="mean")

    return loss


# -- check_grads, per-layer norms and policies from the config, in one run ---------------

POLICIES = [
    {"layers": "blocks/0/*", "stop": True},
    {"layers": "head", "scale": 0.5},
    {"layers": "blocks[2].lin", "float32": True},
]


@pytest.mark.parametrize("strategy", ["none", "fsdp"])
def test_check_grads_norms_by_layer_and_policies(user, strategy):
    """Right rules pass the check and the run trains; the logged norms and the update
    equal jax.grad's on the first batch with the policies applied by hand: the head's
    cotangent halved (all of the backward with it), nothing into blocks[0] or below."""
    root, mod = user
    lines = []
    cfg = config(
        root,
        strategy,
        train={"check_grads": True},
        log={"grad_by_layer": True},
        loss={"grad": "manual", "backward_policies": POLICIES},
    )
    run = fit(root, mod, f"right-{strategy}", cfg, lines)
    table = [ln for ln in lines if ln.startswith("  ")]
    gains = [ln for ln in table if "gain_vjp" in ln]
    assert len(gains) == 3 and all(ln.rstrip().endswith("ok") for ln in gains), lines
    assert any("params.blocks[1].gain" in ln for ln in gains), table
    # the float32 policy's rule is checked too; stop and scale are not rules of their function
    assert any("Linear_backward_in_float32" in ln and ln.rstrip().endswith("ok") for ln in table)
    assert not any("cotangent_vjp" in ln for ln in table)
    assert run.step == 1

    model, p0 = run.model, jax.jit(run.model.init)(jax.random.key(0))
    x, y = first_batch(run)

    @jax.jit
    def expected(p0, x, y):
        def head_loss(h):  # the loss from the head's input
            return nl.softmax_cross_entropy(model.head(p0.head, h), y, reduction="mean")

        h = model.embed(p0.embed, x)
        for block, p in zip(model.blocks, p0.blocks):
            h = block(p, h)
        return jax.grad(plain_loss(model))(p0, x, y), jnp.linalg.norm(jax.grad(head_loss)(h))

    grads, head_cot = expected(p0, x, y)
    grads = jax.tree.map(lambda g: 0.5 * np.asarray(g), grads)  # the head's cotangent halved
    for part in ("embed", ("blocks", 0)):  # stopped at blocks[0]'s layers: nothing below
        grads = _zero(grads, part)

    rec = next(r for r in records(run) if r["split"] == "train")
    assert rec["cotangent_norm/head"] == pytest.approx(0.5 * float(head_cot), rel=1e-5)
    block1 = np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(grads.blocks[1])))
    assert rec["grad_norm/blocks[1]"] == pytest.approx(float(block1), rel=1e-5)
    assert rec["grad_norm/blocks[1].gain"] == pytest.approx(
        float(np.linalg.norm(grads.blocks[1].gain.s)), rel=1e-5
    )
    assert rec["grad_norm/embed"] == 0.0 and rec["cotangent_norm/blocks[0].lin"] == 0.0
    want_keys = {"embed", "blocks[0]", "blocks[0].lin", "blocks[2].gain", "head"}
    assert want_keys <= {k.split("/", 1)[1] for k in rec if k.startswith("grad_norm/")}

    # the update (sgd, learning rate 1) is minus that gradient
    got = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p0, run.params)
    for (path, a), (_, b) in zip(got.items(), grads.items(), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, err_msg=path)


def _zero(tree, part):
    keys = part if isinstance(part, tuple) else (part,)
    node = tree
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = jax.tree.map(np.zeros_like, node[keys[-1]])
    return tree


def test_check_grads_refuses_a_wrong_rule_fsdp(user):
    root, mod = user
    lines = []
    cfg = config(root, "fsdp", train={"check_grads": True})
    with pytest.raises(ConfigError, match=r"gain_vjp_wrong of params\.blocks\[2\]\.gain"):
        fit(root, mod, "wrong-fsdp", cfg, lines, rule="wrong", at=2)
    assert any("WRONG" in ln and "gain_vjp_wrong" in ln for ln in lines)
    assert not (root / "runs" / "wrong-fsdp" / "metrics.jsonl").exists()  # never trained


def test_check_grads_cli_exit_2_one_line(user, capsys):
    """``--check-grads`` on the command line: the table, then one error line, exit 2 (the
    command's main in this process: the user's module is on its path already)."""
    root, _ = user
    import yaml

    from train.__main__ import main

    cfg = config(root, "none", model={"rule": "wrong", "at": 0})
    (root / "wrong.yaml").write_text(yaml.safe_dump({**cfg, "name": "cli"}))
    assert main(["--config", str(root / "wrong.yaml"), "--check-grads"]) == 2
    out, stderr = capsys.readouterr()
    assert "Traceback" not in stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.check_grads: the hand rule "), err
    assert "gain_vjp_wrong of params.blocks[0].gain" in err[0]
    assert "WRONG" in out


# -- loss.check_rules: the user's own rules, checked before step 1 (issue 46) -----------


@pytest.fixture
def rule_cache(tmp_path, monkeypatch):
    """The rule-check cache in a directory of this test's own."""
    monkeypatch.setenv("NNLITE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "checked_rules.json"


def test_a_user_rule_wrong_by_two_stops_a_default_run_in_one_line(user, rule_cache, capsys):
    """``loss.grad: auto`` (the default): the wrong rule is checked against jax.vjp before
    step 1 without --check-grads; one line names it, its error and argument; exit 2."""
    root, _ = user
    import yaml

    from train.__main__ import main

    cfg = config(root, "none", model={"rule": "wrong", "at": 1, "width": 8, "depth": 2})
    del cfg["loss"]  # loss.grad: auto
    (root / "default.yaml").write_text(yaml.safe_dump({**cfg, "name": "default-wrong"}))
    assert main(["--config", str(root / "default.yaml")]) == 2
    out, stderr = capsys.readouterr()
    err = stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in stderr, err
    assert err[0].startswith(
        "error: loss.check_rules: your hand rule gain_vjp_wrong (of gain_wrong, gtmodels.py:"
    ), err
    assert "at params.blocks[1].gain: relative error 1 in the cotangent of argument 0 (x)" in err[0]
    assert "WRONG" not in out  # no table: only --check-grads prints one
    assert not (root / "runs" / "default-wrong" / "metrics.jsonl").exists()  # never trained
    assert not rule_cache.exists()  # a wrong rule is never remembered


def test_a_right_user_rule_is_checked_once_per_code(user, rule_cache, monkeypatch):
    """A right rule trains, the banner naming it as checked (nnlite's own rules not); a
    rerun of the same code and shapes is not checked again, and says so."""
    root, mod = user
    cfg = config(root, "none", model={"width": 8, "depth": 2}, loss={"grad": "auto"})
    lines = []
    run = fit(root, mod, "right", cfg, lines)
    assert run.grad.describe() == "auto -> manual"
    note = [ln for ln in "\n".join(lines).splitlines() if "hand rules of yours" in ln]
    assert len(note) == 1 and "checked against jax.vjp at batch 32 on one device" in note[0]
    assert "gain_vjp (of gain, gtmodels.py:" in note[0] and "linear" not in note[0], note
    assert records(run)[-1]["step"] == 1 and rule_cache.exists()

    def no_check(*a, **k):
        raise AssertionError("checked again")

    monkeypatch.setattr(nl, "check_rules", no_check)
    lines.clear()
    fit(root, mod, "right-again", cfg, lines)
    assert any("checked against jax.vjp by an earlier run (same code" in ln for ln in lines)


def test_check_rules_false_trains_a_wrong_rule_unchecked(user, rule_cache):
    root, mod = user
    cfg = config(root, "none", model={"width": 8, "depth": 2}, loss={"check_rules": False})
    lines = []
    run = fit(root, mod, "unchecked", cfg, lines, rule="wrong", at=0)
    banner = "\n".join(lines)
    assert "hand rules of yours NOT checked against jax.vjp (loss.check_rules=false): " in banner
    assert "gain_vjp_wrong (of gain_wrong, gtmodels.py:" in banner
    assert records(run)[-1]["step"] == 1 and not rule_cache.exists()


@pytest.mark.parametrize("grad", ["auto", "manual"])
def test_a_model_of_nnlite_layers_only_checks_nothing(tmp_path, rule_cache, monkeypatch, grad):
    """nnlite's own rules are never rechecked at start-up: no check runs, nothing is said,
    nothing is cached."""

    def no_check(*a, **k):
        raise AssertionError("nnlite's own rules checked")

    monkeypatch.setattr(nl, "check_rules", no_check)
    cfg = config(tmp_path, "none", loss={"grad": grad})
    cfg["model"] = {"name": "mlp", "hidden_sizes": [8]}
    lines = []
    run = train.fit(None, {**cfg, "name": f"own-{grad}"}, resume="fresh", echo=lines.append)
    assert run.grad.mode == "manual" and run.grad.rules == () and run.grad.rules_note is None
    assert not any("hand rules of yours" in ln for ln in lines)
    assert not rule_cache.exists()


def test_the_rule_cache_key_follows_the_rules_code_and_shapes():
    """What a rule computes by -- its closure, the helpers it calls and their constants --
    and the check's shapes are in the key; the same rule again has the same key."""
    from train.step import rulecache

    def rule(factor, const):
        def helper(x):
            return x * const

        def f(x):
            return x * x

        def f_vjp(x, dret):
            return factor * helper(x) * dret

        return types.SimpleNamespace(f=f, f_vjp=f_vjp)

    x = jnp.ones((2, 3))

    def key(r, arrays=(x,)):
        return rulecache.key([r], arrays, "ctx")

    assert key(rule(2, 1.0)) == key(rule(2, 1.0))
    assert len({key(rule(2, 1.0)), key(rule(3, 1.0)), key(rule(2, 0.5))}) == 3
    assert key(rule(2, 1.0), (jnp.ones((4, 3)),)) != key(rule(2, 1.0))


# -- the non-finite guard names the layer ------------------------------------------------


@pytest.mark.parametrize("strategy", ["none", "fsdp"])
def test_nonfinite_names_first_layer_whose_backward_went_nonfinite(user, strategy):
    root, mod = user
    cfg = config(root, strategy, steps=3)
    with pytest.raises(faults.NonFinite) as e:
        fit(root, mod, f"nan-{strategy}", cfg, rule="nan", at=1)
    msg = str(e.value)
    assert "first non-finite cotangent leaving blocks[1].gain at step 2" in msg, msg
    assert "non-finite values at step 2" in msg


# -- bad policies ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss, match",
    [
        ({"grad": "autodiff", "backward_policies": [{"layers": "head", "clip": 1.0}]},
         r"need manual gradients; this run differentiates with autodiff"),
        ({"grad": "manual", "backward_policies": [{"layers": "blocks/*/attn", "stop": True}]},
         r"backward_policies\[0\]: layers 'blocks/\*/attn' matches no layer .* its layers are "
         r"embed, blocks/0, blocks/0/lin"),
        ({"backward_policies": [{"layers": "head", "clp": 1.0}]},
         r"backward_policies\[0\]: unknown key 'clp'; valid keys: layers, stop, scale, clip"),
        ({"backward_policies": [{"layers": "head", "clip": -1}]},
         r"backward_policies\[0\]\.clip: must be a positive norm, got -1"),
        ({"backward_policies": [{"layers": "head"}]}, r"but no policy"),
    ],
)  # fmt: skip
def test_policy_config_errors(user, loss, match):
    root, mod = user
    with pytest.raises(ConfigError, match=match):
        fit(root, mod, "bad", config(root, loss=loss))


def test_glob_matches_whole_segments():
    from train.step.backward_config import PolicySpec

    spec = PolicySpec("blocks/*/attn", clip=1.0)
    assert spec.matches("blocks[2].attn") and spec.matches("blocks/0/attn")
    assert not spec.matches("blocks[2].attn.qkv") and not spec.matches("attn")
    assert PolicySpec("**/qkv", stop=True).matches("blocks[3].attn.qkv")
    assert PolicySpec("blocks.1.*", stop=True).matches("blocks[1].mlp")
