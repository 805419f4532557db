"""nnlite against PyTorch / transformers / peft at the sizes people train: every row of
issue #43's table measured side by side in one run.

    python -m benchmarks.real_size [--rows ROW,...] [--rounds 3] [--threads N]
                                   [--flags [--flag-sets NAME,...]]
                                   [--host-memory keep|release] [--tiny]

Rows (``--rows``, default all; :data:`ROWS`): the GPT 6x6x384 training step (context 256,
batch 64, ``loss.grad: auto`` as the trainer resolves it) and the baby GPT 4x4x128, each
against nanoGPT's PyTorch model (``benchmarks/_gpt_impls.py``, the same weights, data and
AdamW; the two reach the same loss before timing); one of that GPT's attention layers,
forward and backward, against PyTorch's fused ``scaled_dot_product_attention``; a
SmolLM-135M-shaped Llama (random weights made by ``transformers``;
``benchmarks/pretrained.py``) at 4x256 tokens: full
fine-tuning step with AdamW against ``transformers``, LoRA step (rank 8 on q and v) against
``peft``, forward tokens/s, greedy generation with the cache; one 2048x2048 matmul in
float32 and in bfloat16, XLA against ``torch.mm``.

Each row's two sides run in the same process, same threads (``torch.set_num_threads`` set
to the cores XLA's pool uses: this process's usable cores; ``--threads N`` pins the process
to N of them before JAX starts), interleaved in shuffled rounds after warm-up, medians of
``--rounds`` (>= 3). The ratio is nnlite's median time over the peer's for the same work
(below 1: nnlite is faster). The first line names the machine (CPU model, the ISA flags
the GEMMs choose kernels by, threads, load average, library versions); the last, the load
average after: on a machine whose load exceeds its cores the figures are not evidence.

``--flags``: the matmul rows again under each of :data:`FLAG_SETS` (XLA_FLAGS; XLA reads
them once per process, so each set runs in a fresh process) with what XLA made of the dot
(the optimised HLO's library fusions and custom calls, and the dot's element type).
``--host-memory``: ``release`` (default) leaves glibc's defaults, as both libraries ship
(each step faults its large temporaries in again); ``keep`` calls
``nnlite.keep_host_memory`` first thing (``NNLITE_CPU_MEMORY=keep`` for ``nnlite-train``):
glibc keeps freed host memory for reuse, for both libraries in the process alike.
``--tiny``: every row at a tiny size, one round: a smoke run (times mean nothing).
Results go to ``benchmarks/results/real_size-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from . import _harness as h
from ._matmul import (
    FLAG_SETS,
    MATMUL_REPS,
    flag_runs,
    flags_cell,
    flags_table,
    matmul_cases,
    matmul_child,
)

ROWS = {
    "gpt_large": "GPT 6x6x384, ctx 256, batch 64: training step, loss.grad auto (vs PyTorch)",
    "gpt_baby": "baby GPT 4x4x128, ctx 64, batch 12: training step (vs PyTorch)",
    "attention": "one GPT 6x6x384 layer's causal attention, [64,256,6,64]: forward and "
    "backward (MultiHeadAttention.attend vs torch's scaled_dot_product_attention)",
    "llama_full": "SmolLM-135M-shaped Llama, 4x256 tokens: full fine-tuning step, AdamW "
    "(vs transformers)",
    "llama_lora": "same: LoRA step, rank 8 on q, v (vs peft)",
    "llama_forward": "same: forward (vs transformers)",
    "llama_generate": "same: greedy generation with the cache, 64 tokens (vs transformers)",
    "matmul_f32": "one 2048x2048 matmul, float32 (nl.jit's XLA vs torch.mm)",
    "matmul_bf16": "one 2048x2048 matmul, bfloat16 (nl.jit's XLA vs torch.mm)",
}
# the matmul rows' dtypes
MATMUL_ROWS = {"matmul_f32": "float32", "matmul_bf16": "bfloat16"}
# the GPT rows: (nnlite's steps per call, steps per timed sample) as benchmarks.train_step
GPT_STEPS = {"gpt_large": (2, 2), "gpt_baby": (10, 20)}
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


# -- the machine ---------------------------------------------------------------------------
def machine(threads: int) -> dict:
    """CPU model (lscpu's, else /proc/cpuinfo's), the ISA flags that pick the GEMM kernels,
    threads, 1-minute load average, and the versions of the libraries compared."""
    info = h.cpuinfo()
    model = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in out.splitlines()
                if ln.startswith("Model name:")
            ),
            None,
        )
    except (OSError, subprocess.SubprocessError):
        pass
    flags = frozenset(info.get("flags", "").split())
    versions = {}
    for mod in ("jax", "jaxlib", "torch", "transformers", "peft"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = "not installed"
    import nnlite as nl

    return {
        "cpu": model or info.get("model name") or "unknown",
        "isa": {f: f in flags for f in ISA_FLAGS},
        "threads": threads,
        "load_before": _load(),
        "versions": versions,
        "attention": nl.flash_info(),
        "gemm": nl.gemm_info(),
    }


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_line(m: dict) -> str:
    isa = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in m["isa"].items())
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    return (
        f"machine: {m['cpu']}; {isa}; threads {m['threads']} (XLA's pool and "
        f"torch.set_num_threads); load average {m['load_before']} before; {versions}; "
        f"CPU attention: {m['attention']}; CPU GEMM: {m.get('gemm', 'not recorded')}; "
        f"host memory: {m.get('host_memory', 'not recorded')} (both libraries)"
    )


# -- the rows ------------------------------------------------------------------------------
def gpt_row(row: str, tiny: bool, rounds: int, built: dict) -> dict:
    """The trainer's GPT step (``loss.grad: auto``) against nanoGPT's PyTorch step, after
    checking that both reach the same loss (relative 1e-4) on the same weights and data.
    ``built``: the pairs built so far by spec (under ``--tiny`` both rows are one model)."""
    import jax

    from ._gpt_impls import GPT_SPECS, GPT_TINY

    spec = GPT_TINY if tiny else GPT_SPECS[row]
    k, n = (2, 2) if tiny else GPT_STEPS[row]
    if spec not in built:
        built[spec] = _gpt_pair(row, spec, k)
    ours, theirs = built[spec]
    with jax.numpy_rank_promotion("allow"):  # as benchmarks.train_step runs them
        samples = h.time_interleaved(
            {"nnlite": lambda: ours.run(n), "theirs": lambda: theirs.run(n)},
            rounds=rounds,
            warmup=0 if row == "gpt_large" else 1,
        )
    return _row(samples, "PyTorch", n, "step", spec.tokens_per_step * n, "tokens")


def _gpt_pair(row: str, spec, k: int) -> tuple:
    """nnlite's (K=k steps a call, ``loss.grad: auto``) and PyTorch's GPT on the same
    weights and windows, checked to reach the same loss after k steps."""
    import jax

    from ._gpt_impls import NnliteGPT, TorchGPT, init_weights, make_data, optimizer
    from ._impls import losses_after

    weights, (X, idx) = init_weights(spec), make_data(spec, 10)
    ours = NnliteGPT(spec, weights, X, None, idx, optimizer(), steps_per_call=k, grad="auto")
    theirs = TorchGPT(spec, weights, X, None, idx, None)
    with jax.numpy_rank_promotion("allow"):
        losses = losses_after([ours, theirs], k)
    a, b = losses[ours.name], losses[theirs.name]
    if not abs(a - b) <= 1e-4 * abs(b):
        raise SystemExit(f"{row}: loss after {k} steps: {ours.name} {a!r}, PyTorch {b!r}")
    return ours, theirs


def attention_row(tiny: bool, rounds: int) -> dict:
    """One layer's causal attention, forward and backward: ``MultiHeadAttention.attend``
    under ``nl.jit`` (the fused CPU kernel where it is built: ``nl.flash_info()``) against
    ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch's fused CPU kernel), on
    the same q, k, v and output cotangent, checked equal first."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from .kernels import layer_grad, layer_problem

    att, (q, k, v, w) = layer_problem(tiny)
    b, t, heads, d = q.shape
    grad = layer_grad(att)
    args = [jnp.asarray(x) for x in (q, k, v, w)]
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3)).requires_grad_() for x in (q, k, v))
    tw = torch.tensor(w.transpose(0, 2, 1, 3))

    def ours():
        return jax.block_until_ready(grad(*args))

    def theirs():
        for x in (tq, tk, tv):
            x.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        (out * tw).sum().backward()
        return tq.grad, tk.grad, tv.grad

    for a, g in zip(ours(), theirs(), strict=True):
        g = g.numpy().transpose(0, 2, 1, 3)
        if not np.allclose(a, g, rtol=1e-3, atol=1e-3 * float(np.abs(g).max())):
            raise SystemExit("attention: nnlite's and PyTorch's gradients differ")
    samples = h.time_interleaved({"nnlite": ours, "theirs": theirs}, rounds=rounds, warmup=1)
    flops = 4 * b * heads * t * (t + 1) / 2 * d * 3.5  # causal: forward 2 products, backward 5
    return _row(samples, "torch SDPA", 1, "call", flops, "FLOP")


def llama_row(row: str, bench, tiny: bool, rounds: int) -> dict | None:
    """A Llama row from ``bench`` (a :class:`benchmarks.pretrained.LlamaBench`); None for
    the LoRA row when peft is not installed."""
    tokens = bench.batch * bench.seq
    if row == "llama_forward":
        cases, peer, warmup = bench.forward_cases(), "transformers", 2
        unit, work, what = "forward", tokens, "tokens"
    elif row == "llama_generate":
        new = 4 if tiny else 64
        cases, peer, warmup = bench.sample_cases(new), "transformers", 1
        unit, work, what = "generate", new, "tokens"
    else:
        kind = row.removeprefix("llama_")
        cases = bench.step_cases((kind,))
        peer = "transformers" if kind == "full" else "peft"
        cases = {k.split()[0].replace("torch+peft", "torch"): v for k, v in cases.items()}
        if "torch" not in cases:
            return None
        unit, work, what, warmup = "step", tokens, "tokens", 1
    samples = h.time_interleaved(
        {"nnlite": cases["nnlite"], "theirs": cases["torch"]}, rounds=rounds, warmup=warmup
    )
    return _row(samples, peer, 1, unit, work, what)


def matmul_row(dtype: str, n: int, rounds: int) -> dict:
    samples = h.time_interleaved(matmul_cases(dtype, n), rounds=rounds)
    return _row(samples, "torch.mm", MATMUL_REPS, "matmul", 2 * n**3 * MATMUL_REPS, "FLOP")


def _row(samples: dict, peer: str, per: int, unit: str, work: float, what: str) -> dict:
    """A row's figures: median seconds per ``unit`` (a sample does ``per`` of them and
    ``work`` ``what``s), its rate, and nnlite's time over the peer's."""
    med = {k: h.median(v) for k, v in samples.items()}
    out = {"peer": peer, "unit": unit, "what": what, "samples_s": samples}
    for side, t in med.items():
        out[side] = {"seconds_per_" + unit: t / per, what + "_per_s": work / t}
    out["ratio"] = med["nnlite"] / med["theirs"] if "theirs" in med else math.nan
    return out


def cell(r: dict, side: str) -> str:
    if side not in r:
        return "-"
    v = r[side]
    t, rate = v["seconds_per_" + r["unit"]], v[r["what"] + "_per_s"]
    if r["what"] == "FLOP":
        return f"{rate / 1e9:,.1f} GFLOP/s"
    return f"{h.fmt_time(t)}/{r['unit']} ({rate:,.1f} {r['what']}/s)"


# -- the command ---------------------------------------------------------------------------
def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.real_size", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per row (>= 3)")
    ap.add_argument("--threads", type=int, help="pin to N usable cores (before JAX starts)")
    ap.add_argument(
        "--flags",
        action="store_true",
        help="the matmul rows under each XLA flag set, a fresh process each",
    )
    ap.add_argument(
        "--flag-sets",
        default=",".join(FLAG_SETS),
        help=f"with --flags: comma-separated: {', '.join(FLAG_SETS)}",
    )
    ap.add_argument(
        "--host-memory",
        choices=("keep", "release"),
        default="release",
        help="release: glibc's defaults, as both libraries ship; keep: freed host memory "
        "kept for reuse (nnlite.keep_host_memory, NNLITE_CPU_MEMORY=keep), both alike",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, one round: a smoke run")
    ap.add_argument("--matmul-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.flag_sets = [f.strip() for f in args.flag_sets.split(",") if f.strip()]
    for given, valid, opt in (
        (args.rows, ROWS, "--rows"),
        (args.flag_sets, FLAG_SETS, "--flag-sets"),
    ):
        bad = [x for x in given if x not in valid]
        if bad or not given:
            ap.error(f"{opt}: unknown {bad or 'empty list'}; choose from {', '.join(valid)}")
    if not args.tiny and args.rounds < 3:
        ap.error(f"--rounds {args.rounds}: medians need at least 3 rounds")
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.threads is not None:
        if usable is None:
            ap.error("--threads needs os.sched_setaffinity (Linux)")
        if not 1 <= args.threads <= len(usable):
            ap.error(f"--threads {args.threads}: expected 1 to {len(usable)} (usable cores)")
        os.sched_setaffinity(0, usable[: args.threads])
    args.threads = args.threads or (len(usable) if usable else os.cpu_count() or 1)
    return args


def run_rows(args) -> dict:
    """Every selected row, in :data:`ROWS` order (the Llama's built once for its rows)."""
    results, bench, built = {}, None, {}
    rounds = 1 if args.tiny else args.rounds
    for row in (r for r in ROWS if r in args.rows):
        t0 = time.perf_counter()
        if row.startswith("gpt_"):
            results[row] = gpt_row(row, args.tiny, rounds, built)
        elif row == "attention":
            results[row] = attention_row(args.tiny, rounds)
        elif row.startswith("llama_"):
            if bench is None:
                from .pretrained import LlamaBench

                bench = LlamaBench("tiny", 2, 16) if args.tiny else LlamaBench("smollm", 4, 256)
            results[row] = llama_row(row, bench, args.tiny, rounds)
        else:
            results[row] = matmul_row(MATMUL_ROWS[row], 64 if args.tiny else 2048, rounds)
        print(f"  {row}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    args = parse(argv)
    if args.matmul_child:
        print(json.dumps(matmul_child(json.loads(args.matmul_child))))
        return 0
    import nnlite as nl

    # before torch's threads and JAX's backend start (in-process callers: too late, so no)
    kept = args.host_memory == "keep" and nl.keep_host_memory(warn=False)
    try:
        import torch
    except ImportError:
        raise SystemExit("benchmarks.real_size compares with PyTorch: pip install torch") from None
    torch.set_num_threads(args.threads)
    info = {**machine(args.threads), "host_memory": "kept" if kept else "released"}
    print(machine_line(info), flush=True)
    if args.tiny:
        print("--tiny: every row at a tiny size, one round: a smoke run, its figures mean nothing")
    results = run_rows(args)
    dtypes = [d for r, d in MATMUL_ROWS.items() if r in args.rows]
    runs = None
    if args.flags and dtypes:
        runs = flag_runs(args.flag_sets, dtypes, 64 if args.tiny else 2048, 1 if args.tiny else 3)
    rows = []
    for row, r in results.items():
        if r is None:
            rows.append([row, ROWS[row], "-", "peft not installed", "-"])
            continue
        line = [
            row,
            ROWS[row],
            cell(r, "nnlite"),
            f"{r['peer']}: {cell(r, 'theirs')}",
            f"{r['ratio']:.2f}x",
        ]
        if runs is not None:
            dtype = MATMUL_ROWS.get(row)
            line.append(flags_cell(runs, dtype) if dtype else "")
        rows.append(line)
    header = ["row", "work", "nnlite", "theirs", "nnlite time / theirs"]
    print("\n" + h.table(rows, header + (["--flags"] if runs is not None else [])))
    if runs is not None:
        print("\nthe matmul under XLA_FLAGS (a fresh process each)\n")
        print(flags_table(runs, dtypes))
    info["load_after"] = _load()
    print(
        f"\nload average: {info['load_before']} before, {info['load_after']} after "
        f"(1 minute; {args.threads} threads: a load above them makes these no evidence)"
    )
    payload = {"machine": info, "tiny": args.tiny, "rows": results, "flags": runs}
    print("wrote", h.write_json("real_size-tiny" if args.tiny else "real_size", payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
