"""Faults: SIGTERM/SIGINT preemption, SIGKILL at any moment, and non-finite steps."""

import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _inject
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from _xla import xla_flags

import nnlite as nl
from train import faults
from train.__main__ import main
from train.checkpoint.rundir import TIMING_KEYS
from train.checkpoint.store import flatten_with_paths
from train.config import load_config
from train.data.dataset import epoch_order
from train.loop import nonfinite
from train.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/digits_mlp.yaml"
CACHE = Path("/tmp/nnlite-test-jax-cache")
COMMON = [
    "name=run",
    "data.name=npz",
    "model.hidden_sizes=[16]",
    "train.batch_size=32",
    "log.progress=false",
    "log.plot=false",
]


def cli_args(tmp_path, *overrides) -> list[str]:
    args = ["--config", CONFIG]
    for o in (*COMMON, f"log.dir={tmp_path}", *overrides):
        args += ["--set", o]
    return args


def spawn(args, **inject) -> subprocess.Popen:
    """``python -m train ARGS``, with the faults of tests/_inject.py that ``inject`` names
    (``pause=``, ``stuck=``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    if inject:
        env = _inject.env(env, **inject)
    # Restarted runs compile the same step: share JAX's persistent cache to start faster.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env["XLA_FLAGS"] = xla_flags(1)
    return subprocess.Popen(
        [sys.executable, "-m", "_inject" if inject else "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def in_process(tmp_path, *overrides):
    cfg = load_config(ROOT / CONFIG, [*COMMON, f"log.dir={tmp_path}", *overrides])
    return train(cfg, resume="fresh", echo=lambda *_: None)


def saved_params(run_dir: Path) -> dict:
    last = sorted((run_dir / "checkpoints").glob("ckpt_*.safetensors"))[-1]
    return {k: v for k, v in safetensors.numpy.load_file(str(last)).items()}


def assert_bit_identical(saved: dict, r) -> None:
    ref = {
        **flatten_with_paths("params", r.params),
        **flatten_with_paths("opt_state", r.opt_state),
    }
    assert sorted(saved) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(saved[k], np.asarray(ref[k]), err_msg=k)


def latest_checkpoint(ckpt_dir: Path) -> int:
    steps = [int(p.name[5:13]) for p in ckpt_dir.glob("ckpt_*.safetensors")]
    return max(steps, default=0)


def metrics_without_timings(path: Path) -> list[dict]:
    records = [json.loads(ln) for ln in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# One run, stopped in every way and resumed each time, serves the SIGTERM and the SIGKILL
# tests (each restart pays a JAX start-up), on streamed data: SIGTERM first (a fresh run, then its printed
# command), then one SIGKILL in each phase: a half-written checkpoint, start-up, a
# written-but-unrenamed checkpoint, mid-training; then a run to the end, compared bit for
# bit with one uninterrupted in-process run (the final run too is in-process: it is
# a resume, not a signal's target). Every run but the last pauses in each
# checkpoint write (tests/_inject.py), so that a signal sent after a write began lands
# before the run can end, however loaded the machine.
INTERRUPTED = [
    "train.steps=100",
    "checkpoint.every=5",
    "checkpoint.keep=3",
    "train.log_every=5",
    "train.eval_every=20",
]
PAUSE = 0.2  # the hook pauses twice per checkpoint write: half-written, then unrenamed


def tmp_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the checkpoints being written (nl.save's temporary names)."""
    return [int(p.name[5:13]) for p in ckpt_dir.glob("ckpt_*.safetensors.*.tmp")]


def streamed_copy(npz: str, d: Path) -> list[str]:
    """--set keys of the ``npz`` fixture's data as a directory of .npy files, streamed
    from the host (``data.placement=host``): read per batch a call ahead by a prefetcher."""
    d.mkdir()
    with np.load(npz.split("=", 1)[1]) as f:
        for k in f.files:
            np.save(d / f"{k}.npy", f[k])
    return ["data.name=arrays", f"data.path={d}", "data.placement=host"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, npz):
    tmp_path = tmp_path_factory.mktemp("interrupted")
    # streamed data: a kill finds the prefetcher reading ahead, and the resumed run must
    # still read exactly the batches of (seed, step) (once test_streamed's own kill test)
    over = [*streamed_copy(npz, tmp_path / "arrays"), *INTERRUPTED]
    run_dir = tmp_path / "run"
    ckpt_dir, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    out = {"run_dir": run_dir}
    pause = {"pause": PAUSE}

    # SIGTERM once the first checkpoint write has begun: the run cannot end before it lands
    proc = spawn([*cli_args(tmp_path, *over), "--fresh"], **pause)
    try:
        while not (ckpt_dir.exists() and any(ckpt_dir.iterdir())):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        _, out["sigterm_err"] = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    out["sigterm_rc"] = proc.returncode
    line = next(
        (ln for ln in out["sigterm_err"].splitlines() if ln.startswith("preempted by SIGTERM")),
        "",
    )
    out["sigterm_line"] = line
    args = shlex.split(line.split("resume with: ")[-1])[1:]  # drop "nnlite-train"

    # SIGKILL in each phase, resuming with the printed command each time
    kill_points = []
    for phase in ["half-written", "start-up", "unrenamed", "mid-training"]:
        before = latest_checkpoint(ckpt_dir)
        proc = spawn(args, **pause)
        try:
            if phase in ("half-written", "unrenamed"):  # inside a write ahead of the latest
                while not any(s > before for s in tmp_steps(ckpt_dir)) and proc.poll() is None:
                    time.sleep(0.005)
                # the temporary file stays 2 x PAUSE: half-written, then complete
                time.sleep((0.25 if phase == "half-written" else 1.5) * PAUSE)
            elif phase == "start-up":
                proc.stdout.readline()  # the start line: jax is up, compiling follows
                time.sleep(0.1)
            else:  # right after a write has been renamed, before the next one
                while latest_checkpoint(ckpt_dir) <= before and proc.poll() is None:
                    time.sleep(0.005)
            proc.kill()
            stdout, _ = proc.communicate()
        finally:
            proc.kill()
        done = sorted(p.name for p in ckpt_dir.glob("*"))
        kill_points.append((phase, proc.returncode, done, stdout))
        if phase == "unrenamed":  # a torn last line, as a kill mid-write leaves
            with open(metrics, "a") as f:
                f.write('{"step": 99, "split": "tr')
    out["kill_points"] = kill_points
    # the run to the end: in this process (the subprocesses above compile with the same
    # XLA flags, so its steps are bit for bit theirs; it pays no second JAX start-up)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        out["final_rc"] = main(args)
    out["final_err"] = err.getvalue()
    out["ref"] = in_process(tmp_path, *over, "name=ref")
    return out


def assert_finished_like_uninterrupted(interrupted) -> None:
    run_dir, ref = interrupted["run_dir"], interrupted["ref"]
    assert interrupted["final_rc"] == 0, interrupted["final_err"]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert_bit_identical(saved_params(run_dir), ref)
    assert metrics_without_timings(run_dir / "metrics.jsonl") == metrics_without_timings(
        ref.run_dir / "metrics.jsonl"
    )


def test_sigterm_saves_exits_3_and_the_printed_command_resumes_exactly(interrupted):
    err, line = interrupted["sigterm_err"], interrupted["sigterm_line"]
    assert interrupted["sigterm_rc"] == faults.EXIT_PREEMPTED, err
    assert line.startswith("preempted by SIGTERM"), err
    step = int(line.split("at step ")[1].split(":")[0])
    assert 0 < step < 100
    assert f"ckpt_{step:08d}.safetensors" in line
    command = line.split("resume with: ")[1]
    assert "--fresh" not in command  # it would delete the checkpoint we just wrote
    # the printed command's first run resumed there (it was killed at a later write) ...
    phase, _, _, stdout = interrupted["kill_points"][0]
    assert f"resuming at step {step}" in stdout, (phase, stdout)
    # ... and the run it continues ends exactly as an uninterrupted one
    assert_finished_like_uninterrupted(interrupted)


def test_sigkill_at_any_moment_resumes_bit_identically(interrupted):
    """SIGKILL a run again and again (inside both pauses of a checkpoint write, during
    start-up and mid-training), resume each time, and finish with exactly the params and
    metrics of an uninterrupted run."""
    kill_points = interrupted["kill_points"]
    print("\n".join(f"{w}: status {rc}, left {d}" for w, rc, d, _ in kill_points))
    assert all(rc == -signal.SIGKILL for _, rc, _, _ in kill_points), kill_points
    # Kills landed on half-written or unrenamed temporary files, not only between writes.
    assert any(any(n.endswith(".tmp") for n in done) for _, _, done, _ in kill_points)
    assert_finished_like_uninterrupted(interrupted)


# -- non-finite steps ------------------------------------------------------------------------
def regression_npz(tmp_path, bad_step: int, n=128, batch=16, seed=0) -> str:
    """Linear-regression data whose one huge target makes step ``bad_step``'s loss overflow."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 1)).astype(np.float32)
    y = (2 * x - 1).astype(np.float32)
    # Batches are slices of each epoch's permutation; step s (1-based) takes slice s - 1.
    y[epoch_order(seed, 0, n)[(bad_step - 1) * batch]] = 1e30  # squared: inf in float32
    path = tmp_path / "overflow.npz"
    np.savez(path, x=x, y=y, x_test=x[:16], y_test=(2 * x[:16] - 1))
    return str(path)


NONFINITE = [
    "model={name: linreg}",
    "data.name=npz",
    "optimizer.name=sgd",
    "optimizer.learning_rate=0.01",
    "train.batch_size=16",
    "train.log_every=4",
    "train.eval_every=100",
    "checkpoint.every=4",
    "checkpoint.keep=10",
    "log.progress=false",
    "log.plot=false",
]


def test_nonfinite_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    path = regression_npz(tmp_path, bad_step=6)
    args = ["--config", CONFIG, "--fresh"]
    for o in (*NONFINITE, f"data.path={path}", f"log.dir={tmp_path}", "train.steps=12"):
        args += ["--set", o]
    assert main(args) == faults.EXIT_NONFINITE
    err = capsys.readouterr().err
    # Found at the step-8 boundary (no per-step host sync), named exactly by replaying 4..6.
    assert "error: non-finite values at step 6 (first in loss)" in err
    assert "ckpt_00000004.safetensors (step 4)" in err and "train.nonfinite=skip" in err
    ckpts = sorted(p.name for p in (tmp_path / "digits_mlp" / "checkpoints").iterdir())
    assert ckpts == ["ckpt_00000004.safetensors"]


@pytest.mark.parametrize("steps", [12, 1], ids=["next-loss", "last-step"])
def test_nonfinite_stop_finds_a_bad_step_whose_loss_is_still_finite(tmp_path, capsys, steps):
    # Step 1 (W = 0): one input of 3e38 leaves the loss finite, but its gradient overflows to
    # inf and so do the new params. The step's cheap flag reads only the loss, so the run
    # notices at step 2 (or, when step 1 is the last, before writing the final checkpoint);
    # the replay must still blame step 1 and name the gradient.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 1)).astype(np.float32)
    y = (2 * x - 1).astype(np.float32)
    first = epoch_order(0, 0, 128)[0]
    x[first], y[first] = 3e38, 10.0
    path = tmp_path / "huge_input.npz"
    np.savez(path, x=x, y=y, x_test=x[1:17], y_test=y[1:17])
    args = ["--config", CONFIG, "--fresh"]
    for o in (*NONFINITE, f"data.path={path}", f"log.dir={tmp_path}", f"train.steps={steps}"):
        args += ["--set", o]
    assert main(args) == faults.EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "error: non-finite values at step 1 (first in grads/W)" in err
    assert not list((tmp_path / "digits_mlp" / "checkpoints").glob("*.safetensors"))
    assert "no checkpoint was written" in err


def test_nonfinite_skip_keeps_the_old_state_and_counts(tmp_path):
    path = regression_npz(tmp_path, bad_step=6)
    over = [*NONFINITE, f"data.path={path}", f"log.dir={tmp_path}", "train.steps=12"]
    r = train(load_config(ROOT / CONFIG, [*over, "train.nonfinite=skip"]), resume="fresh")
    # The huge example is in step 6 and, in the second epoch (8 steps each), in this step:
    order1 = epoch_order(0, 1, 128)
    again = 8 + int(np.argmax(order1 == epoch_order(0, 0, 128)[5 * 16])) // 16 + 1
    expected = 1 + (again <= 12)
    assert r.summary["skipped_steps"] == expected
    records = [json.loads(ln) for ln in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [x for x in records if x["split"] == "train"]
    assert [x["skipped_steps"] for x in train_records][-1] == expected
    assert train_records[1]["skipped_steps"] == 1  # step 8 record, after the step-6 skip
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(r.params))


def test_first_nonfinite_names_grads_and_params_by_nnlite_path():
    def layers(w):
        return nl.ParamsDict(ffn=nl.ParamsDict(layers=[nl.ParamsDict(W=jnp.asarray(w))]))

    x = y = jnp.zeros((1,))
    opt = optax.sgd(1.0)

    def sqrt_loss(p, x, y):  # finite at W = 0, but its gradient is inf there
        return jnp.sum(jnp.sqrt(p.ffn.layers[0].W)), {}

    p = layers([0.0, 1.0])
    what = nonfinite.first_nonfinite(sqrt_loss, opt, p, opt.init(p), x, y)
    assert what == "grads/ffn/layers[0]/W"

    def linear_loss(p, x, y):  # loss and gradient finite; the update overflows
        return -1.5 * jnp.sum(p.ffn.layers[0].W), {}

    opt = optax.sgd(1e38)
    p = layers([2e38])
    assert (
        nonfinite.first_nonfinite(linear_loss, opt, p, opt.init(p), x, y)
        == "params/ffn/layers[0]/W"
    )


def test_nonfinite_skip_writes_strict_json_null(tmp_path):
    path = regression_npz(tmp_path, bad_step=8)
    # A train record is the mean of its interval's finite values: logging every step, the
    # skipped step's record has no finite loss at all.
    over = [*NONFINITE, f"data.path={path}", f"log.dir={tmp_path}", "train.steps=8"]
    over.append("train.log_every=1")
    r = train(load_config(ROOT / CONFIG, [*over, "train.nonfinite=skip"]), resume="fresh")

    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds bare {constant}")

    text = (r.run_dir / "metrics.jsonl").read_text()
    records = [json.loads(ln, parse_constant=refuse) for ln in text.splitlines()]
    at8 = next(x for x in records if x["split"] == "train" and x["step"] == 8)
    assert at8["loss"] is None and at8["skipped_steps"] == 1


# -- the watchdog: no compiled call waits without a bound -----------------------------------
def test_watchdog_fires_on_a_stuck_call_and_not_on_finished_ones():
    fired = []
    dog = faults.Watchdog(0.5, on_timeout=fired.append)
    with dog:
        for step in range(3):
            dog.watch(step, jnp.ones(3) * step)
        time.sleep(1.0)
        assert fired == []  # finished calls never fire, however long the loop then idles
        t0 = time.monotonic()
        release = threading.Event()
        stuck = _inject.StuckCall(release)
        dog.watch(3, stuck)
        while not fired and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
        release.set()  # it also holds up the device for every later test
        jax.block_until_ready(stuck)
    assert len(fired) == 1 and 0.5 <= took < 2.0, (fired, took)
    assert fired[0].startswith(
        "error: no compiled call finished within 0.5 s (train.step_timeout) at step 4: "
    )


def test_watchdog_automatic_limit_follows_the_first_calls():
    assert faults.Watchdog(None).limit() == faults.STARTUP_TIMEOUT_S
    dog = faults.Watchdog(None, warmup=2, cap=50.0)
    assert dog.limit() == 50.0
    dog._done, dog._slowest = 2, 0.01
    assert dog.limit() == faults.STEP_TIMEOUT_FLOOR_S
    dog._slowest = 2.0
    assert dog.limit() == 40.0
    dog._slowest = 10.0
    assert dog.limit() == 50.0  # capped below JAX's heartbeat abort
    assert not faults.Watchdog(0).enabled and faults.Watchdog(3).limit() == 3


def test_a_stuck_call_ends_the_run_with_exit_5_within_the_timeout(tmp_path, npz):
    over = [npz, "train.steps=50", "train.log_every=10", "train.step_timeout=2"]
    t0 = time.monotonic()
    proc = spawn(cli_args(tmp_path, *over), stuck="7")
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == faults.EXIT_STUCK, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [
        "error: no compiled call finished within 2 s (train.step_timeout) at step 7: the "
        "device is stuck, or steps really take this long; the last checkpoint is intact, "
        "rerun to resume (train.step_timeout: seconds, 0 to disable)"
    ], err
    assert "Traceback" not in err and took < 60
