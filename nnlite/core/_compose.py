"""Composition: children declared once, and what a call passes down to them.

A module names its children once, in ``setup()`` (``self.fc = nl.Linear(4, 8)``; lists and
dicts of modules too) or as fields holding modules (``Sequential.layers``). From them:

- ``init(key)`` is derived: one key per child that has params, split in declaration order
  (a lone child takes the key itself, as a hand-written ``init`` would pass it), params
  nested by the child's name (a list's elements split their child's key again); a module
  whose ``params_of`` names a child has that child's params as its own, not nested;
- ``uses_key``: a child that takes a key makes its parent take one;
- ``init_state()``: a child with state (``BatchNorm``) makes its parent stateful, its state
  nested by the same names as the params.

Each module call runs in a *frame* (a thread-local stack, Python-level, so it exists only
while the call traces). A child called without ``key=`` gets one from its caller's frame
(``fold_in`` by call order, only for children that use keys); a stateful child called
without ``state=`` gets its state from its caller's frame (found by the child module or its
params, at the same path as in the params) and the caller's frame collects the new state,
which the outermost stateful call returns: ``out, state = model(params, x, state=state,
train=True)``. A ValueError or TypeError raised inside names the layer path
(``blocks[2].mlp``) and the line of the user's code that made the call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import linecache
import os
import sys
import sysconfig
import threading
from collections.abc import Mapping
from typing import Any

import jax

from ._layer_hook import LayerCall, current_layer_hook
from ._params import ParamsDict

__all__ = [
    "call_in_frame",
    "children_of",
    "derived_init",
    "derived_init_state",
    "derived_uses_key",
    "is_child",
    "is_stateful",
]

_local = threading.local()


def _frames() -> list:
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = []
    return frames


def _is_module(value: Any) -> bool:
    # By a class marker, not isinstance: _module imports this file, not the reverse.
    return getattr(type(value), "_nnlite_module", False)


# -- children -----------------------------------------------------------------------------
def is_child(value: Any) -> bool:
    """A module, or a non-empty list/tuple/dict whose values are all children."""
    if _is_module(value):
        return True
    if isinstance(value, (tuple, list)):
        return bool(value) and all(is_child(v) for v in value)
    if isinstance(value, dict):
        return bool(value) and all(isinstance(k, str) and is_child(v) for k, v in value.items())
    return False


def params_name(attr: str) -> str:
    """The params key of a child attribute: ``blocks_`` nests under ``blocks`` (Python's
    trailing underscore, as ``class_``), so a child can share its name with a field."""
    return attr[:-1] if attr.endswith("_") and not attr.endswith("__") else attr


def children_of(module: Any) -> dict[str, Any]:
    """The declared children by params name: fields holding modules (in field order), then
    what ``setup()`` assigned (in assignment order)."""
    d = module.__dict__
    cached = d.get("_nnlite_children")
    if cached is not None:
        return cached
    out = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)}
    out = {k: v for k, v in out.items() if is_child(v)}
    out.update(d.get("_nnlite_setup_children", {}))
    if not d.get("_nnlite_in_setup"):
        object.__setattr__(module, "_nnlite_children", out)
    return out


def _walk(child: Any, path: tuple):
    """``(path, module)`` for every module in a child structure."""
    if isinstance(child, (tuple, list)):
        for i, c in enumerate(child):
            yield from _walk(c, (*path, i))
    elif isinstance(child, dict):
        for k, c in child.items():
            yield from _walk(c, (*path, k))
    else:
        yield path, child


def params_child(module: Any) -> Any:
    """The child named by the module's ``params_of`` (its params are the module's own), or
    None. A TypeError unless it names a declared child, the only one with params."""
    name = getattr(module, "params_of", None)
    if name is None:
        return None
    kids = children_of(module)
    child = kids.get(params_name(name))
    others = [k for k, c in kids.items() if k != params_name(name) and _has_params(c)]
    if not _is_module(child) or others:
        why = f"also {', '.join(others)} hold params" if _is_module(child) else "no such module"
        raise TypeError(
            f"{type(module).__name__}.params_of = {name!r} must name its one child with "
            f"params (a module declared in setup() or a field); {why} (children: "
            f"{', '.join(kids) or 'none'})"
        )
    return child


def child_modules(module: Any):
    """``(params path, module)`` for every module among the declared children: below the
    child's name, or at the root for the ``params_of`` child."""
    inner = params_name(getattr(module, "params_of", None) or "")
    for name, child in children_of(module).items():
        yield from _walk(child, () if name == inner else (name,))


def is_stateful(module: Any) -> bool:
    return callable(getattr(module, "init_state", None))


def derived_uses_key(module: Any) -> bool:
    return any(bool(getattr(m, "uses_key", False)) for _, m in child_modules(module))


def derived_stateful(module: Any) -> bool:
    d = module.__dict__
    if "_nnlite_stateful" not in d:
        object.__setattr__(
            module, "_nnlite_stateful", any(is_stateful(m) for _, m in child_modules(module))
        )
    return d["_nnlite_stateful"]


_SKIP = object()


def _has_params(child: Any) -> bool:
    if isinstance(child, (tuple, list)):
        return any(_has_params(c) for c in child)
    if isinstance(child, dict):
        return any(_has_params(c) for c in child.values())
    return bool(getattr(child, "has_params", True))


def _split(key: Any, n: int) -> list:
    if key is None:
        return [None] * n
    return list(jax.random.split(key, n)) if n else []


def _init_child(child: Any, key: Any) -> Any:
    if isinstance(child, (tuple, list)):
        # Every element gets a key (as Sequential): an index names the same layer whatever
        # its neighbours hold; an element without params keeps its place with {}.
        out = [_init_child(c, k) for c, k in zip(child, _split(key, len(child)), strict=True)]
        return [ParamsDict() if p is _SKIP else p for p in out]
    if isinstance(child, dict):
        names = [k for k, c in child.items() if _has_params(c)]
        keys = dict(zip(names, _split(key, len(names)), strict=True))
        return ParamsDict({k: _init_child(child[k], keys[k]) for k in names})
    if not getattr(child, "has_params", True):
        return _SKIP
    return child.init(key)


def derived_init(module: Any, key: Any) -> ParamsDict:
    """Params of ``module`` from its declared children: one key per child with params, in
    declaration order (``jax.random.split(key, n)``; a lone child takes ``key`` itself),
    nested by the child's name; children without params (pools, activations, dropout) take
    no key and no entry. The ``params_of`` child's params are the module's own."""
    kids = {k: c for k, c in children_of(module).items() if _has_params(c)}
    if not children_of(module) and getattr(module, "has_params", True):
        raise NotImplementedError(
            f"{type(module).__name__} declares no children (assign them in setup(): "
            "self.fc = nl.Linear(...)) and does not define init(key)"
        )
    transparent = params_child(module)
    if transparent is not None:
        return transparent.init(key)
    keys = [key] if len(kids) == 1 else _split(key, len(kids))
    return ParamsDict({n: _init_child(c, k) for (n, c), k in zip(kids.items(), keys, strict=True)})


def derived_param_axes(module: Any) -> ParamsDict | None:
    """The logical axes of a derived ``init``'s params: each child's own declaration (or
    its unnamed axes), nested as ``derived_init`` nests the params."""
    from ._axes import param_axes

    def axes(child: Any) -> Any:
        if isinstance(child, (tuple, list)):
            return [ParamsDict() if s is _SKIP else s for s in map(axes, child)]
        if isinstance(child, dict):
            return ParamsDict({k: axes(c) for k, c in child.items() if _has_params(c)})
        return param_axes(child) if getattr(child, "has_params", True) else _SKIP

    transparent = params_child(module)
    if transparent is not None:
        return param_axes(transparent)
    kids = {k: c for k, c in children_of(module).items() if _has_params(c)}
    return ParamsDict({n: axes(c) for n, c in kids.items()})


def _state_child(child: Any) -> Any:
    if isinstance(child, (tuple, list)):
        if not any(is_stateful(m) for _, m in _walk(child, ())):
            return _SKIP
        out = [_state_child(c) for c in child]
        return [ParamsDict() if s is _SKIP else s for s in out]
    if isinstance(child, dict):
        out = {k: _state_child(c) for k, c in child.items()}
        out = {k: s for k, s in out.items() if s is not _SKIP}
        return ParamsDict(out) if out else _SKIP
    return child.init_state() if is_stateful(child) else _SKIP


def derived_init_state(module: Any) -> ParamsDict:
    """State of ``module`` from its stateful children, nested by the params' names."""
    transparent = params_child(module)
    if transparent is not None:
        return transparent.init_state() if is_stateful(transparent) else ParamsDict()
    out = {n: _state_child(c) for n, c in children_of(module).items()}
    return ParamsDict({n: s for n, s in out.items() if s is not _SKIP})


# -- the call signature of a class -------------------------------------------------------------
@functools.cache
def _accepts(fn: Any) -> tuple[bool, bool, bool]:
    """Whether ``fn`` takes ``key``, ``state`` and ``train``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True, False, False
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return tuple(n in params or (var_kw and n == "key") for n in ("key", "state", "train"))


# -- frames ---------------------------------------------------------------------------------
class _Frame:
    """One module call in progress."""

    __slots__ = (
        "module", "params", "parent", "key", "n_keys", "state", "train", "updates",
        "_mods", "_ids", "segment",
    )  # fmt: skip

    def __init__(self, module, params, parent, key, segment):
        self.module, self.params, self.parent, self.key = module, params, parent, key
        self.n_keys, self.state, self.train, self.updates = 0, None, False, {}
        self._mods = self._ids = None
        self.segment = segment  # this call's path below its parent (None: not found)

    @property
    def root(self) -> _Frame:
        f = self
        while f.parent is not None:
            f = f.parent
        return f

    def next_key(self) -> Any:
        k = jax.random.fold_in(self.key, self.n_keys)
        self.n_keys += 1
        return k

    def locate(self, module: Any, params: Any) -> tuple | None:
        """The path of a child call below this frame's module: by the child module among
        the declared children, else by its params among this call's params."""
        if self._mods is None:
            seen: dict[int, Any] = {}
            for path, m in _declared_paths(self.module, ()):
                seen[id(m)] = None if id(m) in seen else path  # twice: ambiguous
            self._mods = seen
            ids: dict[int, tuple] = {}
            _param_paths(self.params, (), ids)
            self._ids = ids
        path = self._mods.get(id(module))
        if path is None and params is not None:
            path = self._ids.get(id(params))
        return path

    def path(self) -> str:
        parts, f = [], self
        while f.parent is not None:
            parts.append(f.name())
            f = f.parent
        return ".".join(reversed(parts))

    def name(self) -> str:
        """This call's name below its parent: its params path, else (params at the
        parent's root) the ``params_of`` name or the class name."""
        if self.segment:
            return _format(self.segment)
        owner = self.parent.module
        if getattr(owner, "params_of", None) and params_child(owner) is self.module:
            return owner.params_of
        return type(self.module).__name__

    def current_state(self, path: tuple) -> Any:
        if path in self.updates:
            return self.updates[path]
        node = self.state
        for p in path:
            try:
                node = node[p]
            except (KeyError, IndexError, TypeError):
                return _SKIP
        return node

    def new_state(self) -> Any:
        state = self.state
        for path, value in self.updates.items():
            state = _replace(state, path, value)
        return state


def _declared_paths(module: Any, prefix: tuple):
    for path, m in child_modules(module):
        yield (*prefix, *path), m
        yield from _declared_paths(m, (*prefix, *path))


def _param_paths(node: Any, path: tuple, out: dict) -> None:
    if isinstance(node, (ParamsDict, Mapping)):
        out.setdefault(id(node), path)
        for k in node:
            _param_paths(node[k], (*path, k), out)
    elif isinstance(node, (list, tuple)):
        out.setdefault(id(node), path)
        for i, v in enumerate(node):
            _param_paths(v, (*path, i), out)


def _format(path: tuple) -> str:
    s = ""
    for p in path:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s


def _replace(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, (list, tuple)):
        out = list(tree)
        out[head] = _replace(out[head], rest, value)
        return type(tree)(out) if isinstance(tree, tuple) else out
    out = ParamsDict({k: tree[k] for k in tree})
    out[head] = _replace(tree[head], rest, value)
    return out


# -- the call -------------------------------------------------------------------------------
def _drop_params(module: Any, args: tuple) -> tuple:
    """A layer without params is called as ``layer(x)``; ``layer(None, x)`` and
    ``layer(ParamsDict(), x)`` (what Sequential and older code pass) work too."""
    if len(args) >= 2:
        p = args[0]
        if p is None or (isinstance(p, (ParamsDict, Mapping)) and not len(p)):
            return args[1:]
        if isinstance(p, (ParamsDict, Mapping)):
            raise TypeError(
                f"{module._args_repr()} has no params, but was given a ParamsDict with keys "
                f"{', '.join(p)}; call it as layer(x)"
            )
    return args


# Functions called after each module call as ``f(frame, module, args, kwargs, out)``
# (nl.summary appends one while it traces a model; empty otherwise).
CALL_OBSERVERS: list = []


def call_in_frame(module: Any, call: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``call(module, *args, **kwargs)`` (a class's own ``__call__``) in a frame: the
    key, the state and the error locations its children need."""
    params = None
    if not getattr(module, "has_params", True):
        args = _drop_params(module, args)
    else:
        params = args[0] if args else kwargs.get("params")
    frames = _frames()
    parent = frames[-1] if frames else None
    takes_key, takes_state, takes_train = _accepts(call)
    key = _key_for(module, kwargs, parent)
    segment = parent.locate(module, params) if parent is not None else None
    frame = _Frame(module, params, parent, key, segment)
    if takes_key:
        kwargs["key"] = key
    else:
        kwargs.pop("key", None)
    records, returns_pair = _state_for(frame, kwargs, takes_state, takes_train)

    frames.append(frame)
    try:
        out = _run(frame, call, args, kwargs, len(frames) - 1)
    except (ValueError, TypeError) as e:
        _note_where(e, frame)
        if parent is None:
            _annotate(e, module)
        raise
    finally:
        frames.pop()
    if records:  # the new state goes to the caller's frame, at this call's path
        if takes_state:
            out, parent.updates[segment] = out
        else:
            parent.updates[segment] = frame.new_state()
    return (out, frame.new_state()) if returns_pair else out


def _key_for(module: Any, kwargs: dict, parent: _Frame | None) -> Any:
    """The call's key: given, or drawn from the caller's frame for a child that uses one."""
    uses_key = parent is not None and getattr(module, "uses_key", False)
    if "key" in kwargs:
        key = kwargs["key"]
    elif uses_key and parent.key is not None:
        key = parent.next_key()
    else:
        key = None
    if key is None and uses_key:
        root = parent.root
        if root.key is None and not getattr(root.module, "uses_key", False):
            name = type(root.module).__name__
            raise ValueError(
                f"{module._args_repr()} in {name} draws random numbers, but {name}.uses_key "
                "is False, so it is never given a key (its dropout would be off in training): "
                "declare the layer in setup() (uses_key is then derived) or set uses_key = True"
            )
    return key


def _state_for(frame: _Frame, kwargs: dict, takes_state: bool, takes_train: bool):
    """Give the call its state: passed, or found in the caller's frame at the call's path.
    Returns ``(records, returns_pair)``: whether the new state goes back to the caller's
    frame, and whether the call returns ``(out, new_state)`` (the outermost stateful call)."""
    module, parent = frame.module, frame.parent
    in_parent = "state" not in kwargs and parent is not None and parent.state is not None
    if takes_state:  # the layer threads its own state (BatchNorm, a hand-written model)
        if in_parent:
            kwargs["state"] = _parent_state(frame)
            if takes_train:
                kwargs.setdefault("train", parent.train)
        return in_parent, False
    if not derived_stateful(module):
        return False, False
    if in_parent:
        frame.state, frame.train = _parent_state(frame), bool(kwargs.pop("train", parent.train))
    elif "state" in kwargs:
        frame.state, frame.train = kwargs.pop("state"), bool(kwargs.pop("train", False))
    else:
        raise ValueError(
            f"{module._args_repr()} has state (its BatchNorm's running statistics): call it as "
            "out, state = model(params, x, state=state, train=...) with state from "
            "model.init_state()"
        )
    if frame.state is None:
        raise ValueError(f"{module._args_repr()}: state is None; pass model.init_state()")
    return in_parent, not in_parent


def _parent_state(frame: _Frame) -> Any:
    """The state of a child call, found in its caller's frame at the call's params path."""
    module, parent, path = frame.module, frame.parent, frame.segment
    found = _SKIP if path is None else parent.current_state(path)
    if found is not _SKIP:
        return found
    where = type(parent.module).__name__ + (f".{parent.path()}" if parent.path() else "")
    if path is None:
        raise ValueError(
            f"{module._args_repr()} called inside {where} is not one of its declared "
            "children and was not given params from its params: cannot find its state; "
            "declare it in setup() or pass state= yourself"
        )
    raise ValueError(
        f"{module._args_repr()} called inside {where} as {_format(path)}: the state has no "
        f"{_format(path)} (build the state with init_state())"
    )


def _run(frame: _Frame, call: Any, args: tuple, kwargs: dict, depth: int) -> Any:
    module = frame.module
    hook = current_layer_hook() if frame.params is not None else None
    if hook is None:
        out = call(module, *args, **kwargs)
    else:  # per-layer diagnostics and policies (_layer_hook.py)
        run = functools.partial(call, module)
        out = hook(LayerCall(frame.path(), depth, module, args, kwargs, run))
    for observe in CALL_OBSERVERS:  # nl.summary records each layer call (trace time only)
        observe(frame, module, args, kwargs, out)
    return out


# -- errors that point at the user's line ---------------------------------------------------
def _library_dirs() -> tuple[str, ...]:
    import jax as _jax
    import numpy as _np

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nnlite/
    dirs = [here, os.path.dirname(_jax.__file__), os.path.dirname(_np.__file__)]
    for name in ("jaxlib", "optax", "equinox"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(mod.__file__))
    dirs.append(sysconfig.get_paths()["stdlib"])
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


_LIBRARY: tuple[str, ...] | None = None


def _user_site(tb: Any) -> tuple[str, int] | None:
    """The innermost traceback entry outside nnlite, JAX, NumPy and the standard library:
    the user's line."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library_dirs()
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        real = os.path.realpath(filename)
        if not real.startswith(_LIBRARY) and not filename.startswith("<"):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _note_where(e: BaseException, frame: _Frame) -> None:
    if hasattr(e, "_nnlite_where") or hasattr(e, "primitive"):  # ManualGradError: its own
        return
    try:
        e._nnlite_where = frame.path()  # type: ignore[attr-defined]
    except AttributeError:
        pass


def _annotate(e: BaseException, root: Any) -> None:
    path = getattr(e, "_nnlite_where", None)
    if path is None or getattr(e, "_nnlite_annotated", False):
        return
    # The traceback is whole here, at the outermost call: its innermost entry outside
    # the libraries is the user's line (the call that failed, or the failing jnp line).
    site = _user_site(e.__traceback__)
    if not path and site is None:  # the layer called directly: its message says it all
        return
    layer = type(root).__name__ + (f".{path}" if path else "")
    place = f"in layer {layer}"
    if site is not None:
        filename, line = site
        src = linecache.getline(filename, line).strip()
        place += f", at {filename}:{line}" + (f": {src}" if src else "")
    msg = str(e)
    first, _, rest = msg.partition("\n")
    new = f"{first} ({place})" + (f"\n{rest}" if rest else "")
    e._nnlite_annotated = True  # type: ignore[attr-defined]
    if len(e.args) == 1 and isinstance(e.args[0], str) and e.args[0] == msg:
        e.args = (new,)
    else:
        e.add_note(f"({place})")
