"""Train-step time of the gradient modes (autodiff, manual, fused), under jit.

MLP sizes run every mode; the CNN (MNIST-1D ConvBase) and GPT sizes run autodiff, manual
(every layer's hand VJP through ``nl.manual_grads``; target manual <= 1.05x) and auto,
the trainer's default (``loss.grad: auto``, resolved as ``python -m train`` resolves it:
manual for both; its row should time as manual's).

Run from the repository root:

    python benchmarks/grad_modes.py            # MLP, CNN and baby GPT sizes, full rounds
    python benchmarks/grad_modes.py --quick    # fewer, shorter rounds
    python benchmarks/grad_modes.py --size gpt-6x384/T256/b64   # the larger GPT

Each mode gets its own jitted step (optax.adam(1e-3), params and optimizer state donated)
and its own copy of the same initial state: the MLP's ``models.mlp_fused.loss_and_grad``,
the CNN's and GPT's the trainer's own step (``train.compile_fit`` with ``loss.grad``). After warm-up, rounds run the modes in a
shuffled order, each timing ``--steps`` consecutive steps with ``block_until_ready``; the
table shows the median per-step time over rounds and the ratio to autodiff (and the
fastest round, the least disturbed one on a shared machine). Results are also written as
JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import nnlite from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnlite as nl
from models import mlp_fused

# name: (layer sizes, batch)
SIZES: dict[str, tuple[tuple[int, ...], int]] = {
    "784-512-512-10/b256": ((784, 512, 512, 10), 256),
    "1024-4096-4096-10/b1024": ((1024, 4096, 4096, 10), 1024),
    "16-8-4/b8": ((16, 8, 4), 8),  # --tiny
}

# name: (model constructor kwargs, batch); built lazily from models/ (repository root)
MODEL_SIZES: dict[str, tuple[str, dict, int]] = {
    "cnn-convbase/b100": ("cnn", {"in_shape": (40,), "num_classes": 10}, 100),
    "gpt-4x128/T64/b12": (
        "gpt",
        {"vocab_size": 65, "context": 64, "n_layer": 4, "n_head": 4, "n_embd": 128},
        12,
    ),
    "gpt-6x384/T256/b64": (
        "gpt",
        {"vocab_size": 65, "context": 256, "n_layer": 6, "n_head": 6, "n_embd": 384},
        64,
    ),
    "gpt-1x16/T8/b4": (  # --tiny
        "gpt",
        {"vocab_size": 11, "context": 8, "n_layer": 1, "n_head": 2, "n_embd": 16},
        4,
    ),
}
# --tiny: the same code on tiny sizes, one round of one step (a smoke run)
TINY_SIZES = ["16-8-4/b8", "gpt-1x16/T8/b4"]
DEFAULT_SIZES = [*SIZES, "cnn-convbase/b100", "gpt-4x128/T64/b12"]
# The modes of the CNN and GPT sizes: auto is the trainer's default (loss.grad: auto);
# manual+layers is manual with log.grad_by_layer's per-layer norms computed in the step
MODEL_MODES = ("autodiff", "manual", "auto", "manual+layers")

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def make_model(kind: str, kwargs: dict):
    from models.cnn import CNN
    from models.gpt import GPT

    if kind == "cnn":
        return CNN(**kwargs)  # the defaults are the paper's ConvBase
    return GPT(**kwargs)


def make_model_step(model, mode: str, x, y):
    """The trainer's compiled step of ``model`` (``train.compile_fit``) in ``loss.grad``
    mode ``mode`` (``auto`` as the trainer resolves it; ``manual+layers``: manual with
    ``log.grad_by_layer``'s taps, every layer's cotangent and gradient norms computed by
    the step), Adam, on the batch ``x``, ``y``. Returns ``((params, opt_state), step)``,
    ``step(params, opt_state, x, y) -> (params, opt_state, loss)`` on the state's leaves
    as the trainer places them (the batch is already on the device)."""
    from benchmarks._impls import compile_nnlite

    grad, by_layer = ("manual", True) if mode == "manual+layers" else (mode, False)
    batch, config = len(x), {"log": {"grad_by_layer": by_layer}}
    if getattr(model, "task", "") == "language_model":  # windows of one token stream
        rng = np.random.default_rng(0)
        data = {"tokens": rng.integers(0, model.vocab_size, 4 * batch * model.context)}
    else:
        data = {"data": {"train": (np.asarray(x), np.asarray(y)), "test": (x, y)}}
    compiled = compile_nnlite(model, optax.adam(1e-3), batch, grad=grad, config=config, **data)
    st, X, Y = compiled.stepper, compiled.X, compiled.Y
    idx = st.put_indices(compiled.indices(0, 1), 0)

    def step(p_leaves, o_leaves, _x, _y):
        p_leaves, o_leaves, _, metrics = st.run(p_leaves, o_leaves, [], X, Y, idx)
        return p_leaves, o_leaves, metrics["loss"]

    state = tuple(st.put_state(jax.tree.leaves(t)) for t in (compiled.params0, compiled.opt0))
    return state, step


def make_step(mode: str, activation: str, params):
    """``((params, opt_state), step)``: a jitted train step ``(params, opt_state, x, y) ->
    (params, opt_state, loss)`` of the MLP's ``mlp_fused.loss_and_grad``, Adam."""
    opt = optax.adam(1e-3)

    def step(params, opt_state, x, y):
        loss, grads = mlp_fused.loss_and_grad(mode, params, x, y, activation=activation)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return (params, opt.init(params)), jax.jit(step, donate_argnums=(0, 1))


def bench_size(
    sizes: tuple[int, ...],
    batch: int,
    *,
    modes=mlp_fused.GRAD_MODES,
    activation: str = "relu",
    rounds: int = 7,
    steps: int = 3,
    warmup: int = 2,
    seed: int = 0,
    model=None,
) -> dict:
    """Median seconds per train step for each mode on one MLP size (or, with ``model``,
    on that model: ``sizes`` is then ignored and ``modes`` from :data:`MODEL_MODES`)."""
    key = jax.random.key(seed)
    kp, kx, ky = jax.random.split(key, 3)
    state, steps_fn = {}, {}
    if model is None:
        ffn = nl.FFN(sizes[0], tuple(sizes[1:-1]), sizes[-1], activation=activation)
        x = jax.random.normal(kx, (batch, sizes[0]))
        y = jax.random.randint(ky, (batch,), 0, sizes[-1])
        init = ffn.init
    else:
        if getattr(model, "task", "") == "language_model":
            x = jax.random.randint(kx, (batch, model.context), 0, model.vocab_size)
            y = jnp.roll(x, -1, axis=1)
        else:
            x = jax.random.normal(kx, (batch, model.length))
            y = jax.random.randint(ky, (batch,), 0, model.num_classes)
    for mode in modes:  # the same initial values for every mode
        if model is None:
            state[mode], steps_fn[mode] = make_step(mode, activation, init(kp))
        else:
            state[mode], steps_fn[mode] = make_model_step(model, mode, x, y)

    def run(mode: str, n: int) -> float:
        params, opt_state = state[mode]
        t0 = time.perf_counter()
        for _ in range(n):
            params, opt_state, loss = steps_fn[mode](params, opt_state, x, y)
        jax.block_until_ready((params, opt_state, loss))
        dt = time.perf_counter() - t0
        state[mode] = (params, opt_state)
        return dt / n

    for mode in modes:
        run(mode, warmup)
    times = {mode: [] for mode in modes}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(modes)
        rng.shuffle(order)
        for mode in order:
            times[mode].append(run(mode, steps))
    medians = {mode: statistics.median(ts) for mode, ts in times.items()}
    mins = {mode: min(ts) for mode, ts in times.items()}
    base = medians.get("autodiff")
    return {
        "sizes": list(sizes),
        "batch": batch,
        "activation": activation,
        "rounds": rounds,
        "steps_per_round": steps,
        "median_s": medians,
        "ratio_vs_autodiff": {m: (t / base if base else None) for m, t in medians.items()},
        # on a shared machine the fastest round is the least disturbed one
        "min_s": mins,
        "min_ratio_vs_autodiff": {m: t / mins["autodiff"] for m, t in mins.items()}
        if "autodiff" in mins
        else {},
        "all_s": times,
    }


def h_results_dir() -> Path:
    """benchmarks/results, or $NNLITE_BENCH_RESULTS (as benchmarks/_harness.py's)."""
    return Path(os.environ.get("NNLITE_BENCH_RESULTS") or RESULTS_DIR)


def run_all(
    *, quick: bool = False, sizes=None, activation: str = "relu", tiny: bool = False
) -> dict:
    names = sizes or (TINY_SIZES if tiny else DEFAULT_SIZES)
    rounds, steps = (3, 2) if quick else (15, 2)
    if tiny:
        rounds, steps = 1, 1
    results = {}
    for name in names:
        print(f"[grad_modes] {name}: {rounds} rounds x {steps} steps ...", file=sys.stderr)
        if name in MODEL_SIZES:
            kind, kwargs, batch = MODEL_SIZES[name]
            model = make_model(kind, kwargs)
            results[name] = bench_size(
                (),
                batch,
                modes=MODEL_MODES,
                rounds=rounds,
                steps=steps,
                model=model,
            )
            continue
        layer_sizes, batch = SIZES[name]
        results[name] = bench_size(
            layer_sizes, batch, activation=activation, rounds=rounds, steps=steps
        )
    return {
        "benchmark": "grad_modes",
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "quick": quick,
        "results": results,
    }


def format_table(report: dict) -> str:
    lines = [
        f"grad_modes on {report['platform']} ({report['device']}), jax {report['jax']}",
        f"{'size':<26}{'mode':<15}{'median ms':>12}{'vs autodiff':>13}"
        f"{'min ms':>10}{'min vs autodiff':>17}",
    ]
    for name, r in report["results"].items():
        for mode, t in r["median_s"].items():
            ratio = r["ratio_vs_autodiff"][mode]
            t_min, min_ratio = r["min_s"][mode], r["min_ratio_vs_autodiff"][mode]
            lines.append(
                f"{name:<26}{mode:<15}{t * 1e3:>12.2f}{ratio:>12.3f}x"
                f"{t_min * 1e3:>10.2f}{min_ratio:>16.3f}x"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument(
        "--size", action="append", choices=[*SIZES, *MODEL_SIZES], help="repeatable"
    )
    parser.add_argument("--activation", default="relu", choices=mlp_fused.HAND_ACTIVATIONS)
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, 1 step: a smoke run")
    args = parser.parse_args(argv)

    report = run_all(quick=args.quick, sizes=args.size, activation=args.activation, tiny=args.tiny)
    print(format_table(report))
    out = args.out or h_results_dir() / f"grad_modes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing anything
    main()
