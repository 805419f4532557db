"""Train-step throughput: raw JAX vs Equinox vs Flax NNX vs nnlite, plus the GEMM rate.

    python -m benchmarks.train_step [--quick] [--sizes small,medium,large,cnn] [--rounds N]
    python -m benchmarks.train_step --sizes gpt_baby,gpt_large   # the GPT rows
    python -m benchmarks.train_step --tiny [--sizes ...]  # each size's code at a tiny size

For each size (the MLPs SMALL, MEDIUM, LARGE, and CNN: the MNIST-1D paper's conv net): check that every implementation reaches the same loss after 10 steps from
the same weights, then time them interleaved in shuffled rounds and print the median time
per optimizer step and its ratio to raw JAX. A jitted float32 2048x2048 matmul, timed in the
same rounds as LARGE, gives the machine's GEMM rate; the LARGE step's matmul FLOP rate is
reported as a fraction of it.
"""

from __future__ import annotations

import argparse
import sys

import jax

from . import _harness as h
from ._impls import SPECS, TINY, Nnlite, build_all, losses_after
from ._impls_cnn import CNN_SPECS, CNN_TINY, build_all_cnn

# Steps per timed sample, and nnlite's steps per call, for each size: enough work per
# sample that timer resolution and one-off hiccups do not matter.
STEPS_PER_SAMPLE = {"small": 200, "medium": 20, "large": 2, "cnn": 40}
STEPS_PER_CALL = {"small": 20, "medium": 10, "large": 2, "cnn": 20}
ROUNDS = {"small": 25, "medium": 15, "large": 7, "cnn": 15}
ALL_SPECS = {**SPECS, **CNN_SPECS}
GEMM_N = 2048
LOSS_RTOL = 1e-4


def gemm_case(n: int = GEMM_N, reps: int = 4):
    """A callable doing ``reps`` jitted float32 n x n matmuls; and the FLOPs it does."""
    from ._matmul import matmul_cases

    return matmul_cases("float32", n, peer=False, reps=reps)["nnlite"], 2 * n**3 * reps


def check_losses(impls, steps: int = 10, rtol: float = LOSS_RTOL) -> dict[str, float]:
    losses = losses_after(impls, steps)
    ref = losses["raw JAX"]
    for name, v in losses.items():
        if not abs(v - ref) <= rtol * abs(ref):
            raise SystemExit(f"loss mismatch after {steps} steps: {name} {v!r} vs raw JAX {ref!r}")
    return losses


def bench_size(size: str, rounds: int, quick: bool, tiny: bool = False) -> dict:
    spec = ALL_SPECS[size]
    k = STEPS_PER_CALL[size]
    n = STEPS_PER_SAMPLE[size]
    if quick:
        n = max(k, n // 4 // k * k)
    if tiny:  # the same code on a tiny model: a smoke run, times mean nothing
        spec, k, n = (CNN_TINY if size in CNN_SPECS else TINY), 2, 2
    # --tiny: the data of tests/test_benchmarks.py's agree tests, whose compiled programs
    # (the persistent compilation cache's) it then reuses
    nb = {"n_batches": 3} if tiny else {}
    if size in CNN_SPECS:
        impls = build_all_cnn(spec, steps_per_call=k, **nb)
    else:
        impls = build_all(spec, steps_per_call=k, matmul_floor=True, **nb)
    losses = check_losses(impls)
    cases = {impl.name: (lambda impl=impl: impl.run(n)) for impl in impls}
    gemm_flops = None
    if size == "large":
        cases["GEMM 2048"], gemm_flops = gemm_case(64 if tiny else GEMM_N)
    samples = h.time_interleaved(cases, rounds=rounds, warmup=1 if size == "large" else 2)
    per_step = {
        name: h.median(v) / (1 if name == "GEMM 2048" else n) for name, v in samples.items()
    }
    if size in CNN_SPECS:
        shape = {"model": spec.describe(), "batch": spec.batch}
    else:
        shape = {"in": spec.in_features, "hidden": spec.hidden, "classes": spec.classes}
        shape["batch"] = spec.batch
    result = {
        "spec": shape,
        "steps_per_sample": n,
        "rounds": rounds,
        "nnlite_steps_per_call": k,
        "loss_after_10": losses,
        "median_s_per_step": {k_: v for k_, v in per_step.items() if k_ != "GEMM 2048"},
        "samples_s": samples,
    }
    if size not in CNN_SPECS:
        result["matmul_flops_per_step"] = spec.matmul_flops()
    if gemm_flops:
        gemm_rate = gemm_flops / per_step["GEMM 2048"]
        result["gemm_gflops"] = gemm_rate / 1e9
        result["gemm_n"] = 64 if tiny else GEMM_N
        result["step_gflops"] = {
            k_: spec.matmul_flops() / v / 1e9 for k_, v in result["median_s_per_step"].items()
        }
        result["fraction_of_gemm"] = {
            k_: v * 1e9 / gemm_rate for k_, v in result["step_gflops"].items()
        }
    return result


def render(size: str, r: dict) -> str:
    base = r["median_s_per_step"]["raw JAX"]
    rows = []
    for name, t in r["median_s_per_step"].items():
        row = [name, h.fmt_time(t), f"{t / base:.3f}", f"{base / t:.2f}x"]
        if "step_gflops" in r:
            row += [f"{r['step_gflops'][name]:.1f}", f"{r['fraction_of_gemm'][name]:.1%}"]
        rows.append(row)
    header = ["implementation", "median / step", "time vs raw JAX", "throughput vs raw JAX"]
    if "step_gflops" in r:
        header += ["matmul GFLOP/s", "of GEMM rate"]
    s = r["spec"]
    model = s.get("model") or f"{s['in']}->{'->'.join(map(str, s['hidden']))}->{s['classes']}"
    title = (
        f"{size.upper()}: {model}, batch {s['batch']}; {r['rounds']} rounds x "
        f"{r['steps_per_sample']} steps; nnlite K={r['nnlite_steps_per_call']}"
    )
    if "gemm_gflops" in r:
        title += f"; GEMM {r['gemm_n']}^2 f32: {r['gemm_gflops']:.1f} GFLOP/s"
    return title + "\n\n" + h.table(rows, header)


# -- GPT rows (benchmarks/_gpt_impls.py) -----------------------------------------------------
GPT_STEPS_PER_SAMPLE = {"gpt_baby": 20, "gpt_large": 2}
GPT_STEPS_PER_CALL = {"gpt_baby": 10, "gpt_large": 2}
GPT_ROUNDS = {"gpt_baby": 7, "gpt_large": 3}
# Steps before the same-loss check: a large step takes 10-25 s per implementation on 2 cores.
GPT_CHECK_STEPS = {"gpt_baby": 10, "gpt_large": 2}


def bench_gpt(
    size: str,
    rounds: int,
    quick: bool,
    pytorch: bool | str = True,
    tiny=False,
    *,
    steps: tuple[int, int] | None = None,
    rtol: float = LOSS_RTOL,
) -> dict:
    """The GPT step: same loss after 10 steps, then interleaved timing, tokens/s and the
    fraction of the matmul floor (the step's matmuls alone) each implementation reaches.
    With ``pytorch`` and torch installed, nanoGPT's PyTorch model is a row too
    (``"autocast"``: and its bf16 autocast). ``steps``: (nnlite's steps per call, steps per
    timed sample) instead of the size's own; ``rtol``: the same-loss check's tolerance (an
    accelerator's TF32 dots round differently per implementation). MFU is against the
    device's peak as the trainer reports MFU (``CompiledFit.flops_and_peak``: a measured
    GEMM on a CPU, the data sheet's float32 (TF32) figure on a GPU)."""
    from ._gpt_impls import GPT_SPECS, GPT_TINY, build_all_gpt

    spec = GPT_TINY if tiny else GPT_SPECS[size]
    k, n = steps or (GPT_STEPS_PER_CALL[size], GPT_STEPS_PER_SAMPLE[size])
    if quick:
        n = k
    if tiny:
        k = n = 2
    impls = build_all_gpt(spec, steps_per_call=k, matmul_floor=True, pytorch=pytorch)
    with jax.numpy_rank_promotion("allow"):  # the peers are written as their users write them
        losses = check_losses(impls, 2 if tiny else GPT_CHECK_STEPS.get(size, 2), rtol)
        cases = {impl.name: (lambda impl=impl: impl.run(n)) for impl in impls}
        # the check ran (and compiled) every implementation already; the large size skips
        # the extra warm-up call, which costs minutes
        warmup = 0 if size == "gpt_large" and steps is None else 1
        samples = h.time_interleaved(cases, rounds=rounds, warmup=warmup)
    per_step = {name: h.median(v) / n for name, v in samples.items()}
    floor = per_step["matmul floor"]
    # MFU: the step's matmul FLOPs against the peak the trainer reports MFU against
    nnlite = next(i for i in impls if isinstance(i, Nnlite))
    peak = nnlite.compiled.flops_and_peak()[1] or float("nan")
    return {
        "peak_flops_per_s": peak,
        "mfu": {name: spec.matmul_flops() / t / peak for name, t in per_step.items()},
        "spec": dict(spec.__dict__),
        "steps_per_sample": n,
        "rounds": rounds,
        "nnlite_steps_per_call": k,
        "check_steps": GPT_CHECK_STEPS.get(size, 2),
        "loss_after_check_steps": losses,
        "median_s_per_step": per_step,
        "tokens_per_s": {name: spec.tokens_per_step / t for name, t in per_step.items()},
        "floor_fraction": {name: floor / t for name, t in per_step.items()},
        "matmul_flops_per_step": spec.matmul_flops(),
        "samples_s": samples,
    }


def render_gpt(size: str, r: dict) -> str:
    base = r["median_s_per_step"]["raw JAX"]
    rows = [
        [
            name,
            h.fmt_time(t),
            f"{t / base:.3f}",
            f"{r['tokens_per_s'][name]:,.0f}",
            f"{r['floor_fraction'][name]:.1%}",
            f"{r['mfu'][name]:.1%}",
        ]
        for name, t in r["median_s_per_step"].items()
    ]
    header = [
        "implementation",
        "median / step",
        "time vs raw JAX",
        "tokens/s",
        "of matmul floor",
        "MFU",
    ]
    s = r["spec"]
    title = (
        f"{size.upper()}: {s['n_layer']} layers x {s['n_head']} heads x {s['n_embd']}, "
        f"context {s['context']}, batch {s['batch']}; {r['rounds']} rounds x "
        f"{r['steps_per_sample']} steps; nnlite K={r['nnlite_steps_per_call']}"
    )
    return title + "\n\n" + h.table(rows, header)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.train_step", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (a smoke run)")
    ap.add_argument(
        "--sizes",
        default="small,medium,large,cnn",
        help="comma-separated: small,medium,large,cnn,gpt_baby,gpt_large",
    )
    ap.add_argument("--rounds", type=int, default=None, help="override the rounds per size")
    ap.add_argument(
        "--tiny", action="store_true", help="each size's code on a tiny model, 1 round: a smoke run"
    )
    ap.add_argument(
        "--no-pytorch",
        action="store_true",
        help="leave out the GPT rows' PyTorch peer (included when torch is installed)",
    )
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in ALL_SPECS and s not in GPT_ROUNDS:
            ap.error(f"unknown size {s!r}; valid: {', '.join([*ALL_SPECS, *GPT_ROUNDS])}")
    info = h.machine_info()
    print(
        f"machine: {info['cpu']}, {info['affinity']} usable cores; jax {info['versions']['jax']} on {info['jax_devices']}"
    )
    results = {}
    for size in sizes:
        if size in GPT_ROUNDS:
            rounds = 1 if args.tiny else args.rounds or GPT_ROUNDS[size]
            results[size] = bench_gpt(size, rounds, args.quick, not args.no_pytorch, args.tiny)
            print("\n" + render_gpt(size, results[size]), flush=True)
            continue
        rounds = args.rounds or (max(3, ROUNDS[size] // 3) if args.quick else ROUNDS[size])
        results[size] = bench_size(size, 1 if args.tiny else rounds, args.quick, args.tiny)
        print("\n" + render(size, results[size]), flush=True)
    name = "train_step-tiny" if args.tiny else "train_step"
    path = h.write_json(name, {"machine": info, "quick": args.quick, "results": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
