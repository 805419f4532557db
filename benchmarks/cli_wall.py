"""The whole ``python -m train`` command, as a user waits for it, phase by phase.

    python -m benchmarks.cli_wall [--repeats N] [--quick] [CONFIG ...]
        [--set CONFIG:KEY=VALUE ...] [--baseline DIR] [--no-warm] [--no-sklearn] [--tiny]

``--tiny`` (a smoke run): digits_mlp (or the CONFIGs given) and the raw JAX script for 4
steps, cold only, one repeat and no untimed run, without scikit-learn's script.

Each sample is ``python -m train --config configs/CONFIG.yaml --fresh --timings`` as a
fresh process, timed from just before the process is spawned to just after it has exited.
The breakdown comes from the ``timings.json`` the command writes (train/report/timings.py):
interpreter start-up (spawn -> first line of ``train/__main__.py``), config, imports,
JAX backend, data, compile, train, eval, checkpoint, plot, other, and exit (the command's
last timestamp -> the process is gone: interpreter teardown). "CPU" is the user + system
time of the command's process tree (its plot helper included), which a loaded machine
inflates far less than the wall time.

Rows, run interleaved in shuffled order, several repeats, medians:

- ``CONFIG cold``: JAX's persistent compilation cache off: everything compiles.
- ``CONFIG warm``: the cache on, in a directory filled by one untimed run first: what a
  second run of the same config costs.
- ``scikit-learn``: scikit-learn's own digits script as a fresh process: ``import
  sklearn``, ``load_digits``, the same stratified split, ``MLPClassifier(128).fit``,
  ``score``.
- ``raw JAX script``: the digits job written by hand in JAX (``RAW_JAX_SCRIPT``: the same
  MLP, optimizer, batch, steps and evaluations, without checkpoints, metrics files or the
  curves) as a fresh process: the floor. ``digits_mlp cold / the raw JAX script`` is the
  row that catches a start-up regression on any machine, fast or slow.
- ``CONFIG cold (DIR)`` with ``--baseline DIR``: the same command run from another
  checkout (e.g. ``git archive <commit> | tar -x -C DIR``), for before/after figures
  measured side by side. An older tree has no ``--timings``; its command runs under
  ``BASELINE_PROBE``, which calls its ``train.__main__.main`` with the same arguments and
  times its ``load_dataset`` (data), ``prepare`` (compile), ``ckpt.save`` (checkpoint)
  and ``plot_curves`` (plot) by wrapping them; everything else inside ``main`` (config,
  backend, the loop, evaluations) shows as "train".

Python writes bytecode caches (``__pycache__``, filled by the untimed runs) whatever
``PYTHONDONTWRITEBYTECODE`` says: a user's checkout has them. ``--no-bytecode`` leaves the
environment as it is (with ``PYTHONDONTWRITEBYTECODE=1`` each run compiles the project's
own sources, about 0.15 s).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _harness as h
from .time_to_accuracy import cache_env

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = ("digits_mlp", "mnist1d_mlp", "mnist1d_cnn", "shakespeare_gpt")
# Overrides that keep a long config's sample short (the start-up is what is measured).
# (train.steps must stay above the config's optimizer.warmup_steps: 100 for the GPT.)
DEFAULT_SETS = {"shakespeare_gpt": ["train.steps=100", "optimizer.warmup_steps=10"]}
TINY_SETS = ["train.steps=4", "train.eval_every=2", "train.log_every=2", "checkpoint.every=4"]
# Columns of the breakdown, in the order a run meets them (train/report/timings.py PHASES + exit).
COLUMNS = (
    "interpreter",
    "config",
    "imports",
    "backend",
    "data",
    "compile",
    "train",
    "eval",
    "checkpoint",
    "plot",
    "other",
    "exit",
)
SKLEARN = "scikit-learn"
RAW_JAX = "raw JAX script"

# scikit-learn's own script, as a fresh process; prints its phases as JSON.
SKLEARN_SCRIPT = """
import json, time, warnings
t0 = time.time()
import sklearn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier
t1 = time.time()
x, y = load_digits(return_X_y=True)
x, x_test, y, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
t2 = time.time()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ConvergenceWarning at max_iter is expected
    clf = MLPClassifier(hidden_layer_sizes=(128,), random_state=0).fit(x, y)
t3 = time.time()
acc = clf.score(x_test, y_test)
t4 = time.time()
print(json.dumps({"t_main": t0, "t_end": t4, "accuracy": acc,
                  "phases": {"imports": t1 - t0, "data": t2 - t1, "train": t3 - t2,
                             "eval": t4 - t3}}))
"""


# The same job written by hand in JAX, as a fresh process: the floor nnlite's command is
# compared with (the ratio is what a regression moves, on any machine). The digits MLP of
# configs/digits_mlp.yaml (64 -> 128 relu -> 10, adam with a cosine schedule from 3e-3,
# batch 128, one jitted step per call, the test split evaluated every 250 steps), without
# what the command adds (checkpoints, metrics files, the curves, the config's checks).
# Prints its phases as JSON; argv[1]: the number of steps.
RAW_JAX_SCRIPT = """
import json, sys, time
t0 = time.time()
import jax, jax.numpy as jnp, numpy as np, optax
from sklearn.datasets import load_digits
t1 = time.time()
steps, batch, every = int(sys.argv[1]), 128, 250
x, y = load_digits(return_X_y=True)
x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
perm = np.random.default_rng(0).permutation(len(x))
test, tr = perm[: len(x) // 5], perm[len(x) // 5 :]
X, Y, Xt, Yt = (jax.device_put(a) for a in (x[tr], y[tr], x[test], y[test]))
t2 = time.time()
opt = optax.adam(optax.cosine_decay_schedule(3e-3, steps))

def init(key):
    k1, k2 = jax.random.split(key)
    glorot = jax.nn.initializers.glorot_uniform()
    p = {"W1": glorot(k1, (64, 128)), "b1": jnp.zeros(128),
         "W2": glorot(k2, (128, 10)), "b2": jnp.zeros(10)}
    return p, opt.init(p)

def logits(p, x):
    return jax.nn.relu(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]

def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

def step(p, s, idx):
    value, g = jax.value_and_grad(loss)(p, X[idx], Y[idx])
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, value

def evaluate(p):
    z = logits(p, Xt)
    return optax.softmax_cross_entropy_with_integer_labels(z, Yt).mean(), (z.argmax(-1) == Yt).mean()

p, s = jax.jit(init)(jax.random.key(0))
idx0 = np.zeros(batch, np.int32)
step_c = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, idx0).compile()
eval_c = jax.jit(evaluate).lower(p).compile()
t3 = time.time()
rng = np.random.default_rng(1)
order = np.concatenate([rng.permutation(len(tr)) for _ in range(steps * batch // len(tr) + 1)])
for i in range(steps):
    p, s, value = step_c(p, s, order[i * batch : (i + 1) * batch].astype(np.int32))
    if (i + 1) % every == 0 or i + 1 == steps:
        test_loss, acc = (float(v) for v in eval_c(p))
t4 = time.time()
print(json.dumps({"t_main": t0, "t_end": t4, "accuracy": acc,
                  "phases": {"imports": t1 - t0, "data": t2 - t1, "compile": t3 - t2,
                             "train": t4 - t3}}))
"""


# An older tree's command, timed from outside its code (see the module docstring).
BASELINE_PROBE = """
import json, sys, time
from pathlib import Path
t_main = time.time()
t = time.perf_counter()
import train.__main__ as cli
import train.loop.trainer as loop
laps = {"imports": time.perf_counter() - t}

def timed(owner, name, phase):
    f = getattr(owner, name, None)
    if f is None:
        return
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            laps[phase] = laps.get(phase, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrapper)

for owner, name, phase in ((loop, "load_dataset", "data"), (loop, "prepare", "compile"),
                           (loop.ckpt, "save", "checkpoint"), (loop, "plot_curves", "plot")):
    timed(owner, name, phase)
out, argv = Path(sys.argv[1]), sys.argv[2:]  # where timings.json goes, the command's args
t = time.perf_counter()
rc = cli.main(argv)
inside = time.perf_counter() - t
laps["train"] = inside - sum(v for k, v in laps.items() if k != "imports")
out.write_text(json.dumps({"phases": laps, "t_main": t_main, "t_end": time.time()}))
sys.exit(rc)
"""


def child_env(cache_dir: str | None, bytecode: bool) -> dict[str, str]:
    """The environment of a sample: JAX's compilation cache in ``cache_dir`` (None: off),
    and Python's bytecode caches written (``bytecode``) or as the caller has them."""
    env = {**os.environ, **cache_env(cache_dir)}
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def has_timings(root: Path) -> bool:
    """Whether the tree at ``root`` has the CLI's own ``--timings`` (its phases then come
    from the command itself, as the current tree's do, rather than from BASELINE_PROBE)."""
    main = root / "train" / "__main__.py"
    return main.is_file() and '"--timings"' in main.read_text(encoding="utf-8")


def run_cli(root: Path, config: str, sets: list[str], log_dir: str, env: dict, probe: bool = False):
    """One ``python -m train ... --timings`` process from ``root`` (``probe``: an older
    tree's command under BASELINE_PROBE); returns wall and CPU seconds and the phases."""
    probe = probe and not has_timings(root)
    timings = Path(log_dir) / _run_name(root, config, sets) / "timings.json"
    head = [sys.executable, "-m", "train"]
    if probe:  # (the command's own run directory: the probe writes it after the command)
        head = [sys.executable, "-c", BASELINE_PROBE, str(timings)]
    cmd = [*head, "--config", f"configs/{config}.yaml", "--fresh"]
    cmd += [] if probe else ["--timings"]
    for s in [f"log.dir={log_dir}", *sets]:
        cmd += ["--set", s]
    cpu0, t_spawn = _children_cpu(), time.time()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    t_gone, cpu = time.time(), _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} (in {root}) failed:\n{proc.stderr[-3000:]}")
    t = json.loads(timings.read_text())
    return {"wall_s": t_gone - t_spawn, "cpu_s": cpu, "phases": breakdown(t, t_spawn, t_gone)}


def _run_name(root: Path, config: str, sets: list[str]) -> str:
    for s in sets:
        if s.startswith("name="):
            return s.split("=", 1)[1]
    import yaml

    return yaml.safe_load((root / "configs" / f"{config}.yaml").read_text())["name"]


def breakdown(t: dict, t_spawn: float, t_gone: float) -> dict[str, float]:
    """Seconds per column: the command's phases, with the interpreter start-up measured
    from the spawn and the exit up to the process's end."""
    phases = dict(t["phases"])
    phases["interpreter"] = t["t_main"] - t_spawn
    phases["exit"] = t_gone - t["t_end"]
    return phases


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished (and waited for) descendants:
    a sample's CPU time is the difference around it (the plot helper included)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_script(code: str, env: dict, what: str, *args: str) -> dict:
    """A peer's script (``code``, which prints its phases as JSON) as a fresh process with
    ``args``, timed like a command; ``what`` names it in an error."""
    cpu0, t_spawn = _children_cpu(), time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True
    )
    t_gone, cpu = time.time(), _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"the {what} script failed:\n{proc.stderr[-3000:]}")
    t = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": t_gone - t_spawn, "cpu_s": cpu, "phases": breakdown(t, t_spawn, t_gone)}


def parse_sets(items: list[str]) -> dict[str, list[str]]:
    sets: dict[str, list[str]] = {k: list(v) for k, v in DEFAULT_SETS.items()}
    for item in items:
        config, sep, kv = item.partition(":")
        if not sep or "=" not in kv:
            raise SystemExit(f"--set {item!r}: expected CONFIG:KEY=VALUE")
        sets.setdefault(config, []).append(kv)
    return sets


def summarize(samples: dict[str, list[dict]]) -> tuple[list[list[str]], dict]:
    """Table rows (median wall, min wall, median CPU time of the process tree, then the median
    of each phase) and the medians."""
    rows, med = [], {}
    for case, runs in samples.items():
        walls = [r["wall_s"] for r in runs]
        phases = {c: statistics.median(r["phases"].get(c, 0.0) for r in runs) for c in COLUMNS}
        has = {c for r in runs for c in r["phases"]}
        cpu = statistics.median(r["cpu_s"] for r in runs)
        med[case] = {"wall_s": statistics.median(walls), "min_wall_s": min(walls), "cpu_s": cpu}
        med[case].update(phases)
        cells = [f"{phases[c]:.2f}" if c in has else "" for c in COLUMNS]
        rows.append(
            [case, f"{statistics.median(walls):.2f}", f"{min(walls):.2f}", f"{cpu:.2f}", *cells]
        )
    return rows, med


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.cli_wall", description=__doc__.split("\n")[0]
    )
    ap.add_argument("configs", nargs="*", help=f"config names (default: {DEFAULT_CONFIGS})")
    ap.add_argument("--repeats", type=int, default=5, help="samples per row")
    ap.add_argument("--quick", action="store_true", help="one repeat")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="CONFIG:KEY=VAL",
        help="a --set for one config's command, e.g. shakespeare_gpt:train.steps=50 "
        f"(repeatable; defaults: {DEFAULT_SETS})",
    )
    ap.add_argument("--baseline", type=Path, help="another checkout to run the cold rows from")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-cache rows")
    ap.add_argument("--no-sklearn", action="store_true", help="skip scikit-learn's script")
    ap.add_argument("--no-raw-jax", action="store_true", help="skip the raw JAX script")
    ap.add_argument("--no-bytecode", action="store_true", help="no bytecode caches")
    ap.add_argument("--tiny", action="store_true", help="digits_mlp, 4 steps, once, cold")
    args = ap.parse_args(argv)
    if args.tiny:
        args.configs = args.configs or ["digits_mlp"]
        args.quick, args.no_warm, args.no_sklearn = True, True, True
        args.sets = [f"{c}:{kv}" for c in args.configs for kv in TINY_SETS] + args.sets
    args.configs = args.configs or [
        c for c in DEFAULT_CONFIGS if (ROOT / f"configs/{c}.yaml").exists()
    ]
    for c in args.configs:
        if not (ROOT / f"configs/{c}.yaml").exists():
            raise SystemExit(f"no configs/{c}.yaml")
    return args


def make_cases(args, sets: dict[str, list[str]], tmp: str) -> dict:
    """Each row's sample: a function that runs one fresh process and returns its times."""
    bytecode = not args.no_bytecode
    cold_env = child_env(None, bytecode)
    cases = {}  # name -> () -> sample
    for c in args.configs:
        s, log = sets.get(c, []), str(Path(tmp) / "runs")
        warm_env = child_env(str(Path(tmp) / f"jax-cache-{c}"), bytecode)
        cases[f"{c} cold"] = lambda c=c, s=s, log=log: run_cli(ROOT, c, s, log, cold_env)
        if not args.no_warm:
            cases[f"{c} warm"] = lambda c=c, s=s, log=log, e=warm_env: run_cli(ROOT, c, s, log, e)
        if args.baseline is not None:
            base_log = str(Path(tmp) / "base-runs")
            cases[f"{c} cold ({args.baseline})"] = lambda c=c, s=s, log=base_log: run_cli(
                args.baseline, c, s, log, cold_env, probe=True
            )
    if not args.no_sklearn:
        cases[SKLEARN] = lambda: run_script(SKLEARN_SCRIPT, cold_env, SKLEARN)
    if not args.no_raw_jax:  # the digits job's steps, as the (first) digits config runs it
        digits = next((c for c in args.configs if c.startswith("digits")), None)
        raw_steps = _config_steps(digits, sets.get(digits, [])) if digits else 1500
        cases[RAW_JAX] = lambda: run_script(RAW_JAX_SCRIPT, cold_env, "raw JAX", str(raw_steps))
    return cases


def print_ratios(configs: list[str], med: dict) -> None:
    """The digits rows against scikit-learn's script and the raw JAX script."""
    for c in (c for c in configs if c.startswith("digits") and f"{c} cold" in med):
        if SKLEARN in med:
            ratios = [
                f"{m}: {med[f'{c} {m}']['wall_s'] / med[SKLEARN]['wall_s']:.2f}x"
                for m in ("cold", "warm")
                if f"{c} {m}" in med
            ]
            print(f"\n{c} / scikit-learn's script: {', '.join(ratios)}")
        if RAW_JAX in med:
            ratio = med[f"{c} cold"]["wall_s"] / med[RAW_JAX]["wall_s"]
            cpu = med[f"{c} cold"]["cpu_s"] / med[RAW_JAX]["cpu_s"]
            print(f"\n{c} cold / the raw JAX script: {ratio:.2f}x wall, {cpu:.2f}x CPU")


def main(argv=None) -> int:
    args = parse_args(argv)
    sets = parse_sets(args.sets)
    repeats = 1 if args.quick else args.repeats
    info = h.machine_info()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"machine: {info['cpu']}, {info['affinity']} usable cores; load average {load}")
    with tempfile.TemporaryDirectory(prefix="cli_wall-") as tmp:
        cases = make_cases(args, sets, tmp)
        # Untimed: bytecode caches, the warm rows' compilation caches, the OS's file cache
        # (--tiny: one timed sample, cold, is the smoke run).
        for fn in [] if args.tiny else cases.values():
            fn()
        samples = h.repeat_shuffled(cases, repeats)
    rows, med = summarize(samples)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"\nWall time of the whole command, fresh process (median of {repeats}; seconds; "
        f"load average before {_fmt_load(load)}, after {_fmt_load(load_after)})\n"
    )
    print(h.table(rows, ["command", "median wall", "min wall", "CPU", *COLUMNS]))
    print_ratios(args.configs, med)
    path = h.write_json(
        "cli_wall-tiny" if args.tiny else "cli_wall",
        {
            "machine": info,
            "load_before": load,
            "load_after": load_after,
            "repeats": repeats,
            "bytecode": not args.no_bytecode,
            "medians": med,
            "samples": samples,
        },
    )
    print(f"\nwrote {path}")
    return 0


def _config_steps(config: str, sets: list[str]) -> int:
    """``train.steps`` of ``configs/CONFIG.yaml`` with ``sets`` applied."""
    for kv in reversed(sets):
        if kv.startswith("train.steps="):
            return int(kv.split("=", 1)[1])
    import yaml

    return int(yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())["train"]["steps"])


def _fmt_load(load) -> str:
    return "n/a" if load is None else "/".join(f"{x:.1f}" for x in load)


if __name__ == "__main__":
    sys.exit(main())
