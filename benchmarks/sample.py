"""Sampling speed: ``GPT.generate`` (one compiled program, key/value cache) against the naive
loop that re-runs the whole context for every new token.

    python -m benchmarks.sample [--tokens 500] [--rounds 3] [--tiny]

The baby GPT (4 layers, 4 heads, 128 dims, context 64, vocabulary 84) with its init
weights; both generate greedily from the same one-character prompt, so they must produce
the same tokens (checked) while the window is within the context. The naive loop is
nanoGPT's ``generate``: a jitted forward of the last ``context`` tokens (padded to the
context, one compiled shape) per token, then argmax on the host.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from . import _harness as h


def naive(model, params, forward, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        window = seq[-model.context :]
        padded = window + [0] * (model.context - len(window))
        logits = forward(params, jnp.asarray([padded]))
        seq.append(int(jnp.argmax(logits[0, len(window) - 1])))
    return seq


def main(argv=None) -> int:
    from models.gpt import GPT

    ap = argparse.ArgumentParser(prog="python -m benchmarks.sample", description=__doc__)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a 1-layer GPT, 12 tokens: a smoke run")
    args = ap.parse_args(argv)
    model = GPT(vocab_size=84, context=64)
    if args.tiny:
        model = GPT(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=16)
        args.tokens, args.rounds = 12, 1
    params = jax.jit(model.init)(jax.random.key(0))
    forward = jax.jit(model.__call__)
    gen = jax.jit(model.generate, static_argnames=("n_tokens", "top_k"))
    prompt = [0]
    key = jax.random.key(0)
    n = args.tokens

    def cached():
        return np.asarray(gen(params, jnp.asarray([prompt]), n, key, 0.0))[0].tolist()

    within = model.context - len(prompt)  # the two agree until the window slides
    a, b = cached(), naive(model, params, forward, prompt, within)
    if a[: len(b)] != b:
        raise SystemExit("the cached and the naive greedy decodes differ")
    samples = h.time_interleaved(
        {
            "generate (KV cache, one program)": cached,
            "naive recompute loop": lambda: naive(model, params, forward, prompt, n),
        },
        rounds=args.rounds,
        warmup=1,
    )
    rows = []
    base = h.median(samples["naive recompute loop"])
    for name, v in samples.items():
        t = h.median(v)
        rows.append([name, f"{t:.3f} s", f"{n / t:,.0f}", f"{base / t:.1f}x"])
    size = "tiny GPT" if args.tiny else "baby GPT"
    print(f"{size}, {n} tokens, {args.rounds} rounds (median)\n")
    print(h.table(rows, ["sampler", "time", "tokens/s", "speed-up"]))
    h.write_json(
        "sample-tiny" if args.tiny else "sample",
        {"machine": h.machine_info(), "tokens": n, "samples_s": samples},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
