"""ParamsDict: a nested, attribute-access parameter container that JAX sees as a pytree."""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["ParamsDict", "format_path", "leaf_str"]


# Key-path entries are JAX's own ``DictKey``: orbax and ``jax.tree_util.keystr`` read
# them (a custom entry type breaks both), and a ParamsDict built from a plain dict keeps
# the dict's key paths, so a checkpoint keyed by paths reads back either way.
# (``GetAttrKey`` would also satisfy orbax and keystr, but prints ``.my key`` for keys
# that are not identifiers; optax's tree_get walks only real dicts, whichever entry.)
# nnlite's own printing, ``/layers[0]/W``, comes from ``format_path``.
_DictKey = jax.tree_util.DictKey


class _Aux:
    """Treedef auxiliary data: sorted field names (the identity) plus insertion order.

    Equality and hashing use only the sorted names and the static (string) fields, so two
    ParamsDicts with the same fields have equal treedefs whatever order they were built in;
    the insertion order rides along so that unflattening preserves how the tree prints.
    Everything flatten/unflatten needs is precomputed here once per set of fields.
    """

    __slots__ = ("keys", "order", "static", "_hash", "get", "template", "path_keys")

    def __init__(self, keys: tuple[str, ...], order: tuple[str, ...], static: tuple):
        self.keys = keys  # dynamic (pytree child) fields, sorted
        self.order = order  # every field, insertion order
        self.static = static  # ((name, value), ...) for string fields, sorted
        self._hash = hash((keys, static))
        self.get = _tuple_getter(keys)  # data -> children tuple, in `keys` order
        # Unflatten copies this and fills in the children: insertion order for free.
        self.template = dict.fromkeys(order)
        self.template.update(static)
        self.path_keys = tuple(_DictKey(k) for k in keys)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Aux)
            and self._hash == other._hash
            and self.keys == other.keys
            and self.static == other.static
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"ParamsDictKeys{self.keys}"


def _tuple_getter(keys: tuple[str, ...]):
    """A fast ``data -> tuple(data[k] for k in keys)``; itemgetter returns a bare value for
    one key, so that case (and none) gets its own function."""
    if len(keys) >= 2:
        return operator.itemgetter(*keys)
    if len(keys) == 1:
        (k,) = keys
        return lambda data: (data[k],)
    return lambda data: ()


_SLOTS = frozenset(("_data", "_aux", "_children"))

_SEGMENT = re.compile(r"/([^/\[\]]+)|\[(\d+)\]")


class ParamsDict:
    """Nested parameter container with attribute and item access.

    Values are arrays, Python scalars, strings (kept static: they are not pytree leaves, so
    ``jit`` accepts a ParamsDict holding them), nested ParamsDicts, and lists or tuples of
    ParamsDicts. Iteration order, printing and ``items()`` follow insertion order; the pytree
    flattening sorts field names, so treedefs do not depend on insertion order. (One
    consequence: a jitted function's cached output treedef keeps the insertion order of
    the call that traced it, so a later call with the same fields in another order gets
    its result in the first call's order.)

    Example:
        >>> import jax.numpy as jnp
        >>> p = ParamsDict()
        >>> p.a = 4
        >>> p.layer = ParamsDict(W=jnp.zeros((5, 7)), b=jnp.zeros(7))
        >>> p.print()
        /a: 4
        /layer/W: f32[5,7]
        /layer/b: f32[7]
        >>> p["layer"].W.shape
        (5, 7)
    """

    # _data: the fields, insertion order. _aux: cached treedef aux (None once stale).
    # _children: the pytree children in aux.keys order, set by unflatten; the _data dict of
    # an unflattened node is built from them on first use (see __getattr__), so a jit
    # output that is only passed back into jit never pays for building dicts.
    __slots__ = ("_data", "_aux", "_children")

    def __init__(self, *args: Mapping[str, Any], **kwargs: Any):
        _set_data(self, {})
        _set_aux(self, None)
        _set_children(self, None)
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    # -- mapping protocol -------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails, i.e. for keys and for unset slots.
        if name == "_data":
            return self._build_data()
        if name in _SLOTS:  # unset (a copy being restored): no recursion into _data
            raise AttributeError(name)
        data = self._data
        try:
            return data[name]
        except KeyError:
            if name.startswith("__"):  # copy/pickle probes: plain AttributeError
                raise AttributeError(name) from None
            raise AttributeError(
                f"ParamsDict has no key {name!r}; keys are: {', '.join(data) or '(none)'}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        del self[name]

    def __getitem__(self, name: str) -> Any:
        try:
            return self._data[name]
        except KeyError:
            raise KeyError(
                f"ParamsDict has no key {name!r}; keys are: {', '.join(self._data) or '(none)'}"
            ) from None

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(name, str) or name not in self._data:  # a new key: check it once
            _check_key(name)
        if isinstance(value, Mapping) and not isinstance(value, ParamsDict):
            value = ParamsDict(value)
        self._data[name] = value
        _set_aux(self, None)
        _set_children(self, None)

    def __delitem__(self, name: str) -> None:
        del self._data[name]
        _set_aux(self, None)
        _set_children(self, None)

    def __contains__(self, name: object) -> bool:
        return name in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __dir__(self):
        return [*super().__dir__(), *self._data]

    def keys(self):
        return self._data.keys()

    def values(self):
        return self._data.values()

    def get(self, name: str, default: Any = None) -> Any:
        return self._data.get(name, default)

    def __eq__(self, other: object) -> bool:
        """Structural equality; arrays compare with ``np.array_equal``."""
        if not isinstance(other, ParamsDict) or set(self._data) != set(other._data):
            return False
        return all(_leaf_equal(self._data[k], other._data[k]) for k in self._data)

    def __hash__(self) -> int:
        """Hash of the keys and leaves, for a ParamsDict of static values (a ``jit`` static
        argument, as in the seed); arrays are unhashable, so their ParamsDict is too.

        Like the seed's, the hash is of the current contents: do not change a ParamsDict
        while it is a key of a dict or a cached static argument.
        """
        return hash(_hashable(self, ""))

    # copy.copy/deepcopy restore slots with setattr, which __setattr__ would turn into a
    # key; restore them directly instead.
    def __getstate__(self) -> dict[str, Any]:
        return {"_data": self._data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _set_data(self, dict(state["_data"]))
        _set_aux(self, None)
        _set_children(self, None)

    def __repr__(self) -> str:
        lines = [f"  {path}: {leaf_str(leaf)}" for path, leaf in self.items()]
        return "ParamsDict(\n" + "\n".join(lines) + "\n)" if lines else "ParamsDict()"

    # -- pytree -----------------------------------------------------------------------------
    def _get_aux(self) -> _Aux:
        aux = self._aux
        if aux is None:
            data = self._data
            static = tuple(sorted((k, v) for k, v in data.items() if isinstance(v, str)))
            keys = tuple(sorted(k for k, v in data.items() if not isinstance(v, str)))
            aux = _Aux(keys, tuple(data), static)
            _set_aux(self, aux)
        return aux

    def _build_data(self) -> dict[str, Any]:
        """The ``_data`` of an unflattened node: the aux's template filled with children."""
        children = self._children
        if children is None:
            raise AttributeError("_data")
        aux = self._aux
        data = aux.template.copy()
        data.update(zip(aux.keys, children))  # noqa: B905 (unflatten got one per key)
        _set_data(self, data)
        return data

    # The three functions below run once per node at every flatten/unflatten (each jit
    # dispatch): keep them free of anything that could be computed once into the _Aux.
    # Invariant: _children is not None only while _aux is set and matches _data.
    def _tree_flatten(self):
        children = self._children
        if children is not None:
            return children, self._aux
        aux = self._aux
        if aux is None:
            aux = self._get_aux()
        return aux.get(self._data), aux

    def _tree_flatten_with_keys(self):
        children = self._children
        if children is None:
            children = self._tree_flatten()[0]
        return list(zip(self._aux.path_keys, children)), self._aux  # noqa: B905 (same length)

    @staticmethod
    def _tree_unflatten(aux: _Aux, children) -> ParamsDict:
        new = _new(ParamsDict)
        _set_aux(new, aux)
        # JAX passes a fresh tuple; anything else is copied so that it cannot change later.
        _set_children(new, children if type(children) is tuple else tuple(children))
        return new

    # -- seed API: print, items, JSON -------------------------------------------------------
    def items(self, path: str = "") -> Iterator[tuple[str, Any]]:
        """Yield ``(path, leaf)`` pairs in insertion order, paths like ``/layers[1]/b``.

        Args:
            path: a prefix for every path (the seed's argument): ``items("model")`` yields
                ``("model/layers[1]/b", ...)``.
        """
        if not isinstance(path, str):
            raise TypeError(f"ParamsDict.items(path): path must be a str prefix, got {path!r}")
        yield from _walk(self, path)

    def print(self, path: str = "", *, file=None) -> None:
        """Print one line per leaf: ``/a: 4``, ``/layer/W: f32[5,7]``.

        Args:
            path: a prefix for every line (the seed's argument): ``print("model")`` prints
                ``model/a: 4``.
            file: where to write (default ``sys.stdout``), keyword only.
        """
        if not isinstance(path, str):
            raise TypeError(
                f"ParamsDict.print(path): path must be a str prefix, got {type(path).__name__}"
                + ("; to write to a file use print(file=...)" if hasattr(path, "write") else "")
            )
        for p, leaf in self.items(path):
            print(f"{p}: {leaf_str(leaf)}", file=file)

    def to_json(self, *, indent: int | None = None) -> str:
        """JSON of the non-array part (scalars, strings, structure); arrays are left out."""
        return json.dumps(_jsonable(self), indent=indent)

    def toJSON(self, *, indent: int | None = 4) -> str:  # noqa: N802 -- the seed's name
        """``to_json`` under the seed's name (indented by 4, as the seed's is)."""
        return self.to_json(indent=indent)

    # -- summary and flat conversion --------------------------------------------------------
    def summary(self) -> str:
        """A table of every array leaf: path, shape, dtype, count, bytes, then totals.

        An array reachable from several paths is counted once in the totals.
        """
        rows, seen, total_n, total_b = [], set(), 0, 0
        for path, leaf in self.items():
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                continue
            n = int(np.prod(leaf.shape, dtype=np.int64))
            b = n * np.dtype(leaf.dtype).itemsize if _is_numeric(leaf.dtype) else 0
            rows.append((path, str(tuple(leaf.shape)), _dtype_str(leaf.dtype), n, b))
            if id(leaf) not in seen:
                seen.add(id(leaf))
                total_n += n
                total_b += b
        w = max([len(r[0]) for r in rows] + [4])
        lines = [f"{'path':<{w}}  {'shape':<14} {'dtype':<6} {'params':>12} {'bytes':>12}"]
        lines += [f"{p:<{w}}  {s:<14} {d:<6} {n:>12,} {b:>12,}" for p, s, d, n, b in rows]
        lines.append(f"{'total':<{w}}  {'':<14} {'':<6} {total_n:>12,} {total_b:>12,}")
        return "\n".join(lines)

    def num_params(self) -> int:
        """Number of scalars in the array leaves (each distinct array counted once)."""
        seen = {}
        for _, leaf in self.items():
            if hasattr(leaf, "shape"):
                seen[id(leaf)] = int(np.prod(leaf.shape, dtype=np.int64))
        return sum(seen.values())

    def to_flat(self) -> dict[str, Any]:
        """The flat ``{path: leaf}`` dict, e.g. ``{"/layer/W": W}`` (the checkpoint form)."""
        return dict(self.items())

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> ParamsDict:
        """Rebuild a ParamsDict from ``to_flat`` output; ``[i]`` segments become lists.

        A layer without params has no path in ``to_flat``'s output: a missing index among
        a list's ParamsDicts (``/layers[0]/W``, ``/layers[2]/W``: an activation between two
        linear layers) comes back as an empty ParamsDict. One at the end of the list leaves
        no trace; give it as a value (``{"/layers[3]": ParamsDict()}``), as ``nl.load``
        does from the empty nodes ``nl.save`` records.

        Example:
            >>> import jax, nnlite as nl
            >>> seq = nl.Sequential([nl.Linear(2, 3), nl.Activation("relu"), nl.Linear(3, 1)])
            >>> p = seq.init(jax.random.key(0))
            >>> nl.ParamsDict.from_flat(p.to_flat()) == p
            True
        """
        root: dict = {}
        for path, leaf in flat.items():
            segs = _parse_path(path)
            node: Any = root
            for seg, nxt in zip(segs[:-1], segs[1:], strict=True):
                container = [] if isinstance(nxt, int) else {}
                node = _child(node, seg, container, path)
            _assign(node, segs[-1], leaf, path)
        return _build(root)


# -- helpers --------------------------------------------------------------------------------
def _check_key(name: Any) -> None:
    """Refuse keys that are not strings, contain path syntax, or that attribute access
    would not reach (``p.keys`` is the method, ``p._data`` the internals)."""
    if not isinstance(name, str) or not name or "/" in name or "[" in name:
        raise KeyError(
            f"ParamsDict keys must be non-empty strings without '/' or '[', got {name!r}"
        )
    if name.startswith("_"):
        raise KeyError(
            f"ParamsDict key {name!r}: keys starting with '_' are reserved for ParamsDict's "
            f"internals (p.{name} would not reach it); rename it, e.g. {name.lstrip('_') or 'x'!r}"
        )
    if name in _RESERVED:
        raise KeyError(
            f"ParamsDict key {name!r} is the name of a ParamsDict method: p.{name} would give "
            f"the method, not your value; rename it, e.g. {name + '_'!r} (reserved names: "
            f"{', '.join(sorted(_RESERVED))})"
        )


def _hashable(v: Any, path: str) -> Any:
    """``v`` as a hashable value (lists become tuples); arrays refuse, naming the path."""
    if isinstance(v, ParamsDict):  # sorted: equal ParamsDicts hash equal whatever the order
        data = v._data
        return ("ParamsDict", *((k, _hashable(data[k], f"{path}/{k}")) for k in sorted(data)))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, *(_hashable(x, f"{path}[{i}]") for i, x in enumerate(v)))
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        raise TypeError(
            f"unhashable ParamsDict: {path} is an array ({leaf_str(v)}); only a ParamsDict of "
            f"static values (numbers, strings, tuples) can be hashed, e.g. as a jit static "
            f"argument"
        )
    try:
        hash(v)
    except TypeError:
        raise TypeError(
            f"unhashable ParamsDict: {path} is an unhashable {type(v).__name__}"
        ) from None
    return v


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, ParamsDict):
        for k, v in node._data.items():
            yield from _walk(v, f"{prefix}/{k}")
    elif (
        isinstance(node, (list, tuple))
        and not _is_namedtuple(node)
        and not getattr(node, "_pytree_leaf", False)  # nl.Axes: one leaf of names
    ):
        for i, v in enumerate(node):
            yield from _walk(v, f"{prefix}[{i}]")
    else:
        yield prefix, node


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_numeric(dtype) -> bool:
    try:
        return np.dtype(dtype).kind in "biufc" or "bfloat16" in str(dtype)
    except TypeError:
        return False


_KIND = {"f": "f", "i": "i", "u": "u", "c": "c"}


def _dtype_str(dtype) -> str:
    """Short dtype names as JAX prints them: f32, bf16, i32, u8, bool."""
    name = str(dtype)
    if name == "bool":
        return "bool"
    if name == "bfloat16":
        return "bf16"
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return name
    kind = _KIND.get(dt.kind)
    return f"{kind}{dt.itemsize * 8}" if kind else name


def leaf_str(leaf: Any) -> str:
    """How a leaf prints: arrays as ``f32[5,7]``, anything else as ``repr`` (``4``, ``'relu'``)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{_dtype_str(leaf.dtype)}[{','.join(str(d) for d in leaf.shape)}]"
    return repr(leaf)


def format_path(path) -> str:
    """Format a JAX key path (from ``tree_flatten_with_path``) as ``/layer/W``."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            out.append(f"[{k.idx}]")
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(f"/{k.key}")
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(f"/{k.name}")
        else:
            out.append(f"/{k}")
    return "".join(out)


def _leaf_equal(a: Any, b: Any) -> bool:
    if isinstance(a, ParamsDict) or isinstance(b, ParamsDict):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_leaf_equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") or hasattr(b, "shape"):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return a == b


def _jsonable(node: Any) -> Any:
    if isinstance(node, ParamsDict):
        out = {}
        for k, v in node._data.items():
            j = _jsonable(v)
            if j is not _OMIT:
                out[k] = j
        return out
    if isinstance(node, (list, tuple)):
        return [j for j in map(_jsonable, node) if j is not _OMIT]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, np.generic):
        return node.item()
    return _OMIT


_OMIT = object()


def _parse_path(path: str) -> list[str | int]:
    segs: list[str | int] = []
    pos = 0
    for m in _SEGMENT.finditer(path):
        if m.start() != pos:
            break
        segs.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if pos != len(path) or not segs:
        raise ValueError(
            f"bad ParamsDict path {path!r}: expected segments like '/layer/W' or '/layers[1]/b'"
        )
    return segs


def _child(node: Any, seg: str | int, container: Any, path: str) -> Any:
    if isinstance(seg, int):
        if not isinstance(node, list):
            raise ValueError(f"path {path!r}: index [{seg}] applied to a non-list node")
        while len(node) <= seg:
            node.append(None)
        if node[seg] is None:
            node[seg] = container
        return node[seg]
    if not isinstance(node, dict):
        raise ValueError(f"path {path!r}: key /{seg} applied to a list node")
    return node.setdefault(seg, container)


def _assign(node: Any, seg: str | int, leaf: Any, path: str) -> None:
    if isinstance(seg, int):
        if not isinstance(node, list):
            raise ValueError(f"path {path!r}: index [{seg}] applied to a non-list node")
        while len(node) <= seg:
            node.append(None)
        node[seg] = leaf
    else:
        if not isinstance(node, dict):
            raise ValueError(f"path {path!r}: key /{seg} applied to a list node")
        node[seg] = leaf


def _build(node: Any) -> Any:
    if isinstance(node, dict):
        return ParamsDict({k: _build(v) for k, v in node.items()})
    if isinstance(node, list):
        if any(v is None for v in node):
            # a layer without params between layers with params; a gap among arrays (a
            # path left out) has no such reading
            if not any(isinstance(v, dict | list | ParamsDict) for v in node):
                raise ValueError("flat dict has a gap in a list index")
            node = [{} if v is None else v for v in node]
        return [_build(v) for v in node]
    return node


# Slot setters that bypass ParamsDict.__setattr__ (which would store a key).
_new = object.__new__
_set_data = ParamsDict.__dict__["_data"].__set__
_set_aux = ParamsDict.__dict__["_aux"].__set__
_set_children = ParamsDict.__dict__["_children"].__set__

#: Names a key cannot take: attribute access would reach the method, not the value.
_RESERVED = frozenset(name for name in dir(ParamsDict) if not name.startswith("_"))

jax.tree_util.register_pytree_with_keys(
    ParamsDict,
    ParamsDict._tree_flatten_with_keys,
    ParamsDict._tree_unflatten,
    ParamsDict._tree_flatten,
)
