"""First-step latency: trace + compile + first run of the MEDIUM train step.

    python -m benchmarks.first_step [--quick] [--repeats N] [--size medium] [--tiny]

Each measurement is a fresh Python process, so nothing is cached: the process imports
everything, builds the implementation (weights, optimizer state, data on the device),
runs one unrelated tiny jitted function (so the one-off start-up of JAX's tracing and
compiling machinery is not charged to whoever goes first), then times its first train
step until the loss is on the host. Implementations run in shuffled order for several
repeats; we report medians and ratios to raw JAX. ``--tiny`` (a smoke run) measures each
implementation once on a tiny model, in this process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from . import _harness as h

IMPLS = ("raw JAX", "Equinox", "Flax NNX", "nnlite")


def worker(impl: str, size: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from ._impls import SPECS, TINY, Equinox, FlaxNNX, Nnlite, RawJax, init_weights, make_data

    classes = {"raw JAX": RawJax, "Equinox": Equinox, "Flax NNX": FlaxNNX, "nnlite": Nnlite}
    spec = TINY if size == "tiny" else SPECS[size]
    X, Y, idx = make_data(spec, 2)
    obj = classes[impl](spec, init_weights(spec), X, Y, idx, optax.adam(1e-3))
    # nnlite's row is built by train.compile_fit, which compiles its step ahead (as the
    # trainer does, beside init and the evaluation): every row's compiled programs are
    # dropped, so each first step traces and compiles its step in the timed call
    jax.clear_caches()
    jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()  # JAX's one-off start-up
    t0 = time.perf_counter()
    loss = obj.run(1)  # trace, compile, run, fetch the loss
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    obj.run(1)
    second = time.perf_counter() - t0
    return {"impl": impl, "first_s": first, "second_s": second, "loss": loss}


def jax_rank_promotion_allowed():
    import jax

    return jax.numpy_rank_promotion("allow")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.first_step", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="2 repeats")
    ap.add_argument("--repeats", type=int, default=7, help="fresh processes per implementation")
    ap.add_argument("--size", default="medium", choices=("small", "medium", "large"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model, once, in this process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.size)))
        return 0
    if args.tiny:
        with jax_rank_promotion_allowed():  # the peers are written as their users write them
            rows = [[i, f"{worker(i, 'tiny')['first_s'] * 1e3:.0f} ms"] for i in IMPLS]
        print(h.table(rows, ["implementation", "trace+compile+run (tiny: meaningless)"]))
        return 0
    repeats = 2 if args.quick else args.repeats
    info = h.machine_info()
    print(f"machine: {info['cpu']}, {info['affinity']} usable cores; jax {info['versions']['jax']}")
    runs: dict[str, list[dict]] = {i: [] for i in IMPLS}
    rng = random.Random(0)
    for r in range(repeats):
        order = list(IMPLS)
        rng.shuffle(order)
        for impl in order:
            runs[impl].append(
                h.run_module_json("benchmarks.first_step", ["--worker", impl, "--size", args.size])
            )
        print(
            f"repeat {r + 1}/{repeats}: "
            + ", ".join(f"{i} {runs[i][-1]['first_s']:.3f} s" for i in IMPLS),
            flush=True,
        )
    med = {i: h.median([x["first_s"] for x in v]) for i, v in runs.items()}
    med2 = {i: h.median([x["second_s"] for x in v]) for i, v in runs.items()}
    base = med["raw JAX"]
    rows = [
        [i, f"{med[i] * 1e3:.0f} ms", f"{med[i] / base:.3f}", h.fmt_time(med2[i])] for i in IMPLS
    ]
    print(f"\nFirst-step latency, {args.size.upper()} (median of {repeats} fresh processes)\n")
    print(h.table(rows, ["implementation", "trace+compile+run", "vs raw JAX", "second step"]))
    path = h.write_json(
        "first_step",
        {
            "machine": info,
            "size": args.size,
            "median_first_s": med,
            "median_second_s": med2,
            "runs": runs,
        },
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
