"""Stress: multi-device training in one process on 8 host CPU devices, next to CPU-burning
processes; counts the runs that stall. Not part of the test suite (minutes per strategy).

    python -m benchmarks.stress_multidevice [--runs 100] [--burners 2] [--steps 200]
        [--strategies pmap,shard_map,fsdp,fsdp+tensor] [--unbounded] [--timeout 300]

Each run is ``python -m train --config configs/digits_mlp.yaml --fresh --timings`` with
``parallel.strategy`` (and ``parallel.tensor: 2`` for ``fsdp+tensor``) on 8 host devices,
``train.steps`` steps, while ``--burners`` processes spin on the CPU. A run *stalls* when
it exits 5 (the watchdog: no call finished in time), is aborted (status 134: XLA's own
rendezvous timeout), prints XLA's ``may be stuck`` warning, or passes ``--timeout``.
The table gives, per strategy: runs, the load beside them, stalls, the exit statuses,
and the median time per step of the training phase (``timings.json``). ``--unbounded``
runs the loop without its bound on the calls in flight (the trainer started with
``train.loop.trainer.max_in_flight`` replaced by "no limit", :data:`UNBOUNDED`): the
"before" rows, which show the stall and the step time the bound costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from . import _harness as h

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = {
    "pmap": ["parallel.strategy=pmap"],
    "shard_map": ["parallel.strategy=shard_map"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp+tensor": ["parallel.strategy=fsdp", "parallel.tensor=2"],
}
BURN = "while True: pass"
STUCK_MARKS = ("may be stuck", "Termination timeout")
# ``--unbounded``: ``python -m train`` with no bound on the calls in flight
UNBOUNDED = (
    "import sys; from train.loop import trainer; trainer.max_in_flight = lambda *a: None; "
    "from train.__main__ import main; "
    "sys.exit(main(sys.argv[1:], compile_cache=True, standalone=True))"
)


def run_once(
    strategy: str, steps: int, log_dir: str, env: dict, timeout: float, unbounded: bool = False
) -> dict:
    sets = [
        *STRATEGIES[strategy],
        "parallel.devices=8",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"train.log_every={max(1, steps // 4)}",
        f"checkpoint.every={steps}",
        f"log.dir={log_dir}",
        f"name={strategy.replace('+', '_')}",
        "log.progress=false",
        "log.plot=false",
    ]
    trainer = ["-c", UNBOUNDED] if unbounded else ["-m", "train"]
    cmd = [sys.executable, *trainer, "--config", "configs/digits_mlp.yaml", "--fresh"]
    cmd += ["--timings", *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        status, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        status, err = "timeout", (e.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - t0
    per_step = None
    timings = Path(log_dir) / strategy.replace("+", "_") / "timings.json"
    if status == 0 and timings.is_file():
        per_step = json.loads(timings.read_text())["phases"].get("train", 0.0) / steps
        timings.unlink()
    stuck = status in (5, -6, 134, "timeout") or any(m in err for m in STUCK_MARKS)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return {"status": status, "stalled": stuck, "wall_s": wall, "s_per_step": per_step,
            "last_line": last[:300]}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.stress_multidevice", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--runs", type=int, default=100, help="runs per strategy")
    ap.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--unbounded", action="store_true", help="no bound on calls in flight")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = ap.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; valid: {', '.join(STRATEGIES)}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = env.get("XLA_FLAGS", "")
    if "device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    loads = []
    try:
        with tempfile.TemporaryDirectory(prefix="nnlite-stress-") as tmp:
            for i in range(args.runs):
                for s in strategies:
                    loads.append(os.getloadavg()[0])
                    r = run_once(s, args.steps, tmp, env, args.timeout, args.unbounded)
                    results[s].append(r)
                    mark = " STALL: " + r["last_line"] if r["stalled"] else ""
                    ms = "n/a" if r["s_per_step"] is None else f"{r['s_per_step'] * 1e3:.2f}"
                    print(f"run {i + 1}/{args.runs} {s}: exit {r['status']}, load {loads[-1]:.1f}, "
                          f"{r['wall_s']:.1f} s, {ms} ms/step{mark}", flush=True)  # fmt: skip
    finally:
        for p in burners:
            p.kill()
            p.wait()
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"
    bound = "unbounded (before)" if args.unbounded else "bounded"
    rows = []
    for s, rs in results.items():
        exits = Counter(str(r["status"]) for r in rs)
        times = [r["s_per_step"] for r in rs if r["s_per_step"] is not None]
        med = f"{statistics.median(times) * 1e3:.2f}" if times else "n/a"
        rows.append([s, bound, len(rs), f"{args.burners} burners, load {load}",
                     sum(r["stalled"] for r in rs),
                     ", ".join(f"{k}: {v}" for k, v in sorted(exits.items())), med])  # fmt: skip
    print()
    header = ["strategy", "calls in flight", "runs", "load", "stalls", "exits", "ms/step"]
    print(h.table(rows, header))
    h.write_json(
        "stress_multidevice",
        {"args": vars(args), "machine": h.machine_info(), "results": results},
    )
    return 0 if all(not r["stalled"] for rs in results.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
