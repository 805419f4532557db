"""The training loop: build everything from the config, train, evaluate, checkpoint, log."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import models

from . import checkpoint as ckpt
from . import distributed as dist
from . import faults, memory
from .config import Config, ConfigError, dump_yaml, to_dict
from .data import Dataset, host_batch, load_dataset, make_sampler
from .optim import build_optimizer
from .plot import plot_curves as plot_curves  # noqa: F401 - its old home
from .step import (
    batch_grads_fn,
    build_split_eval,
    build_stepper,
    compile_async,
    mean_loss_fn,
    step_flags,
    to_host,
    uses_key,
)
from .timings import Timings

# Keys in metrics.jsonl that measure time; everything else is deterministic.
TIMING_KEYS = ("time", "examples_per_s", "tokens_per_s")
# Short names of metrics on the progress bar.
BAR_NAMES = {"loss": "loss", "accuracy": "acc", "bits_per_char": "bpc"}
# Examples evaluated per chunk of a windowed (text) split: 32k tokens, e.g. 512 windows of
# 64, so evaluating thousands of windows never holds all their activations at once.
EVAL_TOKENS_PER_CHUNK = 2**15
# Config sections that must match a checkpoint being resumed (train.steps may grow).
RESUME_MUST_MATCH = ("seed", "model", "data", "loss", "optimizer")


@dataclass
class Run:
    """What the loop built from the config (also handy in tests and benchmarks)."""

    cfg: Config
    data: Dataset
    model: object
    optimizer: object
    devices: list
    run_dir: Path
    params: object = None  # final params (host numpy leaves in a ParamsDict)
    opt_state: object = None
    step: int = 0
    summary: dict = field(default_factory=dict)


def select_devices(cfg: Config) -> list:
    """The devices to train on: ``parallel.devices`` per process, of every process."""
    local = jax.local_devices()
    if cfg.parallel.strategy == "none":
        if dist.is_multiprocess():
            raise ConfigError(
                f"parallel.strategy=none trains on one device, but this run has "
                f"{jax.process_count()} processes; use pmap or shard_map"
            )
        return local[:1]
    want = len(local) if cfg.parallel.devices == "all" else cfg.parallel.devices
    if want > len(local):
        raise ConfigError(f"parallel.devices={want} but only {len(local)} local devices exist")
    n = want * jax.process_count()
    if cfg.train.batch_size % n:
        lo = cfg.train.batch_size // n * n
        options = [b for b in (lo, lo + n) if b > 0]
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} does not split across {n} devices; "
            f"use a multiple of {n}, e.g. {' or '.join(map(str, options))}"
        )
    return dist.global_devices(want)


def build(cfg: Config, data: Dataset | Future | None = None, timings: Timings | None = None) -> Run:
    """Data, model, optimizer and devices for ``cfg``; raises ConfigError on bad input.

    ``data``: the data set if already loaded, or a Future of it (``python -m train`` loads
    it while JAX imports); None loads it here.
    """
    timings = timings or Timings()
    devices = select_devices(cfg)
    timings.lap("backend")
    if data is None:
        data = load_dataset(cfg.data, context=cfg.model.context)
    elif isinstance(data, Future):
        data = data.result()
    timings.lap("data")
    try:
        model = models.MODELS[cfg.model.name](cfg.model, data)
    except ValueError as e:  # a model config that does not fit the data (e.g. cnn lengths)
        raise ConfigError(str(e)) from None
    if model.task != data.task:
        raise ConfigError(
            f"model.name={cfg.model.name} is a {model.task} model but data.name={cfg.data.name} "
            f"is a {data.task} data set"
        )
    if cfg.loss.grad == "fused" and "fused" not in model.grad_modes:
        # manual works for any model built from nnlite layers; fused is one hand-written
        # backward pass for one model shape.
        raise ConfigError(
            f"loss.grad=fused is not available for model.name={cfg.model.name}; it is a "
            f"hand-written pass of model.name={'/'.join(models.FUSED)} only; use loss.grad="
            "manual (every layer's hand-derived VJP) or autodiff"
        )
    local_batch = cfg.train.batch_size // len(devices)
    if local_batch % cfg.train.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={cfg.train.grad_accum_steps} does not divide the per-device "
            f"batch of {local_batch} (train.batch_size={cfg.train.batch_size} over {len(devices)} "
            f"device(s)); use a divisor of {local_batch}"
        )
    optimizer = build_optimizer(cfg.optimizer, cfg.train.steps)
    # Before anything is allocated: refuse what cannot fit, naming the key.
    memory.check_fits(
        cfg, model, optimizer, data, len(devices) // jax.process_count(), len(devices)
    )
    run_dir = Path(cfg.log.dir) / cfg.name
    return Run(cfg, data, model, optimizer, devices, run_dir)


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that cannot be written as a run needs it, before anything
    is written (a file where a directory must be, a directory that is read-only)."""
    log_dir = run_dir.parent
    expected = {
        log_dir: "a directory (log.dir)",
        run_dir: "the run directory (log.dir/name)",
        run_dir / "checkpoints": "the checkpoint directory",
    }
    for path, what in expected.items():
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path} is a file, but it must be {what}; move it away")
    for name in ("metrics.jsonl", "config.yaml", "curves.png"):
        if (run_dir / name).is_dir():
            raise ConfigError(f"{run_dir / name} is a directory, but the run writes a file there")
    existing = next(p for p in (run_dir / "checkpoints", run_dir, *run_dir.parents) if p.exists())
    for path in {existing, *(p for p in (run_dir, run_dir / "checkpoints") if p.exists())}:
        _probe_writable(path)


def _probe_writable(directory: Path) -> None:
    """Create and remove a file in ``directory`` (what counts, for root and read-only
    mounts alike, is whether a write works)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".nnlite-probe-")
    except OSError as e:
        raise ConfigError(
            f"cannot write in {directory} ({e.strerror}); the run needs it writable (log.dir)"
        ) from None
    os.close(fd)
    os.unlink(name)


def make_stepper(r: Run, p_def, o_def, nonfinite: str):
    """The compiled train step that ``r.cfg`` describes (strategy, grad mode, accumulation)."""
    cfg = r.cfg
    strategy = cfg.parallel.strategy
    grads_fn = batch_grads_fn(r.model, cfg.loss.grad, cfg.train.grad_accum_steps, strategy)
    return build_stepper(
        grads_fn,
        r.optimizer,
        p_def,
        o_def,
        strategy,
        r.devices,
        nonfinite,
        window=r.data.window,
        key_seed=cfg.seed if uses_key(r.model) else None,
    )


def show_jaxpr(cfg: Config, what: str) -> str:
    """Decompiled Python of the config's mean loss (``what="loss"``) or its compiled train step."""
    import nnlite as nl

    if what == "grad":
        return show_grad(cfg)
    fn, args = traced_function(cfg, what)
    return nl.show_jaxpr(fn, *args, name=what)


def show_grad(cfg: Config) -> str:
    """The config's backward pass as Python: each layer's hand VJP call, in reverse order
    (``nnlite.show_grad``), on a batch of up to 4 examples (the code is the same for any
    batch size but for the literal shapes)."""
    import nnlite as nl

    r = build(cfg)
    params = r.model.init(jax.random.key(cfg.seed))
    b = min(cfg.train.batch_size, 4)
    x, y = host_batch(r.data, np.arange(b) % r.data.num_indices)
    if uses_key(r.model):
        key = jax.random.key(cfg.seed)

        def loss(params, x, y):
            return r.model.objective(params, x, y, grad="manual", key=key)[0]
    else:

        def loss(params, x, y):
            return r.model.objective(params, x, y, grad="manual")[0]

    return nl.show_grad(loss, params, jnp.asarray(x), jnp.asarray(y))


def traced_function(cfg: Config, what: str) -> tuple:
    """``(fn, args)``: what ``show_jaxpr(cfg, what)`` decompiles, and its example arguments.

    For ``what="step"``, ``fn`` is the compiled multi-step function of the config's
    strategy and ``args`` are placed as training places them (its params and optimizer
    state are donated: pass copies to call it more than once).
    """
    r = build(cfg)
    params = r.model.init(jax.random.key(cfg.seed))
    loss_fn = mean_loss_fn(r.model, cfg.loss.grad)
    b = cfg.train.batch_size
    if what == "loss":
        x, y = host_batch(r.data, np.arange(b) % r.data.num_indices)
        return (lambda p, x, y: loss_fn(p, x, y)[0]), (params, x, y)
    opt_state = r.optimizer.init(params)
    p_leaves, p_def = jax.tree.flatten(params)
    o_leaves, o_def = jax.tree.flatten(opt_state)
    stepper = make_stepper(r, p_def, o_def, cfg.train.nonfinite)
    idx = np.zeros((cfg.train.steps_per_call, b), np.int32)
    return stepper.run, (
        stepper.put_state(p_leaves),
        stepper.put_state(o_leaves),
        stepper.put_data(r.data.x),
        stepper.put_data(r.data.y),
        stepper.put_indices(idx, 0),
    )


def _metadata(cfg: Config, data: Dataset, step: int, sampler, skipped: int) -> dict:
    order = "[seed, step]" if data.window else "[seed, epoch]"
    meta = {
        "data_position": sampler.position(step),
        "rng": {"init_seed": cfg.seed, "data_order": f"numpy default_rng({order})"},
        "config": to_dict(cfg),
        "skipped_steps": str(skipped),
    }
    if data.vocab is not None:  # what sampling needs to turn ids back into text
        meta["vocab"] = json.dumps(data.vocab)
    return meta


def _check_resumable(cfg: Config, meta: dict, path: Path) -> None:
    try:
        saved = json.loads(meta.get("config", "{}"))
    except json.JSONDecodeError:
        raise ConfigError(f"checkpoint {path}: its config metadata is not valid JSON") from None
    now = to_dict(cfg)
    for section in RESUME_MUST_MATCH:
        was, is_ = saved.get(section), now[section]
        if was == is_:
            continue
        key, was_v, is_v = section, was, is_
        if isinstance(was, dict):
            key = next(f"{section}.{k}" for k in is_ if was.get(k) != is_[k])
            was_v, is_v = was.get(key.split(".")[1]), is_[key.split(".")[1]]
        raise ConfigError(
            f"checkpoint {path} was written with {key}={was_v!r} but the config has {key}={is_v!r}; "
            "use --fresh to start over, or another run name"
        )


def init_state(model, optimizer, key):
    """Initial ``(params, opt_state)``."""
    params = model.init(key)
    return params, optimizer.init(params)


# Init runs once, so compile it fast rather than well: threefry and erf_inv make LLVM's
# default optimisation cost ~1.1 s for the digits MLP's init, 0.2 s at level 0, and 0.1 s
# without XLA's fusion emitters as well (the same values, bit for bit, as level 0 alone).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def init_program(model, optimizer):
    """``init_state`` as one jitted program, ``seed -> (params, opt_state)`` with the key
    ``jax.random.key(seed)``. Run eagerly, each random/initializer op (the key's creation
    too) compiles a tiny XLA program of its own (2.5 s in all for the digits MLP, vs 0.1 s)."""

    def init(seed):
        return init_state(model, optimizer, jax.random.key(seed))

    return jax.jit(init, compiler_options=INIT_COMPILER_OPTIONS)


def init_state_compiled(model, optimizer, seed: int):
    """``init_state`` for ``jax.random.key(seed)``, run as one compiled program."""
    return init_program(model, optimizer)(seed)


@dataclass
class Prepared:
    """What a run computes with, compiled and placed (see :func:`prepare`)."""

    params0: object  # initial params and optimizer state, host copies
    opt0: object
    stepper: object  # train.step.Stepper
    evaluate: object  # jitted (params, X, Y) -> metrics
    X: object  # the train split, placed for the stepper
    Y: object
    X_test: object  # the test split, on eval_device
    Y_test: object
    eval_device: object

    @property
    def p_def(self):
        return jax.tree.structure(self.params0)

    @property
    def o_def(self):
        return jax.tree.structure(self.opt0)


def prepare(r: Run, nonfinite: str, first_indices: np.ndarray) -> Prepared:
    """The initial state, the train step and the evaluation, compiled side by side.

    A small model's cold start is compile time: for the digits MLP ~0.3 s of XLA for the
    step, ~0.1 s each for init and eval, against a few ms of training per 50 steps. XLA
    compiles with the GIL released, so each program is traced and lowered here and
    compiled on a worker thread: the step compiles while init is traced, compiled and run
    and the eval is traced. The step is traced for init's output *types* placed as
    ``put_state`` places them (the key of jit's caches) and for ``first_indices`` (this
    process's ``[K, batch]`` indices of the first call), so the loop's first call finds it
    compiled (other call sizes compile on first use).
    """
    cfg = r.cfg
    seed = np.int32(cfg.seed)
    init = init_program(r.model, r.optimizer).trace(seed)
    p_avals, o_avals = init.out_info
    p_def, o_def = jax.tree.structure(p_avals), jax.tree.structure(o_avals)
    stepper = make_stepper(r, p_def, o_def, nonfinite)
    X, Y = stepper.put_data(r.data.x), stepper.put_data(r.data.y)
    eval_dev = jax.local_devices()[0]
    X_test, Y_test = (
        jax.device_put(r.data.x_test, eval_dev),
        jax.device_put(r.data.y_test, eval_dev),
    )
    chunk = len(r.data.x_test)  # example data sets: one pass over the whole split
    if r.data.window is not None:
        chunk = max(1, EVAL_TOKENS_PER_CHUNK // r.data.window)
    evaluate = build_split_eval(r.model, chunk)
    on_eval_dev = jax.sharding.SingleDeviceSharding(eval_dev)
    eval_params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_eval_dev), p_avals
    )
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="nnlite-compile") as pool:
        jobs = []
        p_abs = stepper.abstract_state(jax.tree.leaves(p_avals))
        if p_abs is not None:  # pmap compiles on its first call
            o_abs = stepper.abstract_state(jax.tree.leaves(o_avals))
            idx = stepper.put_indices(first_indices, 0)
            jobs.append(compile_async(pool, stepper.run, p_abs, o_abs, X, Y, idx))
        init_job = compile_async(pool, init)
        jobs.append(compile_async(pool, evaluate, eval_params, X_test, Y_test))
        # Host copies: the step donates its inputs, and these are needed again (resume, replay).
        params0, opt0 = jax.device_get(init_job.result()(seed))
        for job in jobs:
            job.result()  # the first calls must find them compiled, not compile them again
    return Prepared(params0, opt0, stepper, evaluate, X, Y, X_test, Y_test, eval_dev)


def boundaries(cfg: Config) -> list[int]:
    """The cadences (in steps) at which the loop stops to log, evaluate or checkpoint."""
    tc = cfg.train
    return [tc.eval_every, tc.log_every] + ([cfg.checkpoint.every] if cfg.checkpoint.every else [])


def steps_in_call(cfg: Config, step: int, every: list[int]) -> int:
    """How many steps the call starting at ``step`` runs: up to ``train.steps_per_call``,
    stopping at the next boundary (``every``: :func:`boundaries`) or the end."""
    tc = cfg.train
    k = tc.steps_per_call - step % tc.steps_per_call
    nxt = min([tc.steps] + [(step // e + 1) * e for e in every])
    return min(k, nxt - step)


def _read_metrics(path: Path) -> list[tuple[str, dict]]:
    """``(line, record)`` for each complete line of metrics.jsonl; a torn last line (a kill
    mid-write) is dropped."""
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append((ln, json.loads(ln)))
        except json.JSONDecodeError:
            continue  # only a write cut short by a kill leaves a line like this
    return out


def _rewrite_metrics(path: Path, upto_step: int) -> None:
    """Drop metrics logged after ``upto_step`` (they will be logged again) and torn lines."""
    if not path.exists():
        return
    kept = [ln for ln, record in _read_metrics(path) if record["step"] <= upto_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def _load_checkpoint(cfg, path: Path, params0, opt0):
    """(step, param leaves, opt leaves, skipped steps) from ``path``, checked against ``cfg``."""
    params_h, opt_h, meta = ckpt.restore(path, params0, opt0)
    _check_resumable(cfg, meta, path)
    start = int(meta["step"])
    if start > cfg.train.steps:
        raise ConfigError(
            f"checkpoint {path} is at step {start}, past train.steps={cfg.train.steps}"
        )
    skipped = int(meta.get("skipped_steps", "0"))
    return start, jax.tree.leaves(params_h), jax.tree.leaves(opt_h), skipped


def _agree_on_start(cfg, resume: str, ckpt_dir: Path, params0, opt0):
    """Process 0 picks the starting state (latest checkpoint or init); all processes get it.

    Only process 0 reads the run directory, so hosts need no shared file system. A bad
    checkpoint or an unwritable run directory raises ConfigError on every process
    (process 0 says why).
    """
    p_leaves, o_leaves = jax.tree.leaves(params0), jax.tree.leaves(opt0)
    start, skipped, path, error = 0, 0, None, None
    if dist.is_main():
        try:
            check_run_dir(ckpt_dir.parent)  # before anything is written
            existing = [] if resume == "fresh" else ckpt.list_checkpoints(ckpt_dir)
            if resume == "require" and not existing:
                raise ConfigError(f"--resume: no checkpoint in {ckpt_dir}")
            if existing:
                path = existing[-1]
                start, p_leaves, o_leaves, skipped = _load_checkpoint(cfg, path, params0, opt0)
        except ConfigError as e:
            error = e
    if not dist.is_multiprocess():
        if error is not None:
            raise error
        return start, p_leaves, o_leaves, skipped, path
    head = dist.broadcast(np.array([start, skipped, error is not None], np.int32))
    if head[2]:
        raise error or ConfigError("process 0 could not resume this run (see its output)")
    start, skipped = int(head[0]), int(head[1])
    p_leaves, o_leaves = dist.broadcast((p_leaves, o_leaves))
    return start, p_leaves, o_leaves, skipped, path


def train(
    cfg: Config,
    *,
    resume: str = "auto",
    echo=print,
    timings: Timings | None = None,
    plotter=None,
    data: Dataset | Future | None = None,
) -> Run:
    """Train per ``cfg``. ``resume``: "auto" (latest checkpoint if any), "require", "fresh".

    Raises ConfigError on bad input, ``faults.Preempted`` after a SIGTERM/SIGINT checkpoint
    and ``faults.NonFinite`` when a step goes non-finite with ``train.nonfinite=stop``.

    ``timings`` (train/timings.py) collects where the time goes; ``plotter`` (a
    ``train.plot.CurvePlotter``) draws curves.png in its helper process, and the caller
    waits for it (without one, the run draws it before returning); ``data``: see
    :func:`build`.

    The skeleton: build and compile; agree on the starting state (checkpoint or init)
    before writing anything; then one compiled call after another, stopping at the
    boundaries to log, evaluate and checkpoint (each a method of :class:`_Loop`).
    """
    dist.initialize(cfg.distributed)  # before anything touches a device
    if not dist.is_main():
        echo = _quiet
    timings = timings or Timings()
    r = build(cfg, data, timings)
    loop = _Loop.begin(r, resume, echo, timings, plotter)
    if loop.step >= cfg.train.steps:
        return loop.already_finished()
    try:
        with loop.watch, loop.watchdog:
            while loop.step < cfg.train.steps:
                loop.run_call()
                at = loop.boundary()
                if at is None:
                    continue
                loop.check_nonfinite()
                if at.log:
                    loop.log_train()
                if at.eval:
                    loop.evaluate()
                if at.checkpoint or at.stop:
                    loop.checkpoint()
                if at.stop:
                    raise faults.Preempted(loop.step, loop.good_ckpt, loop.watch.signal_name)
    finally:
        loop.close()
    return loop.finish()


@dataclass(frozen=True)
class Boundary:
    """What the loop does after the call that ended at a step."""

    log: bool
    eval: bool
    checkpoint: bool
    stop: bool  # a SIGTERM/SIGINT was agreed on: checkpoint and leave


@dataclass
class _Loop:
    """The state of a training run between compiled calls, and its named steps."""

    r: Run
    prep: Prepared
    sampler: object  # train.data.BatchIndices or WindowIndices
    echo: object
    step: int  # steps done
    p_leaves: list  # params and optimizer state, placed for the stepper
    o_leaves: list
    skipped: int  # non-finite steps skipped (train.nonfinite=skip)
    good_step: int  # the last state known finite and saved (or the initial state)
    good_ckpt: Path | None
    start_step: int = 0  # the step this run started (or resumed) at
    calls: int = 0
    metrics: dict = field(default_factory=dict)  # the last call's metrics (on the device)
    pending: list = field(default_factory=list)  # each call's metrics since the last boundary
    pending_from: int = 0
    last_eval: dict = field(default_factory=dict)
    window_start: int = 0  # examples/s is measured over the steps since the last log
    t_start: float = 0.0
    t_window: float = 0.0
    log_file: object = None
    bar: object = None
    watch: object = None
    timings: Timings = field(default_factory=Timings)
    plotter: object = None  # train.plot.CurvePlotter, or None: draw in finish()
    watchdog: object = None
    in_flight: list = field(default_factory=list)  # outputs of calls not yet waited for

    @classmethod
    def begin(cls, r: Run, resume: str, echo, timings: Timings, plotter=None) -> _Loop:
        """Compile, agree on the starting state, then (process 0) set up the run directory."""
        cfg = r.cfg
        sampler = make_sampler(cfg.seed, r.data, cfg.train.batch_size)
        first = dist.process_share(sampler.batches(0, steps_in_call(cfg, 0, boundaries(cfg))))
        prep = prepare(r, cfg.train.nonfinite, first)
        timings.lap("compile")
        # Decide where to start before writing anything: a bad checkpoint must not cost files.
        start, p_leaves, o_leaves, skipped, good_ckpt = _agree_on_start(
            cfg, resume, r.run_dir / "checkpoints", prep.params0, prep.opt0
        )
        if dist.is_main():  # only process 0 writes the run directory
            _open_run_dir(r, resume, start)
        echo(_banner(r, prep, start))
        put = prep.stepper.put_state
        loop = cls(
            r,
            prep,
            sampler,
            echo,
            step=start,
            p_leaves=put(p_leaves),
            o_leaves=put(o_leaves),
            skipped=skipped,
            good_step=start,
            good_ckpt=good_ckpt,
            start_step=start,
            pending_from=start,
            window_start=start,
            timings=timings,
            plotter=plotter,
        )
        loop.bar = _progress(cfg, start) if dist.is_main() else _NoBar()
        if dist.is_main():
            loop.log_file = open(r.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - close()
        loop.watch = faults.PreemptionWatch(dist.is_multiprocess())
        settings = dist.resolve(cfg.distributed)
        loop.watchdog = faults.Watchdog(
            cfg.train.step_timeout,
            multiprocess=dist.is_multiprocess(),
            # automatic: fire before JAX's heartbeat abort does (a C++ stack, status -6)
            cap=0.8 * settings.heartbeat_timeout if settings else None,
            fresh_line=cfg.log.progress and dist.is_main(),
        )
        loop.t_start = loop.t_window = time.perf_counter()
        timings.lap("other")
        return loop

    # -- the steps of the loop ---------------------------------------------------------

    def run_call(self) -> None:
        """One compiled call: up to ``train.steps_per_call`` steps, up to the next boundary."""
        cfg, stepper = self.r.cfg, self.prep.stepper
        k = steps_in_call(cfg, self.step, boundaries(cfg))
        idx = stepper.put_indices(dist.process_share(self.sampler.batches(self.step, k)), self.step)
        if faults.stuck_here(self.step, k, jax.process_index()):  # test hook
            stuck = faults.StuckCall()
            self.watchdog.watch(self.step, stuck)
            stuck.block_until_ready()  # as at any sync point: never returns
        self.p_leaves, self.o_leaves, self.metrics = stepper.run(
            self.p_leaves, self.o_leaves, self.prep.X, self.prep.Y, idx
        )
        self.watchdog.watch(self.step, self.metrics)
        # Several processes on CPU (gloo): every local device's part of a call runs on a
        # shared thread pool and blocks its thread inside gloo's collectives. With many
        # calls in flight, the pool fills with parts waiting in a collective (or for a
        # device's in-flight slot) while the part they wait for has no thread left: a
        # deadlock with every process alive (2 x 8 devices: ~step 45; pmap 2 x 2: ~100).
        # Bounding the calls in flight rules that out.
        limit = max_in_flight(cfg.parallel.strategy, dist.is_multiprocess())
        if limit is not None:
            self.in_flight.append(self.metrics)
            while len(self.in_flight) > limit:
                jax.block_until_ready(self.in_flight.pop(0))
        self.step += k
        self.calls += 1
        self.bar.update(k)
        self.pending.append(self.metrics)  # non-finite flags: read at the next boundary

    def boundary(self) -> Boundary | None:
        """What to do now that ``self.step`` steps are done (None: just carry on)."""
        cfg, step = self.r.cfg, self.step
        last = step == cfg.train.steps
        at = Boundary(
            log=step % cfg.train.log_every == 0 or last,
            eval=step % cfg.train.eval_every == 0 or last,
            checkpoint=bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last,
            stop=self.watch.should_stop(self.calls),
        )
        return at if (at.log or at.eval or at.checkpoint or at.stop) else None

    def check_nonfinite(self) -> None:
        """At a boundary the host syncs anyway: read the steps' non-finite flags."""
        flags = np.concatenate([step_flags(m) for m in self.pending])
        first, self.pending, self.pending_from = self.pending_from, [], self.step
        if flags.any() and self.r.cfg.train.nonfinite == "stop":
            self._stop_nonfinite(first + int(np.argmax(flags)) + 1)
        self.skipped += int(flags.sum())

    def log_train(self) -> None:
        """A train record in metrics.jsonl (the last step's metrics) and the progress bar."""
        tc = self.r.cfg.train
        m = {
            name: float(to_host(v).reshape(-1)[-1])
            for name, v in self.metrics.items()
            if name != "nonfinite"
        }
        now = time.perf_counter()
        rate = (self.step - self.window_start) * tc.batch_size / max(now - self.t_window, 1e-9)
        self.t_window, self.window_start = now, self.step
        extra = {"skipped_steps": self.skipped} if tc.nonfinite == "skip" else {}
        window = self.r.data.window
        rates = {"examples_per_s": round(rate, 1)}
        if window is not None:
            rates["tokens_per_s"] = round(rate * window, 1)
        self._write(
            {
                "step": self.step,
                "split": "train",
                **m,
                **extra,
                **rates,
                "time": round(now - self.t_start, 3),
            }
        )
        shown = {BAR_NAMES.get(k, k): f"{v:.4f}" for k, v in m.items()}
        if window is not None:
            shown["tok_s"] = f"{rate * window:,.0f}"
        else:
            shown["ex_s"] = f"{rate:,.0f}"
        self.bar.set_postfix(**shown)

    def evaluate(self) -> None:
        """Metrics on the whole held-out split (process 0): a "test" record, or "val" for
        text (its fixed set of validation windows)."""
        if not dist.is_main():
            return
        prep = self.prep
        jax.block_until_ready(self.p_leaves)  # the training so far is charged to "train"
        self.timings.lap("train")
        params = jax.tree.unflatten(
            prep.p_def, jax.device_put(prep.stepper.get_state(self.p_leaves), prep.eval_device)
        )
        result = prep.evaluate(params, prep.X_test, prep.Y_test)
        self.last_eval = {k: float(v) for k, v in result.items()}
        self._write(
            {
                "step": self.step,
                "split": self.r.data.eval_split,
                **self.last_eval,
                "time": round(time.perf_counter() - self.t_start, 3),
            }
        )
        self.timings.lap("eval")

    def checkpoint(self) -> None:
        """Save the state (process 0 writes), after checking it is finite."""
        jax.block_until_ready(self.p_leaves)
        self.timings.lap("train")
        state = self.host_state()
        # The loss-only flag cannot see a last step that broke the params.
        if self.r.cfg.train.nonfinite == "stop" and not _all_finite(state[0]):
            self._stop_nonfinite(self.step)
        self.good_step = self.step
        if dist.is_main():
            cfg = self.r.cfg
            self.good_ckpt = ckpt.save(
                self.r.run_dir / "checkpoints",
                self.step,
                *state,
                _metadata(cfg, self.r.data, self.step, self.sampler, self.skipped),
                cfg.checkpoint.keep,
            )
        self.timings.lap("checkpoint")

    def already_finished(self) -> Run:
        """A rerun of a finished run: say so, with its final metrics; train nothing."""
        r = self.r
        self.close()
        r.params, r.opt_state = self.host_state()
        r.step = self.step
        records = [rec for _, rec in _read_metrics(r.run_dir / "metrics.jsonl")]
        final = next((rec for rec in reversed(records) if rec.get("split") == "test"), {})
        self.last_eval = {k: v for k, v in final.items() if k not in ("step", "split", "time")}
        r.summary = {"step": self.step, **{f"test_{k}": v for k, v in self.last_eval.items()}}
        shown = ", ".join(
            f"test {k} {v:.4f}" if isinstance(v, float) else f"test {k} {v}"
            for k, v in sorted(self.last_eval.items(), key=lambda kv: kv[0] != "loss")
        )
        self.echo(
            f"already finished: step {self.step} of train.steps={r.cfg.train.steps}"
            + (f", {shown}" if shown else "")
            + f" (from {r.run_dir / 'metrics.jsonl'}); nothing to train. Raise train.steps "
            "to train on, or use --fresh to start over"
        )
        return r

    def close(self) -> None:
        self.bar.close()
        if self.log_file is not None:
            self.log_file.close()

    def finish(self) -> Run:
        """Final params and summary on the Run, the plot, and the closing line."""
        r, tc = self.r, self.r.cfg.train
        wall = time.perf_counter() - self.t_start
        self.timings.lap("train")
        r.params, r.opt_state = self.host_state()
        r.step = self.step
        split, window = r.data.eval_split, r.data.window
        rate = (self.step - self.start_step) * tc.batch_size / max(wall, 1e-9)
        r.summary = {
            "step": self.step,
            **{f"{split}_{k}": v for k, v in self.last_eval.items()},
            "skipped_steps": self.skipped,
            "wall_s": wall,
            "examples_per_s": rate,
            **({"tokens_per_s": rate * window} if window is not None else {}),
        }
        if r.cfg.log.plot and dist.is_main():
            if self.plotter is not None:  # the caller waits for it
                self.plotter.draw(r.run_dir / "metrics.jsonl", r.run_dir / "curves.png")
            else:
                plot_curves(r.run_dir / "metrics.jsonl", r.run_dir / "curves.png")
                self.timings.lap("plot")
        last = self.last_eval
        more = "".join(
            f", {split} {name.replace('_', ' ')} {last[name]:.4f}"
            for name in ("accuracy", "bits_per_char")
            if name in last
        )
        skip = f", {self.skipped} non-finite steps skipped" if self.skipped else ""
        speed = f"{rate:,.0f} examples/s"
        if window is not None:
            speed = f"{rate * window:,.0f} tokens/s"
        self.echo(
            f"done: step {self.step}, {split} loss {last.get('loss', float('nan')):.4f}{more}"
            f"{skip}, wall {wall:.1f} s, {speed}"
        )
        return r

    # -- helpers -----------------------------------------------------------------------

    def host_state(self) -> tuple:
        """``(params, opt_state)`` as host numpy leaves in their trees."""
        prep = self.prep
        get = prep.stepper.get_state
        return (
            jax.tree.unflatten(prep.p_def, [np.asarray(v) for v in get(self.p_leaves)]),
            jax.tree.unflatten(prep.o_def, [np.asarray(v) for v in get(self.o_leaves)]),
        )

    def _stop_nonfinite(self, flagged: int):
        r, prep = self.r, self.prep
        checker = make_stepper(r, prep.p_def, prep.o_def, "check")
        loss_fn = mean_loss_fn(r.model, r.cfg.loss.grad)  # the replay names the bad leaf
        raise faults.NonFinite(
            _explain_nonfinite(
                r,
                r.cfg,
                self.sampler,
                checker,
                loss_fn,
                prep.params0,
                prep.opt0,
                flagged,
                self.good_step,
                self.good_ckpt,
            )
        )

    def _write(self, record: dict) -> None:
        _write(self.log_file, record)


def _open_run_dir(r: Run, resume: str, start: int) -> None:
    """Create the run directory, clear it for --fresh, write config.yaml and cut
    metrics.jsonl back to ``start`` (what a resumed run logs again)."""
    ckpt_dir, metrics_path = r.run_dir / "checkpoints", r.run_dir / "metrics.jsonl"
    if resume == "fresh" and r.run_dir.exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        metrics_path.unlink(missing_ok=True)
    r.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.clean_temporary(ckpt_dir)
    (r.run_dir / "config.yaml").write_text(dump_yaml(r.cfg))
    _rewrite_metrics(metrics_path, start)


def _banner(r: Run, prep: Prepared, start: int) -> str:
    """The run's first line: devices, model size, data, run directory."""
    cfg = r.cfg
    procs = f"{jax.process_count()} processes x " if dist.is_multiprocess() else ""
    per_proc = len(r.devices) // jax.process_count()
    note = f"\n  note: {r.data.name}: {r.data.note}" if r.data.note else ""
    return (
        f"nnlite train: {cfg.name}  devices: {procs}{per_proc} x {r.devices[0].platform} "
        f"({cfg.parallel.strategy})  model: {cfg.model.name} ({prep.params0.num_params():,} "
        f"params)  data: {r.data.name} ({r.data.describe()})  "
        f"run dir: {r.run_dir}" + (f"  resuming at step {start}" if start else "") + note
    )


def _explain_nonfinite(
    r, cfg, sampler, checker, loss_fn, params0, opt0, flagged, good_step, good_ckpt
) -> str:
    """The message for a run stopped at step ``flagged``: replay from the last good state
    with ``checker`` (a stepper whose flag covers the new params as well as the loss), find
    the first bad step (``flagged`` or one before: bad params show in the next loss), and
    name the first non-finite value that step produces."""
    p_host, o_host = jax.tree.leaves(params0), jax.tree.leaves(opt0)
    if good_step > 0:  # process 0 wrote (or resumed from) a checkpoint at good_step
        if dist.is_main():
            _, p_host, o_host, _ = _load_checkpoint(cfg, good_ckpt, params0, opt0)
        p_host, o_host = dist.broadcast((p_host, o_host))
    X, Y = checker.put_data(r.data.x), checker.put_data(r.data.y)

    def replay(upto: int):
        """State after steps good_step..upto-1, and the first flagged step on the way."""
        p, o = checker.put_state(p_host), checker.put_state(o_host)
        for s in range(good_step, upto):
            idx = checker.put_indices(dist.process_share(sampler.batches(s, 1)), s)
            p, o, m = checker.run(p, o, X, Y, idx)
            if step_flags(m).any():
                return p, o, s + 1
        return p, o, None

    bad = replay(flagged)[2] or flagged
    p_leaves, o_leaves, _ = replay(bad - 1)
    p_def, o_def = jax.tree.structure(params0), jax.tree.structure(opt0)
    params = jax.tree.unflatten(p_def, [np.asarray(v) for v in checker.get_state(p_leaves)])
    opt_state = jax.tree.unflatten(o_def, [np.asarray(v) for v in checker.get_state(o_leaves)])
    x, y = host_batch(r.data, sampler.batch(bad - 1))
    what = faults.first_nonfinite(loss_fn, r.optimizer, params, opt_state, x, y)
    where = f"first in {what}" if what else "not reproducible on one device to name the leaf"
    kept = (
        f"the last good checkpoint is {good_ckpt} (step {good_step})"
        if good_ckpt is not None
        else "no checkpoint was written"
    )
    return (
        f"non-finite values at step {bad} ({where}); training stopped and {kept}. "
        "Lower optimizer.learning_rate, check the data, or set train.nonfinite=skip "
        "to skip such steps"
    )


def _all_finite(tree) -> bool:
    return all(np.all(np.isfinite(v)) for v in jax.tree.leaves(tree))


def _quiet(*_args, **_kwargs) -> None:
    pass


def _write(f, record: dict) -> None:
    if f is None:  # not process 0: it writes nothing
        return
    # Strict JSON: a non-finite value (a skipped step's loss) is written as null.
    record = {
        k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in record.items()
    }
    f.write(json.dumps(record, allow_nan=False) + "\n")
    f.flush()


def max_in_flight(strategy: str, multiprocess: bool) -> int | None:
    """How many compiled calls may be in flight at once (None: no limit). Several CPU
    processes need a bound (see ``_Loop.run_call``), and both strategies wait for each
    call: with one more shard_map call queued, a peer killed mid-call left the survivor a
    gloo "collective mismatch" abort (two calls' collectives interleaved) in 1 run of 4."""
    if not multiprocess or jax.devices()[0].platform != "cpu":
        return None
    return 0


class _NoBar:
    def set_postfix(self, **_):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


def _progress(cfg: Config, start: int):
    if not cfg.log.progress:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.steps, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True
    )
