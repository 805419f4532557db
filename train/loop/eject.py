"""``python -m train --config FILE --eject DIR``: the run as a standalone training script.

DIR gets three files: ``train_ejected.py`` (the data read, the train step as Python with
the hand rules called by name, the config's optax chain, the loop), ``params.safetensors``
(the run's initial params, exactly as the trainer initialises them) and ``data.npz`` (the
training arrays the run draws its batches from). The script imports jax, numpy, optax and
nnlite (its rules and ``nnlite.load``), never ``train`` or ``models``, and prints the loss
means the trainer writes to metrics.jsonl, equal to float rounding. docs/gradients.md
("Eject the step") explains each choice.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import jax
import numpy as np

import nnlite as nl

from ..config import Config, OptimizerConfig
from ..data.dataset import host_batch, make_sampler
from ..errors import ConfigError
from ..model import contract
from ..optim import GIVEN
from .build import INIT_COMPILER_OPTIONS, Run, build, init_state_compiled

SCRIPT = "train_ejected.py"
PARAMS = "params.safetensors"
DATA = "data.npz"

HOW = "--eject writes a one-device script of a plain train step"


def eject(cfg: Config, out: str | os.PathLike) -> Path:
    """Write the script, the initial params and the data into the new directory ``out``.

    Raises ConfigError (one line) for a directory that exists and is not empty or cannot
    be written, and for a run the script cannot reproduce (a multi-device strategy, model
    state, streamed data, gradient accumulation, a model's own fused pass). ``out`` is
    created whole or not at all: the files are written into a temporary sibling, renamed
    into place last.
    """
    _check_config(cfg)
    target = _check_target(Path(out))
    # Written into a temporary sibling first (which proves the place writable), renamed last.
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as e:
        raise ConfigError(
            f"--eject {out}: cannot write in {target.parent} ({e.strerror})"
        ) from None
    try:
        r = build(cfg)
        _check_supported(r)
        cfg = r.cfg  # the model section resolved from the data
        params, _ = jax.device_get(init_state_compiled(r.model, r.optimizer, cfg.seed))
        sampler = make_sampler(cfg.seed, r.data, cfg.train.batch_size)
        x0, y0 = (np.asarray(a) for a in host_batch(r.data, sampler.batch(0)))
        step_src, how = _step_source(r, params, x0, y0)
        opt_src = optimizer_source(cfg.optimizer, cfg.train.steps)
        _check_optimizer(opt_src, r, params)
        script = _script(r, step_src, how, opt_src)
        nl.save(tmp / PARAMS, params)
        if jax.tree.structure(nl.load(tmp / PARAMS)) != jax.tree.structure(params):
            raise ConfigError(  # the script rebuilds the params from the file's paths alone
                f"{HOW}: model.name={cfg.model.name}: its params do not read back from "
                f"{PARAMS} with nnlite.load(path) in the same structure"
            )
        _save_data(tmp / DATA, r)
        (tmp / SCRIPT).write_text(script)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's is private; DIR gets a new directory's mode
        if target.exists():  # an empty directory (kept, with its owner and mode): filled
            for name in (PARAMS, DATA, SCRIPT):  # the script last: present means complete
                (tmp / name).rename(target / name)
            tmp.rmdir()
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target / SCRIPT


def _check_target(target: Path) -> Path:
    """``target`` made absolute, if it can become the ejected directory (else one line)."""
    where = f"--eject {target}"
    if target.exists():
        if not target.is_dir():
            raise ConfigError(f"{where}: exists and is not a directory; name a new directory")
        if any(target.iterdir()):
            raise ConfigError(
                f"{where}: the directory exists and is not empty (nothing was written); "
                "name a new or empty directory"
            )
    parent = target.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"{where}: the parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        raise ConfigError(f"{where}: cannot write in {parent} (permission denied)")
    return target.absolute()


def _check_config(cfg: Config) -> None:
    """One line for a config the one-device script does not reproduce (before anything is
    built or written)."""
    if cfg.parallel.strategy != "none":
        raise ConfigError(
            f"{HOW}: parallel.strategy={cfg.parallel.strategy} is not supported; eject with "
            "--set parallel.strategy=none (every strategy trains like one device on the same "
            "global batch, so that script reproduces this run's losses to float rounding)"
        )
    if cfg.train.grad_accum_steps != 1:
        raise ConfigError(
            f"{HOW}: train.grad_accum_steps={cfg.train.grad_accum_steps} is not supported; "
            "use 1 (the same update, in one pass)"
        )
    if cfg.train.nonfinite == "skip":
        raise ConfigError(
            f"{HOW}: train.nonfinite=skip keeps the old state on a non-finite step; the "
            "script stops there instead: use train.nonfinite=stop"
        )
    if cfg.optimizer.name == GIVEN:
        raise ConfigError(
            f"{HOW}: optimizer.name=given is an object passed to train.fit, which a script "
            "cannot name; use a named optimizer or a module:function factory"
        )


def _check_supported(r: Run) -> None:
    """One line for a model or data set the one-device script does not reproduce."""
    cfg = r.cfg
    if contract.is_stateful(r.model):
        raise ConfigError(
            f"{HOW}: model.name={cfg.model.name} has model state (init_state: BatchNorm's "
            "running statistics), which the ejected step does not carry"
        )
    if r.data.streamed or r.data.stream is not None or hasattr(r.data.x, "pair_reader"):
        raise ConfigError(
            f"{HOW}: data.name={cfg.data.name} is read a batch at a time from the host "
            "(streamed, or a data source); the script trains on arrays held in memory: "
            "use data.placement: device, or arrays (an npz file)"
        )
    if r.grad_mode not in contract.BASE_GRAD_MODES:
        raise ConfigError(
            f"{HOW}: loss.grad={r.grad_mode} is a model's own backward pass; eject with "
            "--set loss.grad=manual (the hand rules, equal to float rounding) or autodiff"
        )
    if callable(getattr(r.model, "wrap_optimizer", None)):
        raise ConfigError(
            f"{HOW}: model.name={cfg.model.name} wraps the optimizer (wrap_optimizer: "
            "some params frozen), which the script does not reproduce"
        )


# -- the step -----------------------------------------------------------------------------


def _step_source(r: Run, params, x, y) -> tuple[str, str]:
    """The loss's source for the script and how the step differentiates it: ``manual``
    prints the hand VJPs (``value_and_grad``), ``autodiff`` the forward calls (``loss``)
    for ``jax.value_and_grad``, or the loss's decompiled jaxpr when a layer has no rule."""
    keyed = contract.uses_key(r.model)
    objective = contract.objective_fn(r.model, r.grad_mode)
    batch = [x, y]
    if keyed:  # the key is an argument: the script derives it per step, as the trainer
        batch.append(jax.random.key(r.cfg.seed))

        def loss(params, x, y, key):
            return objective(params, x, y, key=key)[0]

    else:

        def loss(params, x, y):
            return objective(params, x, y)[0]

    if r.grad_mode == "manual":
        try:
            return nl.show_value_and_grad(loss, params, *batch), "manual"
        except (nl.ManualGradError, ValueError) as e:
            raise ConfigError(f"{HOW}: loss.grad=manual: {_one_line(e)}") from None
    try:
        return nl.show_forward(loss, params, *batch), "forward"
    except (nl.ManualGradError, ValueError, nl.RuleContractError):
        pass  # an operation without a rule: the loss as its jaxpr, differentiated by JAX
    try:
        # every captured constant printed in the file (the script has no LARGE_CONSTS)
        src = nl.show_jaxpr(loss, params, *batch, name="loss_jaxpr", max_const_size=1 << 40)
    except nl.UnsupportedPrimitiveError as e:
        raise ConfigError(f"{HOW}: the loss cannot be printed: {_one_line(e)}") from None
    args = "params, x, y, key" if keyed else "params, x, y"
    src += (
        f"\n\ndef loss({args}):\n"
        f"    return loss_jaxpr(*jax.tree.leaves(params), {args.split(', ', 1)[1]})\n"
    )
    return src, "jaxpr"


def _one_line(e: Exception) -> str:
    return textwrap.shorten(" ".join(str(e).split()), 300, placeholder=" ...")


# -- the optimizer: the config's optax chain as source ---------------------------------------


def _schedule_expr(oc: OptimizerConfig, total: int, imports: list[str]) -> str:
    lr = repr(oc.learning_rate)
    name = oc.schedule
    if ":" in name:
        fn = _import_line(name, imports)
        params = inspect.signature(_resolve(name)).parameters
        offered = {"learning_rate": oc.learning_rate, "total_steps": total}
        kw = (
            offered
            if any(p.kind is p.VAR_KEYWORD for p in params.values())
            else {k: v for k, v in offered.items() if k in params}
        )
        return f"{fn}({', '.join(f'{k}={v!r}' for k, v in kw.items())})"
    exprs = {
        "constant": f"optax.constant_schedule({lr})",
        "cosine": f"optax.cosine_decay_schedule({lr}, {total}, alpha={oc.end_lr_fraction!r})",
        "warmup_cosine": (
            f"optax.warmup_cosine_decay_schedule(0.0, {lr}, {oc.warmup_steps}, {total}, "
            f"end_value={oc.learning_rate * oc.end_lr_fraction!r})"
        ),
        "exponential": (
            f"optax.exponential_decay({lr}, transition_steps={total}, decay_rate={oc.decay_rate!r})"
        ),
    }
    if name not in exprs:
        raise ConfigError(f"{HOW}: optimizer.schedule={name} has no ejected form")
    return exprs[name]


def _rule_parts(oc: OptimizerConfig) -> list[str]:
    """The named optimizer's optax parts (train/optim/named.py), as source."""
    mask = "decay_mask" if oc.decay == "matrices" else "None"
    b2 = oc.b2
    l2 = [f"optax.add_decayed_weights({oc.weight_decay!r}, mask={mask})"] * bool(oc.weight_decay)
    parts = {
        "sgd": lambda: [*l2, "optax.sgd(lr)"],
        "momentum": lambda: [*l2, f"optax.sgd(lr, momentum={oc.momentum!r})"],
        "adam": lambda: [
            *l2,
            f"optax.adam(lr, b1={oc.b1!r}, b2={0.999 if b2 is None else b2!r})",
        ],
        "adamw": lambda: [
            f"optax.adamw(lr, b1={oc.b1!r}, b2={0.999 if b2 is None else b2!r}, "
            f"weight_decay={oc.weight_decay!r}, mask={mask})"
        ],
        "lion": lambda: [
            f"optax.lion(lr, b1={oc.b1!r}, b2={0.99 if b2 is None else b2!r}, "
            f"weight_decay={oc.weight_decay!r}, mask={mask})"
        ],
    }
    if oc.name not in parts:
        raise ConfigError(f"{HOW}: optimizer.name={oc.name} has no ejected form")
    return parts[oc.name]()


def optimizer_source(oc: OptimizerConfig, total_steps: int) -> str:
    """``def make_optimizer(): ...`` building the optax optimizer ``oc`` describes, as
    ``train.optim.named.build_optimizer`` does (a user's ``module:function`` imported)."""
    imports: list[str] = []
    body: list[str] = []
    if ":" in oc.name:
        fn = _import_line(oc.name, imports)
        kw = ", ".join(f"{k}={v!r}" for k, v in dict(oc.options).items())
        parts = [f"{fn}({kw})"]
    else:
        body.append(f"lr = {_schedule_expr(oc, total_steps, imports)}  # step -> learning rate")
        parts = _rule_parts(oc)
    if oc.clip_norm is not None:
        parts = [f"optax.clip_by_global_norm({oc.clip_norm!r})", *parts]
    if len(parts) == 1:
        body.append(f"return {parts[0]}")
    else:
        body.append("return optax.chain(")
        body += [f"    {p}," for p in parts]
        body.append(")")
    lines = list(dict.fromkeys(imports))
    if any("decay_mask" in p for p in parts):
        lines += [
            "",
            "",
            "def decay_mask(params):",
            '    """Weight decay for matrices only (ndim >= 2), not biases or norms."""',
            "    return jax.tree.map(lambda p: p.ndim >= 2, params)",
        ]
    lines += ["", "", "def make_optimizer():"] + [f"    {b}" for b in body]
    return "\n".join(lines).strip("\n") + "\n"


def _resolve(name: str):
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _module_root(module: str) -> str | None:
    """The directory to put on ``sys.path`` for ``import module`` (None: not a file)."""
    path = getattr(sys.modules.get(module) or importlib.import_module(module), "__file__", None)
    if path is None:
        return None
    root = Path(path).resolve().parent
    for _ in module.split(".")[1:]:
        root = root.parent
    return str(root)


OWN = ("jax", "numpy", "optax", "nnlite")  # what the script may import from anywhere


def _with_paths(imports: list[str]) -> list[str]:
    """Import lines, each of a user's module (a hand rule's home) preceded by the
    ``sys.path`` entry it was found in when the run was ejected."""
    out = []
    for line in imports:
        m = re.match(r"from (\S+) import ", line)
        if m and m.group(1).split(".")[0] not in OWN:
            root = _module_root(m.group(1))
            entry = f"sys.path.insert(0, {root!r})  # where the run found {m.group(1)}"
            if root is not None and entry not in out:
                out.append(entry)
        out.append(line)
    return out


def _import_line(name: str, imports: list[str]) -> str:
    """Import a user's ``module:function`` in the script (from the directory the run found
    the module in) and return the name to call."""
    module, _, attr = name.partition(":")
    root = _module_root(module)  # the config's loading put its directory on the path
    if root is not None:
        imports.append(f"sys.path.insert(0, {root!r})  # where the run found {module}")
    imports.append(f"from {module} import {attr}")
    return attr


def _check_optimizer(src: str, r: Run, params) -> None:
    """The emitted chain must update as the run's optimizer does: one update compared."""
    ns: dict = {}
    exec(_PRELUDE + src, ns)  # noqa: S102 -- our own generated source
    mine = ns["make_optimizer"]()
    grads = jax.tree.map(lambda p: np.cos(np.asarray(p, np.float32) + 1).astype(p.dtype), params)

    # one program (run eagerly, each optax op would compile on its own), compiled fast
    @functools.partial(jax.jit, compiler_options=INIT_COMPILER_OPTIONS)
    def both(grads, params):
        pair = (r.optimizer, mine)
        return tuple(opt.update(grads, opt.init(params), params)[0] for opt in pair)

    want, got = both(grads, params)
    same = jax.tree.structure(want) == jax.tree.structure(got) and all(
        np.allclose(a, b, rtol=1e-6, atol=0)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
    )
    if not same:  # the tables in train/optim/ moved on without this module
        raise ConfigError(
            f"{HOW}: optimizer.name={r.cfg.optimizer.name}: the ejected optax chain does not "
            "update as the run's optimizer does (train/loop/eject.py is behind "
            "train/optim/named.py)"
        )


_PRELUDE = "import sys\nimport jax\nimport optax\n"


# -- the data -------------------------------------------------------------------------------


def _save_data(path: Path, r: Run) -> None:
    """The training arrays as the step sees them; token streams in the smallest unsigned
    dtype that holds the vocabulary (the script casts batches back)."""
    arrays = {}
    for name, a in (("x", r.data.x), ("y", r.data.y)):
        a = np.asarray(a)
        if r.data.window is not None and np.issubdtype(a.dtype, np.integer):
            a = a.astype(np.min_scalar_type(max(int(r.data.num_classes) - 1, 0)))
        arrays[name] = a
    np.savez(path, **arrays)


# -- the script -----------------------------------------------------------------------------


def _wrap_import(line: str, width: int = 100) -> str:
    """A long ``from m import a, b, ...`` as a parenthesised list, one name per line."""
    m = re.fullmatch(r"from (\S+) import (.+)", line)
    if len(line) <= width or m is None:
        return line
    names = "".join(f"    {n.strip()},\n" for n in m.group(2).split(","))
    return f"from {m.group(1)} import (\n{names})"


def _split_imports(src: str) -> tuple[list[str], str]:
    """A printed module's top-level import lines, and the rest."""
    imports, rest = [], []
    for line in src.splitlines():
        if re.match(r"(import |from \S+ import |sys\.path\.insert\()", line):
            imports.append(line)
        else:
            rest.append(line)
    return imports, "\n".join(rest).strip("\n")


def _script(r: Run, step_src: str, how: str, opt_src: str) -> str:
    cfg = r.cfg
    data = r.data
    keyed = contract.uses_key(r.model)
    step_imports, step_body = _split_imports(step_src)
    opt_imports, opt_body = _split_imports(opt_src)
    base = ["import argparse", "import math", "import os", "import sys", ""]
    base += ["import jax", "import jax.numpy as jnp", "import numpy as np", "import optax", ""]
    base += ["import nnlite"]
    extra = _with_paths([i for i in dict.fromkeys(step_imports) if i not in base])
    extra = [_wrap_import(line) for line in extra]
    # the dtypes the trainer's gather gives (what jax.device_put makes of the arrays)
    x_dtype = jax.dtypes.canonicalize_dtype(np.asarray(data.x[:1]).dtype).name
    y_dtype = jax.dtypes.canonicalize_dtype(np.asarray(data.y[:1]).dtype).name
    config_line = " ".join(f"{k}={v}" for k, v in _key_settings(cfg))
    if how == "manual":
        differentiate = (
            "    # the hand-derived backward pass above: the rules' VJPs called in reverse\n"
            f"    loss, grads = value_and_grad(params, x, y{', key' if keyed else ''})"
        )
    else:
        differentiate = (
            "    # JAX's autodiff of the forward pass above (loss.grad=autodiff)\n"
            f"    loss, grads = jax.value_and_grad(loss_fn)(params, x, y{', key' if keyed else ''})"
        )
    key_line = (
        "    # the step's random key (dropout): fold_in(key(SEED), step), as the trainer's\n"
        "    key = jax.random.fold_in(jax.random.key(SEED), step)\n"
        if keyed
        else ""
    )
    if data.window is None:
        sampler = _EXAMPLE_SAMPLER
        n_src = "len(X)"
    else:
        sampler = _WINDOW_SAMPLER
        n_src = "len(X) - WINDOW + 1"
    opt_lines = [i for i in opt_imports if not i.startswith(("import jax", "import optax"))]
    header = f'''"""The training run of {cfg.name}, ejected by ``python -m train --eject``.

    {config_line}

Runs without nnlite's trainer: jax, numpy, optax, and nnlite's rules (nnlite.rules) and
nnlite.load. It reads the run's initial params ({PARAMS}) and training arrays ({DATA})
from its own directory, draws the trainer's batches (a pure function of the seed and the
step), runs the train step below (loss.grad={r.grad_mode}) with the config's optax chain,
and prints the mean loss every LOG_EVERY steps: the "loss" of the run's metrics.jsonl, to
float rounding. Evaluation, checkpoints, callbacks and loggers stay the trainer's.

    python {SCRIPT} [--steps N]
"""
'''
    text = header + "\n" + "\n".join(base + extra) + "\n"
    text += "\n".join(opt_lines) + ("\n" if opt_lines else "")
    text += f"""
HERE = os.path.dirname(os.path.abspath(__file__))

# -- the run's settings (the resolved config) --
SEED = {cfg.seed}
BATCH_SIZE = {cfg.train.batch_size}
STEPS = {cfg.train.steps}
LOG_EVERY = {cfg.train.log_every}
WINDOW = {data.window!r}  # text: the context length (a batch index is a window start)


# -- the data: the arrays the run trains on (data.name={cfg.data.name}) --
def read_data():
    with np.load(os.path.join(HERE, "{DATA}")) as f:
        return f["x"], f["y"]


X, Y = read_data()
N = {n_src}  # how many distinct batch indices there are
{sampler}

def get_batch(step):
    \"\"\"The batch (x, y) of training step ``step``, in the step's dtypes.\"\"\"
    idx = batch_indices(step)
    if WINDOW is not None:  # windows of the token stream; y is x shifted by one
        idx = idx[:, None] + np.arange(WINDOW, dtype=idx.dtype)[None, :]
    return X[idx].astype(np.{x_dtype}), Y[idx].astype(np.{y_dtype})


# -- {_LOSS_TITLES[how]} --
{step_body}
"""
    if how != "manual":
        text += "\n\nloss_fn = loss\n"
    text += f"""

# -- the optimizer: the config's optax chain (optimizer.name={cfg.optimizer.name}) --
{opt_body}


optimizer = make_optimizer()


# -- one train step, compiled --
def train_step(params, opt_state, x, y, step):
{key_line}{differentiate}
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


train_step = jax.jit(train_step, donate_argnums=(0, 1))


# -- the loop --
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS, help="stop after this many steps")
    args = ap.parse_args(argv)
    params = nnlite.load(os.path.join(HERE, "{PARAMS}"))  # the run's initial params
    opt_state = optimizer.init(params)
    total, count = 0.0, 0
    for step in range(min(args.steps, STEPS)):
        x, y = get_batch(step)
        params, opt_state, loss = train_step(params, opt_state, x, y, np.int32(step))
        total, count = total + float(loss), count + 1  # host float64, as the trainer's
        done = step + 1
        if done % LOG_EVERY == 0 or done == STEPS or done == args.steps:
            avg = total / count
            print(f"step {{done}} loss {{avg!r}}", flush=True)
            total, count = 0.0, 0
            if not math.isfinite(avg):
                print(f"stopped: non-finite loss by step {{done}}", file=sys.stderr)
                return 4
    nnlite.save(os.path.join(HERE, "trained.safetensors"), params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""
    return text


def _key_settings(cfg: Config) -> list[tuple[str, object]]:
    return [
        ("model.name", cfg.model.name),
        ("data.name", cfg.data.name),
        ("loss.grad", cfg.loss.grad),
        ("optimizer.name", cfg.optimizer.name),
        ("train.steps", cfg.train.steps),
        ("seed", cfg.seed),
    ]


_LOSS_TITLES = {
    "manual": "the loss and its hand-derived gradient (nnlite.show_value_and_grad)",
    "forward": "the loss: each layer's forward function by name (nnlite.show_forward)",
    "jaxpr": "the loss, decompiled (nnlite.show_jaxpr: an operation of it has no hand rule)",
}

_EXAMPLE_SAMPLER = '''PER_EPOCH = max(N // BATCH_SIZE, 1)  # the tail that does not fill a batch is dropped


def epoch_order(epoch, cache={}):
    """The permutation of the training set in ``epoch``: a pure function of (SEED, epoch)."""
    if epoch not in cache:
        cache.clear()
        order = np.random.default_rng([SEED, epoch]).permutation(N).astype(np.int32)
        cache[epoch] = np.resize(order, BATCH_SIZE) if N < BATCH_SIZE else order
    return cache[epoch]


def batch_indices(step):
    """The trainer's batch of ``step``: consecutive slices of each epoch's permutation."""
    epoch, i = divmod(step, PER_EPOCH)
    return epoch_order(epoch)[i * BATCH_SIZE : (i + 1) * BATCH_SIZE]
'''

_WINDOW_SAMPLER = '''

def batch_indices(step):
    """The trainer's batch of ``step``: BATCH_SIZE window starts drawn uniformly by
    default_rng([SEED, step]), a pure function of both."""
    dtype = np.int32 if N <= np.iinfo(np.int32).max else np.int64
    return np.random.default_rng([SEED, step]).integers(0, N, BATCH_SIZE, dtype=dtype)
'''
