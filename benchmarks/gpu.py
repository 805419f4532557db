"""The accelerator figures of benchmarks/README.md: the GPT train step against its peers,
MFU, bfloat16, one device and fsdp, in one process run (a lent GPU's time is short).

    python -m benchmarks.gpu           # on a machine with a GPU: a few minutes
    python -m benchmarks.gpu --tiny    # the same code at toy sizes on any device (seconds)

1. ``steps``: ``benchmarks.train_step``'s GPT rows (raw JAX, Equinox, Flax NNX, nnlite
   K=1 / K=n / manual / auto, PyTorch eager and its bf16 autocast, the matmul floor) at
   ``gpt_large`` and ``gpt2_small``; MFU against the data sheet's float32 (TF32) peak.
2. ``precision``: ``benchmarks.precision``'s GPT step (the trainer's) at the same sizes in
   float32, under ``train.precision`` bfloat16 / float16 and the GPT's ``model.dtype:
   bfloat16``; the dots per dtype in the optimised HLO; MFU as the trainer reports it
   (against ``train.precision``'s peak).
3. ``trainer``: ``python -m train`` on the GPT (``gpt_large``'s shape; a character corpus
   made of this repository's docs) under ``parallel.strategy`` none and fsdp, float32 and
   bfloat16: the trainer's own tokens/s and MFU (``metrics.jsonl``'s last train row, so
   compilation and evaluation are not in it).

Each part runs on its own: one that fails prints its error and the others still run. The
results go to ``benchmarks/results/gpu-*.json`` (or ``$NNLITE_BENCH_RESULTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (nnlite's steps per call, steps per timed sample, rounds) per GPT size on an accelerator
GPU_STEPS = {"gpt_large": (10, 20, 5), "gpt2_small": (5, 10, 5)}


def part_steps(tiny: bool) -> dict:
    from . import train_step

    out = {}
    for size, (k, n, rounds) in GPU_STEPS.items():
        r = train_step.bench_gpt(
            size, 1 if tiny else rounds, False, "autocast", tiny, steps=(k, n), rtol=2e-3
        )
        print("\n" + train_step.render_gpt(size, r), flush=True)
        out[size] = r
        if tiny:
            break
    return out


def _precision_rows(size, tiny: bool, rounds: int) -> dict:
    from .precision import VARIANTS, Step, hlo_profile

    rows = {}
    labels = list(VARIANTS)[:2] if tiny else list(VARIANTS)  # tiny: float32, bf16
    steps = {label: Step(size, "manual", *VARIANTS[label]) for label in labels}
    for label, step in steps.items():
        flops, peak = step.compiled.flops_and_peak()  # the trainer's: train.precision's peak
        rows[label] = {
            "hlo": hlo_profile(step.lowered().compile().as_text()),
            "flops": flops,
            "peak": peak,
        }
    m = 2 if tiny else 10  # steps per timed sample: one sync at its end
    from . import _harness as h

    samples = h.time_interleaved(
        {k: (lambda s=s: s.run(m)) for k, s in steps.items()}, rounds=rounds
    )
    for label, r in rows.items():
        t = h.median(samples[label]) / m
        r["s_per_step"] = t
        r["mfu"] = r["flops"] / t / r["peak"] if r["flops"] and r["peak"] else None
    return rows


def part_precision(tiny: bool) -> dict:
    from ._gpt_impls import GPT_SPECS
    from .deep import LARGE, TINY

    sizes = {"tiny": TINY} if tiny else {"gpt_large": LARGE, "gpt2_small": GPT_SPECS["gpt2_small"]}
    out = {}
    for name, size in sizes.items():
        rows = _precision_rows(size, tiny, 1 if tiny else 10)
        base = rows["float32"]["s_per_step"]
        print(
            f"\nprecision, {name} ({size.n_layer} x {size.n_embd}, context {size.context}, "
            f"batch {size.batch}), manual rules, AdamW"
        )
        print("| precision | ms/step | x float32 | dots (HLO) | converts | MFU (peak) |")
        print("|---|---|---|---|---|---|")
        for label, r in rows.items():
            dots = ", ".join(f"{c} {dt}" for dt, c in sorted(r["hlo"]["dots"].items()))
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
            peak = "?" if not r["peak"] else f"{r['peak'] / 1e12:.3g} TFLOP/s"
            print(
                f"| {label} | {r['s_per_step'] * 1e3:.2f} | {r['s_per_step'] / base:.2f} | "
                f"{dots} | {r['hlo']['converts']} | {mfu} ({peak}) |",
                flush=True,
            )
        out[name] = rows
    return out


def corpus(path: Path) -> Path:
    """A character corpus of this repository's own docs (no third-party text)."""
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    path.write_text("\n".join(f.read_text(encoding="utf-8") for f in files), encoding="utf-8")
    return path


def part_trainer(tiny: bool) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        text = corpus(Path(d) / "corpus.txt")
        shape = (
            dict(n_layer=1, n_head=2, n_embd=32, context=16, batch=4, steps=20, k=10)
            if tiny
            else dict(n_layer=6, n_head=6, n_embd=384, context=256, batch=64, steps=300, k=50)
        )
        for strategy in ("none", "fsdp"):
            for prec in ("float32", "bfloat16"):
                name = f"{strategy}_{prec}"
                sets = {
                    "name": name,
                    "data.name": "text",
                    "data.path": str(text),
                    "data.eval_windows": 64,
                    "model.n_layer": shape["n_layer"],
                    "model.n_head": shape["n_head"],
                    "model.n_embd": shape["n_embd"],
                    "model.context": shape["context"],
                    "train.batch_size": shape["batch"],
                    "train.steps": shape["steps"],
                    "train.steps_per_call": shape["k"],
                    "train.eval_every": shape["steps"],
                    "train.log_every": shape["k"],
                    "optimizer.warmup_steps": 10,
                    "checkpoint.every": 0,
                    "log.dir": d,
                    "parallel.strategy": strategy,
                    "train.precision": prec,
                }
                cmd = [sys.executable, "-m", "train", "--config", "configs/shakespeare_gpt.yaml"]
                for k, v in sets.items():
                    cmd += ["--set", f"{k}={v}"]
                t0 = time.perf_counter()
                proc = subprocess.run(
                    cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, check=False
                )
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    print(f"\ntrainer {name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
                    continue
                rows = [
                    json.loads(line)
                    for line in (Path(d) / name / "metrics.jsonl").read_text().splitlines()
                ]
                last = [r for r in rows if r.get("split") == "train"][-1]
                val = [r for r in rows if r.get("split") == "val"][-1]
                tokens = shape["batch"] * shape["context"]
                out[name] = {
                    "tokens_per_s": last["tokens_per_s"],
                    "ms_per_step": 1e3 * tokens / last["tokens_per_s"],
                    "mfu": last.get("mfu"),
                    "val_loss": val["loss"],
                    "wall_s": wall,
                    "done": proc.stdout.strip().splitlines()[-1],
                }
                print(f"\ntrainer {name}: {out[name]}", flush=True)
    return out


PARTS = {"precision": part_precision, "trainer": part_trainer, "steps": part_steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run on any device")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}; valid: {', '.join(PARTS)}")
    from . import _harness as h

    info = h.machine_info()
    print(f"machine: {info['cpu']}; jax {info['versions']['jax']} on {info['jax_devices']}")
    try:
        import jax

        print("device kind:", jax.devices()[0].device_kind, flush=True)
    except Exception:  # noqa: BLE001 - informational
        pass
    results, failed = {}, []
    for p in parts:
        t0 = time.perf_counter()
        try:
            results[p] = PARTS[p](args.tiny)
        except (Exception, SystemExit):  # noqa: BLE001 - one part's failure must not lose the others
            traceback.print_exc()
            failed.append(p)
        print(f"[{p}: {time.perf_counter() - t0:.0f} s]", flush=True)
        h.write_json("gpu-tiny" if args.tiny else "gpu", {"machine": info, "results": results})
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
