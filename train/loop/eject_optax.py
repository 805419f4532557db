"""``--eject``: the config's optax chain as the script's source (the tables of
``train/optim/``), checked against the run's optimizer, and the import lines of a user's
modules."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from pathlib import Path

import jax
import numpy as np

from ..errors import ConfigError
from ..optim.section import OptimizerConfig
from .build import Run, init_compiler_options

HOW = "--eject writes a one-device script of a plain train step"


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


def with_paths(imports: list[str]) -> list[str]:
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


def check_optimizer(src: str, r: Run, params) -> None:
    """The emitted chain must update as the run's optimizer does: one update compared."""
    ns: dict = {}
    exec(_PRELUDE + src, ns)  # noqa: S102 -- our own generated source
    mine = ns["make_optimizer"]()
    grads = jax.tree.map(lambda p: np.cos(np.asarray(p, np.float32) + 1).astype(p.dtype), params)

    # one program (run eagerly, each optax op would compile on its own), compiled fast
    @functools.partial(jax.jit, compiler_options=init_compiler_options())
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
            "update as the run's optimizer does (train/loop/eject_optax.py is behind "
            "train/optim/named.py)"
        )


_PRELUDE = "import sys\nimport jax\nimport optax\n"
