"""The step-time bubble at a checkpoint: synchronous writes against ``checkpoint.async``.

    python -m benchmarks.checkpoint [--size small|medium|large] [--rounds N] [--tiny]

A wide MLP on the digits (params + Adam state: small 6 MB, medium 52 MB, large 205 MB of
float32), trained in-process by ``train.fit`` with ``train.log_every: 1`` so that every
step is a boundary whose time a callback records, and a checkpoint every
``EVERY`` steps (``keep: 2``). From the intervals between boundaries:

- ``step``: the median interval (one step, its metrics read back);
- ``stall``: the interval that holds a checkpoint minus the median step, median over the
  checkpoints (the end's excluded): how long training stood still;
- ``extra``: the sum over the ``EVERY`` intervals from a checkpoint to the next of
  (interval - median step), median over the checkpoints: everything the checkpoint cost
  the loop, the writer thread's competition for the cores included;
- ``write``: how long one write took (sync: inside the stall; async: on its thread), timed
  around ``nl.save``, the writer every checkpoint goes through.

Rows run interleaved (sync, async, sync, ...), ``--rounds`` of each; medians. ``--tiny``
(a smoke run): a 64-wide MLP, 7 steps, one round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from . import _harness as h

SIZES = {"small": [512, 512], "medium": [2048, 2048], "large": [4096, 4096]}
EVERY = 50


class _Clock:
    """Records when each boundary (here: every step) is reached."""

    def __init__(self):
        self.t: dict[int, float] = {}

    def on_step_end(self, loop, step, metrics):
        self.t[step] = time.perf_counter()


def one_run(hidden: list[int], steps: int, every: int, background: bool, log_dir: str) -> dict:
    import nnlite as nl
    import train

    clock = _Clock()
    seconds: list[float] = []
    save = nl.save  # the trainer's one writer (train/checkpoint: every byte goes through it)

    def timed(*args, **kwargs):  # how long each write took, on whichever thread
        t0 = time.perf_counter()
        try:
            return save(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    nl.save = timed
    try:
        r = train.fit(
            None,
            {
                "model": {"name": "mlp", "hidden_sizes": hidden},
                "train": {"batch_size": 128, "steps": steps, "log_every": 1, "eval_every": steps},
                "checkpoint": {"every": every, "keep": 2, "async": background},
                "log": {"progress": False, "plot": False, "dir": log_dir},
            },
            overrides={"name": "async" if background else "sync"},
            resume="fresh",
            callbacks=[clock],
            echo=lambda *a: None,
        )
    finally:
        nl.save = save
    t = clock.t
    gaps = {s: t[s] - t[s - 1] for s in range(2, steps + 1)}
    ckpts = [s for s in range(every, steps, every)]  # the end's checkpoint excluded
    plain = [g for s, g in gaps.items() if (s - 1) not in ckpts]
    step = statistics.median(plain)
    stall = [gaps[s + 1] - step for s in ckpts]
    extra = [sum(gaps[s + i] - step for i in range(1, every + 1) if s + i in gaps) for s in ckpts]
    import jax

    state = sum(getattr(v, "nbytes", 0) for v in jax.tree.leaves((r.params, r.opt_state)))
    return {
        "step_s": step,
        "stall_s": statistics.median(stall),
        "extra_s": statistics.median(extra),
        "write_s": statistics.median(seconds[: len(ckpts)]) if seconds else 0.0,
        "state_bytes": state,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--size", choices=sorted(SIZES), default="medium")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, interleaved")
    ap.add_argument("--steps", type=int, default=4 * EVERY + 1, help="steps per run")
    ap.add_argument("--tiny", action="store_true", help="a smoke run: tiny model, 7 steps")
    args = ap.parse_args(argv)
    hidden, steps, every, rounds = SIZES[args.size], args.steps, EVERY, args.rounds
    if args.tiny:
        hidden, steps, every, rounds = [64], 7, 2, 1
    samples: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="nnlite-bench-ckpt-") as log_dir:
        for _ in range(rounds):
            for mode in ("sync", "async"):
                samples[mode].append(one_run(hidden, steps, every, mode == "async", log_dir))
    med = {
        mode: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        for mode, runs in samples.items()
    }
    mb = med["sync"]["state_bytes"] / 2**20
    rows = []
    for mode, m in med.items():
        rows.append(
            [
                mode,
                f"{mb:.0f} MB",
                f"{1e3 * m['step_s']:.1f}",
                f"{1e3 * m['write_s']:.0f}",
                f"{1e3 * m['stall_s']:.0f}",
                f"{1e3 * m['extra_s']:.0f}",
                f"{m['stall_s'] / max(med['sync']['stall_s'], 1e-9):.2f}",
            ]
        )
    header = ["writes", "state", "step ms", "write ms", "stall ms", "extra ms", "stall vs sync"]
    print(f"checkpoint every {every} steps, MLP {hidden}, {rounds} round(s), medians")
    print(h.table(rows, header))
    path = h.write_json(
        "checkpoint",
        {"machine": h.machine_info(), "hidden": hidden, "samples": samples, "medians": med},
    )
    print(f"raw samples: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
