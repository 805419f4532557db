"""nnlite's native CPU kernels against XLA's own ops, in one process.

    python -m benchmarks.kernels [--kernel attention|gemm] [--rows ROW,...] [--rounds 5] [--tiny]

Each row builds the same program twice, once with the kernel and once without, traces and
compiles each under its setting, checks that both give the same result, then times them
interleaved (medians of ``--rounds``). ``--kernel`` (:data:`KERNELS`):

* ``attention``: ``MultiHeadAttention`` taking ``nl.flash_attention`` (the fused kernel,
  ``nnlite/nn/_flash.py``) or XLA's ops (the query blocks of ``nnlite/nn/_attention.py``);
* ``gemm``: nnlite's products (``nl.matmul``: ``Linear``, LoRA, the tied and chunked heads)
  on Intel MKL's GEMM (``nnlite/core/_gemm.py``) or on XLA's dot.

Rows (:data:`ROWS`): one GPT 6x6x384 layer's attention (``attend``, forward and backward),
that GPT's training step (the trainer's, ``loss.grad: auto``), and a SmolLM-135M-shaped
Llama's full fine-tuning step, LoRA step and forward at 4x256 tokens. ``--tiny``: tiny
sizes, one round (a smoke run). Results go to
``benchmarks/results/kernels-<kernel>-latest.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from . import _harness as h

ROWS = {
    "layer": "one GPT 6x6x384 layer's causal attention [64,256,6,64]: attend, forward+backward",
    "gpt_large": "GPT 6x6x384, ctx 256, batch 64: the trainer's training step",
    "llama_full": "SmolLM-135M-shaped Llama, 4x256 tokens: full fine-tuning step",
    "llama_lora": "same: LoRA step (rank 8 on q, v)",
    "llama_forward": "same: forward",
}


# kernel: (its column's name, its switch (the environment variable ``nnlite.core._native``
# knows it by), the prefix of its info line when it runs, the info line's function's name)
KERNELS = {
    "attention": ("fused kernel", "NNLITE_CPU_ATTENTION", "fused", "flash_info"),
    "gemm": ("MKL", "NNLITE_CPU_GEMM", "MKL", "gemm_info"),
}


def _variants(make, kernel: str):
    """``{"kernel": (fn, result), "xla": (fn, result)}``: ``make()`` built, traced and run
    once with the kernel and once with it held off (``_native.off``: XLA's ops)."""
    from nnlite.core import _native

    out = {}
    for name, context in (
        ("kernel", contextlib.nullcontext()),
        ("xla", _native.off(KERNELS[kernel][1])),
    ):
        with context:
            fn = make()
            out[name] = (fn, fn())
    return out


def _same(results: dict, rtol: float) -> None:
    import jax
    import numpy as np

    a, b = (jax.tree.leaves(results[k]) for k in ("kernel", "xla"))
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        if not np.allclose(x, y, rtol=rtol, atol=rtol * float(np.abs(y).max() or 1)):
            raise SystemExit("the kernel's result differs from XLA's ops'")


def layer_problem(tiny: bool):
    """One GPT 6x6x384 layer's causal attention (``[64, 256, 6, 64]``; tiny: ``[2, 80, 2,
    16]``): ``(layer, [q, k, v, w])``, ``w`` the output's cotangent, float32 numpy arrays
    (``benchmarks.real_size`` hands the same ones to PyTorch)."""
    import numpy as np

    import nnlite as nl

    b, t, heads, d = (2, 80, 2, 16) if tiny else (64, 256, 6, 64)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((b, t, heads, d), dtype=np.float32) for _ in range(4)]
    return nl.MultiHeadAttention(heads * d, heads, causal=True), arrays


def layer_grad(att):
    """``(q, k, v, w) -> (dq, dk, dv)`` of ``sum(att.attend(q, k, v) * w)``, compiled with
    ``nl.jit`` (``w`` an argument: a closed-over array would be a constant XLA folds)."""
    import jax
    import jax.numpy as jnp

    import nnlite as nl

    return nl.jit(jax.grad(lambda q, k, v, w: jnp.sum(att.attend(q, k, v) * w), (0, 1, 2)))


def layer_case(tiny: bool):
    import jax
    import jax.numpy as jnp

    att, arrays = layer_problem(tiny)
    args = [jnp.asarray(a) for a in arrays]

    def make():
        grad = layer_grad(att)
        return lambda: jax.block_until_ready(grad(*args))

    return make, 1, 1e-4


def gpt_case(tiny: bool):
    import jax

    from ._gpt_impls import GPT_SPECS, GPT_TINY, NnliteGPT, init_weights, make_data, optimizer

    spec = GPT_TINY if tiny else GPT_SPECS["gpt_large"]
    weights, (X, idx) = init_weights(spec), make_data(spec, 10)

    def make():
        model = NnliteGPT(spec, weights, X, None, idx, optimizer(), steps_per_call=2, grad="auto")

        def run():  # two steps from the same weights and windows: the loss after them
            with jax.numpy_rank_promotion("allow"):
                return model.run(2)

        return run

    return make, 2, 1e-4


def llama_case(tiny: bool, kind: str, bench):
    def make():
        if kind == "forward":
            return bench.forward_cases()["nnlite"]
        cases = bench.step_cases((kind,))
        return cases[next(k for k in cases if k.startswith("nnlite"))]

    return make, 1, 1e-4 if kind == "forward" else None


def run(args) -> dict:
    results, bench = {}, None
    rounds = 1 if args.tiny else args.rounds
    for row in (r for r in ROWS if r in args.rows):
        t0 = time.perf_counter()
        if row == "layer":
            make, per, rtol = layer_case(args.tiny)
        elif row == "gpt_large":
            make, per, rtol = gpt_case(args.tiny)
        else:
            if bench is None:
                from .pretrained import LlamaBench

                bench = LlamaBench("tiny", 2, 16) if args.tiny else LlamaBench("smollm", 4, 256)
            make, per, rtol = llama_case(args.tiny, row.removeprefix("llama_"), bench)
        built = _variants(make, args.kernel)
        if rtol is not None:
            _same({k: v[1] for k, v in built.items()}, rtol)
        samples = h.time_interleaved(
            {k: v[0] for k, v in built.items()}, rounds=rounds, warmup=0 if per > 1 else 1
        )
        med = {k: h.median(v) / per for k, v in samples.items()}
        results[row] = {"seconds": med, "samples_s": samples, "ratio": med["kernel"] / med["xla"]}
        print(f"  {row}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--kernel", default="attention", choices=list(KERNELS), help="which kernel")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per row (>= 3)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, one round: a smoke run")
    args = ap.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in args.rows if r not in ROWS]
    if bad or not args.rows:
        ap.error(f"--rows: unknown {bad or 'empty list'}; choose from {', '.join(ROWS)}")
    if not args.tiny and args.rounds < 3:
        ap.error(f"--rounds {args.rounds}: medians need at least 3 rounds")
    import nnlite as nl

    name, _, runs, info_fn = KERNELS[args.kernel]
    info, line = h.machine_info(), getattr(nl, info_fn)()
    print(f"machine: {info['cpu']}, {info['affinity']} cores; CPU {args.kernel}: {line}")
    if not line.startswith(runs):
        raise SystemExit(f"no {name} in this process: {line}")
    results = run(args)
    rows = [
        [row, ROWS[row], h.fmt_time(r["seconds"]["xla"]), h.fmt_time(r["seconds"]["kernel"]),
         f"{r['ratio']:.2f}x"]
        for row, r in results.items()
    ]  # fmt: skip
    header = ["row", "work", "XLA's ops", name, f"{name} / XLA"]
    print("\n" + h.table(rows, header))
    stem = f"kernels-{args.kernel}" + ("-tiny" if args.tiny else "")
    h.write_json(stem, {"machine": info, "kernel": args.kernel, "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
