"""bfloat16 / float16 against float32 on the shipped GPT: step time, MFU, what XLA compiles.

For each compute precision (``train.precision``'s policy on the float32 GPT, and the GPT's
own ``model.dtype: bfloat16``) the trainer's train step (``train.compile_fit``: loss,
gradients by ``--grad``, AdamW) is timed interleaved with float32, and its optimised HLO is
read: how many dots there are and in which dtype XLA runs them, and how many ``convert``
ops it added. The model FLOPs and the peak are the trainer's (the step's cost analysis, a
measured GEMM: ``CompiledFit.flops_and_peak``): MFU per row. A matrix product alone in float32 and bfloat16
shows what the CPU does with bfloat16 without the model around it. Then the shipped recipe
trains ``--train-steps`` steps in float32 and under ``train.precision: bfloat16`` through the
trainer and the val losses are compared (the issue's bound: 0.02 nats).

Run for real (a few minutes on 2 cores):
    python -m benchmarks.precision
Check that it works (seconds):
    python -m benchmarks.precision --tiny
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from . import _harness as h
from .deep import SHIPPED, TINY, gpt, train_val_loss

VARIANTS = {  # label: (train.precision, GPT model.dtype)
    "float32": ("float32", "float32"),
    "bfloat16 (train.precision)": ("bfloat16", "float32"),
    "float16 (train.precision)": ("float16", "float32"),
    "bfloat16 (model.dtype)": ("float32", "bfloat16"),
}


class Step:
    """The trainer's GPT train step (``train.compile_fit``) under a precision policy
    (``train.precision``) and the GPT's ``model.dtype``, AdamW, params and optimizer state
    donated, on one fixed batch."""

    def __init__(self, size, grad: str, precision: str, dtype: str):
        import jax
        import numpy as np
        import optax

        from ._impls import compile_nnlite

        self.model = gpt(size, dtype=dtype)
        tx = optax.adamw(1e-3, b1=0.9, b2=0.99, weight_decay=0.1)
        tokens = np.random.default_rng(0).integers(0, size.vocab, 4 * size.batch * size.context)
        config = {"train": {"precision": precision}}
        self.compiled = c = compile_nnlite(
            self.model, tx, size.batch, grad=grad, config=config, tokens=tokens
        )
        st = self.stepper = c.stepper
        self.p, self.o = (st.put_state(jax.tree.leaves(t)) for t in (c.params0, c.opt0))
        self.batch = st.put_indices(c.indices(0, 1), 0)

    def lowered(self):
        return self.stepper.compiled.lower(
            self.p, (self.o, []), self.compiled.X, self.compiled.Y, self.batch
        )

    def run(self, n: int) -> float:
        """``n`` steps (one call each); the last loss, on the host."""
        st, X, Y = self.stepper, self.compiled.X, self.compiled.Y
        for _ in range(n):
            self.p, self.o, _, metrics = st.run(self.p, self.o, [], X, Y, self.batch)
        return float(metrics["loss"][-1])

    def __call__(self):
        return self.run(1)


def hlo_profile(text: str) -> dict:
    """Counts in optimised HLO text: dots by result dtype, and the ``convert`` ops."""
    dots: dict[str, int] = {}
    for m in re.finditer(r"= (\w+)\[[^\]]*\]\S* dot\(", text):
        dots[m.group(1)] = dots.get(m.group(1), 0) + 1
    onednn = len(re.findall(r'custom_call_target="__onednn\$matmul', text))
    return {"dots": dots, "converts": len(re.findall(r" convert\(", text)), "onednn": onednn}


def gemm_rates(n: int) -> dict:
    """FLOP/s of an ``n x n`` matrix product in float32 and bfloat16 (best of 5)."""
    from ._matmul import gemm_rate

    return {dt: gemm_rate(dt, n) for dt in ("float32", "bfloat16")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run in seconds")
    ap.add_argument("--grad", default="manual", choices=("manual", "autodiff"))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--train-steps",
        type=int,
        default=500,
        help="steps of the recipe per run (0: no training runs)",
    )
    ap.add_argument("--hlo-dir", default=None, help="also write each step's optimised HLO here")
    args = ap.parse_args(argv)
    size = TINY if args.tiny else SHIPPED
    rounds = 1 if args.tiny else args.rounds
    variants = list(VARIANTS)[:2] if args.tiny else list(VARIANTS)  # tiny: float32, bf16
    steps = {k: Step(size, args.grad, *VARIANTS[k]) for k in variants}
    profile, flops = {}, {}
    for label, step in steps.items():
        lowered = step.lowered()
        text = lowered.compile().as_text()
        profile[label] = hlo_profile(text)
        # the trainer's count (before the backend turns dots into library calls)
        flops[label] = step.compiled.flops_and_peak()[0]
        if args.hlo_dir:
            out = Path(args.hlo_dir) / f"{re.sub(r'[^a-z0-9]+', '_', label)}.hlo"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
    t = h.medians(steps, rounds)
    peak = steps["float32"].compiled.flops_and_peak()[1]  # the trainer's: a measured GEMM
    rows = []
    for label in steps:
        p = profile[label]
        dots = ", ".join(f"{n} {dt}" for dt, n in sorted(p["dots"].items()))
        mfu = flops[label] / t[label] / peak if flops[label] else float("nan")
        rows.append(
            [
                label,
                f"{t[label] * 1e3:.2f}",
                f"{t[label] / t['float32']:.2f}",
                dots,
                p["converts"],
                f"{mfu:.1%}",
            ]
        )
    print(
        f"\nthe GPT train step ({args.grad}; {size.n_layer} x {size.n_embd}, context "
        f"{size.context}, batch {size.batch}); MFU against the float32 GEMM peak "
        f"{peak / 1e9:.1f} GFLOP/s"
    )
    print(h.table(rows, ["precision", "ms/step", "x float32", "dots (HLO)", "converts", "MFU"]))
    gemm = gemm_rates(256 if args.tiny else 1024)
    print("\nthe matrix product alone (GFLOP/s)")
    print(
        h.table(
            [[dt, f"{r / 1e9:.1f}", f"{gemm['float32'] / r:.2f}"] for dt, r in gemm.items()],
            ["dtype", "GFLOP/s", "float32 / it"],
        )
    )
    val = {}
    if args.train_steps < 1:  # --train-steps 0: the step table only
        h.write_json("precision", {"step_s": t, "hlo": profile, "flops": flops, "peak": peak})
        return 0
    with tempfile.TemporaryDirectory() as d:
        for prec in ("float32", "bfloat16"):
            over = [f"train.precision={prec}", f"name=precision_{prec}"]
            val[prec] = train_val_loss("float32", args.train_steps, args.tiny, Path(d), over)
    print(
        f"\nval loss after {args.train_steps} steps of the shipped recipe: float32 "
        f"{val['float32']:.4f}, train.precision=bfloat16 {val['bfloat16']:.4f} "
        f"({val['bfloat16'] - val['float32']:+.4f} nats)"
    )

    h.write_json(
        "precision",
        {"step_s": t, "hlo": profile, "flops": flops, "peak": peak, "gemm": gemm, "val": val},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
