"""``nnlite-train lr-find --config FILE [--set key=value ...] [--min-lr LR] [--max-lr LR]
[--steps N] [--out DIR]``: an LR range test, and a suggested learning rate.

The run's model, data, optimizer and parallel strategy, trained from their initial state
for up to ``--steps`` steps while the learning rate grows exponentially from ``--min-lr``
to ``--max-lr`` (Smith 2015; fastai's and Lightning's ``lr_find``). Each step's training
loss is smoothed by an exponential moving average (``--smoothing``, bias-corrected); the
test stops once the smoothed loss passes ``--diverge`` times its minimum, or a loss is not
finite. It writes, into ``<log.dir>/<name>_lr_find/`` (or ``--out``): ``config.yaml``,
``lr_find.csv`` and ``lr_find.json`` (every step's learning rate, loss and smoothed loss,
and the suggestions) and ``lr_find.png`` (when matplotlib is installed), and prints the
suggested learning rate: by default where the smoothed loss falls fastest against
log(lr) (``--suggest steepest``), or the learning rate of its minimum divided by 10
(``--suggest min10``); both are printed and recorded.

The optimizer is the config's with its learning rate replaced by the range: a named
optimizer takes the range as its learning-rate schedule (its ``schedule`` and
``learning_rate`` are set aside); a factory ``module:function`` is built with
``learning_rate=1.0`` and its updates are scaled by the range (the same for any optimizer
whose update is proportional to its learning rate, as optax's are). Nothing is
checkpointed and the run's own directory is not touched. Bad arguments are one line and
exit 2.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import faults
from .config import ArgumentParser, OptimizerConfig, dump_yaml, load_config
from .data import overfit
from .data.feed import BatchFeed, call_schedule
from .errors import ConfigError, missing_extra
from .loop.build import build, prepare
from .optim import GIVEN
from .optim.named import accepted, chained, rule_call, rule_parts
from .parallel import distributed as dist
from .report.plot import plot_lr_find
from .step.step import to_host

SUGGESTIONS = {
    "steepest": "steepest descent of the smoothed loss",
    "min10": "the smoothed loss's minimum / 10",
}


def parse_args(argv):
    ap = ArgumentParser(
        prog="nnlite-train lr-find",
        description="An LR range test: train with an exponentially growing learning rate, "
        "plot the loss against it and suggest a learning rate.",
    )
    ap.add_argument(
        "--config",
        required=True,
        help="YAML config file (the checkout's configs/ has the shipped ones)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.batch_size=64 (repeatable)",
    )
    ap.add_argument("--min-lr", type=float, default=1e-7, help="first learning rate (1e-7)")
    ap.add_argument("--max-lr", type=float, default=10.0, help="last learning rate (10)")
    ap.add_argument("--steps", type=int, default=200, help="steps from min to max (200)")
    ap.add_argument(
        "--smoothing",
        type=float,
        default=0.98,
        help="weight of the moving average of the loss (0.98; 0: none)",
    )
    ap.add_argument(
        "--diverge",
        type=float,
        default=4.0,
        help="stop once the smoothed loss passes this many times its minimum (4)",
    )
    ap.add_argument(
        "--suggest",
        choices=tuple(SUGGESTIONS),
        default="steepest",
        help="which learning rate to suggest: steepest (default) or min10",
    )
    ap.add_argument("--out", default=None, help="output directory (<log.dir>/<name>_lr_find)")
    args = ap.parse_args(argv)
    for flag, v in (("--min-lr", args.min_lr), ("--max-lr", args.max_lr)):
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be a finite learning rate > 0, got {v}")
    if args.min_lr >= args.max_lr:
        raise ConfigError(f"--min-lr ({args.min_lr:g}) must be below --max-lr ({args.max_lr:g})")
    if args.steps < 2:
        raise ConfigError(f"--steps must be >= 2, got {args.steps}")
    if not 0.0 <= args.smoothing < 1.0:
        raise ConfigError(f"--smoothing must be in [0, 1), got {args.smoothing}")
    if not (math.isfinite(args.diverge) and args.diverge > 1.0):
        raise ConfigError(f"--diverge must be a finite number > 1, got {args.diverge}")
    return args


def lr_at(step: int, min_lr: float, max_lr: float, steps: int) -> float:
    """The learning rate of step ``step`` (0-based) of the range."""
    return min_lr * (max_lr / min_lr) ** (step / (steps - 1))


def range_schedule(min_lr: float, max_lr: float, steps: int):
    """The range as an optax schedule: ``count -> min_lr * (max_lr/min_lr)^(count/(steps-1))``."""

    log_ratio = math.log(max_lr / min_lr)
    return lambda count: min_lr * jnp.exp(log_ratio * jnp.minimum(count, steps - 1) / (steps - 1))


def range_optimizer(ocfg, schedule):
    """The config's optimizer with ``schedule`` for its learning rate (module docstring)."""

    where = f"optimizer.name={ocfg.name}"
    if ocfg.name == GIVEN:
        raise ConfigError(
            f"lr_find: {where} stands for an object given to train.fit(optimizer=...); name "
            "the optimizer in the config (optimizer.name: adam, or a 'module:function' factory)"
        )
    if ":" in ocfg.name:
        if "learning_rate" not in accepted(rule_call(ocfg, None)[0], {"learning_rate": 1.0}):
            raise ConfigError(
                f"lr_find: {where} takes no learning_rate argument, so the range test cannot "
                "set its learning rate; give your factory a learning_rate parameter"
            )
        unit = dataclasses.replace(ocfg, options={**ocfg.options, "learning_rate": 1.0})
        parts = [*rule_parts(unit, None), optax.scale_by_schedule(schedule)]
    else:
        parts = rule_parts(ocfg, schedule)
    if ocfg.clip_norm is not None:
        parts = [optax.clip_by_global_norm(ocfg.clip_norm), *parts]
    return chained(parts)


class Smoother:
    """The bias-corrected exponential moving average of the loss, and the stop rule."""

    def __init__(self, beta: float, diverge: float):
        self.beta, self.diverge = beta, diverge
        self.avg, self.n, self.best = 0.0, 0, math.inf

    def add(self, loss: float) -> tuple[float, str | None]:
        """The smoothed loss after ``loss``, and why to stop (None: go on)."""
        if not math.isfinite(loss):
            return math.nan, f"the loss is {loss}"
        self.n += 1
        self.avg = self.beta * self.avg + (1 - self.beta) * loss
        smoothed = self.avg / (1 - self.beta**self.n)
        self.best = min(self.best, smoothed)
        if self.n > 1 and smoothed > self.diverge * self.best:
            return smoothed, (
                f"the smoothed loss {smoothed:.4g} passed {self.diverge:g} x its minimum "
                f"{self.best:.4g}"
            )
        return smoothed, None


def suggestions(points: list[dict]) -> dict[str, float]:
    """``{"steepest": lr, "min10": lr}`` (those the points allow) from the smoothed loss.

    The first tenth of the points (at most 10) are left out: the moving average is still
    settling there. steepest: the middle of the window (a tenth of the points) over which
    the smoothed loss falls fastest against log(lr), on the way down to its minimum; min10: the learning rate of that minimum / 10."""

    lrs = np.array([p["lr"] for p in points])
    smooth = np.array([p["smoothed_loss"] for p in points])
    ok = np.isfinite(smooth)
    lrs, smooth = lrs[ok], smooth[ok]
    out: dict[str, float] = {}
    skip = min(10, len(smooth) // 10)  # the moving average is still settling there
    if len(smooth) <= skip:
        return out
    lowest = skip + int(np.argmin(smooth[skip:]))
    out["min10"] = float(lrs[lowest] / 10)
    # On the way down to the minimum (past it, the loss of a diverging run jumps about),
    # each slope over a window of a tenth of the points: a step's noise is not a descent.
    w = max(1, len(smooth) // 10)
    xs, ys = np.log(lrs[skip : lowest + 1]), smooth[skip : lowest + 1]
    if len(ys) > w:
        slopes = (ys[w:] - ys[:-w]) / (xs[w:] - xs[:-w])
        i = int(np.argmin(slopes))
        if slopes[i] < 0:
            out["steepest"] = float(np.sqrt(lrs[skip + i] * lrs[skip + i + w]))
    return out


def find(cfg, args, echo=print) -> dict:
    """Run the range test for ``cfg``; return its record (what lr_find.json holds)."""

    steps = args.steps
    dist.initialize(cfg.distributed)
    opt = range_optimizer(cfg.optimizer, range_schedule(args.min_lr, args.max_lr, steps))
    run_cfg = dataclasses.replace(
        cfg,
        optimizer=OptimizerConfig(name=GIVEN),
        train=dataclasses.replace(cfg.train, steps=steps),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
    )
    r = build(run_cfg, optimizer=opt)
    sampler = overfit.run_sampler(run_cfg, r.data)
    k = cfg.train.steps_per_call
    calls = list(call_schedule(0, steps, lambda s: min(k - s % k, steps - s)))
    prep = prepare(r, "stop", dist.process_share(sampler.batches(*calls[0])))
    stepper = prep.stepper
    state = [stepper.put_state(jax.tree.leaves(t)) for t in (prep.params0, prep.opt0)]
    s_leaves = stepper.put_state(jax.tree.leaves(prep.state0))
    echo(
        f"lr_find: {cfg.name}: up to {steps} steps, learning rate {args.min_lr:.3g} -> "
        f"{args.max_lr:.3g} (exponential), optimizer {cfg.optimizer.name}, model "
        f"{cfg.model.name} ({prep.params0.num_params():,} params), "
        f"{len(r.devices)} x {r.devices[0].platform} ({r.strategy.describe()}), data "
        f"{r.data.name}, batch {cfg.train.batch_size}"
    )
    feed = BatchFeed(r.data, sampler, stepper, iter(calls)) if r.data.streamed else None
    smoother = Smoother(args.smoothing, args.diverge)
    points: list[dict] = []
    stop: str | None = None

    def read(first: int, metrics) -> str | None:
        losses = to_host(metrics["loss"])
        for i, loss in enumerate(losses.reshape(-1, losses.shape[-1])[0]):
            step = first + i
            smoothed, why = smoother.add(float(loss))
            lr = lr_at(step, args.min_lr, args.max_lr, steps)
            points.append({"step": step, "lr": lr, "loss": float(loss), "smoothed_loss": smoothed})
            if why:
                return why
        return None

    p_leaves, o_leaves = state
    pending = None
    try:
        for step, n in calls:
            if feed is not None:
                batch = feed.get(step, n)
            else:
                batch = stepper.put_indices(dist.process_share(sampler.batches(step, n)), step)
            p_leaves, o_leaves, s_leaves, metrics = stepper.run(
                p_leaves, o_leaves, s_leaves, prep.X, prep.Y, batch
            )
            if pending is not None and (stop := read(*pending)):  # the call before: no wait
                break
            pending = (step, metrics)
        else:
            stop = read(*pending)
    finally:
        if feed is not None:
            feed.close()
    found = suggestions(points)
    last = points[-1]
    return {
        "min_lr": args.min_lr,
        "max_lr": args.max_lr,
        "steps": steps,
        "smoothing": args.smoothing,
        "diverge": args.diverge,
        "steps_run": len(points),
        "stopped": None if stop is None else {"step": last["step"], "lr": last["lr"], "why": stop},
        "suggest": args.suggest,
        "suggested_lr": found.get(args.suggest),
        "suggestions": found,
        "points": points,
    }


def write(out: Path, cfg, record: dict) -> list[str]:
    """config.yaml, lr_find.csv, lr_find.json and lr_find.png in ``out``; the names
    written (and a note for a plot that could not be drawn)."""

    out.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, ["step", "lr", "loss", "smoothed_loss"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(record["points"])
    files = {
        "config.yaml": dump_yaml(cfg),
        "lr_find.csv": buffer.getvalue(),
        "lr_find.json": json.dumps(_json_safe(record), indent=1) + "\n",
    }
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    written = list(files)
    marks = {SUGGESTIONS[k].split(" of")[0]: v for k, v in record["suggestions"].items()}
    try:
        plot_lr_find(record["points"], out / "lr_find.png", f"lr_find: {cfg.name}", marks)
        written.append("lr_find.png")
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        written.append("no plot: matplotlib is not installed (pip install matplotlib)")
    return written


def _json_safe(v):
    """Non-finite floats as null (strict JSON, as metrics.jsonl writes them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)

        cfg = load_config(args.config, args.overrides)
        out = Path(args.out) if args.out else Path(cfg.log.dir) / f"{cfg.name}_lr_find"
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {str(out)!r} is a file; give a directory")
        record = find(cfg, args)

        if not dist.is_main():
            return 0
        written = write(out, cfg, record)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    except ImportError as e:
        if missing_extra(e) is None:
            raise
        print(f"error: {missing_extra(e)}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT
    stopped = record["stopped"]
    if stopped:
        print(
            f"lr_find: stopped at step {stopped['step']} of {record['steps']} (lr "
            f"{stopped['lr']:.3g}): {stopped['why']}"
        )
    else:
        print(
            f"lr_find: ran all {record['steps']} steps; the smoothed loss stayed below "
            f"{record['diverge']:g} x its minimum"
        )
    found = record["suggestions"]
    others = ", ".join(f"{SUGGESTIONS[k]}: {v:.3g}" for k, v in found.items() if k != args.suggest)
    print(f"wrote {out}/: {', '.join(written)}")
    lr = record["suggested_lr"]
    if lr is None:
        print(
            f"error: lr_find: the smoothed loss fell over too few steps ({record['steps_run']} "
            f"run) to suggest a learning rate by {SUGGESTIONS[args.suggest]}; widen the range "
            f"(--min-lr {args.min_lr:g}, --max-lr {args.max_lr:g}) or raise --steps"
            + (f" ({others})" if others else ""),
            file=sys.stderr,
        )
        return faults.EXIT_BAD_INPUT
    print(
        f"suggested learning rate: {lr:.3g} ({SUGGESTIONS[args.suggest]})"
        + (f"; {others}" if others else "")
        + f"; train with --set optimizer.learning_rate={lr:.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
