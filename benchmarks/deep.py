"""Deep-model costs of the GPT: scan_layers, remat, bfloat16 and XLA's oneDNN dot path.

Parts (``--parts``, all by default), each printing a table of medians:

* ``compile``: lower + compile time of the GPT train step (loss, gradients in the
  ``--grad`` mode, AdamW update) at ``n_layer`` 4, 12, 24, 48, unrolled and with
  ``scan_layers``, at the shipped width (configs/shakespeare_gpt.yaml), and the step time
  of both layouts at the shipped size, interleaved.
* ``remat``: the GPT-large step (benchmarks/_gpt_impls.py: 6 x 6 heads x 384, context
  256, batch 64) with ``remat`` none / block / full: peak temporary memory from
  ``compiled.memory_analysis()``, median step time, and its model FLOP/s (the matmul
  FLOPs of ``GPTSpec.matmul_flops``) against the 2048 x 2048 float32 GEMM rate.
* ``bf16``: step time of the shipped model in float32 and bfloat16 (interleaved), and the
  val loss of each after ``--train-steps`` steps of the shipped config through
  ``train.fit``.
* ``flags``: the whole GPT step (shipped size and GPT-large) in two fresh processes, with
  and without the oneDNN flags (``ONEDNN_FLAGS``; XLA_FLAGS is read when jax is
  imported), step times and the losses after the same steps compared.

Run for real (about 5 minutes on 2 cores; the lead's command):
    python -m benchmarks.deep
Check that it works (seconds):
    python -m benchmarks.deep --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from . import _harness as h
from ._gpt_impls import GPT_SPECS, GPT_TINY, GPTSpec

ONEDNN_FLAGS = (
    "--xla_cpu_experimental_onednn_custom_call=true --xla_cpu_use_onednn=false "
    "--xla_cpu_experimental_ynn_fusion_type=invalid --xla_cpu_use_xnnpack=false"
)
ROOT = Path(__file__).resolve().parents[1]


SHIPPED = GPTSpec("shipped", 65, 64, 4, 4, 128, 12)  # configs/shakespeare_gpt.yaml (its vocab)
LARGE = GPT_SPECS["gpt_large"]
TINY = GPT_TINY  # 1 layer: a compile costs the same at any width


def gpt(size: GPTSpec, **options):
    from models.gpt import GPT

    return GPT(size.vocab, size.context, size.n_layer, size.n_head, size.n_embd, **options)


class Step:
    """One GPT train step, jitted with params and optimizer state donated: the task's
    loss, gradients by ``grad`` (``autodiff`` or ``manual``), AdamW (the shipped
    config's settings, constant rate)."""

    def __init__(self, size: GPTSpec, grad: str, **options):
        import jax
        import optax

        import nnlite as nl

        self.size, self.model = size, gpt(size, **options)
        self.tx = optax.adamw(1e-3, b1=0.9, b2=0.99, weight_decay=0.1)
        # the task's loss as the trainer computes it: the labels' log-probabilities, the
        # head a chunk at a time (no [batch, T, vocab] logits)
        loss = lambda p, x, y: -self.model(p, x, labels=y).mean()
        if grad == "manual":
            loss = nl.manual_grads(loss)
        tx = self.tx

        def step(params, opt, x, y):
            value, g = jax.value_and_grad(loss)(params, x, y)
            updates, opt = tx.update(g, opt, params)
            return optax.apply_updates(params, updates), opt, value

        self.jitted = jax.jit(step, donate_argnums=(0, 1))
        rng = __import__("numpy").random.default_rng(0)
        tokens = rng.integers(0, size.vocab, (size.batch, size.context + 1)).astype("int32")
        self.x, self.y = jax.numpy.asarray(tokens[:, :-1]), jax.numpy.asarray(tokens[:, 1:])
        self.reset()

    def reset(self):
        import jax

        self.params = self.model.init(jax.random.key(0))
        self.opt = self.tx.init(self.params)

    def compile(self):
        """``(seconds to lower and compile, the compiled step)``."""
        t0 = time.perf_counter()
        compiled = self.jitted.lower(self.params, self.opt, self.x, self.y).compile()
        return time.perf_counter() - t0, compiled

    def __call__(self):
        self.params, self.opt, loss = self.jitted(self.params, self.opt, self.x, self.y)
        loss.block_until_ready()
        return float(loss)


_STEPS: dict = {}


def shared_step(size: GPTSpec, grad: str, **options) -> Step:
    """One :class:`Step` per (size, grad, options) in this process: a part that times or
    measures a step another part has built reuses its traced and compiled program (the
    compile part's depth loop and its timed layouts at the base depth; at ``--tiny`` the
    compile part's scanned step without remat and the remat part's ``none``)."""
    k = (size, grad, tuple(sorted(options.items())))
    if k not in _STEPS:
        _STEPS[k] = Step(size, grad, **options)
    return _STEPS[k]


def part_compile(tiny: bool, grad: str, rounds: int) -> dict:
    base = TINY if tiny else SHIPPED
    # --tiny: one depth (the loop's code is the same for each; a second depth cost two
    # compiles for a ratio that means nothing at a tiny size)
    depths = (1,) if tiny else (4, 12, 24, 48)
    if not tiny:  # (--tiny: the first depth is this very program, and times mean nothing)
        Step(TINY, grad).compile()  # the process's first compile pays one-time costs: not counted
    rows, out = [], {}
    for n in depths:
        size = dataclasses.replace(base, n_layer=n)
        secs = {}
        for scan in (False, True):
            secs[scan] = shared_step(size, grad, scan_layers=scan).compile()[0]
        out[n] = secs
        rows.append(
            [n, f"{secs[False]:.2f}", f"{secs[True]:.2f}", f"{secs[False] / secs[True]:.2f}"]
        )
    print(f"\ncompile time of the GPT step ({grad}; width {base.n_embd}, context {base.context})")
    print(h.table(rows, ["n_layer", "unrolled s", "scan_layers s", "unrolled / scan"]))
    first, last = depths[0], depths[-1]
    print(
        f"scan_layers: {last} layers compile in {out[last][True] / out[first][True]:.2f}x "
        f"the time of {first}"
    )
    # the GPT's default remat ("auto": dots_saveable when scanned) and the scan without it
    steps = {  # (the depth loop's steps at n_layer=base.n_layer: already compiled)
        "unrolled": shared_step(base, grad, scan_layers=False),
        "scanned": shared_step(base, grad, scan_layers=True),
        "scanned, remat none": shared_step(base, grad, scan_layers=True, remat="none"),
    }
    t = h.medians(steps, rounds)
    rows = [[k, f"{v * 1e3:.2f}", f"{v / t['unrolled']:.3f}"] for k, v in t.items()]
    print(f"\nstep time at n_layer={base.n_layer} ({grad}; remat auto unless named)")
    print(h.table(rows, ["layout", "ms/step", "x unrolled"]))
    return {"compile_s": out, "step_s": t}


def part_remat(tiny: bool, grad: str, rounds: int) -> dict:
    from .train_step import gemm_case

    size = spec = TINY if tiny else LARGE
    steps, mem = {}, {}
    for remat in ("none", "block", "full"):
        steps[remat] = shared_step(size, grad, remat=remat, scan_layers=True)
        _, compiled = steps[remat].compile()
        m = compiled.memory_analysis()
        mem[remat] = None if m is None else m.temp_size_in_bytes
    gemm, gemm_flops = gemm_case(256 if tiny else 2048, reps=1 if tiny else 4)
    t = h.medians(steps, rounds)
    gemm_rate = gemm_flops / h.medians({"gemm": gemm}, 5)["gemm"]
    rows = []
    for remat, secs in t.items():
        rate = spec.matmul_flops() / secs
        mib = "n/a" if mem[remat] is None else f"{mem[remat] / 2**20:.1f}"
        rows.append(
            [
                remat,
                mib,
                f"{secs * 1e3:.1f}",
                f"{secs / t['none']:.2f}",
                f"{rate / 1e9:.1f}",
                f"{rate / gemm_rate:.0%}",
            ]
        )
    print(
        f"\nGPT-large step ({grad}, scan_layers) with remat; GEMM {'256' if tiny else '2048'}: "
        f"{gemm_rate / 1e9:.1f} GFLOP/s"
    )
    print(
        h.table(
            rows, ["remat", "peak temp MiB", "ms/step", "x none", "model GFLOP/s", "of GEMM rate"]
        )
    )
    return {"temp_bytes": mem, "step_s": t, "gemm_flops_per_s": gemm_rate}


def train_val_loss(dtype: str, steps: int, tiny: bool, run_dir: Path, extra=()) -> float:
    import train

    sets = [
        f"log.dir={run_dir}",
        "log.progress=false",
        "log.plot=false",
        f"name=bf16_{dtype}",
        f"model.dtype={dtype}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"checkpoint.every={steps}",
        *extra,  # more --set overrides (benchmarks/precision.py: train.precision)
    ]
    if tiny:
        text = run_dir / "tiny.txt"
        text.write_text("To be, or not to be, that is the question.\n" * 40)
        sets += [
            "data.name=text",
            f"data.path={text}",
            "data.eval_windows=16",
            "model.context=16",
            "model.n_layer=1",
            "model.n_embd=16",
            "model.n_head=2",
            "train.steps_per_call=1",
            "optimizer.warmup_steps=1",
        ]
    config = ROOT / "configs/shakespeare_gpt.yaml"
    run = train.fit(None, config, overrides=sets, resume="fresh", echo=lambda *_: None)
    return float(run.summary["val_loss"])


def part_bf16(tiny: bool, grad: str, rounds: int, train_steps: int) -> dict:
    import tempfile

    size = TINY if tiny else SHIPPED
    steps = {d: Step(size, grad, dtype=d) for d in ("float32", "bfloat16")}
    t = h.medians(steps, rounds)
    with tempfile.TemporaryDirectory() as d:
        val = {dt: train_val_loss(dt, train_steps, tiny, Path(d)) for dt in steps}
    rows = [
        [dt, f"{t[dt] * 1e3:.2f}", f"{t[dt] / t['float32']:.2f}", f"{val[dt]:.4f}"] for dt in steps
    ]
    print(
        f"\nbfloat16 vs float32, shipped GPT ({grad}); val loss after {train_steps} steps of "
        "the shipped config"
    )
    print(h.table(rows, ["dtype", "ms/step", "x float32", "val loss"]))
    print(f"val loss bfloat16 - float32: {val['bfloat16'] - val['float32']:+.4f} nats")
    return {"step_s": t, "val_loss": val}


def flags_child(tiny: bool, grad: str, rounds: int, large_rounds: int) -> dict:
    """In this process (XLA_FLAGS as the parent set them): the median step time and every
    step's loss, from init (the same steps in both processes)."""
    import statistics

    out = {}
    for name, size, n in (("shipped", SHIPPED, rounds), ("large", LARGE, large_rounds)):
        step = Step(TINY if tiny else size, grad)
        losses, secs = [step()], []  # the first call compiles
        for _ in range(n):
            t0 = time.perf_counter()
            losses.append(step())
            secs.append(time.perf_counter() - t0)
        out[name] = {"step_s": statistics.median(secs), "losses": losses}
    return out


def part_flags(tiny: bool, grad: str, rounds: int, large_rounds: int) -> dict:

    args = [
        "--flags-child",
        "--grad",
        grad,
        "--rounds",
        str(rounds),
        "--large-rounds",
        str(large_rounds),
    ] + (["--tiny"] if tiny else [])
    base_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = {}
    for label, flags in (("default", None), ("oneDNN", ONEDNN_FLAGS)):
        env = dict(base_env) if flags is None else {**base_env, "XLA_FLAGS": flags}
        os.environ.pop("XLA_FLAGS", None)
        res[label] = h.run_module_json("benchmarks.deep", args, env=env)
    rows = []
    for size in ("shipped", "large"):
        a, b = res["default"][size], res["oneDNN"][size]
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(b["losses"], a["losses"]))
        n = len(a["losses"])
        rows.append(
            [
                size,
                f"{a['step_s'] * 1e3:.1f}",
                f"{b['step_s'] * 1e3:.1f}",
                f"{b['step_s'] / a['step_s']:.3f}",
                f"{worst:.1e}",
            ]
        )
    print(f"\nthe GPT step with XLA's oneDNN dot path ({grad}), each in its own process")
    print(
        h.table(
            rows,
            [
                "size",
                "default ms",
                "oneDNN ms",
                "oneDNN / default",
                f"max rel. loss diff ({n} steps)",
            ],
        )
    )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="compile,remat,bf16,flags")
    ap.add_argument("--grad", default="manual", choices=("manual", "autodiff"))
    ap.add_argument("--rounds", type=int, default=5, help="timed steps, shipped size")
    ap.add_argument("--large-rounds", type=int, default=2, help="timed steps, GPT-large")
    ap.add_argument(
        "--train-steps",
        type=int,
        default=500,
        help="bf16 part: steps of the shipped config per dtype (2000 = the recipe)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: check that it runs")
    ap.add_argument("--flags-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:  # seconds, not minutes: a few steps and rounds
        args.rounds, args.large_rounds = 1, 1
        args.train_steps = min(args.train_steps, 20)
    sys.path.insert(0, str(ROOT))
    if args.flags_child:
        print(json.dumps(flags_child(args.tiny, args.grad, args.rounds, args.large_rounds)))
        return 0

    parts = args.parts.split(",")
    unknown = set(parts) - {"compile", "remat", "bf16", "flags"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from compile, remat, bf16, flags")
    result = {"machine": h.machine_info(), "grad": args.grad, "tiny": args.tiny}
    if "compile" in parts:
        result["compile"] = part_compile(args.tiny, args.grad, args.rounds)
    if "remat" in parts:
        result["remat"] = part_remat(args.tiny, args.grad, args.large_rounds)
    if "bf16" in parts:
        result["bf16"] = part_bf16(args.tiny, args.grad, args.rounds, args.train_steps)
    if "flags" in parts:
        result["flags"] = part_flags(args.tiny, args.grad, args.rounds, args.large_rounds)
    if not args.tiny:
        print(f"\nwrote {h.write_json('deep', json.loads(json.dumps(result, default=str)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
