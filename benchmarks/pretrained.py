"""Pretrained models (nl.hf) against PyTorch ``transformers`` on a SmolLM-135M-shaped Llama.

    python -m benchmarks.pretrained [--size smollm|tiny] [--batch 4] [--seq 256]
                                    [--new-tokens 64] [--rounds 3] [--precision]

A random-weight Llama made locally by ``transformers`` (``--size smollm``: 30 layers, 576
wide, 9 heads, 3 KV heads, MLP 1536, vocabulary 49152, tied head: SmolLM-135M's shape;
``tiny`` for a quick check that the script works), saved with ``save_pretrained``. Measured,
each row in the same process for both libraries, interleaved (PyTorch with as many threads
as the CPU has, which is what XLA uses):

- import: ``nl.hf.load_pretrained`` and ``AutoModelForCausalLM.from_pretrained``, each in a
  fresh process: wall time and the peak resident memory the load added to the process;
- forward: tokens/s of the logits of ``[batch, seq]`` tokens;
- a training step (AdamW, next-token cross-entropy): LoRA (rank 8 on q and v, only the
  adapters differentiated) and full fine-tuning in nnlite; PyTorch full fine-tuning and,
  when ``peft`` is installed, PyTorch + peft LoRA with the same targets;
- sampling: greedy new tokens/s with the key/value cache, ``model.generate`` (one compiled
  program) against ``transformers``' ``generate``.

``--precision`` (also ``--lora-base``) measures instead float32 against bfloat16 compute
(``train.precision: bfloat16``'s policy): the full fine-tuning step (float32 params and
AdamW), and the trainer's LoRA step with the frozen base stored in float32 and in bfloat16
(``model.param_dtype``), each computed in float32 and in bfloat16: their times and the
compiled steps' memory (params, temporaries).

Results go to ``benchmarks/results/pretrained-latest.json``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

SIZES = {
    "smollm": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=10000.0,
    ),
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
LORA_TARGETS = ["*/attn/q", "*/attn/v"]
ROOT = Path(__file__).resolve().parent.parent


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_child(directory: str, which: str) -> None:
    """In a fresh process: import the library, then time one load; print JSON."""
    if which == "nnlite":
        import jax

        import nnlite as nl

        base = _rss_mb()
        t0 = time.perf_counter()
        _, params = nl.hf.load_pretrained(directory)
        jax.block_until_ready(params)
    else:
        warnings.simplefilter("ignore")
        import transformers

        base = _rss_mb()
        t0 = time.perf_counter()
        transformers.AutoModelForCausalLM.from_pretrained(directory)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_added_mb": _rss_mb() - base}))


def _child(directory: str, which: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.pretrained", "--load-child", directory, which],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _full_step(loss, opt):
    """The compiled step of ``loss(params, *rest)``: gradients and ``opt`` (an optax
    optimizer) on ``params``, params and optimizer state donated (as the trainer's step);
    ``rest``, arguments passed through undifferentiated."""
    import jax
    import optax

    import nnlite as nl

    def step(p, s, *rest):
        g = jax.grad(loss)(p, *rest)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return nl.jit(step, donate_argnums=(0, 1))


def _adapter_step(loss, opt):
    """The compiled LoRA step of ``loss(params)``: :func:`_full_step` on the adapters only,
    called as ``step(adapters, state, frozen)``. The frozen base is an argument, not closed
    over: a closed-over array is a constant of the program, which XLA folds at compile time
    (it spent over a second transposing the 135M model's f32[49152,576] token table)."""
    import nnlite as nl

    return _full_step(lambda a, frozen: loss(nl.lora_join(a, frozen)), opt)


def _stepping(step, *state, frozen=()):
    """A case that runs ``step(*state, *frozen)`` once and blocks, carrying the (donated)
    state from call to call."""
    import jax

    box = [state]

    def go():
        box[0] = step(*box[0], *frozen)
        jax.block_until_ready(box[0])

    return go


class LlamaBench:
    """The Llama of ``size`` (a :data:`SIZES` name) made by ``transformers`` with random
    weights, saved and loaded by ``nl.hf``, and the cases that time both libraries on
    ``[batch, seq]`` tokens: :meth:`forward_cases`, :meth:`step_cases`,
    :meth:`sample_cases` (``{name: callable}`` that block until done). Optimizer: AdamW
    (lr 1e-4, weight decay 0.01) in both."""

    def __init__(self, size: str, batch: int, seq: int):
        warnings.simplefilter("ignore")
        import numpy as np
        import torch
        import transformers

        import nnlite as nl

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.size, self.cfg = size, transformers.LlamaConfig(**SIZES[size])
        self.dir = tempfile.mkdtemp(prefix="nnlite-bench-hf-")
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)  # 540 MB at smollm
        torch.manual_seed(0)
        self.ref = transformers.AutoModelForCausalLM.from_config(self.cfg)
        self.ref.save_pretrained(self.dir)
        self.ref.eval()
        self.model, self.params = nl.hf.load_pretrained(self.dir)
        self.batch, self.seq = batch, seq
        self.tokens = np.random.default_rng(0).integers(0, self.cfg.vocab_size, (batch, seq + 1))
        # numpy, not jax arrays: closed over by the jitted steps as constants (nl.Embedding's
        # range check reads concrete ids on the host)
        self.x = self.tokens[:, :-1].astype(np.int32)
        self.y = self.tokens[:, 1:].astype(np.int32)
        self.tx, self.ty = torch.tensor(self.tokens[:, :-1]), torch.tensor(self.tokens[:, 1:])

    def forward_cases(self) -> dict:
        import torch

        import nnlite as nl

        model = self.model
        # a closure of its own: jit's cache is keyed by the function, so each caller's
        # settings at its first call (benchmarks.kernels' A/B) are the ones traced
        forward = nl.jit(lambda p, x: model(p, x))
        params, x, ref, tx = self.params, self.x, self.ref, self.tx

        def torch_forward():
            with torch.no_grad():
                return ref(tx).logits

        return {"nnlite": lambda: forward(params, x).block_until_ready(), "torch": torch_forward}

    def step_cases(self, which=("full", "lora")) -> dict:
        """``nnlite full``/``torch full`` and ``nnlite lora``/``torch+peft lora`` (when peft
        is installed) for each of ``which``."""
        import jax
        import optax
        import torch

        import nnlite as nl

        model, x, y, tx, ty = self.model, self.x, self.y, self.tx, self.ty
        opt = optax.adamw(1e-4, weight_decay=0.01)

        # the trainer's language-model loss: the labels' mean negative log-probability, the
        # head in chunks (token_log_probs), never all [4, 256, 49152] logits; the programs
        # compiled with nnlite's options and the state donated, as the trainer's step is
        def xent(m, p):
            return -m.token_log_probs(p, x, y).mean()

        def torch_step(module, optim):
            def step():
                logits = module(input_ids=tx).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ty.flatten())
                optim.zero_grad()
                loss.backward()
                optim.step()

            return step

        cases = {}
        if "full" in which:
            full_step = _full_step(lambda p: xent(model, p), opt)
            params = jax.tree.map(jax.numpy.copy, self.params)  # the step donates its own
            cases["nnlite full"] = _stepping(full_step, params, opt.init(params))
            torch_opt = torch.optim.AdamW(self.ref.parameters(), 1e-4, weight_decay=0.01)
            cases["torch full"] = torch_step(self.ref, torch_opt)
        if "lora" in which:
            lmodel, lparams = nl.hf.add_lora(model, self.params, LORA_TARGETS, jax.random.key(0))
            adapters, frozen = nl.lora_split(lparams)
            lora_step = _adapter_step(lambda p: xent(lmodel, p), opt)
            cases["nnlite lora"] = _stepping(
                lora_step, adapters, opt.init(adapters), frozen=(frozen,)
            )
            try:
                cases["torch+peft lora"] = torch_step(*self._peft())
            except ImportError:
                pass
        return cases

    def _peft(self):
        import peft
        import torch
        import transformers

        peft_model = peft.get_peft_model(
            transformers.AutoModelForCausalLM.from_pretrained(self.dir),
            peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        )
        trained = [p for p in peft_model.parameters() if p.requires_grad]
        return peft_model, torch.optim.AdamW(trained, 1e-4, weight_decay=0.01)

    def precision_cases(self) -> tuple[dict, dict]:
        """The full fine-tuning step (float32 params, AdamW) computed in float32 and under
        ``train.precision: bfloat16``'s policy; and the trainer's LoRA model
        (``nl.hf.Pretrained``: rank 8 on q and v, the loss by ``token_log_probs``, AdamW, the
        adapters and their state donated) with its frozen base stored in float32 and in
        bfloat16 (``model.param_dtype``), each computed in float32 and under
        ``train.precision: bfloat16``'s policy: ``({name: step}, {name:
        (params MB, temporaries MB)})``, the sizes from the compiled step's memory analysis
        (the params: the program's arguments, adapters and optimizer state included)."""
        import jax
        import optax

        import nnlite as nl
        from train.step.precision import Policy

        x, y = self.x, self.y
        opt = optax.adamw(1e-4, weight_decay=0.01)
        lora = {"rank": 8, "alpha": 16, "targets": LORA_TARGETS}
        cases, memory = {}, {}

        def add(name, step, *state, frozen=()):
            compiled = step.lower(*state, *frozen).compile()
            info = compiled.memory_analysis()
            memory[name] = (info.argument_size_in_bytes / 2**20, info.temp_size_in_bytes / 2**20)
            cases[name] = _stepping(compiled, *state, frozen=frozen)

        for compute in ("float32", "bfloat16"):  # full fine-tuning: float32 params, AdamW
            m = self.model if compute == "float32" else Policy(self.model, compute)
            step = _full_step(lambda p, m=m: -m.token_log_probs(p, x, y).mean(), opt)
            params = jax.tree.map(jax.numpy.copy, self.params)
            add(f"full step, compute {compute}", step, params, opt.init(params))
        for stored in ("float32", "bfloat16"):
            model = nl.hf.Pretrained(self.dir, lora=lora, param_dtype=stored)
            adapters, frozen = nl.lora_split(jax.jit(model.init)(jax.random.key(0)))
            for compute in ("float32", "bfloat16"):
                m = model if compute == "float32" else Policy(model, compute)
                step = _adapter_step(lambda p, m=m: -m.token_log_probs(p, x, y).mean(), opt)
                a = jax.tree.map(jax.numpy.copy, adapters)
                name = f"LoRA step, base {stored}, compute {compute}"
                add(name, step, a, opt.init(a), frozen=(frozen,))
        return cases, memory

    def sample_cases(self, new_tokens: int) -> dict:
        """Greedy sampling of ``new_tokens`` after a 16-token prompt, with the cache."""
        import jax
        import jax.numpy as jnp
        import torch

        import nnlite as nl

        n, prompt, params, ref = new_tokens, self.tokens[:1, :16], self.params, self.ref
        gen = nl.jit(self.model.generate, static_argnums=2)

        def torch_gen():
            with torch.no_grad():
                ref.generate(torch.tensor(prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)  # fmt: skip

        def nnlite_gen():
            gen(params, jnp.asarray(prompt), n, jax.random.key(0), 0.0).block_until_ready()

        return {"nnlite": nnlite_gen, "torch": torch_gen}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="smollm")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="--size tiny --rounds 1: a smoke run")
    ap.add_argument(
        "--precision",
        "--lora-base",
        dest="precision",
        action="store_true",
        help="only float32 against bfloat16 compute: the full step, and the LoRA step with "
        "its frozen base in float32 and in bfloat16 (model.param_dtype): time and the "
        "compiled step's memory",
    )
    ap.add_argument("--load-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.size, args.rounds, args.new_tokens = "tiny", 1, 4
    if args.load_child:
        load_child(*args.load_child)
        return 0

    import torch

    from . import _harness as h

    torch.set_num_threads(os.cpu_count() or 1)
    bench = LlamaBench(args.size, args.batch, args.seq)
    if args.precision:
        return _precision(bench, args.rounds, args.batch * args.seq)
    rows, results = [], {"size": args.size, "config": SIZES[args.size]}
    loads = {w: _child(bench.dir, w) for w in ("nnlite", "transformers")}
    results["import"] = loads
    for w, r in loads.items():
        rows.append((f"import ({w})", f"{r['seconds']:.2f} s", f"+{r['peak_added_mb']:.0f} MB"))
    b, t, n = args.batch, args.seq, args.new_tokens
    fw = h.time_interleaved(bench.forward_cases(), rounds=args.rounds)
    results["forward_tokens_per_s"] = {k: b * t / h.median(v) for k, v in fw.items()}
    steps = h.time_interleaved(bench.step_cases(), rounds=args.rounds, warmup=1)
    results["step_seconds"] = {k: h.median(v) for k, v in steps.items()}
    if "torch+peft lora" not in steps:
        results["peft"] = "not installed"
    sm = h.time_interleaved(bench.sample_cases(n), rounds=args.rounds, warmup=1)
    results["sample_tokens_per_s"] = {k: n / h.median(v) for k, v in sm.items()}

    for k, v in results["forward_tokens_per_s"].items():
        rows.append((f"forward {b}x{t} ({k})", f"{v:,.0f} tokens/s", ""))
    for k, v in results["step_seconds"].items():
        rows.append((f"train step {b}x{t} ({k})", h.fmt_time(v), f"{b * t / v:,.0f} tokens/s"))
    for k, v in results["sample_tokens_per_s"].items():
        rows.append((f"greedy sampling, {n} tokens ({k})", f"{v:,.1f} tokens/s", ""))
    print(h.table(rows, ["what", "time / rate", "note"]))
    results["machine"] = h.machine_info()
    print("wrote", h.write_json(f"pretrained-{args.size}", results))
    return 0


def _precision(bench, rounds: int, tokens: int) -> int:
    """``--precision``: the table of :meth:`LlamaBench.precision_cases`."""
    from . import _harness as h

    cases, memory = bench.precision_cases()
    times = h.time_interleaved(cases, rounds=rounds, warmup=1)
    rows, results = [], {"size": bench.size, "precision": {}}
    for name, (params_mb, temp_mb) in memory.items():
        v = h.median(times[name])
        results["precision"][name] = {"seconds": v, "params_mb": params_mb, "temp_mb": temp_mb}
        rows.append((name, h.fmt_time(v), f"{tokens / v:,.0f} tokens/s",
                     f"{params_mb:,.1f} MB", f"{temp_mb:,.1f} MB"))  # fmt: skip
    print(h.table(rows, ["what", "time", "rate", "params", "temporaries"]))
    results["machine"] = h.machine_info()
    print("wrote", h.write_json(f"pretrained-precision-{bench.size}", results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
