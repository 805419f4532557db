"""The 2048x2048 matmul of ``benchmarks.real_size``: XLA against ``torch.mm``, and under
each of :data:`FLAG_SETS` in a fresh process (``--flags``) with what XLA made of the dot.

benchmarks/README.md ("XLA:CPU flags and the bfloat16 matmul") records which of these
flags exist in jaxlib 0.10.2 and what each does to the optimised HLO.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from . import _harness as h

MATMUL_REPS = 4  # matmuls per timed sample
# XLA_FLAGS tried on the matmul rows (benchmarks/README.md says what each does to the HLO)
_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type=invalid"
FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn custom call": "--xla_cpu_experimental_onednn_custom_call=true "
    f"--xla_cpu_use_onednn=true {_NO_YNN} --xla_cpu_use_xnnpack=false",
    "onednn fusion": f"--xla_cpu_experimental_onednn_fusion_type=dot,eltwise {_NO_YNN}",
    "ynn dot+eltwise": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise",
    "xnn fusion": f"--xla_cpu_experimental_xnn_fusion_type=dot,eltwise {_NO_YNN}",
    "xnn graph": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY "
    f"{_NO_YNN}",
    "eigen (no ynn)": _NO_YNN,
    "xnnpack off": "--xla_cpu_use_xnnpack=false",
    "vector width 512": "--xla_cpu_prefer_vector_width=512",
}


def matmul_cases(dtype: str, n: int, peer: bool = True, reps: int = MATMUL_REPS) -> dict:
    """``reps`` n x n matmuls in ``dtype``: compiled by XLA as nnlite compiles its programs
    (``nl.jit``: on the CPU XLA's own dot, not YNNPACK's; ``nnlite``) and, with ``peer`` and
    torch installed, ``torch.mm`` (``theirs``)."""
    import jax.numpy as jnp
    import numpy as np

    import nnlite as nl

    rng = np.random.default_rng(0)
    a32, b32 = (rng.normal(size=(n, n)).astype(np.float32) for _ in range(2))
    a, b = jnp.asarray(a32, dtype), jnp.asarray(b32, dtype)
    mm = nl.jit(lambda a, b: a @ b)

    def ours():
        for _ in range(reps):
            out = mm(a, b)
        out.block_until_ready()

    cases = {"nnlite": ours}
    if not peer:
        return cases
    try:
        import torch

        ta, tb = (torch.from_numpy(m).to(getattr(torch, dtype)) for m in (a32, b32))
        cases["theirs"] = lambda: [torch.mm(ta, tb) for _ in range(reps)]
    except ImportError:
        pass
    return cases


def gemm_rate(dtype: str, n: int, rounds: int = 5) -> float:
    """FLOP/s of XLA's n x n matrix product in ``dtype``, the best of ``rounds`` samples."""
    samples = h.time_interleaved(matmul_cases(dtype, n, peer=False), rounds=rounds)["nnlite"]
    return 2 * n**3 * MATMUL_REPS / min(samples)


def kernels(hlo: str) -> str:
    """What XLA made of the dots in an optimised HLO text: each library fusion or custom
    call (``__ynn_fusion``, ``__xnn_fusion``, ``__onednn_fusion``, ``__onednn$matmul``) with
    its result type, then the element types of the ``dot``s (inside those fusions, or XLA's
    own GEMM): ``__ynn_fusion -> f32; dot f32``."""
    libs = []
    for line in hlo.splitlines():
        m = re.search(r'"kind":"(__\w+)"|custom_call_target="([^"]+)"', line)
        out = re.search(r"= (\w+)\[", line)
        if m and out:
            libs.append(f"{m.group(1) or m.group(2)} -> {out.group(1)}")
    dots = sorted(set(re.findall(r"= (\w+)\[[\d,]*\](?:\{[\d,]*\})? dot\(", hlo)))
    parts = sorted(set(libs)) + ([f"dot {', '.join(dots)}"] if dots else [])
    return "; ".join(parts) or "no dot"


def matmul_child(spec: dict) -> dict:
    """In this process (XLA_FLAGS as the parent set them): per dtype, the median seconds of
    ``MATMUL_REPS`` n x n matmuls and :func:`kernels` of the compiled program."""
    import jax
    import jax.numpy as jnp

    import nnlite as nl

    n, out = spec["n"], {}
    for dtype in spec["dtypes"]:
        x = jax.ShapeDtypeStruct((n, n), getattr(jnp, dtype))
        hlo = nl.jit(lambda a, b: a @ b).lower(x, x).compile().as_text()
        ours = matmul_cases(dtype, n, peer=False)["nnlite"]
        t = h.median(h.time_interleaved({"xla": ours}, rounds=spec["rounds"])["xla"])
        out[dtype] = {
            "seconds": t,
            "gflops": 2 * n**3 * MATMUL_REPS / t / 1e9,
            "kernels": kernels(hlo),
        }
    return out


def flag_runs(names: list[str], dtypes: list[str], n: int, rounds: int) -> dict:
    """:func:`matmul_child` in a fresh process per flag set; a set this jaxlib rejects
    gives ``{"error": its last stderr line}``."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    spec = json.dumps({"n": n, "dtypes": dtypes, "rounds": rounds})
    out = {}
    for name in names:
        flags = FLAG_SETS[name]
        env = {**base, "XLA_FLAGS": flags} if flags else base
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.real_size", "--matmul-child", spec],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        if proc.returncode == 0:
            out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            out[name] = {"error": lines[-1][-200:]}
    return out


def flags_table(runs: dict, dtypes: list[str]) -> str:
    rows = []
    for name, r in runs.items():
        row = [name, f"`{FLAG_SETS[name]}`" if FLAG_SETS[name] else "(none)"]
        for d in dtypes:
            v = r.get(d)
            row += [v["kernels"], f"{v['gflops']:,.1f}"] if v else [r.get("error", "-"), "-"]
        rows.append(row)
    header = ["flag set", "XLA_FLAGS"]
    for d in dtypes:
        header += [f"{d}: what XLA made of the dot", f"{d} GFLOP/s"]
    return h.table(rows, header)


def flags_cell(runs: dict, dtype: str) -> str:
    """The matmul row's ``--flags`` column: the fastest flag set against the default."""
    ok = {k: v[dtype] for k, v in runs.items() if dtype in v}
    if not ok:
        return "-"
    best = max(ok, key=lambda k: ok[k]["gflops"])
    rel = (
        f", {ok[best]['gflops'] / ok['default']['gflops']:.2f}x default" if "default" in ok else ""
    )
    return f"best: {best} ({ok[best]['gflops']:,.1f} GFLOP/s{rel})"
