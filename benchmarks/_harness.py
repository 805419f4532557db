"""Shared timing, table and result-file helpers for the benchmarks.

Timing rules (docs/benchmarks.md states them): every implementation runs in the same
process on the same work, after warm-up, in rounds whose order is shuffled; each sample
ends with ``block_until_ready``; we report medians and ratios against the baseline of
that run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (``model name``, ``flags``, ...),
    whitespace collapsed; empty where there is none (macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:  # the blank line after the first processor
                break
            continue
        fields.setdefault(key.strip(), " ".join(value.split()))
    return fields


def machine_info() -> dict:
    """What the numbers were measured on: CPU model, core count, library versions."""
    import jax

    cpu = cpuinfo().get("model name") or platform.processor() or platform.machine()
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for mod in ("jaxlib", "optax", "equinox", "flax", "sklearn", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "jax_devices": [str(d) for d in jax.devices()],
        "versions": versions,
    }


def time_interleaved(
    cases: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 2,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Seconds per call of each case, over ``rounds`` shuffled rounds after ``warmup`` calls.

    Each case must do a fixed amount of work and block until its results are ready.
    """
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    rng = random.Random(seed)
    names = list(cases)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for n in names:
            t0 = time.perf_counter()
            cases[n]()
            samples[n].append(time.perf_counter() - t0)
    return samples


def medians(cases: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict:
    """:func:`time_interleaved`'s median seconds per case."""
    samples = time_interleaved(cases, rounds=rounds, warmup=warmup)
    return {k: median(v) for k, v in samples.items()}


def repeat_shuffled(
    cases: Mapping[str, Callable[[], dict]], repeats: int, *, digits: int = 2, seed: int = 0
) -> dict[str, list[dict]]:
    """Samples of start-up benchmarks (each case a fresh process returning a dict with its
    ``wall_s``): every case once per repeat, in an order shuffled per repeat; prints each
    repeat's wall times (``digits`` decimals)."""
    samples: dict[str, list[dict]] = {n: [] for n in cases}
    rng = random.Random(seed)
    for r in range(repeats):
        order = list(cases)
        rng.shuffle(order)
        for name in order:
            samples[name].append(cases[name]())
        walls = ", ".join(f"{n} {samples[n][-1]['wall_s']:.{digits}f} s" for n in cases)
        print(f"repeat {r + 1}/{repeats}: {walls}", flush=True)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def format_bytes(n: float) -> str:
    """``9.3 MiB``: bytes in binary units, one decimal."""
    exp = min(int(math.log(n, 1024)) if n >= 1 else 0, 4)
    return f"{n:.0f} B" if exp == 0 else f"{n / 1024**exp:.1f} {'BKMGT'[exp]}iB"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain Markdown table (pastes into the README as is)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *map(line, cells[1:])])


# Where results go instead of benchmarks/results (the test suite's smoke runs use a tmp dir)
RESULTS_ENV = "NNLITE_BENCH_RESULTS"


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_DIR)


def write_json(name: str, payload: dict) -> Path:
    """Write ``<results>/<name>-<timestamp>.json`` and ``<name>-latest.json`` (``<results>``:
    ``benchmarks/results``, or ``$NNLITE_BENCH_RESULTS``)."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    text = json.dumps(payload, indent=2)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(text)
    (out / f"{name}-latest.json").write_text(text)
    return path


def run_module_json(
    module: str, args: Sequence[str], *, env: Mapping[str, str] | None = None
) -> dict:
    """Run ``python -m module args`` in a fresh process; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
