"""The training CLI: equivalences between strategies, resume, determinism, shipped configs."""

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from _common import cli_sets, quiet_log
from _tolerance import (
    ROUNDINGS_PER_LAYER,
    SAME_PROGRAMS,
    assert_close_f32,
    assert_same_trajectory,
    first_step_grads,
    max_abs_diff,
)

from train import Callback
from train.__main__ import main
from train.checkpoint.rundir import TIMING_KEYS
from train.config import load_config, to_dict
from train.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path, config="configs/digits_mlp.yaml", *overrides, resume="fresh", callbacks=()):
    cfg = load_config(
        ROOT / config,
        [f"log.dir={tmp_path}", "log.progress=false", "log.plot=false", *overrides],
    )
    return train(cfg, resume=resume, echo=lambda *_: None, callbacks=callbacks)


def metrics_without_timings(path):
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


SHORT = ["train.steps=10", "train.batch_size=64", "train.eval_every=5", "train.log_every=1"]
# Layers on the longest path of each config's model (tests/_tolerance.py: the ops bound).
LAYERS = {"configs/digits_mlp.yaml": 4, "configs/linreg_pmap.yaml": 2}  # + relu, loss


class FirstStep(Callback):
    """Keeps the optimizer state after step 1 (a boundary when the run logs every step)."""

    opt_state = None

    def on_step_end(self, loop, step, metrics):
        if step == 1:
            self.opt_state = loop.opt_state()


def grads_and_trajectory(tmp_path, config, *overrides, steps=10):
    """The first step's gradient of a config, and the run after ``steps`` steps: one run,
    read after its first step (under SAME_PROGRAMS, tests/_tolerance.py, a 1-step run's
    step is the same program, so its gradient is the one an N-step run takes first)."""
    common = [*SHORT, *overrides, *SAME_PROGRAMS, "train.log_every=1"]
    first = FirstStep()
    r = run(tmp_path, config, *common, f"train.steps={steps}", callbacks=[first])
    assert first.opt_state is not None, "no boundary after step 1"
    one = types.SimpleNamespace(cfg=r.cfg, step=1, opt_state=first.opt_state)
    return first_step_grads(one), r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(config, *overrides)``: :func:`grads_and_trajectory`'s result, one run per
    resulting config (its name and directory aside): tests that train the same thing (the
    one-device and 2-device references of the strategy, fused and accumulation checks)
    share one run."""
    done = {}

    def get(config, *overrides):
        tmp = tmp_path_factory.mktemp("trained")
        cfg = load_config(ROOT / config, [f"log.dir={tmp}", *SHORT, *overrides, *SAME_PROGRAMS])
        key = json.dumps({**to_dict(cfg), "name": None, "log": None}, sort_keys=True)
        if key not in done:
            done[key] = grads_and_trajectory(tmp, config, *overrides, f"name=r{len(done)}")
        return done[key]

    return get


def assert_same_training(got, want, ops, what):
    """``(grads, run)`` pairs: gradients to ``ops`` roundings, params within one lr."""
    assert_close_f32(got[0], want[0], ops=ops, what=what)
    assert_same_trajectory(got[1].params, want[1].params, lr=want[1].cfg.optimizer.learning_rate)


@pytest.mark.parametrize(
    "config", ["configs/digits_mlp.yaml", "configs/linreg_pmap.yaml"], ids=["mlp", "linreg"]
)
def test_strategies_match_one_device(trained, config):
    # adam for linreg too (it trains with sgd): adam's first moment shows the gradient
    adam = "optimizer.name=adam"
    ref = trained(config, adam, "parallel.strategy=none")
    # The reference must have moved away from init, or equality would prove nothing.
    init = ref[1].model.init(jax.random.key(ref[1].cfg.seed))
    assert max_abs_diff(ref[1].params, init) > 1e-3
    # One device count per strategy: any count splits the batch and reduces its gradient
    # the same way (the count changes only the order of the sums).
    for strategy, n in [("pmap", 8), ("shard_map", 2)]:
        par = [f"parallel.strategy={strategy}", f"parallel.devices={n}"]
        got = trained(config, adam, *par)
        assert len(got[1].devices) == n
        ops = ROUNDINGS_PER_LAYER * LAYERS[config]
        assert_same_training(got, ref, ops, f"{strategy} x {n}: ")


# (SAME_PROGRAMS and test_strategies_match_one_device's device counts: the one-step runs
# are that test's programs, which the session's compile cache has)
@pytest.mark.parametrize("strategy, devices", [("none", 1), ("pmap", 8), ("shard_map", 2)])
def test_steps_per_call_matches_single_steps(tmp_path, strategy, devices):
    common = [
        *SAME_PROGRAMS,
        "train.steps=12",
        "train.batch_size=64",
        "train.log_every=4",
        f"parallel.strategy={strategy}",
        f"parallel.devices={devices}",
    ]
    single = run(tmp_path, "configs/digits_mlp.yaml", *common, "train.steps_per_call=1", "name=a")
    multi = run(tmp_path, "configs/digits_mlp.yaml", *common, "train.steps_per_call=4", "name=b")
    # The same steps, compiled in a loop or one by one: equal up to rounding (bit-identical
    # on the CPUs measured, but XLA may compile a loop body differently). A step that took
    # the wrong batch, or metrics logged for the wrong step, differ by ~lr in the params
    # and by the loss's change per step (~2%) in the metrics.
    assert_same_trajectory(multi.params, single.params, lr=single.cfg.optimizer.learning_rate)
    ra = metrics_without_timings(single.run_dir / "metrics.jsonl")
    rb = metrics_without_timings(multi.run_dir / "metrics.jsonl")
    assert [(r["step"], r["split"]) for r in ra] == [(r["step"], r["split"]) for r in rb]
    for x, y in zip(ra, rb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-3)
        assert x["accuracy"] == pytest.approx(y["accuracy"], abs=1 / 64)  # one example


# 30 steps, checkpoints at 20 and 30 (keep=2), curves on: the run whose directory
# test_run_directory_contents reads, the uninterrupted run test_resume_is_bit_identical
# resumes a copy of, and the first of test_same_config_gives_identical_metrics's two runs.
THIRTY = [
    "train.steps=30",
    "checkpoint.every=10",
    "checkpoint.keep=2",
    "train.log_every=5",
    "train.eval_every=10",
]


@pytest.fixture(scope="module")
def thirty(tmp_path_factory):
    return run(
        tmp_path_factory.mktemp("thirty"), "configs/digits_mlp.yaml", *THIRTY, "log.plot=true"
    )


def test_resume_is_bit_identical(tmp_path, thirty):
    full = thirty
    # The same run's directory, then a crash right after step 20: later checkpoints never
    # happened.
    part_dir = tmp_path / "part"
    shutil.copytree(full.run_dir, part_dir)
    ckpts = sorted((part_dir / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["ckpt_00000020.safetensors", "ckpt_00000030.safetensors"]
    ckpts[1].unlink()
    # Step 20 as the trainer wrote it before it used nl.save (same keys, no "format" in the
    # metadata), beside a temporary file of the old name that a kill left.
    import safetensors
    import safetensors.numpy

    with safetensors.safe_open(str(ckpts[0]), framework="numpy") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "format"}
    tensors = safetensors.numpy.load_file(str(ckpts[0]))
    assert meta["format_version"] == "1" and "params/ffn/layers[0]/W" in tensors
    safetensors.numpy.save_file(tensors, str(ckpts[0]), metadata=meta)
    ckpts[1].with_name(ckpts[1].name + ".tmp").write_bytes(b"half")
    resumed = run(tmp_path, "configs/digits_mlp.yaml", *THIRTY, "name=part", resume="auto")
    assert resumed.step == 30
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(full.opt_state), jax.tree.leaves(resumed.opt_state)):
        np.testing.assert_array_equal(a, b)
    assert metrics_without_timings(full.run_dir / "metrics.jsonl") == metrics_without_timings(
        resumed.run_dir / "metrics.jsonl"
    )


def test_same_config_gives_identical_metrics(tmp_path, thirty):
    # a second fresh run of thirty's config (its curves aside: they change no metric)
    b = run(tmp_path / "b", "configs/digits_mlp.yaml", *THIRTY)
    ma = metrics_without_timings(thirty.run_dir / "metrics.jsonl")
    assert len(ma) > 5
    assert ma == metrics_without_timings(b.run_dir / "metrics.jsonl")


def test_run_directory_contents(thirty):
    r = thirty
    cfg = load_config(
        ROOT / "configs/digits_mlp.yaml",
        [f"log.dir={r.run_dir.parent}", "log.progress=false", "log.plot=false", *THIRTY],
    )
    names = sorted(p.name for p in r.run_dir.iterdir())
    assert names == ["checkpoints", "config.yaml", "curves.png", "metrics.jsonl"]
    assert (r.run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = sorted(p.name for p in (r.run_dir / "checkpoints").iterdir())
    assert ckpts == ["ckpt_00000020.safetensors", "ckpt_00000030.safetensors"]
    assert load_config(r.run_dir / "config.yaml") == r.cfg  # with the data-filled model fields
    assert r.cfg.model.options == {**cfg.model.options, "in_features": 64, "num_classes": 10}
    from safetensors import safe_open

    with safe_open(str(r.run_dir / "checkpoints" / ckpts[-1]), framework="numpy") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "params/ffn/layers[0]/W" in keys and "params/head/b" in keys
    assert any(k.startswith("opt_state") and k.endswith("/mu/head/W") for k in keys)
    assert meta["step"] == "30" and json.loads(meta["data_position"])["epoch"] == 30 // (
        1437 // 128
    )
    assert json.loads(meta["config"])["name"] == cfg.name
    # For inference: the params part, as a ParamsDict or checked against the model.
    import nnlite as nl

    path = r.run_dir / "checkpoints" / ckpts[-1]
    for params in (
        nl.load(path, subtree="params"),
        nl.load(path, like=r.model.init(jax.random.key(0)), subtree="params"),
    ):
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(r.params), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def digits_mlp_full(tmp_path_factory):
    """The shipped digits MLP config as it stands (its loss.grad: auto), trained once for
    the two tests that read its accuracy."""
    return run(tmp_path_factory.mktemp("digits_mlp_full"), "configs/digits_mlp.yaml", "name=auto")


def test_digits_mlp_config_reaches_97_percent(digits_mlp_full):
    assert digits_mlp_full.summary["test_accuracy"] >= 0.97


def test_print_config(capsys):
    assert (
        main(
            [
                "--config",
                str(ROOT / "configs/digits_mlp.yaml"),
                "--set",
                "train.steps=7",
                "--print-config",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "steps: 7" in out and "name: digits_mlp" in out


def test_cli_bad_input_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            "--config",
            "configs/digits_mlp.yaml",
            "--set",
            "optimizer.name=adamax",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "optimizer.name=adamax is not a named optimizer (sgd, momentum, adam, adamw, lion)" in (
        proc.stderr
    )


# Without accumulation fused is a custom_vjp inside the loss that each strategy
# differentiates as it does autodiff's: one device, and shard_map (the loss pmean-ed
# before the fused backward pass); pmap differentiates the local loss as one device does
# and pmeans afterwards (test_strategies_match_one_device), and the fused pass under
# pmap is test_grad_accumulation_equals_one_big_batch[fused-pmap]'s and
# tests/test_grad_modes.py's test_modes_under_pmap_match_one_device's.
@pytest.mark.parametrize("strategy", ["none", "shard_map"])
def test_fused_mode_trains_like_autodiff(trained, strategy):
    # manual == autodiff for this model under every strategy: tests/test_manual_train.py
    # (shard_map on 2 devices: the autodiff runs are test_strategies_match_one_device's,
    # the fused one on shard_map test_grad_accumulation_equals_one_big_batch's whole batch)
    par = [f"parallel.strategy={strategy}"] + (["parallel.devices=2"] if strategy != "none" else [])
    mlp = "configs/digits_mlp.yaml"
    auto = trained(mlp, *par, "loss.grad=autodiff")
    fused = trained(mlp, *par, "loss.grad=fused")
    assert_same_training(fused, auto, ROUNDINGS_PER_LAYER * LAYERS[mlp], "fused: ")


# Two accumulation paths (train/step/step.py: batch_grads_fn): the generic scan of
# value_and_grad (autodiff and manual alike) over each strategy's global_loss (the
# identity for none and pmap, a pmean for shard_map), and the model's own accumulating
# pass (fused), whose local sums each strategy reduces its own way (local_accumulator,
# reduce(local_grads=True)). Each path under each strategy whose code for it differs,
# each grad mode once: the generic scan on none (pmap's global_loss too; its pmean after
# the scan is fused x pmap's) and on shard_map; fused on pmap (the base class's
# accumulator, also none's) and on shard_map (its own).
@pytest.mark.parametrize(
    "grad, strategy",
    [
        ("autodiff", "none"),
        ("manual", "shard_map"),
        ("fused", "pmap"),
        ("fused", "shard_map"),
    ],
)
def test_grad_accumulation_equals_one_big_batch(trained, grad, strategy):
    # k microbatches of B/k summed into one update == one step on the batch of B (B = 64:
    # two whole-batch runs are test_strategies_match_one_device's and
    # test_fused_mode_trains_like_autodiff's, shared).
    common = [
        "train.batch_size=64",
        f"loss.grad={grad}",
        f"parallel.strategy={strategy}",
    ] + (["parallel.devices=2"] if strategy != "none" else [])
    mlp = "configs/digits_mlp.yaml"
    whole = trained(mlp, *common, "train.grad_accum_steps=1")
    accum = trained(mlp, *common, "train.grad_accum_steps=4")
    # + 1 layer: the sum over microbatches
    assert_same_training(accum, whole, ROUNDINGS_PER_LAYER * (LAYERS[mlp] + 1), "accum: ")


def test_grad_modes_config_offers_every_model_mode():
    from train.config import GRAD_MODES
    from train.model import registry as models
    from train.model.contract import grad_modes

    # The trainer keeps its own tuple (nnlite has no CLI settings); every mode a shipped
    # model supports must be a choice the config accepts.
    for name in models.MODELS:
        modes = grad_modes(models.resolve(name))
        assert set(modes) <= set(GRAD_MODES), (name, modes)
    assert "fused" in grad_modes(models.resolve("mlp"))


def test_fused_mode_reaches_autodiff_accuracy(tmp_path, digits_mlp_full):
    auto = digits_mlp_full
    fused = run(tmp_path, "configs/digits_mlp.yaml", "loss.grad=fused", "name=fused")
    assert fused.summary["test_accuracy"] >= 0.97 and auto.summary["test_accuracy"] >= 0.97
    # 1500 Adam steps: runs that differ only in rounding end a few of the 360 test examples
    # apart (1 here), not exactly level; that the two modes compute the same gradient is
    # test_fused_mode_trains_like_autodiff's
    assert abs(fused.summary["test_accuracy"] - auto.summary["test_accuracy"]) <= 4 / 360


@pytest.mark.parametrize("strategy", ["none", "shard_map"])
def test_prepare_compiles_the_first_step_and_the_eval_ahead(tmp_path, strategy):
    from train.loop.build import build, prepare
    from train.loop.trainer import boundaries, steps_in_call

    cfg = load_config(
        ROOT / "configs/digits_mlp.yaml",
        [f"log.dir={tmp_path}", "train.steps_per_call=4", f"parallel.strategy={strategy}"],
    )
    r = build(cfg)
    k = steps_in_call(cfg, 0, boundaries(cfg))
    first = np.arange(k * cfg.train.batch_size).reshape(k, -1)
    prep = prepare(r, cfg.train.nonfinite, first)
    st = prep.stepper
    p_leaves = st.put_state(jax.tree.leaves(prep.params0))
    o_leaves = st.put_state(jax.tree.leaves(prep.opt0))
    idx = st.put_indices(first)
    # the evaluation may still be compiling on prepare's thread (its first call waits for
    # it): let that finish, or its event would reach the listener below from that thread
    prep.evaluate.wait()
    compiled = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        p_leaves, o_leaves, _, metrics = st.run(p_leaves, o_leaves, [], prep.X, prep.Y, idx)
        params = jax.tree.unflatten(jax.tree.structure(prep.params0), st.get_state(p_leaves))
        evaluated = prep.evaluate(
            jax.device_put(params, prep.eval_device), prep.X_test, prep.Y_test
        )
        jax.block_until_ready((metrics, evaluated))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiled == []  # both calls ran what prepare had compiled
    assert metrics["loss"].shape == (k,) and np.isfinite(np.asarray(metrics["loss"])).all()


# (also test_linreg_pmap_config_recovers_the_line, which trained the same config again)
def test_linreg_pmap_config_recovers_the_line_and_prints_its_learned_params(tmp_path, capsys):
    base = cli_sets(*quiet_log(tmp_path))
    assert main(["--config", str(ROOT / "configs/linreg_pmap.yaml"), *base]) == 0
    out = capsys.readouterr().out
    assert "devices: 8 x cpu (pmap" in out  # devices: all
    lines = out.splitlines()
    at = lines.index("learned params (2):")
    w = float(lines[at + 1].split("= [[")[1].rstrip("]"))
    b = float(lines[at + 2].split("= [")[1].rstrip("]"))
    assert lines[at + 1].startswith("  /W = ") and lines[at + 2].startswith("  /b = ")
    assert abs(w - 2) < 0.1 and abs(b + 1) < 0.1  # what configs/linreg_pmap.yaml promises
    # (a model with more than 100 params prints no such table: the digits MLP's run in
    # test_compile_cache_is_the_clis_alone)


def test_compile_cache_is_the_clis_alone(tmp_path, monkeypatch, capsys):
    from train import __main__ as cli

    before = jax.config.jax_compilation_cache_dir
    base = cli_sets(*quiet_log(tmp_path))
    monkeypatch.setenv("NNLITE_CACHE", str(tmp_path / "cache"))
    assert (
        main(["--config", str(ROOT / "configs/digits_mlp.yaml"), *base, "--set", "train.steps=2"])
        == 0
    )
    # a model with more than 100 params prints no learned-params table (linreg's: see
    # test_linreg_pmap_config_recovers_the_line_and_prints_its_learned_params)
    assert "learned params" not in capsys.readouterr().out
    assert jax.config.jax_compilation_cache_dir == before  # in-process callers: untouched
    # no compile cache written (the directory may hold the MFU's measured CPU peak, which
    # a process measures once: run alone, this test's run is the one that measures it)
    assert not (tmp_path / "cache" / "jax").exists()
    assert cli.compile_cache_dir("auto") == tmp_path / "cache" / "jax"
    monkeypatch.delenv("NNLITE_CACHE")
    assert cli.compile_cache_dir("auto") == Path.home() / ".cache" / "nnlite" / "jax"
    assert cli.compile_cache_dir("~/x") == Path.home() / "x" and cli.compile_cache_dir(None) is None


def test_python_m_train_fills_the_compile_cache_unless_off(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}
    env.update(NNLITE_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    sets = [
        "name=c",
        "train.steps=2",
        "log.progress=false",
        "log.plot=false",
        f"log.dir={tmp_path}",
    ]
    sets += ["model.hidden_sizes=[8]", "compile_cache=auto"]
    args = [sys.executable, "-m", "train", "--config", "configs/digits_mlp.yaml"]
    proc = subprocess.run(
        [*args, *[x for s in sets for x in ("--set", s)]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    cached = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "jax").glob("*-cache"))
    assert {"jit_init", "jit_multi_step", "jit_evaluate"} <= set(cached), cached
    # compile_cache: null, off: python -m train's main passes the config's None to the
    # same enable_compile_cache, which turns JAX's persistent cache off for the process
    # (in this process: the setting, put back; a subprocess for it compiled everything
    # again only to find no files)
    from train import __main__ as cli

    assert (
        load_config(ROOT / "configs/digits_mlp.yaml", ["compile_cache=null"]).compile_cache is None
    )
    was = jax.config.jax_enable_compilation_cache
    try:
        cli.enable_compile_cache(None)
        assert jax.config.jax_enable_compilation_cache is False
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
