"""What the params features cost (or save) per train step: a frozen backbone, the EMA of
the params and the logged norms.

    python -m benchmarks.params_step frozen   # GPT, all blocks but the last frozen
    python -m benchmarks.params_step extras   # norms (log.norms) and EMA (train.ema_decay)

``frozen``: the GPT train step with the embeddings and every block but the last frozen
(``optimizer.frozen``), under ``loss.grad`` manual and autodiff, against the same step
with nothing frozen. Each case is the trainer's own step as ``train.compile_fit`` builds it
from the config (``optimizer.frozen``: the trained-params mask, Adam with ``set_to_zero``
for the frozen params).

``extras``: the unfrozen step with nothing logged beyond the loss, with the three norms
(``log.norms``, the default) and with the EMA (``train.ema_decay``) too.

All cases in one process, rounds in shuffled order (``_harness.time_interleaved``); the
table shows the median per-step time and the ratio to the first case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from benchmarks import _harness as h

# name: (GPT kwargs, batch)
SIZES = {
    "gpt-4x128/T64/b12": (dict(vocab_size=65, context=64, n_layer=4, n_head=4, n_embd=128), 12),
    "gpt-6x384/T256/b64": (dict(vocab_size=65, context=256, n_layer=6, n_head=6, n_embd=384), 64),
    # --tiny (a smoke run of this module's code): 1 block, so frozen mode freezes the
    # embeddings (wte: the tied head too) and trains the block; frozen blocks are
    # tests/test_params_features.py's. A second block cost each of 7 compiles ~1.5x.
    "gpt-1x16/T8/b4": (dict(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=16), 4),
}


def frozen_globs(n_layer: int) -> list[str]:
    """The embeddings (wte is also the tied head) and every block but the last."""
    return ["wte/*", "wpe/*", *[f"blocks/{i}/*" for i in range(n_layer - 1)]]


class Case:
    """One compiled train step of the GPT, as the trainer builds it (``train.compile_fit``),
    on its own state."""

    def __init__(self, model, batch, grad, *, frozen=(), norms=False, ema=None, steps_per_call=1):
        from benchmarks._impls import compile_nnlite

        rng = np.random.default_rng(0)
        stream = rng.integers(0, model.vocab_size, 20_000).astype(np.int32)
        config = {
            "optimizer": {"name": "adam", "learning_rate": 1e-3, "frozen": list(frozen)},
            "train": {"ema_decay": ema},
            "log": {"norms": norms},
        }
        compiled = compile_nnlite(
            model,
            None,
            batch,
            grad=grad,
            steps_per_call=steps_per_call,
            config=config,
            tokens=stream,
        )
        self.stepper = compiled.stepper
        self.X, self.Y = compiled.X, compiled.Y
        self.idx = rng.integers(0, len(stream) - model.context - 1, (64, steps_per_call, batch))
        self.idx = self.idx.astype(np.int32)
        self.p = self.stepper.put_state(jax.tree.leaves(compiled.params0))
        self.o = self.stepper.put_state(jax.tree.leaves(compiled.opt0))
        self.t = 0

    def __call__(self):
        st = self.stepper
        self.p, self.o, _, m = st.run(
            self.p, self.o, [], self.X, self.Y, st.put_indices(self.idx[self.t % 64], self.t)
        )
        self.t += 1
        return float(m["loss"][-1])  # waits for the step


def cases_for(mode: str, model, batch: int) -> dict:
    if mode == "frozen":
        globs = frozen_globs(model.n_layer)
        return {
            "manual, unfrozen": Case(model, batch, "manual"),
            "manual, frozen": Case(model, batch, "manual", frozen=globs),
            "autodiff, unfrozen": Case(model, batch, "autodiff"),
            "autodiff, frozen": Case(model, batch, "autodiff", frozen=globs),
        }
    return {
        "manual, loss only": Case(model, batch, "manual"),
        "+ norms": Case(model, batch, "manual", norms=True),
        "+ norms + EMA": Case(model, batch, "manual", norms=True, ema=0.999),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["frozen", "extras"])
    ap.add_argument("--size", default="gpt-4x128/T64/b12", choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed sample")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT, one round: a smoke run")
    args = ap.parse_args(argv)
    if args.tiny:
        args.size, args.rounds, args.steps = "gpt-1x16/T8/b4", 1, 1
    from models.gpt import GPT

    kwargs, batch = SIZES[args.size]
    model = GPT(**kwargs)
    cases = cases_for(args.mode, model, batch)
    losses = {name: case() for name, case in cases.items()}  # compiles each
    steps = args.steps

    def timed(case):
        return lambda: [case() for _ in range(steps)]

    samples = h.time_interleaved(
        {n: timed(c) for n, c in cases.items()}, rounds=args.rounds, warmup=1
    )
    first = next(iter(cases))
    base = h.median(samples[first]) / steps
    rows = []
    for name, s in samples.items():
        t = h.median(s) / steps
        rows.append([name, h.fmt_time(t), f"{t / base:.3f}x", h.fmt_time(min(s) / steps)])
    print(f"params_step {args.mode}: {args.size}, {args.rounds} rounds x {steps} steps")
    print(h.table(rows, ["case", "median step", f"vs {first}", "min step"]))
    h.write_json(
        f"params_step_{args.mode}",
        {
            "size": args.size,
            "machine": h.machine_info(),
            "first_losses": losses,
            "samples_s": samples,
            "steps_per_sample": steps,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
