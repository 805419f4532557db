"""``nnlite-train --config FILE --eject DIR``: the run as a standalone training script.

DIR gets three files: ``train_ejected.py`` (the data read, the train step as Python with
the hand rules called by name, the config's optax chain, the loop), ``params.safetensors``
(the run's initial params, exactly as the trainer initialises them) and ``data.npz`` (the
training arrays the run draws its batches from). The script imports jax, numpy, optax and
nnlite (its rules and ``nnlite.load``), never ``train`` or ``models``, and prints the loss
means the trainer writes to metrics.jsonl, equal to float rounding. docs/gradients.md
("Eject the step") explains each choice.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
from pathlib import Path

import jax
import numpy as np

import nnlite as nl

from .. import parallel
from ..config import Config
from ..data.dataset import host_batch, make_sampler
from ..errors import ConfigError
from ..model import contract
from ..optim import GIVEN
from .build import Run, build, init_state_compiled
from .eject_optax import HOW, check_optimizer, optimizer_source
from .eject_script import DATA, PARAMS, SCRIPT, script_text


def eject(cfg: Config, out: str | os.PathLike) -> Path:
    """Write the script, the initial params and the data into the new directory ``out``.

    Raises ConfigError (one line) for a directory that exists and is not empty or cannot
    be written, and for a run the script cannot reproduce (a multi-device strategy, model
    state, streamed data, a model's own fused pass). ``out`` is created whole or not at
    all: the files are written into a temporary sibling, moved into place last.
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
        # traced at the size the loss sees: one microbatch (the code works at any batch)
        micro = cfg.train.batch_size // cfg.train.grad_accum_steps
        x0, y0 = (np.asarray(a) for a in host_batch(r.data, sampler.batch(0)[:micro]))
        step_src, how = _step_source(r, params, x0, y0)
        opt_src = optimizer_source(cfg.optimizer, cfg.train.steps)
        check_optimizer(opt_src, r, params)
        script = script_text(r, step_src, how, opt_src, target)
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
    if not parallel.strategy_class(cfg.parallel.strategy).one_device:
        raise ConfigError(
            f"{HOW}: parallel.strategy={cfg.parallel.strategy} is not supported; eject with "
            "--set parallel.strategy=none (every strategy trains like one device on the same "
            "global batch, so that script reproduces this run's losses to float rounding)"
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
    prints the hand rules (``value_and_grad``), ``autodiff`` the forward calls (``loss``)
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
