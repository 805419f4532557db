"""Sharding on paper: params + optimizer bytes per device and the collectives in the
compiled train step, for each sharded layout of 8 devices and a hand-written FSDP step.

    python -m benchmarks.sharding [--n-layer 4] [--n-embd 128] [--batch 16] [--tiny]

Nothing is timed (8 host CPU devices share the machine's cores, so step times say
nothing): the numbers are read from the arrays' shardings (``Strategy.bytes_per_device``),
from XLA's ``compiled.memory_analysis()`` (the step's argument bytes on one device) and
from the compiled HLO's text (``all-gather``, ``reduce-scatter``, ``all-reduce``, ...:
one per op, an async ``-start``/``-done`` pair counted once). The model is the shipped
GPT at ``configs/shakespeare_gpt.yaml``'s size, Adam, autodiff.

"cookbook fsdp" is the minimal form from JAX's training cookbook, written here in ~40
lines on the same model: plain ``jax.jit`` with ``in_shardings``/``out_shardings`` of
``NamedSharding``, every param split along its largest dimension that 8 divides, Adam's
state like its param, the batch split over the same axis.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks._harness import format_bytes  # noqa: E402
from benchmarks._impls import compile_nnlite  # noqa: E402
from models.gpt import GPT  # noqa: E402

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
LAYOUTS = {  # name -> (strategy, parallel.tensor, parallel.fsdp_min_bytes)
    "none": ("none", 1, 0),
    "fsdp": ("fsdp", 1, 16384),
    "fsdp, min_bytes=0": ("fsdp", 1, 0),  # every leaf that 8 divides, as the cookbook's
    "tensor=2": ("tensor", 2, 0),
    "fsdp+tensor=2": ("fsdp", 2, 16384),
}


def count_collectives(hlo: str) -> dict[str, str]:
    """Each collective of an HLO module's text as ``ops (arrays)``: XLA's combiner merges
    several arrays into one op with a tuple type (``-start`` of an async pair counts,
    ``-done`` not)."""
    out = {}
    for op in COLLECTIVES:
        types = re.findall(rf"= (\(.*?\)|\S+) {op}(?:-start)?\(", hlo)
        arrays = sum(t.count("[") if t.startswith("(") else 1 for t in types)
        out[op] = str(len(types)) + (f" ({arrays})" if arrays != len(types) else "")
    return out


def nnlite_step(model, optimizer, name, tensor, min_bytes, batch, devices):
    """Bytes per device and the compiled step of ``python -m train``'s stepper
    (``train.compile_fit`` with the layout's ``parallel`` section)."""
    parallel = {"strategy": name, "tensor": tensor, "fsdp_min_bytes": min_bytes}
    parallel["devices"] = 1 if name == "none" else len(devices)
    run = compile_nnlite(
        model, optimizer, batch, config={"parallel": parallel}, tokens=np.zeros(4096, np.int32)
    )
    stepper = run.stepper
    idx = stepper.put_indices(np.zeros((1, batch), np.int32))
    p_abs = stepper.abstract_state(jax.tree.leaves(run.params0))
    o_abs = stepper.abstract_state(jax.tree.leaves(run.opt0))
    # the state travels as (params, (opt_state, model state)): Stepper.run's layout
    compiled = stepper.compiled.lower(p_abs, (o_abs, []), run.X, run.Y, idx).compile()
    strategy = run.run.strategy
    state = strategy.bytes_per_device(run.params0) + strategy.bytes_per_device(run.opt0)
    return state, compiled


def cookbook_fsdp_step(model, optimizer, batch, devices):
    """The hand-written FSDP step: jit + NamedSharding, nothing of nnlite's strategies."""
    mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices)
    n = len(devices)

    def shard(a):  # the largest dimension that n divides, else whole on every device
        dims = [i for i, d in enumerate(a.shape) if d % n == 0]
        spec = [None] * len(a.shape)
        if dims:
            spec[max(dims, key=lambda i: a.shape[i])] = "fsdp"
        return NamedSharding(mesh, P(*spec))

    params = jax.eval_shape(model.init, jax.random.key(0))
    opt_state = jax.eval_shape(optimizer.init, params)
    p_sh, o_sh = jax.tree.map(shard, params), jax.tree.map(shard, opt_state)
    batch_sh = NamedSharding(mesh, P("fsdp"))

    def objective(params, x, y):  # the trainer's loss: the labels' log-probabilities
        return -model(params, x, labels=y).mean()

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(objective)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(
        train_step,
        in_shardings=(p_sh, o_sh, batch_sh, batch_sh),
        out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    tokens = jax.ShapeDtypeStruct((batch, model.context), jnp.int32)
    compiled = step.lower(params, opt_state, tokens, tokens).compile()
    state = sum(
        int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
        for a, s in zip(*(jax.tree.leaves(t) for t in ((params, opt_state), (p_sh, o_sh))))
    )
    return state, compiled


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.sharding", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (a multiple of 8)")
    ap.add_argument("--tiny", action="store_true", help="1 layer of width 32: a smoke run")
    args = ap.parse_args(argv)
    if args.tiny:
        args.n_layer, args.n_embd, args.batch = 1, 32, 8
    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"needs 8 devices, found {len(devices)}")
    devices = devices[:8]
    model = GPT(vocab_size=64, context=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    optimizer = optax.adam(1e-3)
    rows = {}
    for label, layout in LAYOUTS.items():
        if args.tiny and label == "fsdp, min_bytes=0":  # the fsdp row's code, another threshold
            continue
        rows[label] = nnlite_step(model, optimizer, *layout, args.batch, devices)
    rows["cookbook fsdp"] = cookbook_fsdp_step(model, optimizer, args.batch, devices)
    n_params = sum(
        int(np.prod(a.shape))
        for a in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))
    )
    print(
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd} ({n_params:,} params), Adam, "
        f"batch {args.batch} x {model.context} tokens, {len(devices)} host devices\n"
    )
    head = "| layout | params + opt / device | vs none | step args / device (XLA) | "
    print(head + " | ".join(COLLECTIVES) + " |")
    print("|---" * (4 + len(COLLECTIVES)) + "|")
    base = rows["none"][0]
    for label, (state, compiled) in rows.items():
        counts = count_collectives(compiled.as_text())
        mem = compiled.memory_analysis()
        args_bytes = format_bytes(mem.argument_size_in_bytes) if mem is not None else "n/a"
        cells = [label, format_bytes(state), f"{state / base:.3f}", args_bytes]
        print("| " + " | ".join(cells + [str(counts[op]) for op in COLLECTIVES]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
