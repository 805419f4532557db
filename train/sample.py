"""``nnlite-train sample --run DIR [--prompt TEXT] [--tokens N] [--temperature T]
[--top-k K] [--top-p P] [--repetition-penalty R] [--seed S] [--best] [--stream]``: generate
text from a run's newest checkpoint (``--best``: its best by ``checkpoint.monitor``).

A Hugging Face model (``model.name: hf:DIR``) stops at its directory's end-of-text ids;
``--stream`` prints its tokens as they are made (``nl.hf.generate_stream``).

The run directory holds what sampling needs: ``config.yaml`` (the model) and checkpoints
whose metadata carry the character vocabulary, or the tokenizer of a run on prepared
tokens (char, byte or BPE: the prompt is encoded and the output decoded with it); any language-model run samples, a user's
own model included (``train.inference.generate``). Generation is one compiled program: the
GPT's key/value cache (``GPT.generate``), or a sliding window for any other model; the
text goes to stdout, timings to stderr. Text
longer than the model's context slides its window by half a context (see models/gpt.py).
Bad arguments (no run, no checkpoint, characters outside the vocabulary, a prompt longer
than the context, bad numbers) print one line and exit 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import faults
from .config import MAX_SEED, ArgumentParser
from .errors import ConfigError
from .inference import generator, load_run, until_stop


def parse_args(argv):
    ap = ArgumentParser(
        prog="nnlite-train sample",
        description="Generate text from a trained language model's newest checkpoint.",
    )
    ap.add_argument("--run", required=True, help="run directory, e.g. runs/shakespeare_gpt")
    ap.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    ap.add_argument("--tokens", type=int, default=500, help="tokens (characters) to generate")
    ap.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy"
    )
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0: all)")
    ap.add_argument(
        "--top-p", type=float, default=None,
        help="nucleus sampling: among the most likely tokens whose probability reaches p "
        "(models with their own generate: nl.hf models)",
    )  # fmt: skip
    ap.add_argument(
        "--repetition-penalty", type=float, default=None,
        help="divide the logits of tokens already seen by R (> 1 repeats less; nl.hf models)",
    )  # fmt: skip
    ap.add_argument(
        "--stream", action="store_true",
        help="print the tokens as they are made (models that decode step by step: nl.hf)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    ap.add_argument(
        "--best", action="store_true",
        help="the best checkpoint by checkpoint.monitor (a run with checkpoint.keep_best), "
        "not the newest",
    )  # fmt: skip
    ap.add_argument(
        "--ema",
        action="store_true",
        help="sample from the params' moving average (train.ema_decay)",
    )
    args = ap.parse_args(argv)
    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.repetition_penalty is not None and not 0 < args.repetition_penalty < float("inf"):
        raise ConfigError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")
    return args


def load_model(run_dir: Path, which: str = "latest", ema: bool = False):
    """``(loaded run, vocab)`` of the newest (or ``which="best"``) checkpoint of ``run_dir``
    (a language model; vocab is None for a run with a byte or BPE tokenizer,
    ``run.tokenizer``); ``ema``: with the params' moving average."""
    run = load_run(run_dir, which, ema=ema)
    cfg = run.config
    if run.vocab is None and run.tokenizer is None:
        raise ConfigError(
            f"checkpoint {run.checkpoint}: no vocabulary in its metadata; model.name="
            f"{cfg.model.name} with data.name={cfg.data.name} is not a text model"
        )
    if run.model.task != "language_model":
        raise ConfigError(
            f"model.name={cfg.model.name} is not a language model; it cannot generate"
        )
    return run, run.vocab


def encode_prompt(prompt: str, run) -> list[int]:
    """The prompt's ids in the run's vocabulary or tokenizer (at most a context of them)."""
    context = run.model.context
    if run.vocab is not None:
        unknown = sorted(set(prompt) - set(run.vocab))
        if unknown:
            raise ConfigError(
                f"--prompt has characters outside the model's vocabulary: "
                f"{''.join(unknown)!r}; the vocabulary is {run.vocab!r}"
            )
    ids = run.encode(prompt)
    if len(ids) > context:
        unit = "characters" if run.vocab is not None else "tokens"
        raise ConfigError(
            f"--prompt is {len(ids)} {unit}, longer than the model's context "
            f"of {context}; shorten it"
        )
    return ids


def generate(
    model, params, ids, n_tokens, seed, temperature, top_k, state=None, top_p=None,
    repetition_penalty=None,
):  # fmt: skip
    """``(all ids, compile seconds, generate seconds)``: one compiled call of the model's
    generator (``train.inference.generator``) for a batch of one (``state``: a stateful
    model's); cut after the model's first end-of-text id (``stop_ids``) where it made one."""

    fn = generator(model, state, top_p=top_p, repetition_penalty=repetition_penalty)
    prompt = jnp.asarray(np.asarray(ids, np.int32)[None, :])
    key = jax.random.key(seed)
    t0 = time.perf_counter()
    compiled = fn.lower(params, prompt, n_tokens, key, temperature, top_k).compile()
    t1 = time.perf_counter()
    out = np.asarray(compiled(params, prompt, key, temperature))[0]
    t2 = time.perf_counter()
    return until_stop(out, len(ids), getattr(model, "stop_ids", ())), t1 - t0, t2 - t1


def stream(run, ids, args, top_k, write=None) -> tuple[int, float]:
    """Print the prompt, then each token's text as soon as it is made (a model's
    ``generate_stream``); returns ``(tokens made, seconds)``. Text is written once it
    decodes whole (a character split over byte-level tokens waits for its last byte)."""

    write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    steps = getattr(run.model, "generate_stream", None)
    if steps is None:
        raise ConfigError(
            f"--stream needs a model that decodes step by step (nl.hf models); "
            f"{type(run.model).__name__} generates in one compiled program: drop --stream"
        )
    extra = {} if args.repetition_penalty is None else {
        "repetition_penalty": args.repetition_penalty
    }  # fmt: skip
    prompt = np.asarray(ids, np.int32)[None, :]
    key = jax.random.key(args.seed)
    made = list(ids)
    shown = run.decode(made)
    write(shown)
    t0 = time.perf_counter()
    for tok in steps(
        run.params, prompt, args.tokens, key, args.temperature, top_k, args.top_p, **extra
    ):
        made.append(int(tok[0]))
        text = run.decode(made)
        if text.startswith(shown) and not text.endswith("\ufffd"):
            write(text[len(shown) :])
            shown = text
    write(run.decode(made)[len(shown) :] + "\n")
    return len(made) - len(ids), time.perf_counter() - t0


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        run, vocab = load_model(Path(args.run), "best" if args.best else "latest", args.ema)
        path = run.checkpoint
        prompt = args.prompt
        if prompt is None:
            prompt = "\n" if vocab is None or "\n" in vocab else vocab[0]
        if not prompt:
            raise ConfigError("--prompt must not be empty (omit it to start from a newline)")
        ids = encode_prompt(prompt, run)
        top_k = args.top_k or None
        limit = getattr(run.model, "max_positions", None)  # a model that does not slide
        if limit is not None and len(ids) + args.tokens > limit:
            raise ConfigError(
                f"--tokens {args.tokens} after a prompt of {len(ids)} tokens exceeds the "
                f"model's {limit} positions; ask for at most {limit - len(ids)}"
            )
        if args.stream:
            n, t_gen = stream(run, ids, args, top_k)
            print(f"[{path.name}: {n} tokens in {t_gen:.3f} s, streamed]", file=sys.stderr)
            return 0
        out, t_compile, t_gen = generate(
            run.model, run.params, ids, args.tokens, args.seed, args.temperature, top_k,
            run.state, args.top_p, args.repetition_penalty,
        )  # fmt: skip
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    print(run.decode(out))
    n = len(out) - len(ids)
    print(
        f"[{path.name}: {n} tokens in {t_gen:.3f} s, "
        f"{n / max(t_gen, 1e-9):,.0f} tokens/s; compiled in {t_compile:.2f} s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
