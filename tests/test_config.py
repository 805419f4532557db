"""Bad input to the training CLI: one clear line, exit status 2, nothing damaged."""

import re
from pathlib import Path

import numpy as np
import pytest

import models
from train import config as config_mod
from train.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs/digits_mlp.yaml")


def cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_model_names_match_registry():
    assert set(config_mod.MODEL_NAMES) == set(models.MODELS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.bogus=1"], r"unknown key 'train.bogus'; valid keys in train: batch_size, steps"),
        (["bogus.key=1"], r"unknown key 'bogus'; valid keys in the top level: name, seed, model"),
        (["train.steps=abc"], r"train.steps: expected int, got 'abc'"),
        (["train.steps=0"], r"train.steps must be >= 1, got 0"),
        (["seed=-1"], r"seed must be in \[0, 2147483647\], got -1"),
        (
            ["data.split_seed=2147483648"],
            r"data.split_seed must be in \[0, 2147483647\], got 2147483648",
        ),
        (["optimizer.learning_rate=fast"], r"optimizer.learning_rate: expected float, got 'fast'"),
        (
            ["optimizer.name=adamax"],
            r"optimizer.name: 'adamax' is not one of sgd, momentum, adam, adamw, lion",
        ),
        (
            ["parallel.strategy=ddp"],
            r"parallel.strategy: 'ddp' is not one of none, pmap, shard_map",
        ),
        (
            ["parallel.devices=many"],
            r"parallel.devices must be 'all' or a positive int, got 'many'",
        ),
        (["model.name=resnet"], r"model.name: 'resnet' is not one of mlp, linreg"),
        (
            ["model.hidden_sizes=[]"],
            r"model.hidden_sizes must be a non-empty list of positive ints",
        ),
        (["model.hidden_sizes=12"], r"model.hidden_sizes: expected list of int, got 12"),
        (["data.name=npz"], r"data.path is required when data.name is npz"),
        (["data.test_fraction=1.5"], r"data.test_fraction must be in \(0, 1\), got 1.5"),
        (["train=3"], r"train must be a mapping, got 3"),
        (["train.steps"], r"--set 'train.steps': expected section.key=value"),
        (
            ["parallel.strategy=pmap", "parallel.devices=8", "train.batch_size=100"],
            r"train.batch_size=100 does not split across 8 devices; use a multiple of 8, e.g. 96 or 104",
        ),
        (
            ["parallel.strategy=pmap", "parallel.devices=64"],
            r"parallel.devices=64 but only 8 local devices exist",
        ),
        (
            ["data.name=linreg"],
            r"model.name=mlp is a classification model but data.name=linreg is a regression",
        ),
    ],
)
def test_bad_config_values(capsys, tmp_path, overrides, message):
    sets = [x for o in overrides for x in ("--set", o)]
    code, err = cli(capsys, "--config", DIGITS, "--set", f"log.dir={tmp_path}", *sets)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err), err
    assert not (tmp_path / "digits_mlp").exists()  # nothing written for bad input


def test_missing_config_file(capsys, tmp_path):
    code, err = cli(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "config file not found" in err and "nope.yaml" in err


def test_bad_yaml(capsys, tmp_path):
    code, err = cli(capsys, "--config", write(tmp_path, "train: [1, 2\n"))
    assert code == 2 and "not valid YAML at line" in err


def test_top_level_not_a_mapping(capsys, tmp_path):
    code, err = cli(capsys, "--config", write(tmp_path, "- 1\n- 2\n"))
    assert code == 2 and "expected a mapping of sections" in err


def test_error_names_the_file(capsys, tmp_path):
    path = write(tmp_path, "train:\n  stepz: 3\n")
    code, err = cli(capsys, "--config", path)
    assert code == 2 and path in err and "train.stepz" in err


def npz_args(path, tmp_path, *sets):
    """CLI arguments training the digits config on the npz file ``path``."""
    args = ["--config", DIGITS]
    for o in ("data.name=npz", f"data.path={path}", f"log.dir={tmp_path}", *sets):
        args += ["--set", o]
    return args


def npz_case(tmp_path, capsys, **arrays):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    return cli(capsys, *npz_args(path, tmp_path))


X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
Y = np.arange(40) % 4


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": X}, r"missing array 'y'; found \['x'\]"),
        ({"x": X, "y": Y[:30]}, r"y has shape \(30,\) but x has 40 rows"),
        ({"x": np.where(X > 1, np.nan, X), "y": Y}, r"x has \d+ non-finite values"),
        ({"x": X, "y": Y - 1}, r"labels must be >= 0, found -1"),
        ({"x": X, "y": Y, "x_test": X}, r"x_test and y_test must be given together"),
        (
            {"x": X, "y": Y, "x_test": X[:, :2], "y_test": Y},
            r"x_test has feature shape \(2,\), x has \(3,\)",
        ),
        (
            {"x": X.reshape(40, 3, 1), "y": Y},
            r"x must have shape \[n, features\], got \(40, 3, 1\)",
        ),
        (
            {"x": X, "y": np.stack([Y, Y], 1)},
            r"integer labels y must have shape \[n\], got \(40, 2\)",
        ),
        (
            {"x": X, "y": np.array(["a"] * 40)},
            r"y must be integer labels or float targets, got dtype <U1",
        ),
    ],
)
def test_bad_npz(tmp_path, capsys, arrays, message):

    code, err = npz_case(tmp_path, capsys, **arrays)
    assert code == 2 and re.search(message, err), err


def test_npz_missing_and_unreadable(tmp_path, capsys):
    code, err = cli(
        capsys,
        "--config",
        DIGITS,
        "--set",
        "data.name=npz",
        "--set",
        f"data.path={tmp_path}/no.npz",
    )
    assert code == 2 and "no.npz" in err and "file not found" in err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    code, err = cli(
        capsys, "--config", DIGITS, "--set", "data.name=npz", "--set", f"data.path={bad}"
    )
    assert code == 2 and "not a readable .npz file" in err


def test_npz_trains(tmp_path, capsys):
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(3, 5)) * 4
    y = np.arange(300) % 3
    x = (centers[y] + rng.normal(size=(300, 5))).astype(np.float32)
    path = tmp_path / "blobs.npz"
    np.savez(path, x=x, y=y)
    sets = ("train.steps=200", "train.batch_size=32", "log.progress=false", "name=blobs")
    code = main(npz_args(path, tmp_path, *sets))
    assert code == 0
    assert "test accuracy" in capsys.readouterr().out


def test_bad_checkpoint_is_reported_and_left_alone(tmp_path, capsys):
    base = [
        "--config",
        DIGITS,
        "--set",
        f"log.dir={tmp_path}",
        "--set",
        "log.progress=false",
        "--set",
        "train.steps=10",
    ]
    assert main(base) == 0
    run_dir = tmp_path / "digits_mlp"
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    ckpt = run_dir / "checkpoints" / "ckpt_00000010.safetensors"
    ckpt_before = ckpt.read_bytes()
    capsys.readouterr()

    # A different architecture: the restore names the first path that does not fit.
    code, err = cli(capsys, *base, "--set", "model.hidden_sizes=[32]", "--set", "train.steps=20")
    assert code == 2
    assert (
        "'params/ffn/layers[0]/W' is float32[64, 128], the model/optimizer expects float32[64, 32]"
        in err
    )
    # A changed hyperparameter that keeps the shapes: refused by name.
    code, err = cli(
        capsys, *base, "--set", "optimizer.learning_rate=0.5", "--set", "train.steps=20"
    )
    assert (
        code == 2
        and "optimizer.learning_rate=0.003 but the config has optimizer.learning_rate=0.5" in err
    )
    # A corrupt file.
    ckpt.write_bytes(b"\x00" * 16)
    code, err = cli(capsys, *base, "--set", "train.steps=20")
    assert code == 2 and "not a readable safetensors file" in err
    ckpt.write_bytes(ckpt_before)
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before

    code, err = cli(capsys, *base, "--resume", "--set", f"log.dir={tmp_path}/empty")
    assert code == 2 and "--resume: no checkpoint in" in err
