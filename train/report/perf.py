"""Model FLOPs, achieved FLOP/s and MFU (model FLOPs utilisation) of a run.

FLOPs per step are counted from the traced step's jaxpr (``nl.flops``, through
``train.loop.build.step_cost``): every matrix product and convolution exactly, other
operations as XLA's cost analysis counts them, and every loop by its trip count: the
``lax.scan`` of a call's ``train.steps_per_call`` steps (divided back to one step), the
microbatches of ``train.grad_accum_steps``, a scanned layer stack (``scan_layers``), the
chunked LM head and its loss. A ``jit`` over sharded arrays is the global program; a
``shard_map`` body counts once per device, so the count is the total over the devices.
XLA's own cost analysis (``nl.cost_analysis``) counts a loop's body once: a scanned
12-layer GPT's step read about 12x too few FLOPs, and its MFU as much too low.

The peak: on a GPU the data sheet's dense figure for the compute dtype (:data:`GPU_PEAKS`);
on a CPU a measured rate: the best of a few 1024x1024 matrix products in that dtype on one
device, which uses every core (the host devices of ``--xla_force_host_platform_device_count``
share them, so the machine's peak is that one number, not one per device). It is measured
once per process and cached on disk per machine (``$NNLITE_CACHE/peak_flops.json``, else
``~/.cache/nnlite``), so a run pays it (~0.2 s) once; a rate measured on a busy machine is
measured again by the next run on a quiet one (:func:`cpu_peak`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

# Dense peak FLOP/s per device from the vendors' data sheets (no sparsity): TF32 for
# float32 where the GPU's matrix units do it (the default precision of XLA's float32 dots).
GPU_PEAKS = {
    "H200": {"float32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
    "H100": {"float32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},  # SXM
    "H100 PCIe": {"float32": 378e12, "bfloat16": 756e12, "float16": 756e12},
    "A100": {"float32": 156e12, "bfloat16": 312e12, "float16": 312e12},
    "L4": {"float32": 60e12, "bfloat16": 121e12, "float16": 121e12},
    "A10": {"float32": 62.5e12, "bfloat16": 125e12, "float16": 125e12},
    "V100": {"float32": 15.7e12, "bfloat16": 15.7e12, "float16": 125e12},
    "T4": {"float32": 8.1e12, "bfloat16": 8.1e12, "float16": 65e12},
    "RTX 4090": {"float32": 82.6e12, "bfloat16": 165.2e12, "float16": 165.2e12},
    "RTX 3090": {"float32": 35.6e12, "bfloat16": 71e12, "float16": 71e12},
}

_MEASURED: dict[str, float] = {}  # this process's CPU peaks by dtype


def step_flops(cost: dict | None) -> float | None:
    """Model FLOPs of one optimizer step from ``cost`` (``step_cost``: one step, counted
    over every device); None if unknown."""
    flops = None if not cost else cost.get("flops")
    if flops is None or not flops > 0:
        return None
    return float(flops)


def gpu_peak(device_kind: str, dtype: str) -> float | None:
    """The data-sheet peak of a GPU named ``device_kind`` (``"NVIDIA H100 80GB HBM3"``)."""
    kind = device_kind.upper()
    best = None
    for name in GPU_PEAKS:  # the longest name contained wins (H100 PCIe)
        if name.upper() in kind and (best is None or len(name) > len(best)):
            best = name
    return None if best is None else GPU_PEAKS[best][dtype]


def _cache_file() -> Path:
    from ..data.text.corpus import cache_dir

    return cache_dir() / "peak_flops.json"


def _machine_key(dtype: str) -> str:
    import jax

    return f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}|jax {jax.__version__}|{dtype}"


def measure_cpu_peak(dtype: str = "float32", n: int = 1024, reps: int = 5) -> float:
    """The best FLOP/s of an ``n x n`` matrix product in ``dtype`` on the first CPU device."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), dev)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        mm(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def cpu_peak(dtype: str = "float32") -> float:
    """:func:`measure_cpu_peak`, once per process and machine (cached on disk).

    A machine busy with other work measures a fraction of its peak (on the shared 2-core
    VM, 6 GFLOP/s at load 7 against 18.5 quiet), and a cached low peak would inflate every
    later run's MFU past 100%. So the cache keeps the best rate measured and whether it was
    measured on a quiet machine (1-minute load average below 3/4 of the cores); an entry
    measured busy is measured again by the next run that finds the machine quiet (a busy
    one uses it as it is: measuring costs ~0.5 s there), and the better of the two is kept."""
    if dtype in _MEASURED:
        return _MEASURED[dtype]
    key, path = _machine_key(dtype), _cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    cached = cached if isinstance(cached, dict) else {}
    value, quiet = _cache_entry(cached.get(key))
    quiet_now = None if quiet else _quiet()
    if value is None or quiet_now:
        value, quiet = max(value or 0.0, measure_cpu_peak(dtype)), quiet_now
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cached[key] = {"flops": value, "quiet": quiet}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measured again next time
    _MEASURED[dtype] = float(value)
    return float(value)


def _cache_entry(entry) -> tuple[float | None, bool]:
    """``(flops, measured quiet)`` of a cache entry (an older cache's bare number: not
    known to be quiet); ``(None, False)`` for a missing or malformed one."""
    if isinstance(entry, int | float) and entry > 0:
        return float(entry), False
    if isinstance(entry, dict):
        flops = entry.get("flops")
        if isinstance(flops, int | float) and flops > 0:
            return float(flops), entry.get("quiet") is True
    return None, False


def _quiet() -> bool:
    """Whether the machine is quiet enough to measure its peak: the 1-minute load average
    below 3/4 of the cores (this process's own compile threads included)."""
    try:
        return os.getloadavg()[0] < 0.75 * (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return True


def peak_flops(devices: list, dtype: str = "float32") -> tuple[float | None, str]:
    """The peak FLOP/s of ``devices`` together in ``dtype`` and where it comes from."""
    dev = devices[0]
    if dev.platform == "cpu":
        return cpu_peak(dtype), "measured GEMM"
    peak = gpu_peak(getattr(dev, "device_kind", ""), dtype)
    if peak is None:
        return None, f"no peak known for {getattr(dev, 'device_kind', dev.platform)}"
    return peak * len(devices), "data sheet"


def utilisation(flops_per_step: float | None, steps: int, seconds: float, peak: float | None):
    """``{flops_per_step, flops_per_s, mfu}`` (the keys that are known)."""
    out: dict[str, Any] = {}
    if flops_per_step is None:
        return out
    out["flops_per_step"] = float(flops_per_step)
    if steps > 0 and seconds > 0:
        rate = flops_per_step * steps / seconds
        out["flops_per_s"] = float(rate)
        if peak:
            out["mfu"] = float(rate / peak)
    return out


def fmt_flops(x: float) -> str:
    """``3.2 GFLOP``-style scaling."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def describe(u: dict) -> str:
    """``, 1.2 GFLOP/step, 3.4 GFLOP/s, MFU 12.3%`` for the done line ('' if unknown)."""
    if "flops_per_step" not in u:
        return ""
    s = f", {fmt_flops(u['flops_per_step'])}FLOP/step"
    if "flops_per_s" in u:
        s += f", {fmt_flops(u['flops_per_s'])}FLOP/s"
    if "mfu" in u:
        s += f", MFU {100 * u['mfu']:.1f}%"
    return s
