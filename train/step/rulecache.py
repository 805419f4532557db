"""Which sets of a user's hand rules passed ``loss.check_rules`` already, by their code.

A run whose rules, model and shapes are those of a run that checked them skips the check:
the key is a hash of each rule's code (its source, or its bytecode where there is none;
its defaults and closure; the functions and constants of its module it names, followed
recursively) and of what the check ran on (the shapes and dtypes of the params and the
batch, the model's hyperparameters, the precision and policies, jax's version). Only passes
are stored: a wrong rule is checked again at every run. The file is
``$NNLITE_CACHE/checked_rules.json`` (else ``~/.cache/nnlite``); a cache that cannot be
read or written costs a check, nothing else.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import marshal
import os
import tempfile
import time
import types
from pathlib import Path

import jax
import numpy as np

import nnlite as nl

from ..data.text.corpus import cache_dir

FILE = "checked_rules.json"
KEEP = 512  # entries kept, the newest


def path() -> Path:
    return cache_dir() / FILE


def _scalar(v) -> bool:
    return isinstance(v, (bool, int, float, complex, str, bytes, type(None)))


def _code(fn) -> str:
    """A function's code: its source, else its marshalled bytecode."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        return marshal.dumps(code).hex() if code is not None else repr(type(fn))


def _names(code: types.CodeType) -> set[str]:
    """The global names ``code`` (and the functions nested in it) reads."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def fingerprint(fn, h, seen: set | None = None) -> None:
    """Feed ``h`` with what ``fn`` computes by (see the module docstring)."""
    seen = set() if seen is None else seen
    fn = getattr(fn, "__wrapped__", fn)  # functools.wraps: the function itself
    if id(fn) in seen:
        return
    seen.add(id(fn))
    h.update(_code(fn).encode())
    h.update(repr(getattr(fn, "__defaults__", None)).encode())
    h.update(repr(getattr(fn, "__kwdefaults__", None)).encode())
    values = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _has(c)]
    code, module = getattr(fn, "__code__", None), getattr(fn, "__module__", None)
    if code is not None:
        glob = getattr(fn, "__globals__", {})
        values += [glob[n] for n in sorted(_names(code)) if n in glob]
    for v in values:
        if _scalar(v):
            h.update(repr(v).encode())
        elif isinstance(v, (np.ndarray, np.generic, jax.Array)) and v.size <= MAX_CONSTANT:
            a = np.asarray(v)  # a constant array the rule reads
            h.update(f"{a.dtype}{a.shape}".encode() + a.tobytes())
        elif callable(getattr(v, "f_vjp", None)):
            fingerprint(v.f, h, seen)  # another rule of the user's, called inside
            fingerprint(v.f_vjp, h, seen)
        elif isinstance(v, types.FunctionType) and _users(v.__module__ or module):
            fingerprint(v, h, seen)  # a helper of the user's: its code counts too


#: Libraries whose functions a rule calls as they are: not fingerprinted.
LIBRARIES = frozenset({"jax", "jaxlib", "numpy", "nnlite", "optax", "scipy", "math"})
MAX_CONSTANT = 1 << 20  # elements of a module-level array hashed with the rule


def _users(module: str | None) -> bool:
    return (module or "").split(".")[0] not in LIBRARIES


def _has(cell) -> bool:
    try:
        _ = cell.cell_contents  # an empty cell (a name not yet bound) raises
    except ValueError:
        return False
    return True


def key(rules, arrays, context: str) -> str:
    """The cache key of checking ``rules`` on ``arrays`` (a pytree: the params, batch and
    keyword arguments of the check) in ``context`` (the model, precision, policies)."""
    h = hashlib.sha256()
    for rule in rules:
        fingerprint(rule.f, h)
        fingerprint(rule.f_vjp, h)
    leaves, tree = jax.tree.flatten(arrays)
    h.update(str(tree).encode())
    h.update(repr([str(jax.typeof(a)) for a in leaves]).encode())
    h.update(f"{context}|jax {jax.__version__}|nnlite {nl.__version__}".encode())
    return h.hexdigest()


def _read() -> dict:
    try:
        with open(path()) as f:
            data = json.load(f)
        return {k: v for k, v in data.items() if isinstance(v, dict)}
    except (OSError, ValueError, AttributeError):  # absent, unreadable, not a JSON object
        return {}


def seen(k: str) -> bool:
    """Whether rules with key ``k`` passed the check before."""
    return k in _read()


def store(k: str, names: list[str]) -> None:
    """Record that rules with key ``k`` (``names``, for a reader) passed."""
    data = _read()
    data[k] = {"rules": names, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    data = dict(sorted(data.items(), key=lambda kv: str(kv[1].get("when")))[-KEEP:])
    target = path()
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".checked_rules.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, target)  # readers see the old file or the new one, never half
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        # not stored: the next run checks again
