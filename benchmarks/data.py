"""Data bigger than memory: host memory of streamed training and of prepare, and the
baby GPT's step time streamed vs on the device.

    python -m benchmarks.data rss [--big-mb 2048] [--small-mb 20] [--tokenizers char,byte,bpe]
                                  [--steps 300] [--workdir /tmp/nnlite-data-bench] [--keep]
    python -m benchmarks.data steps [--corpus-mb 20] [--calls 40] [--rounds 5]
    python -m benchmarks.data {rss,steps} --tiny   # a smoke run: 0.1-0.2 MB, a 1-layer GPT

``rss`` generates two corpora under ``--workdir`` (random words of a generated
vocabulary, streamed to disk in 4 MiB blocks: the generator holds one block), then, each
in a fresh process whose peak RSS is read from ``wait4``:

- ``python -m train.prepare`` of the big corpus with each tokenizer: peak RSS and MB/s of
  input (bpe trains its vocabulary on a ``--bpe-sample-mb`` sample, 100 MB by default,
  and encodes everything);
- ``python -m train`` of the baby GPT (configs/shakespeare_gpt.yaml) on each corpus
  prepared char-level, ``data.placement=host`` (streamed), ``--steps`` steps: peak RSS,
  big vs small (target: within 10% and under 1 GB); and on the small corpus with
  ``data.placement=device``, the baseline of JAX, XLA and the compiles themselves. Peak RSS counts the pages of
  train.bin that the run's memory map touched (file-backed, reclaimable); the
  ``rss_anon`` column is the run's own memory (``RssAnon`` sampled every 50 ms).

The corpora are deleted at the end unless ``--keep``.

``steps`` prepares one corpus (char) and trains the baby GPT with ``train.fit`` in one
process, on the device (``data.placement=device``: the training split on the device,
indices per call) and streamed (``host``: batches read from the memory map a call ahead),
the two alternating round after round; a callback takes the time at each call's end
(``train.steps_per_call`` steps a call, ``train.log_every`` the same: the loop waits for
each call's metrics), and it prints medians per step and the ratio (target: streamed
within 5% of on-device).

Each prints a Markdown table and writes ``benchmarks/results/data-<time>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import _harness as h

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4 << 20
GPT_CONFIG = "configs/shakespeare_gpt.yaml"


def generate_corpus(path: Path, megabytes: int, seed: int = 0) -> None:
    """``megabytes`` MB of random words from a generated 20k-word vocabulary (Zipf-like
    frequencies, punctuation, line breaks), written a 4 MiB block at a time."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
    lengths = rng.integers(1, 10, 20000)
    words = [bytes(rng.choice(letters, n)) for n in lengths]
    words += [b",", b".", b"\n", b"!", b"?", b";"]
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    left = int(megabytes * 1_000_000)
    with open(path, "wb") as f:
        while left > 0:  # (~6 bytes a word: the words of a block, or of what is left, cut)
            ids = rng.choice(len(words), min(BLOCK, left) // 5, p=p)
            block = b" ".join(words[i] for i in ids.tolist())[: min(BLOCK, left)]
            f.write(block)
            left -= len(block)


def run_measured(args: list[str], env: dict | None = None) -> dict:
    """Run ``args`` in a fresh process: wall seconds, peak RSS (``wait4``'s ru_maxrss) and
    the peak of its RssAnon sampled every 50 ms."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    peak_anon = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak_anon[0] = max(peak_anon[0], int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read()
    proc.stderr.close()  # (os.wait4 below, not proc.wait: Popen would not close it)
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {
        "wall_s": time.perf_counter() - t0,
        "peak_rss": usage.ru_maxrss * 1024,  # Linux: KiB
        "rss_anon": peak_anon[0],
    }


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def prepare_args(corpus: Path, out: Path, tokenizer: str) -> list[str]:
    args = [sys.executable, "-m", "train.prepare", "--input", str(corpus), "--out", str(out)]
    args += ["--tokenizer", tokenizer, "--force"]
    return args + (["--vocab-size", "8192"] if tokenizer == "bpe" else [])


# --tiny: a 1-layer GPT of width 32 instead of the baby GPT (the same code, seconds)
TINY_MODEL = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "train.steps_per_call=2",
    "data.eval_windows=16",
]


def train_sets(
    data_dir: Path, log_dir: Path, name: str, steps: int, placement: str, tiny: bool = False
) -> list[str]:
    """The ``--set`` overrides of a baby GPT run on prepared tokens in ``data_dir``."""
    return [
        "data.name=tokens",
        f"data.path={data_dir}",
        f"data.placement={placement}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"train.log_every={min(100, steps)}",
        f"checkpoint.every={steps}",
        f"log.dir={log_dir}",
        f"name={name}",
        "log.progress=false",
        "log.plot=false",
        f"optimizer.warmup_steps={min(10, steps - 1)}",
        *(TINY_MODEL if tiny else []),
    ]


def train_args(*args, **kwargs) -> list[str]:
    """``python -m train`` of :func:`train_sets`' run."""
    sets = train_sets(*args, **kwargs)
    cmd = [sys.executable, "-m", "train", "--config", GPT_CONFIG, "--fresh"]
    return cmd + [a for s in sets for a in ("--set", s)]


def cmd_rss(a) -> dict:
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    rows, raw = [], {}
    try:
        corpora = {}
        for label, size in (("small", a.small_mb), ("big", a.big_mb)):
            path = work / f"{label}.txt"
            t0 = time.perf_counter()
            generate_corpus(path, size)
            print(
                f"generated {path} ({size} MB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr
            )
            corpora[label] = path
        big_bytes = corpora["big"].stat().st_size
        for tok in [t for t in a.tokenizers.split(",") if t]:
            out = work / f"big_{tok}"
            m = run_measured(prepare_args(corpora["big"], out, tok), env)
            m["mb_per_s"] = big_bytes / 1e6 / m["wall_s"]
            raw[f"prepare {tok}"] = m
            rows.append(
                [f"prepare --tokenizer {tok} ({mb(big_bytes)})", mb(m["peak_rss"]),
                 mb(m["rss_anon"]), f"{m['mb_per_s']:.1f} MB/s", f"{m['wall_s']:.0f} s"]
            )  # fmt: skip
            if tok != "char":
                shutil.rmtree(out, ignore_errors=True)
        if not (work / "big_char" / "meta.json").is_file():  # --tokenizers without char
            run_measured(prepare_args(corpora["big"], work / "big_char", "char"), env)
        small_dir = work / "small_char"
        raw["prepare small char"] = run_measured(
            prepare_args(corpora["small"], small_dir, "char"), env
        )
        runs = [("small", small_dir, "host"), ("big", work / "big_char", "host")]
        if not a.tiny:  # the baseline: JAX and XLA themselves
            runs.append(("small", small_dir, "device"))
        for label, d, placement in runs:
            args = train_args(d, work / "runs", label, a.steps, placement, a.tiny)
            m = run_measured(args, env)
            raw[f"train {label} {placement}"] = m
            size = corpora[label].stat().st_size
            how = "streamed" if placement == "host" else "on the device"
            rows.append(
                [f"train {'tiny' if a.tiny else 'baby'} GPT, {a.steps} steps, {how} ({mb(size)} corpus)", mb(m["peak_rss"]),
                 mb(m["rss_anon"]), "", f"{m['wall_s']:.0f} s"]
            )  # fmt: skip
        ratio = raw["train big host"]["peak_rss"] / raw["train small host"]["peak_rss"]
        print(h.table(rows, ["what", "peak RSS", "peak RssAnon", "throughput", "wall"]))
        print(f"\ntraining peak RSS, big / small corpus: {ratio:.3f} (target <= 1.10, < 1 GB)")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {"rows": rows, "raw": raw}


class CallTimes:
    """A callback (``train.Callback``'s protocol): the time at every boundary of the loop,
    each call's end when ``train.log_every`` is ``train.steps_per_call``."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, loop, step: int, metrics: dict) -> None:
        self.times.append(time.perf_counter())


def cmd_steps(a) -> dict:
    import yaml

    import train

    k = 2 if a.tiny else yaml.safe_load((ROOT / GPT_CONFIG).read_text())["train"]["steps_per_call"]
    steps = k * (a.calls + 2)  # two calls of warm-up (the prefetch queue filled), then timed
    work = Path(tempfile.mkdtemp(prefix="nnlite-steps-"))
    times: dict[str, list[float]] = {"device": [], "host": []}
    try:
        generate_corpus(work / "c.txt", a.corpus_mb)
        subprocess.run(prepare_args(work / "c.txt", work / "tok", "char"), cwd=ROOT, check=True)
        for _ in range(a.rounds):  # the two placements' runs alternate, round after round
            for placement, samples in times.items():
                sets = train_sets(work / "tok", work / "runs", placement, steps, placement, a.tiny)
                calls = CallTimes()
                train.fit(
                    None,
                    ROOT / GPT_CONFIG,
                    overrides=[*sets, f"train.log_every={k}"],
                    resume="fresh",
                    echo=lambda *_: None,
                    callbacks=[calls],
                )
                ends = calls.times[1:]  # from the end of the second call
                samples += [(t1 - t0) / k for t0, t1 in zip(ends, ends[1:])]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {p: statistics.median(t) for p, t in times.items()}
    rows = [[p, f"{med[p] * 1e3:.2f} ms", f"{med[p] / med['device']:.3f}"] for p in times]
    print(
        h.table(
            rows,
            [f"{'tiny' if a.tiny else 'baby'} GPT, data.placement", "median step", "vs device"],
        )
    )
    return {"rows": rows, "raw": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.data", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    rss = sub.add_parser("rss", help="peak RSS of prepare and of streamed training")
    rss.add_argument("--big-mb", type=int, default=2048)
    rss.add_argument("--small-mb", type=int, default=20)
    rss.add_argument("--tokenizers", default="char,byte,bpe")
    rss.add_argument("--steps", type=int, default=300)
    rss.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "nnlite-data-bench"))
    rss.add_argument("--keep", action="store_true", help="keep the generated corpora")
    steps = sub.add_parser("steps", help="baby GPT step time, streamed vs on the device")
    steps.add_argument("--corpus-mb", type=int, default=20)
    steps.add_argument("--calls", type=int, default=40, help="calls timed per round and path")
    steps.add_argument("--rounds", type=int, default=5)
    for p in (rss, steps):
        p.add_argument("--tiny", action="store_true", help="0.1-0.2 MB, a 1-layer GPT: a smoke run")
    a = ap.parse_args(argv)
    if a.tiny and a.cmd == "rss":
        # 200 and 100 kB (the word list's 20k words and a GPT context fit many times over)
        a.big_mb, a.small_mb, a.tokenizers, a.steps = 0.2, 0.1, "char", 2  # one call of K=2
        a.workdir = tempfile.mkdtemp(prefix="nnlite-data-tiny-")
    elif a.tiny:
        a.corpus_mb, a.calls, a.rounds = 0.2, 2, 1
    result = cmd_rss(a) if a.cmd == "rss" else cmd_steps(a)
    h.write_json(f"data-{a.cmd}" + ("-tiny" if a.tiny else ""), {"args": vars(a), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
