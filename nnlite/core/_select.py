"""Choosing params by path: globs over ParamsDict paths, and freezing what they choose.

One notation for every feature that names params (LoRA targets, the trainer's
``optimizer.frozen`` and ``optimizer.param_groups``): ``fnmatch`` globs over the paths a
ParamsDict prints (``/blocks[0]/attn/q/W``), where ``*`` spans ``/``. A glob may leave
out the leading ``/`` and may write a list index as a path part (``blocks/0/*`` is
``/blocks[0]/*``); ``[0]`` in a glob is the index 0, not a character class.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from ._params import format_path

__all__ = ["freeze", "match_paths", "param_paths", "path_mask"]

_INDEX = re.compile(r"\[(\d+)\]")


def param_paths(params: Any) -> list[str]:
    """Every leaf's path (``/blocks[0]/attn/q/W``), in leaf order."""
    return [format_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _forms(path: str) -> tuple[str, ...]:
    """The spellings a glob may match: ``/a[0]/W``, ``a[0]/W``, ``/a/0/W``, ``a/0/W``."""
    slashed = _INDEX.sub(r"/\1", path)
    return (path, path.lstrip("/"), slashed, slashed.lstrip("/"))


def _pattern(glob: str) -> str:
    """``glob`` with a literal list index ``[N]`` escaped (fnmatch reads it as a class)."""
    return _INDEX.sub(lambda m: f"[[]{m.group(1)}[]]", glob)


def matches(glob: str, path: str) -> bool:
    """Whether ``glob`` (the notation of the module docstring) matches ``path``."""
    pat = _pattern(glob)
    return any(fnmatch.fnmatchcase(form, pat) for form in _forms(path))


def match_paths(globs: Iterable[str], paths: Sequence[str], where: str = "glob") -> list[set[str]]:
    """For each glob, the ``paths`` it matches. A glob that matches none is a ValueError
    naming it (with ``where``) and listing the paths there are."""
    paths = list(paths)
    out = []
    for glob in globs:
        if not isinstance(glob, str) or not glob.strip():
            raise ValueError(f"{where}: expected a glob over param paths, got {glob!r}")
        hit = {p for p in paths if matches(glob.strip(), p)}
        if not hit:
            shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
            raise ValueError(f"{where}: {glob!r} matches no param; the params are: {shown}")
        out.append(hit)
    return out


def path_mask(params: Any, globs: Iterable[str], where: str = "glob") -> Any:
    """A tree like ``params`` with ``True`` where a leaf's path matches one of ``globs``.

    Example:
        >>> import jax
        >>> import nnlite as nl
        >>> p = jax.jit(nl.FFN(3, (4,), 2).init)(jax.random.key(0))
        >>> m = path_mask(p, ["layers/0/*"])
        >>> [bool(x) for x in jax.tree.leaves(m)]
        [True, True, False, False]
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [format_path(p) for p, _ in leaves]
    chosen = set().union(*match_paths(globs, paths, where))
    return jax.tree.unflatten(treedef, [p in chosen for p in paths])


def freeze(optimizer: Any, trainable: Any | Callable[[Any], Any], *, label: str = "train") -> Any:
    """``optimizer`` on the params where ``trainable`` is True only: every other param gets
    a zero update and no optimizer state (``optax.multi_transform`` with
    ``optax.set_to_zero``), so weight decay cannot move it and Adam keeps no moments for it.

    ``trainable``: a tree of bools like the params, or a function of the params giving one;
    ``label``: the trained part's key in the optimizer state (``inner_states/<label>``).

    Example:
        >>> import jax, optax
        >>> import nnlite as nl
        >>> p = jax.jit(nl.FFN(3, (4,), 2).init)(jax.random.key(0))
        >>> opt = freeze(optax.adamw(0.1), lambda q: nl.path_mask(q, ["layers/1/*"]))
        >>> grads = jax.tree.map(jax.numpy.ones_like, p)
        >>> first_step = jax.jit(lambda grads, p: opt.update(grads, opt.init(p), p))
        >>> updates, _ = first_step(grads, p)
        >>> float(abs(updates.layers[0].W).max()), float(abs(updates.layers[1].W).max()) > 0
        (0.0, True)
    """
    import optax

    def labels(params):
        mask = trainable(params) if callable(trainable) else trainable
        return jax.tree.map(lambda m: label if m else "frozen", mask)

    return optax.multi_transform({label: optimizer, "frozen": optax.set_to_zero()}, labels)
