"""from_equinox: any Equinox module as an nnlite layer (arrays -> ParamsDict, the rest static)."""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._mode import manual_active
from ..core._module import Module, ParamsMismatchError
from ..core._params import ParamsDict
from ..grad._manual import hand_rule

__all__ = ["EquinoxLayer", "from_equinox"]


def _segment(entry: Any) -> str | int:
    """One key-path entry as a ParamsDict segment: a field name or a list index."""
    if isinstance(entry, jax.tree_util.GetAttrKey):
        name = entry.name
    elif isinstance(entry, jax.tree_util.SequenceKey):
        return entry.idx
    elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return entry.key
    elif isinstance(entry, jax.tree_util.DictKey):
        name = str(entry.key)
    else:
        name = str(entry)
    # ParamsDict keys cannot hold '/' or '['; anything else reads as it is.
    return re.sub(r"[/\[\]]", "_", name) or "_"


def _path_str(segs: tuple[str | int, ...]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f"/{s}" for s in segs)


def _build(paths: list[tuple[str | int, ...]], leaves: list[Any]) -> ParamsDict:
    """A nested ParamsDict from key paths; list gaps (an element without arrays, such as an
    activation in an ``eqx.nn.Sequential``) become empty ParamsDicts, which hold no leaves."""
    root: dict = {}
    for segs, leaf in zip(paths, leaves, strict=True):
        node: Any = root
        for seg, nxt in zip(segs[:-1], segs[1:], strict=True):
            node = _child(node, seg, [] if isinstance(nxt, int) else {})
        _child(node, segs[-1], leaf, overwrite=True)

    def convert(node: Any) -> Any:
        if isinstance(node, dict):
            return ParamsDict({k: convert(v) for k, v in node.items()})
        if isinstance(node, list):
            return [ParamsDict() if v is None else convert(v) for v in node]
        return node

    return convert(root)


def _child(node: Any, seg: str | int, value: Any, overwrite: bool = False) -> Any:
    if isinstance(seg, int):
        while len(node) <= seg:
            node.append(None)
        if node[seg] is None or overwrite:
            node[seg] = value
        return node[seg]
    if overwrite or seg not in node:
        node[seg] = value
    return node[seg]


def _lookup(params: Any, segs: tuple[str | int, ...]) -> Any:
    node = params
    for seg in segs:
        node = node[seg]
    return node


class _Static:
    """The non-array part of an Equinox module, the arrays' treedef and leaf paths: hashable
    and comparable, so an ``EquinoxLayer`` can be a static argument of ``jit``. The arrays
    the module was built with ride along for ``init`` but take no part in equality."""

    def __init__(self, static: Any, treedef: Any, paths: tuple, initial: tuple):
        self.static, self.treedef, self.paths, self.initial = static, treedef, paths, initial
        try:
            static_hash = hash(static)
        except TypeError:
            static_hash = hash(type(static))
        self._hash = hash((treedef, paths, static_hash))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        if self is other:
            return True
        if self._hash != other._hash or self.treedef != other.treedef:
            return False
        if self.paths != other.paths:
            return False
        import equinox as eqx

        return eqx.tree_equal(self.static, other.static) is True

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return type(self.static).__name__


class EquinoxLayer(Module):
    """An Equinox module as an nnlite layer; build it with ``from_equinox(module)``.

    ``init(key)`` returns the arrays the Equinox module was built with, as a ParamsDict
    keyed by their field paths (``/weight_ih``, ``/layers[0]/weight``). The key is unused:
    Equinox initialises weights when the module is constructed, so build the Equinox module
    with the key you want (``eqx.nn.GRUCell(..., key=k)``); this also makes the nnlite
    layer start from exactly the weights Equinox would train.

    ``__call__(params, x, *args, key=None, **kwargs)`` rebuilds the module
    (``eqx.combine``) and calls it as ``module(x, *args, **kwargs)``, passing ``key=key``
    when the module's ``__call__`` takes a ``key`` and one is given. Equinox modules take
    one example (no batch axis): ``jax.vmap`` over a batch, as in Equinox.

    ``module(params)`` is the rebuilt Equinox module itself, for its other methods.
    """

    wrapped: _Static

    def _short_repr(self) -> str:
        return f"EquinoxLayer({self.wrapped!r})"

    _args_repr = _short_repr

    @property
    def uses_key(self) -> bool:
        """Whether the Equinox module holds an ``eqx.nn.Dropout`` with ``p > 0``: a model
        that declares this layer then takes a key in training, which reaches it."""
        import equinox as eqx

        arrays = jax.tree_util.tree_unflatten(self.wrapped.treedef, list(self.wrapped.initial))
        module = eqx.combine(arrays, self.wrapped.static)
        drops = jax.tree.leaves(module, is_leaf=lambda m: isinstance(m, eqx.nn.Dropout))
        return any(isinstance(m, eqx.nn.Dropout) and m.p > 0 for m in drops)

    def init(self, key: jax.Array | None = None) -> ParamsDict:
        paths = list(self.wrapped.paths)
        return _build(paths, [jnp.asarray(a) for a in self.wrapped.initial])

    def module(self, params: ParamsDict) -> Any:
        """The Equinox module with ``params``' arrays."""
        import equinox as eqx

        leaves = []
        for segs, want in zip(self.wrapped.paths, self.wrapped.initial, strict=True):
            path = _path_str(segs)
            try:
                leaf = _lookup(params, segs)
            except (KeyError, AttributeError, IndexError, TypeError):
                raise ParamsMismatchError(self._short_repr(), path, "is missing") from None
            shape = tuple(getattr(leaf, "shape", ()))
            if shape != want.shape:
                raise ParamsMismatchError(
                    self._short_repr(), path, f"has shape {shape}, expected {want.shape}"
                )
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and jax.dtypes.canonicalize_dtype(
                dtype
            ) != jax.dtypes.canonicalize_dtype(want.dtype):
                raise ParamsMismatchError(
                    self._short_repr(),
                    path,
                    f"has dtype {jnp.dtype(dtype)}, expected {jnp.dtype(want.dtype)}",
                )
            leaves.append(leaf)
        arrays = jax.tree_util.tree_unflatten(self.wrapped.treedef, leaves)
        return eqx.combine(arrays, self.wrapped.static)

    def __call__(self, params: ParamsDict, x: Any, *args: Any, key: Any = None, **kwargs: Any):
        if key is not None and _takes_key(self.module(params)):
            kwargs["key"] = key
        if manual_active():
            # No hand rules for a foreign layer: its rule is JAX's autodiff of its call,
            # for this layer only; the rest of the model keeps its hand rules.
            _say_autodiff_once(self)
            return _equinox_apply(params, x, layer=self, args=args, kwargs=kwargs)
        return self.module(params)(x, *args, **kwargs)


_told: set = set()


def _say_autodiff_once(layer: EquinoxLayer) -> None:
    what = layer._short_repr()
    if what not in _told:
        _told.add(what)
        logging.getLogger("nnlite").warning(
            "nnlite: loss.grad=manual: %s has no hand rule; JAX autodiff differentiates "
            "this layer (every nnlite layer keeps its hand rules)",
            what,
        )


def _equinox_apply_vjp(params, x, dret, *, layer, args, kwargs):
    _, pullback = jax.vjp(lambda p, x: layer.module(p)(x, *args, **kwargs), params, x)
    return pullback(dret)


@hand_rule(_equinox_apply_vjp)
def _equinox_apply(params, x, *, layer, args, kwargs):
    """An Equinox layer's call; its "hand rule" is ``jax.vjp`` of the call (see above)."""
    return layer.module(params)(x, *args, **kwargs)


def _takes_key(module: Any) -> bool:
    try:
        sig = inspect.signature(module.__call__)
    except (TypeError, ValueError):
        return False
    return any(
        p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
    )


def from_equinox(module: Any) -> EquinoxLayer:
    """Wrap an ``equinox.Module`` as an nnlite layer, so the ``eqx.nn`` zoo (``GRUCell``,
    ``LSTMCell``, ``Conv2d``, ``MultiheadAttention``, ...) works inside nnlite models.

    Its arrays (``eqx.partition(module, eqx.is_array)``) become a ParamsDict keyed by field
    paths; everything else (hyperparameters, activation functions) stays static in the
    layer, which is hashable, so ``jit``, ``grad``, ``vmap`` and optax treat the layer like
    any nnlite layer. Stateful layers (``eqx.nn.BatchNorm`` with ``eqx.nn.State``) are not
    covered: their state is not a parameter.

    Args:
        module: any ``equinox.Module``.

    Returns:
        An ``EquinoxLayer``: ``init(key)`` gives the module's own arrays (the key is unused,
        see ``EquinoxLayer``), ``__call__(params, x, *args, key=None)`` calls the module.

    Example:
        >>> import equinox as eqx, jax, jax.numpy as jnp
        >>> cell = from_equinox(eqx.nn.GRUCell(3, 4, key=jax.random.key(0)))
        >>> p = jax.jit(cell.init)(jax.random.key(1))
        >>> p.print()
        /weight_ih: f32[12,3]
        /weight_hh: f32[12,4]
        /bias: f32[12]
        /bias_n: f32[4]
        >>> jax.jit(cell)(p, jnp.ones(3), jnp.zeros(4)).shape  # GRUCell(input, hidden)
        (4,)
        >>> mlp = from_equinox(eqx.nn.MLP(2, 1, 8, depth=2, key=jax.random.key(0)))
        >>> [path for path, _ in mlp.init(None).items()][:2]
        ['/layers[0]/weight', '/layers[0]/bias']
    """
    import equinox as eqx

    if not isinstance(module, eqx.Module):
        raise TypeError(
            f"from_equinox: expected an equinox.Module, got {type(module).__name__}"
            + (" (already an nnlite Module)" if isinstance(module, Module) else "")
        )
    arrays, static = eqx.partition(module, eqx.is_array)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    paths = tuple(tuple(_segment(e) for e in path) for path, _ in with_paths)
    if len(set(paths)) != len(paths):
        raise ValueError(
            f"from_equinox: {type(module).__name__} has array paths that collide once "
            f"written as ParamsDict keys: {[_path_str(p) for p in paths]}"
        )
    initial = tuple(np.asarray(leaf) for _, leaf in with_paths)
    return EquinoxLayer(_Static(static, treedef, paths, initial))
