"""train.precision (bfloat16, float16 with loss scaling) on a user's model under none and
fsdp, MFU in the summary and the metrics, --profile, nl.summary and --summary."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import user_module

import nnlite as nl
import train
from train.__main__ import main
from train.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]

USER = """
import jax
import nnlite as nl


class TwoLayer(nl.Module):
    in_features: int
    num_classes: int
    hidden: int = 32
    task = "classification"

    def setup(self):
        self.fc1 = nl.Linear(self.in_features, self.hidden)
        self.norm = nl.LayerNorm(self.hidden)
        self.fc2 = nl.Linear(self.hidden, self.num_classes)

    def __call__(self, params, x, *, key=None):
        h = jax.nn.relu(self.fc1(params.fc1, x))
        return self.fc2(params.fc2, self.norm(params.norm, h))
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf")
    (root / "user.yaml").write_text(
        "model: {name: 'perf_user:TwoLayer'}\ndata: {name: digits}\n"
        "train: {batch_size: 64, steps: 8}\nlog: {progress: false, plot: false}\n"
    )
    with user_module(root, "perf_user", USER):
        yield root


def fit(root, name, steps=30, **sections):
    cfg = {
        "name": name,
        "model": {"name": "perf_user:TwoLayer"},
        "data": {"name": "digits"},
        "train": {"batch_size": 64, "steps": steps, "eval_every": steps, "log_every": 20},
        "log": {"dir": str(root / "runs"), "progress": False, "plot": False},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return train.fit(None, cfg, echo=lambda *_: None)


@pytest.fixture(scope="module")
def f32_run(user):
    return fit(user, "f32", loss={"grad": "manual"})


def test_bfloat16_trains_like_float32_manual_and_fsdp(user, f32_run):
    bf16 = fit(user, "bf16", loss={"grad": "manual"}, train={"precision": "bfloat16"})
    sharded = fit(
        user,
        "bf16_fsdp",
        train={"precision": "bfloat16"},
        loss={"grad": "autodiff"},
        parallel={"strategy": "fsdp", "fsdp_min_bytes": 0},
    )
    ref = f32_run.summary["test_loss"]
    for run in (bf16, sharded):
        assert abs(run.summary["test_loss"] - ref) < 0.05, (run.summary, ref)
        assert run.summary["test_loss"] != ref  # it really ran in another precision
        leaves = jax.tree.leaves(run.params)
        assert {np.asarray(a).dtype for a in leaves} == {np.dtype(np.float32)}  # params f32
    # the FLOPs of one global step, on one device or 8 (fsdp's program is the global one:
    # counted once, not once per device); autodiff and manual differ by a few ops
    one, eight = bf16.summary["flops_per_step"], sharded.summary["flops_per_step"]
    assert 0.8 * one < eight < 1.25 * one, (one, eight)


def test_init_compiler_options_are_the_cpu_backends_only(monkeypatch):
    from train.loop import build

    assert build.init_compiler_options()["xla_backend_optimization_level"] == 0
    # a GPU backend refuses XLA:CPU's options ("No such compile option"): none there
    monkeypatch.setattr(build.jax, "default_backend", lambda: "gpu")
    assert build.init_compiler_options() == {}


def test_the_policy_computes_in_the_dtype_and_the_loss_in_float32(user):
    from perf_user import TwoLayer

    from train.model.contract import objective_fn
    from train.step import precision

    model = TwoLayer(64, 10)
    params = jax.eval_shape(model.init, jax.random.key(0))  # traced below: shapes suffice
    x, y = np.ones((4, 64), np.float32), np.zeros((4,), np.int32)
    objective = objective_fn(precision.apply(model, "bfloat16"))
    jaxpr = jax.make_jaxpr(lambda p: objective(p, x, y)[0])(params)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert jaxpr.out_avals[0].dtype == jnp.float32
    grads = jax.eval_shape(jax.grad(lambda p: objective(p, x, y)[0]), params)
    assert {a.dtype for a in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def test_float16_skips_overflowing_steps_and_resumes_bit_identically(user):
    # 2**24 overflows float16's cotangents: the first steps are skipped, halving the scale
    kw = {
        "train": {"precision": "float16", "loss_scale": 2.0**24},
        "parallel": {"strategy": "fsdp", "fsdp_min_bytes": 0},
        "checkpoint": {"every": 6},
    }
    whole = fit(user, "f16", steps=12, **kw)
    from perf_user import TwoLayer

    init = jax.jit(TwoLayer(64, 10).init)(jax.random.key(0))  # the run's seed 0; one compile
    scale = float(whole.opt_state.scale)
    assert 2.0**12 <= scale < 2.0**24  # halved on each overflow, then kept
    assert int(whole.opt_state.good_steps) > 0
    assert np.isfinite(whole.summary["test_loss"])
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(init), strict=True)
    ]
    assert any(changed)
    fit(user, "f16_resumed", steps=6, **kw)
    resumed = fit(user, "f16_resumed", steps=12, **kw)  # resumes from step 6
    for a, b in zip(
        jax.tree.leaves((whole.params, whole.opt_state)),
        jax.tree.leaves((resumed.params, resumed.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = (user / "runs" / "f16" / "metrics.jsonl").read_text()
    record = [json.loads(s) for s in text.splitlines()]
    assert any("loss_scale" in r for r in record if r["split"] == "train")


def test_bad_precision_is_one_line(user):
    with pytest.raises(ConfigError, match="train.precision.*float32.*bfloat16.*float16"):
        fit(user, "bad", train={"precision": "half"})
    with pytest.raises(ConfigError, match="train.loss_scale"):
        fit(user, "bad", train={"precision": "float16", "loss_scale": 0.5})


def test_mfu_in_the_summary_and_the_metrics(user, f32_run):
    s = f32_run.summary
    table = nl.summary(f32_run.model, jnp.zeros((64, 64)))
    model_flops = table.totals["flops_forward"] + table.totals["flops_backward"]
    # the compiled step's count: forward + backward + the optimizer, on the same batch
    assert model_flops <= s["flops_per_step"] < 2 * model_flops
    assert s["flops_per_s"] > 0 and 0 < s["mfu"] < 2
    text = (user / "runs" / "f32" / "metrics.jsonl").read_text()
    records = [json.loads(r) for r in text.splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    assert all(r["flops_per_step"] == s["flops_per_step"] and "mfu" in r for r in train_records)


def test_a_scanned_gpts_step_counts_every_block_microbatch_and_step(tmp_path):
    """flops_per_step is the jaxpr's count of the compiled call (nl.flops), every loop by
    its trip count: the scanned blocks, the 2 microbatches and the call's 2 steps (XLA's
    cost analysis counted one block of one microbatch of one step: half the step's FLOPs
    here, ~1/n_layer of a deep model's)."""
    from models.gpt import GPT

    (tmp_path / "t.txt").write_text("".join(chr(97 + i * 7 % 26) for i in range(2000)))
    gpt = {"context": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "remat": "none"}
    cfg = {
        "name": "scanned",
        "model": {"name": "gpt", "scan_layers": True, **gpt},
        "data": {"name": "text", "path": str(tmp_path / "t.txt"), "eval_windows": 8},
        "train": {"batch_size": 8, "steps": 2, "steps_per_call": 2, "grad_accum_steps": 2},
        "log": {"dir": str(tmp_path), "progress": False, "plot": False},
    }
    run = train.fit(None, cfg, echo=lambda *_: None)
    model = GPT(vocab_size=run.model.vocab_size, **gpt)
    params = jax.eval_shape(model.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)  # the global batch of one step
    grads = nl.flops(jax.grad(lambda p, t: -model(p, t, labels=t).mean()), params, tokens)
    n_params = sum(a.size for a in jax.tree.leaves(params))
    # the gradient of the whole batch, plus the optimizer's few dozen FLOPs per param
    assert grads["flops"] < run.summary["flops_per_step"] < grads["flops"] + 100 * n_params
    assert grads["matmul_flops"] > 0.8 * grads["flops"]  # a missing block shows


def test_summary_of_a_users_model(user):
    from perf_user import TwoLayer

    table = nl.summary(TwoLayer(64, 10), jnp.zeros((16, 64)))
    rows = {r["path"]: r for r in table.rows}
    assert list(rows) == ["fc1", "norm", "fc2"]
    assert rows["fc1"]["output_shape"] == (16, 32) and rows["fc1"]["params"] == 64 * 32 + 32
    assert rows["fc1"]["param_bytes"] == 4 * rows["fc1"]["params"]
    # a matmul is 2*b*in*out FLOPs forward (XLA adds the bias), about twice that backward
    # (the input's cotangent and the weight's), less the first layer's unneeded input one
    assert 2 * 16 * 64 * 32 <= rows["fc1"]["flops_forward"] <= 2 * 16 * 64 * 32 + 16 * 32
    assert rows["fc2"]["flops_backward"] >= 2 * 16 * 32 * 10 * 2 * 0.9
    assert rows["fc2"]["activation_bytes"] == 16 * 32 * 4  # its input, kept for dW
    assert table.totals["params"] == sum(r["params"] for r in table.rows)
    text = str(table)
    assert "fc1" in text and "TwoLayer" in text.splitlines()[-1]


def test_summary_rows_count_the_backward_pass_training_runs():
    """A layer's backward FLOPs count its input's cotangent only where training needs one
    (the input depends on the params): the first layer's is left out, as in the total,
    so the rows of a chain of layers add up to the total (#46: 164k in a row, 82.5k in
    the total)."""
    b, n_in, hidden, n_out = 16, 64, 32, 10
    table = nl.summary(nl.FFN(n_in, (hidden,), n_out), jnp.zeros((b, n_in)))
    first, second = table.rows
    dw_first = 2 * b * n_in * hidden  # dW = x^T dy; no dx: x is the model's input
    assert dw_first <= first["flops_backward"] <= dw_first + 2 * b * hidden
    dw_dx_second = 2 * (2 * b * hidden * n_out)  # dW and dx (its input comes from layer 1)
    assert dw_dx_second <= second["flops_backward"] <= dw_dx_second + 2 * b * n_out
    rows = first["flops_backward"] + second["flops_backward"]
    assert rows == pytest.approx(table.totals["flops_backward"], rel=0.02)  # + the relu's


def test_summary_of_the_gpt_names_each_block():
    from models.gpt import GPT

    model = GPT(vocab_size=17, context=8, n_layer=2, n_embd=16, n_head=2)
    table = nl.summary(model, jax.ShapeDtypeStruct((2, 8), jnp.int32), flops=False)
    paths = [r["path"] for r in table.rows]
    assert "blocks[0].attn.qkv" in paths and "blocks[1].mlp.fc" in paths
    assert table.totals["output_shape"] == (2, 8, 17)
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert table.totals["params"] == sum(a.size for a in jax.tree.leaves(params))
    assert table.totals["flops_forward"] is None and table.totals["activation_bytes"] > 0


def test_summary_counts_every_block_of_a_scanned_gpt():
    # nl.flops counts the stack's scan body n_layer times: the same totals as the unrolled
    # blocks (XLA's cost analysis read one block of the scanned model)
    from models.gpt import GPT

    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    totals = [
        nl.summary(
            GPT(vocab_size=17, context=8, n_layer=3, n_head=2, n_embd=16, scan_layers=scan,
                remat="none"),
            tokens,
        ).totals
        for scan in (False, True)
    ]  # fmt: skip
    assert totals[1]["flops_forward"] == totals[0]["flops_forward"]
    assert totals[1]["flops_backward"] == pytest.approx(totals[0]["flops_backward"], rel=1e-3)


def test_summary_of_a_stateful_model_runs_it_in_eval_mode():
    from models.resnet import ResNet

    model = ResNet(in_shape=(8, 8), num_classes=10, channels=(4,))
    table = nl.summary(model, jnp.zeros((2, 8, 8)), flops=False)
    bn = [r for r in table.rows if r["type"] == "BatchNorm"]
    assert bn and all(r["output_shape"][-1] == 4 and r["params"] == 8 for r in bn)
    assert table.totals["output_shape"] == (2, 10)


def test_cli_summary_and_profile(user, tmp_path, capsys):
    cfg = str(user / "user.yaml")
    assert main(["--config", cfg, "--summary"]) == 0
    out = capsys.readouterr().out
    assert "fc1" in out and "total" in out and "TwoLayer" in out
    assert main(["--config", cfg, "--profile", "5:2"]) == 2
    assert "--profile '5:2': expected 0 <= START < STOP" in capsys.readouterr().err
    assert main(["--config", cfg, "--profile", "2:9"]) == 2
    assert "ends after train.steps=8" in capsys.readouterr().err
    log = ["--set", f"log.dir={tmp_path}"]
    assert main(["--config", cfg, *log, "--profile", "2:4"]) == 0
    out = capsys.readouterr().out
    assert "profile: steps 3-4 traced to" in out and "MFU" in out.splitlines()[-1]
    assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))


def test_a_cpu_peak_measured_busy_is_measured_again_and_the_best_kept(tmp_path, monkeypatch):
    from train.report import perf

    monkeypatch.setenv("NNLITE_CACHE", str(tmp_path))
    rates, loads = iter([6e9, 18e9, 12e9]), iter([7.0, 7.0, 0.2, 0.2])
    monkeypatch.setattr(perf, "measure_cpu_peak", lambda dtype: next(rates))
    monkeypatch.setattr(perf.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(perf.os, "cpu_count", lambda: 2)
    peaks = []
    for _ in range(4):  # four runs: each a new process (the in-process memo cleared)
        monkeypatch.setattr(perf, "_MEASURED", {})
        peaks.append(perf.cpu_peak("float32"))
    # measured busy (6); the next run, busy too, uses it; the next, quiet, measures again
    # and keeps the best (18); the quiet entry is not measured again
    assert peaks == [6e9, 6e9, 18e9, 18e9]
    assert next(rates) == 12e9
    entry = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(entry.values()) == [{"flops": 18e9, "quiet": True}]


def test_cost_analysis_of_a_program_whose_client_analyses_no_lowered_program():
    # A GPU's CUDA plugin (PJRT C API) gives no Lowered.cost_analysis(): nl.cost_analysis
    # reads the same module through the CPU client instead.
    lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((64, 32)), jnp.ones((32, 16)))

    class PluginLowered:
        def cost_analysis(self):
            return None

        def compiler_ir(self, dialect):
            return lowered.compiler_ir(dialect)

    assert nl.cost_analysis(PluginLowered())["flops"] == 2 * 64 * 32 * 16
    assert nl.cost_analysis(lowered)["flops"] == 2 * 64 * 32 * 16


def test_step_cost_is_the_traced_calls_count_per_step():
    from train.loop.build import step_cost

    def call(x, ws):  # 3 steps of 2 products each
        return jax.lax.scan(lambda h, w: (h @ w @ w, None), x, ws)[0]

    traced = jax.jit(call).trace(jnp.ones((8, 16)), jnp.ones((3, 16, 16)))
    cost = step_cost(traced, steps=3)
    assert cost["flops"] == cost["matmul_flops"] == 2 * (2 * 8 * 16 * 16)
    assert cost["lower_bound"] is False and cost["unknown"] == ()


# -- what the machine has, in the banner (train/report/machine.py) ---------------------------
def cpuinfo(model: str, flags: str) -> str:
    """A /proc/cpuinfo text of two processors (the banner reads the first)."""
    one = (
        f"processor\t: {{}}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    )
    return one.format(0) + "\n" + one.format(1)


SAPPHIRE = cpuinfo("Intel(R) Xeon(R)  Platinum 8480+", "fpu sse4_2 avx avx2 fma avx512f "
                   "avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8")  # fmt: skip
SKYLAKE = cpuinfo("Intel(R) Xeon(R) Processor", "fpu sse4_2 avx avx2 fma avx512f avx512bw")


def test_the_cpu_is_described_by_its_model_and_matrix_isa():
    from train.report import machine

    assert machine.describe_cpu(SAPPHIRE) == (
        "Intel(R) Xeon(R) Platinum 8480+ (AVX2, AVX-512, AVX512-BF16, AMX)"
    )
    assert machine.describe_cpu(SKYLAKE) == "Intel(R) Xeon(R) Processor (AVX2, AVX-512)"
    old = cpuinfo("Old", "fpu sse2")
    assert machine.describe_cpu(old) == "Old (none of AVX2, AVX-512, AVX512-BF16, AMX)"
    # an ARM or non-Linux text (no flags line): nothing to say
    assert machine.describe_cpu("processor\t: 0\nFeatures\t: fp asimd\n") is None
    assert machine.describe_cpu("") is None


def test_machine_lines_say_when_bfloat16_is_emulated():
    from types import SimpleNamespace

    from train.report import machine

    cpu = SimpleNamespace(platform="cpu")
    assert machine.machine_lines(cpu, "bfloat16", SAPPHIRE) == [
        "cpu: Intel(R) Xeon(R) Platinum 8480+ (AVX2, AVX-512, AVX512-BF16, AMX)"
    ]
    assert machine.machine_lines(cpu, "float32", SKYLAKE) == [
        "cpu: Intel(R) Xeon(R) Processor (AVX2, AVX-512)"
    ]
    assert machine.machine_lines(cpu, "bfloat16", SKYLAKE) == [
        "cpu: Intel(R) Xeon(R) Processor (AVX2, AVX-512)",
        machine.BF16_EMULATED,
    ]
    assert machine.machine_lines(cpu, "float32", SKYLAKE, kept=True) == [
        "cpu: Intel(R) Xeon(R) Processor (AVX2, AVX-512)",
        machine.HOST_MEMORY_KEPT,
    ]
    assert machine.machine_lines(cpu, "bfloat16", "") == []  # no /proc/cpuinfo
    gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    assert machine.machine_lines(gpu, "bfloat16", SKYLAKE, kept=True) == ["gpu: NVIDIA H200"]


def test_the_banner_names_the_cpu_and_the_emulated_bfloat16(user, monkeypatch):
    from train.report import machine

    monkeypatch.setattr(machine, "read_cpuinfo", lambda: SKYLAKE)
    lines = []
    cfg = {
        "name": "isa",
        "model": {"name": "perf_user:TwoLayer"},
        "data": {"name": "digits"},
        "train": {"batch_size": 64, "steps": 1, "precision": "bfloat16"},
        "log": {"dir": str(user / "runs"), "progress": False, "plot": False},
    }
    train.fit(None, cfg, echo=lines.append)
    banner = next(s for s in lines if s.startswith("nnlite train: isa")).splitlines()
    assert banner[1:3] == ["  cpu: Intel(R) Xeon(R) Processor (AVX2, AVX-512)",
                           f"  {machine.BF16_EMULATED}"]  # fmt: skip
