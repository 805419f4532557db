"""``--eject``: the text of the ejected script, from the printed loss (and gradient)
and the optimizer's source."""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import numpy as np

from ..config import Config
from ..model import contract
from .build import Run
from .eject_optax import with_paths

SCRIPT = "train_ejected.py"
PARAMS = "params.safetensors"
DATA = "data.npz"


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


#: ``sys.path.insert(0, '/abs/dir')  # where the run found module`` (eject_optax.with_paths)
_PATH_LINE = re.compile(r"sys\.path\.insert\(0, (['\"])(.*)\1\)  # where the run found (\S+)$")


def _portable_paths(lines: list[str], script_dir: Path) -> tuple[list[str], list[str]]:
    """``lines`` without their ``sys.path.insert`` of an absolute directory, and the lines
    that replace them: each directory relative to the script's own, then the directory the
    script runs in (the script runs on another machine, or after the project moved)."""
    roots: dict[str, list[str]] = {}
    rest = []
    for line in lines:
        m = _PATH_LINE.match(line)
        if m is None:
            rest.append(line)
            continue
        try:
            rel = os.path.relpath(m.group(2), script_dir)
        except ValueError:  # another drive (Windows): only the working directory is left
            rel = None
        modules = roots.setdefault(rel, [])
        if m.group(3) not in modules:
            modules.append(m.group(3))
    if not roots:
        return rest, []
    names = ", ".join(dict.fromkeys(m for ms in roots.values() for m in ms))
    entries = [f"os.path.join(HERE, {rel!r})" for rel in roots if rel is not None]
    block = [
        "",
        f"# Your own modules ({names}): where the run found them, relative to this script",
        "# (the project's directory as it was ejected), else the directory you run it from.",
        "HERE = os.path.dirname(os.path.abspath(__file__))",
        f"sys.path[:0] = [{', '.join([*entries, 'os.getcwd()'])}]",
    ]
    return rest, block


def script_text(r: Run, step_src: str, how: str, opt_src: str, script_dir: Path) -> str:
    """The ejected script, to be written into ``script_dir``."""
    cfg = r.cfg
    data = r.data
    keyed = contract.uses_key(r.model)
    step_imports, step_body = _split_imports(step_src)
    opt_imports, opt_body = _split_imports(opt_src)
    base = ["import argparse", "import math", "import os", "import sys", ""]
    base += ["import jax", "import jax.numpy as jnp", "import numpy as np", "import optax", ""]
    base += ["import nnlite"]
    extra = with_paths([i for i in dict.fromkeys(step_imports) if i not in base])
    extra = [_wrap_import(line) for line in extra]
    # the dtypes the trainer's gather gives (what jax.device_put makes of the arrays)
    x_dtype = jax.dtypes.canonicalize_dtype(np.asarray(data.x[:1]).dtype).name
    y_dtype = jax.dtypes.canonicalize_dtype(np.asarray(data.y[:1]).dtype).name
    config_line = " ".join(f"{k}={v}" for k, v in _key_settings(cfg))
    k = cfg.train.grad_accum_steps
    differentiate = _differentiate(how, k, keyed, r.grad_mode)
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
    header = _header(cfg, r.grad_mode, config_line)
    user_imports, paths = _portable_paths([*extra, *opt_lines], Path(script_dir).absolute())
    text = header + "\n" + "\n".join(base + paths + user_imports) + "\n"
    text += "" if paths else "\nHERE = os.path.dirname(os.path.abspath(__file__))\n"
    text += f"""
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


# nnlite.jit: jax.jit with nnlite.compiler_options() (on the CPU, XLA's own GEMM)
train_step = nnlite.jit(train_step, donate_argnums=(0, 1))


{_LOOP}"""
    return text


def _header(cfg: Config, grad_mode: str, config_line: str) -> str:
    """The script's docstring: what it runs and how."""
    return f'''"""The training run of {cfg.name}, ejected by ``nnlite-train --eject``.

    {config_line}

Runs without nnlite's trainer: jax, numpy, optax, and nnlite's rules (nnlite.rules) and
nnlite.load. It reads the run's initial params ({PARAMS}) and training arrays ({DATA})
from its own directory, draws the trainer's batches (a pure function of the seed and the
step), runs the train step below (loss.grad={grad_mode}) with the config's optax chain,
and prints the mean loss every LOG_EVERY steps: the "loss" of the run's metrics.jsonl, to
float rounding. Evaluation, checkpoints, callbacks and loggers stay the trainer's.

    python {SCRIPT} [--steps N]
"""
'''


def _differentiate(how: str, k: int, keyed: bool, grad_mode: str) -> str:
    """The train step's lines that compute ``loss, grads`` (``k`` microbatches summed)."""
    call = "value_and_grad" if how == "manual" else "jax.value_and_grad(loss_fn)"
    why = (
        "the hand-derived backward pass above: the rules' VJPs called in reverse"
        if how == "manual"
        else f"JAX's autodiff of the forward pass above (loss.grad={grad_mode})"
    )
    if k == 1:
        key_arg = ", key" if keyed else ""
        return f"    # {why}\n    loss, grads = {call}(params, x, y{key_arg})"
    key_arg = ", jax.random.fold_in(key, i)" if keyed else ""
    return (
        f"    # train.grad_accum_steps={k}: the batch as {k} microbatches (each its own\n"
        "    # key), their gradients summed and averaged: the update of the whole batch\n"
        f"    xs, ys = x.reshape({k}, -1, *x.shape[1:]), y.reshape({k}, -1, *y.shape[1:])\n"
        "    grads = jax.tree.map(jnp.zeros_like, params)\n"
        "    losses = []\n"
        f"    for i in range({k}):\n"
        f"        # {why}\n"
        f"        loss_i, grads_i = {call}(params, xs[i], ys[i]{key_arg})\n"
        "        grads = jax.tree.map(jnp.add, grads, grads_i)\n"
        "        losses.append(loss_i)\n"
        f"    grads = jax.tree.map(lambda g: g / {k}, grads)\n"
        "    loss = jnp.mean(jnp.stack(losses))"
    )


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

_LOOP = """# -- the loop --
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS, help="stop after this many steps")
    args = ap.parse_args(argv)
    params = nnlite.load(os.path.join(HERE, "<PARAMS>"))  # the run's initial params
    opt_state = optimizer.init(params)
    total, count = 0.0, 0
    for step in range(min(args.steps, STEPS)):
        x, y = get_batch(step)
        params, opt_state, loss = train_step(params, opt_state, x, y, np.int32(step))
        total, count = total + float(loss), count + 1  # host float64, as the trainer's
        done = step + 1
        if done % LOG_EVERY == 0 or done == STEPS or done == args.steps:
            avg = total / count
            print(f"step {done} loss {avg!r}", flush=True)
            total, count = 0.0, 0
            if not math.isfinite(avg):
                print(f"stopped: non-finite loss by step {done}", file=sys.stderr)
                return 4
    nnlite.save(os.path.join(HERE, "trained.safetensors"), params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
""".replace("<PARAMS>", PARAMS)
