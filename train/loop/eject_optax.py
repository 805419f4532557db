"""``--eject``: the config's optax chain as the script's source (the tables of
``train/optim/``), checked against the run's optimizer, and the import lines of a user's
modules."""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import re
import sys
from pathlib import Path

import jax
import numpy as np

from ..errors import ConfigError
from ..optim import GIVEN
from ..optim.named import rule_call, schedule_call
from ..optim.section import OptimizerConfig
from ..registry import PACKAGE
from .build import Run, init_compiler_options

HOW = "--eject writes a one-device script of a plain train step"


# -- the optimizer: the config's optax chain as source ---------------------------------------


class _Name:
    """A variable of the script (``lr``), written as its name."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _call(fn, kwargs: dict, imports: list[str], defs: dict[str, str]) -> str:
    """``fn(key=value, ...)`` as source; ``fn`` defined in the script (``defs``: the
    trainer's own functions, copied with the helpers they call) or imported (a user's)."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    if not getattr(fn, "__module__", "").startswith(PACKAGE + "."):
        return f"{_import_line(f'{fn.__module__}:{fn.__qualname__}', imports)}({args})"
    _define(fn, defs)
    return f"{fn.__name__}({args})"


def _define(fn, defs: dict[str, str]) -> None:
    """``fn``'s source into ``defs``, after that of the functions of its module it calls."""
    if fn.__name__ in defs:
        return
    defs[fn.__name__] = ""  # a placeholder against recursion
    codes = [fn.__code__, *(c for c in fn.__code__.co_consts if inspect.iscode(c))]
    used = (i.argval for c in codes for i in dis.get_instructions(c) if i.opname == "LOAD_GLOBAL")
    for name in dict.fromkeys(used):
        helper = fn.__globals__.get(name)
        if inspect.isfunction(helper) and helper.__module__ == fn.__module__:
            _define(helper, defs)
    defs.pop(fn.__name__)
    defs[fn.__name__] = inspect.getsource(fn)


def optimizer_source(oc: OptimizerConfig, total_steps: int) -> str:
    """``def make_optimizer(): ...`` building the optax optimizer ``oc`` describes from the
    same functions ``train.optim.named.build_optimizer`` calls (the trainer's copied into
    the script, a user's imported)."""
    imports: list[str] = []
    defs: dict[str, str] = {}
    body: list[str] = []
    if oc.name == GIVEN:
        raise ConfigError(f"{HOW}: optimizer.name=given has no source")
    lr = None
    if not oc.is_factory:
        fn, kwargs = schedule_call(oc, total_steps)
        body += ["# step -> learning rate", f"lr = {_call(fn, kwargs, imports, defs)}"]
        lr = _Name("lr")
    fn, kwargs = rule_call(oc, lr)
    body.append(f"parts = {_call(fn, kwargs, imports, defs)}")
    body.append("if not hasattr(parts, 'update'):  # a list of transformations, chained")
    body.append("    parts = list(parts)")
    body.append("else:")
    body.append("    parts = [parts]")
    if oc.clip_norm is not None:
        body.append(f"parts = [optax.clip_by_global_norm({oc.clip_norm!r}), *parts]")
    body.append("return parts[0] if len(parts) == 1 else optax.chain(*parts)")
    lines = list(dict.fromkeys(imports))
    for src in defs.values():
        lines += ["", "", *src.rstrip("\n").splitlines()]
    lines += ["", "", "def make_optimizer():"] + [f"    {b}" for b in body]
    return "\n".join(lines).strip("\n") + "\n"


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
    if not same:  # the source differs from what the trainer built
        raise ConfigError(
            f"{HOW}: optimizer.name={r.cfg.optimizer.name}: the ejected optax chain does not "
            "update as the run's optimizer does"
        )


_PRELUDE = "import sys\nimport jax\nimport optax\n"
