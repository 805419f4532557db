"""Where the wall time of ``nnlite-train`` goes: ``--timings``.

A :class:`Timings` is a lap clock: ``lap(name)`` charges the time since the previous lap
to the phase ``name`` (phases that recur, such as ``eval`` inside the loop, add up), so
the phases partition the run from the first line of ``train/__main__.py`` to the last.
``--timings`` writes them to ``<run dir>/timings.json`` and prints one line to stderr;
nothing else in the run directory or on stdout changes.

``timings.json``: ``{"phases": {name: seconds}, "t_process_start": epoch s,
"t_main": epoch s, "t_end": epoch s}``. ``t_process_start`` comes from ``/proc`` (10 ms
resolution; absent elsewhere); a caller that starts the process itself (benchmarks/
cli_wall.py) knows it exactly, and the process exit (interpreter teardown) is the time
from ``t_end`` to the process's end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# The phases, in the order a run meets them (see ``lap`` calls in train/).
PHASES = (
    "interpreter",  # process start -> first line of train/__main__.py (Python + site)
    "config",  # argparse, yaml, config validation
    "imports",  # jax, optax, nnlite, models, the loop
    "backend",  # JAX's CPU client and the device list
    "data",  # loading/generating the data set (what of it did not overlap the imports)
    "compile",  # model build, tracing, lowering and compiling init, step and eval
    "train",  # the loop's compiled calls and logging
    "eval",  # test-set evaluations inside the loop
    "checkpoint",  # checkpoint saves inside the loop
    "plot",  # waiting for curves.png
    "other",  # everything else (run directory, messages, final state)
)


def process_start_time() -> float | None:
    """Epoch seconds at which this process started (Linux ``/proc``), or None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - max(age, 0.0)


class Timings:
    """Lap clock over the phases of one run (see the module docstring)."""

    def __init__(self) -> None:
        self.t_main = time.time()
        self._last = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.t_end: float | None = None

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self._last)
        self._last = now

    def end(self) -> None:
        """The last lap (``other``) and the end time."""
        self.lap("other")
        self.t_end = time.time()

    def to_dict(self) -> dict:
        start = process_start_time()
        phases = dict(self.phases)
        if start is not None:
            phases["interpreter"] = max(self.t_main - start, 0.0)
        ordered = {p: round(phases[p], 4) for p in PHASES if p in phases}
        ordered.update({p: round(v, 4) for p, v in phases.items() if p not in ordered})
        return {
            "phases": ordered,
            "t_process_start": start,
            "t_main": self.t_main,
            "t_end": self.t_end,
        }

    def write(self, path: Path) -> str:
        """Write ``timings.json`` to ``path``; returns the one-line summary."""
        d = self.to_dict()
        path.write_text(json.dumps(d, indent=1) + "\n")
        total = sum(d["phases"].values())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in d["phases"].items() if v >= 0.005)
        return f"timings (s): {parts}; total {total:.2f} (+ exit); wrote {path}"
