"""``python -m train --eject DIR``: the ejected script runs without the trainer and prints
the trainer's losses (metrics.jsonl) to float rounding; bad directories and runs it cannot
reproduce are one line, exit 2, nothing written."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import train
from train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12

# The scripts run in a process where the trainer and the shipped models cannot be
# imported: one process runs each given script in turn, from the script's own directory
# (where a user's modules are not: the script finds them relative to itself), as
# ``python SCRIPT`` would (one process for both tests' scripts: ~1.5 s of imports each).
RUN_BLOCKED = textwrap.dedent(
    """
    import os, runpy, sys
    for name in ("train", "models", "nnlite.train", "nnlite.models"):
        sys.modules[name] = None  # importing it raises ImportError
    for script in sys.argv[1:]:
        os.chdir(os.path.dirname(script))
        sys.argv = [script]
        print("script", script, flush=True)
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            assert not e.code, (script, e.code)
    """
)

USER_MODEL = '''
import jax.numpy as jnp
import nnlite as nl


def scaled_tanh_vjp(x, dret):
    return dret * 2.0 * (1 - jnp.tanh(x) ** 2)


@nl.hand_rule(scaled_tanh_vjp)
def scaled_tanh(x):
    return 2.0 * jnp.tanh(x)


class DropMLP(nl.Module):
    """A user's model with its own hand rule and dropout (a key per step)."""

    in_features: int
    num_classes: int
    task = "classification"

    def setup(self):
        self.inp = nl.Linear(self.in_features, 16)
        self.drop = nl.Dropout(0.3)
        self.out = nl.Linear(16, self.num_classes)

    def __call__(self, params, x, *, key=None):
        h = self.drop(scaled_tanh(self.inp(params.inp, x)), key=key)
        return self.out(params.out, h)
'''


def _trainer_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}


def _scripts_losses(*scripts: Path) -> dict[Path, dict[int, float]]:
    """``{script: {step: loss}}`` as the scripts print them, run in one blocked process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", RUN_BLOCKED, *map(str, scripts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = {}
    for line in out.stdout.splitlines():
        if line.startswith("script "):
            current = losses.setdefault(Path(line.split(" ", 1)[1]), {})
            continue
        _, step, _, loss = line.split()
        current[int(step)] = float(loss)
    assert sorted(losses) == sorted(scripts), out.stdout
    return losses


def _eject_and_train(
    tmp: Path, config: str, overrides: list[str], empty_dir: bool = False
) -> tuple[Path, Path, list[str]]:
    """The ejected script, the trainer's run directory, and what --eject wrote (before
    the script ran and saved its trained params beside it)."""
    sets = [f"train.steps={STEPS}", "train.log_every=1", f"train.eval_every={STEPS}"]
    sets += [f"log.dir={tmp / 'runs'}", "log.progress=false", "log.plot=false", *overrides]
    argv = ["--config", config] + [a for s in sets for a in ("--set", s)]
    if empty_dir:  # an existing empty directory is filled; else a new one is made
        (tmp / "ejected").mkdir()
    assert main([*argv, "--eject", str(tmp / "ejected")]) == 0
    written = sorted(p.name for p in (tmp / "ejected").iterdir())
    run = train.fit(None, config, overrides=sets, echo=lambda *_: None)
    return tmp / "ejected" / "train_ejected.py", run.run_dir, written


@pytest.fixture(scope="module")
def mlp_shipped(tmp_path_factory):
    """configs/digits_mlp.yaml as shipped (loss.grad=autodiff): ejected, and trained."""
    tmp = tmp_path_factory.mktemp("eject_mlp")
    return _eject_and_train(tmp, str(ROOT / "configs/digits_mlp.yaml"), [])


@pytest.fixture(scope="module")
def user_dropout(tmp_path_factory):
    """A user's model with its own rule and dropout, manual, two microbatches per step,
    adamw + clipping + warmup."""
    tmp = tmp_path_factory.mktemp("eject_user")
    (tmp / "dropmods.py").write_text(USER_MODEL)
    config = tmp / "drop.yaml"
    config.write_text(
        textwrap.dedent(
            """
            name: drop
            model: {name: "dropmods:DropMLP"}
            data: {name: digits}
            loss: {grad: manual}
            optimizer: {name: adamw, learning_rate: 0.01, weight_decay: 0.1, decay: matrices,
                        schedule: warmup_cosine, warmup_steps: 3, clip_norm: 0.5}
            seed: 3
            train: {batch_size: 64, grad_accum_steps: 2}
            """
        )
    )
    return _eject_and_train(tmp, str(config), [], empty_dir=True)


@pytest.fixture(scope="module")
def script_losses(mlp_shipped, user_dropout):
    """Both ejected scripts' printed losses, from one process; the user's project moved
    elsewhere first (the script names no directory of the machine it was made on)."""
    project = user_dropout[0].parents[1]
    moved = project.rename(project.with_name(project.name + "_moved"))
    try:
        script = moved / user_dropout[0].relative_to(project)
        losses = _scripts_losses(mlp_shipped[0], script)
    finally:
        moved.rename(project)
    losses[user_dropout[0]] = losses.pop(script)
    return losses


def test_shipped_config_script_reproduces_the_trainer_losses(mlp_shipped, script_losses):
    script, run_dir, written = mlp_shipped
    src = script.read_text()
    # autodiff: the forward pass by the layers' functions, differentiated by JAX
    assert "from nnlite.rules import linear, mean, relu, softmax_cross_entropy" in src
    assert "jax.value_and_grad(loss_fn)" in src and "optax.adam(" in src
    assert not any(w in src for w in ("import train", "from train", "models"))
    assert written == [
        "data.npz",
        "params.safetensors",
        "train_ejected.py",
    ]
    want = _trainer_losses(run_dir)
    got = script_losses[script]
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)
    assert want[STEPS] < want[1]  # it trained


def test_user_model_with_rule_and_dropout_reproduces(user_dropout, script_losses):
    script, run_dir, _ = user_dropout
    src = script.read_text()
    # manual: the hand VJPs called by name, the user's from the user's module
    assert "from dropmods import scaled_tanh, scaled_tanh_vjp" in src
    # found relative to the script (and from where it runs), no absolute directory
    assert "sys.path[:0] = [os.path.join(HERE, '..'), os.getcwd()]" in src
    assert str(script.parents[1]) not in src
    assert "scaled_tanh_vjp(" in src and "linear_vjp(" in src and "dropout_vjp(" in src
    assert "key = jax.random.fold_in(jax.random.key(SEED), step)" in src
    assert "for i in range(2):" in src and "jax.random.fold_in(key, i)" in src  # microbatches
    assert "optax.clip_by_global_norm(0.5)" in src and "decay='matrices'" in src
    # the trainer's own optimizer functions, copied: adamw and the mask it calls
    assert "def adamw(learning_rate" in src and "def decay_mask(params)" in src
    want = _trainer_losses(run_dir)
    got = script_losses[script]
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    return err


def test_bad_directories_are_one_line_and_untouched(tmp_path, capsys):
    config = ["--config", str(ROOT / "configs/digits_mlp.yaml")]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    err = _refused(capsys, [*config, "--eject", str(full)])
    assert "not empty" in err and str(full) in err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    assert (full / "keep.txt").read_text() == "mine"

    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not a directory" in _refused(capsys, [*config, "--eject", str(a_file)])
    assert a_file.read_text() == "x"

    missing = tmp_path / "no" / "such" / "dir"
    assert "does not exist" in _refused(capsys, [*config, "--eject", str(missing)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]  # no leftovers


def test_runs_it_cannot_reproduce_are_refused(tmp_path, capsys):
    config = ["--config", str(ROOT / "configs/digits_mlp.yaml")]
    out = str(tmp_path / "out")
    err = _refused(capsys, [*config, "--set", "parallel.strategy=fsdp", "--eject", out])
    assert "parallel.strategy=fsdp" in err and "parallel.strategy=none" in err
    err = _refused(capsys, [*config, "--set", "train.nonfinite=skip", "--eject", out])
    assert "train.nonfinite=skip" in err
    err = _refused(capsys, [*config, "--set", "loss.grad=fused", "--eject", out])
    assert "loss.grad=fused" in err and "loss.grad=manual" in err
    err = _refused(capsys, [*config, "--processes", "2", "--eject", out])
    assert "--processes" in err
    assert list(tmp_path.iterdir()) == []
