"""Where a step's time goes, per op family: one compiled step traced with ``jax.profiler``,
its events joined with the optimised HLO.

    python -m benchmarks.op_profile [--rows gpt_large,llama_full] [--options nnlite|xla]
                                    [--top 15] [--tiny]

On the CPU every thunk XLA runs is a trace event named by its HLO instruction; the
optimised HLO (``XLA_FLAGS=--xla_dump_to``, so each row runs in a fresh process) says what
each one computes: a GEMM (its operand shapes and contracting dimensions, forward or
backward by the op's ``transpose(jvp(...))`` scope), attention's batched products, an
elementwise, reduce or data-movement fusion, a copy. The table sums the events' time per
family, then lists the costliest kinds of op.

``--options``: ``nnlite`` compiles as the trainer does (``nl.jit``: XLA's own Eigen dot on
the CPU), ``xla`` with XLA's defaults (YNNPACK's dot fusions). Eigen's dot thunks run
asynchronously, so their events hold only the launch: under ``nnlite`` the GEMMs' time
lands in the "outside events" line (the step's wall time less the events'); ``xla``'s
profile attributes every op. Rows: ``gpt_large`` (GPT 6x6x384, context 256, batch 64, the
trainer's step), ``llama_full`` and ``llama_lora`` (a SmolLM-135M-shaped Llama, 4x256
tokens, the full fine-tuning and the LoRA steps of ``benchmarks.pretrained``) and
``llama_forward`` (its forward pass, all logits). ``--tiny``: every row at a tiny size (a
smoke run; times mean nothing). Results: ``benchmarks/results/op_profile-latest.json``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _harness as h

ROWS = ("gpt_large", "llama_full", "llama_lora", "llama_forward")
_DATA_MOVEMENT = {
    "parameter", "transpose", "copy", "bitcast", "reshape", "broadcast", "slice",
    "concatenate", "pad", "dynamic-slice", "dynamic-update-slice",
}  # fmt: skip
_INSTRUCTION = re.compile(r"(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)?) ([a-z][\w\-]*)\(")


def parse_hlo(text: str) -> tuple[dict, dict]:
    """``(computations, instructions)`` of an optimised HLO module's text: each
    computation's instruction lines, and each instruction's ``(shape, opcode, line)``."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[current] = []
        elif current and line.startswith("  ") and " = " in line:
            comps[current].append(line.strip())
    inst = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:
                inst[m.group(1)] = (m.group(2), m.group(3), line)
    return comps, inst


def _dims(shape: str) -> str:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return m.group(1) if m else shape


def _dot(line: str, inst: dict) -> tuple[str, str]:
    operands = re.search(r" (?:dot|convolution)\(([^)]*)\)", line).group(1)
    shapes = [_dims(inst.get(o.strip().split(" ")[-1].lstrip("%"), ("?",))[0]) for o in
              operands.split(",")]  # fmt: skip
    contract = re.search(
        r"lhs_contracting_dims=\{([\d,]*)\}, rhs_contracting_dims=\{([\d,]*)\}", line
    )
    batched = "lhs_batch_dims" in line
    what = f"[{shapes[0]}] x [{shapes[1]}]"
    if contract:
        what += f" contracting {contract.group(1)}/{contract.group(2)}"
    return ("attention: batched products" if batched else "GEMMs"), what


def classify(name: str, comps: dict, inst: dict) -> tuple[str, str]:
    """``(family, kind)`` of the HLO instruction ``name``."""
    if name not in inst:
        family = "attention kernels" if name.startswith("nnlite_attention") else "other"
        return family, re.sub(r"\.\d+$", "", name)
    shape, op, line = inst[name]
    scope = re.search(r'op_name="([^"]*)"', line)
    side = "backward" if scope and "transpose(" in scope.group(1) else "forward"
    calls = re.search(r"calls=%?([\w.\-]+)", line)
    if op == "fusion" and calls:
        body = comps.get(calls.group(1), [])
        dots = [b for b in body if re.search(r" (?:dot|convolution)\(", b)]
        if dots:
            family, what = _dot(dots[0], inst)
            return family, f"{what} -> [{_dims(shape)}], {side}"
        ops = {m.group(3) for m in map(_INSTRUCTION.match, body) if m} - {"parameter"}
        if ops & {"reduce", "reduce-window"}:
            family = "reduce fusions"
        elif ops <= _DATA_MOVEMENT:
            family = "copies and transposes"
        else:
            family = "elementwise fusions"
        return family, f"[{_dims(shape)}] {'+'.join(sorted(ops))[:70]}"
    if op in ("dot", "convolution"):
        family, what = _dot(line, inst)
        return family, f"{what} -> [{_dims(shape)}], {side}"
    if op in ("copy", "transpose"):
        return "copies and transposes", f"{op} [{_dims(shape)}]"
    target = re.search(r'custom_call_target="([^"]*)"', line)
    if op == "custom-call" and target:  # nnlite's native kernels
        if target.group(1) == "nnlite_gemm":
            layouts = line.partition("operand_layout_constraints=")[2].partition("}}")[0]
            dims = re.findall(r"\w+\[([\d,]*)\]", layouts)
            return "GEMMs", f"MKL [{'] x ['.join(dims)}] -> [{_dims(shape)}], {side}"
        if target.group(1).startswith("nnlite_attention"):
            return "attention kernels", target.group(1)
    return "other", f"{op} [{_dims(shape)}]"


def table(events: list[dict], hlo_text: str, wall_s: float, top: int) -> dict:
    """Per family and per kind of op: seconds and counts of the trace's HLO events."""
    comps, inst = parse_hlo(hlo_text)
    fam, fam_n = collections.Counter(), collections.Counter()
    kind, kind_n = collections.Counter(), collections.Counter()
    for e in events:
        family, what = classify(e["args"]["hlo_op"], comps, inst)
        fam[family] += e["dur"] / 1e6
        fam_n[family] += 1
        kind[(family, what)] += e["dur"] / 1e6
        kind_n[(family, what)] += 1
    inside = sum(fam.values())
    return {
        "wall_s": wall_s,
        "events_s": inside,
        "families": [(f, s, fam_n[f]) for f, s in fam.most_common()],
        "kinds": [(f, w, s, kind_n[(f, w)]) for (f, w), s in kind.most_common(top)],
    }


def _build(row: str, tiny: bool):
    """The row's step as a no-argument call that blocks until done."""
    import jax

    if row == "gpt_large":
        from ._gpt_impls import GPT_SPECS, GPT_TINY, NnliteGPT, init_weights, make_data, optimizer

        spec = GPT_TINY if tiny else GPT_SPECS["gpt_large"]
        weights, (X, idx) = init_weights(spec), make_data(spec, 10)
        with jax.numpy_rank_promotion("allow"):
            impl = NnliteGPT(
                spec, weights, X, None, idx, optimizer(), steps_per_call=1, grad="auto"
            )
        return lambda: impl.run(1)
    from .pretrained import LlamaBench

    bench = LlamaBench("tiny" if tiny else "smollm", 2 if tiny else 4, 16 if tiny else 256)
    which = row.removeprefix("llama_")
    if which == "forward":
        return bench.forward_cases()["nnlite"]
    return bench.step_cases((which,))[f"nnlite {which}"]


def child(row: str, tiny: bool, options: str, top: int) -> dict:
    """In this (fresh) process: build, warm, time and trace one step; the table."""
    import jax

    import nnlite.core._compile as compile_options

    if options == "xla":
        compile_options.CPU_OPTIONS.clear()
    step = _build(row, tiny)
    step()
    t0 = time.perf_counter()
    step()
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="nnlite-op-profile-") as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        step()
        jax.profiler.stop_trace()
        path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
        events = [
            e for e in json.load(gzip.open(path))["traceEvents"]
            if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})
        ]  # fmt: skip
    modules = collections.Counter(e["args"].get("hlo_module") for e in events)
    module = modules.most_common(1)[0][0]  # the step: the program with the most events
    dumps = glob.glob(
        f"{os.environ['NNLITE_OP_PROFILE_DUMP']}/*{module}.cpu_after_optimizations.txt"
    )
    events = [e for e in events if e["args"].get("hlo_module") == module]
    return {"row": row, "module": module, **table(events, Path(dumps[-1]).read_text(), wall, top)}


def run_row(row: str, tiny: bool, options: str, top: int) -> dict:
    """:func:`child` in a fresh process whose XLA_FLAGS dump the optimised HLO."""
    code = (  # NNLITE_CPU_MEMORY=keep: freed host memory kept, as nnlite-train does
        "import json, sys; from nnlite.core._host_memory import keep_if_asked; "
        "keep_if_asked(); "
        "from benchmarks.op_profile import child; "
        f"print('OP_PROFILE ' + json.dumps(child({row!r}, {tiny}, {options!r}, {top})))"
    )
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="nnlite-op-profile-hlo-") as dump:
        env = {**os.environ, "NNLITE_OP_PROFILE_DUMP": dump}
        flags = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
        env["XLA_FLAGS"] = flags
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
            timeout=3600,
        )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("OP_PROFILE ")]
    if proc.returncode or not lines:
        raise SystemExit(f"op_profile {row}: the child failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("OP_PROFILE ") :])


def render(r: dict, options: str) -> str:
    out = [
        f"### {r['row']} ({options} options): one step {r['wall_s']:.3f} s, "
        f"{r['events_s']:.3f} s in op events",
        "",
        "| op family | seconds | share of the step | ops |",
        "|---|---|---|---|",
    ]
    for family, s, n in r["families"]:
        out.append(f"| {family} | {s:.3f} | {100 * s / r['wall_s']:.1f}% | {n} |")
    outside = r["wall_s"] - r["events_s"]
    what = "outside events (async dots, gaps)" if outside >= 0 else (
        "events overlapping (thunks run concurrently)")  # fmt: skip
    out.append(f"| {what} | {outside:.3f} | {100 * outside / r['wall_s']:.1f}% | |")
    out += ["", "| seconds | ops | family | kind |", "|---|---|---|---|"]
    out += [f"| {s:.3f} | {n} | {f} | {w} |" for f, w, s, n in r["kinds"]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--options", choices=("nnlite", "xla"), default="nnlite")
    ap.add_argument("--top", type=int, default=15, help="kinds of op listed per row")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        ap.error(f"--rows: unknown {', '.join(bad) or '(none)'}; valid: {', '.join(ROWS)}")
    results = [run_row(r, args.tiny, args.options, args.top) for r in rows]
    for r in results:
        print(render(r, args.options), end="\n\n")
    path = h.write_json("op_profile", {"options": args.options, "rows": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
