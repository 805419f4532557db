"""Logical axes: how a layer's params shard, named per dimension, mapped onto a mesh later.

A layer says what each dimension of each of its params *is* (``("embed", "mlp")`` for a
transformer MLP's first weight); a parallel strategy maps those names onto mesh axes with a
rule table (MaxText's and levanter's logical-axis rules). The layer knows nothing of
meshes, the strategy nothing of layers.
"""

from __future__ import annotations

from typing import Any

import jax

from ._params import ParamsDict

__all__ = ["AXIS_NAMES", "Axes", "param_axes"]

#: The logical names nnlite's own layers use (a layer may use others; a rule table that
#: does not know a name leaves that dimension to the fallback rule).
AXIS_NAMES = {
    "embed": "the model width (features) of a transformer's layers",
    "mlp": "the hidden width of a transformer MLP (its fc output, proj input)",
    "qkv": "the fused [q | k | v] output columns of attention, heads within each",
    "heads": "attention heads x head_dim (the output projection's input)",
    "vocab": "an embedding table's rows (token ids)",
    "position": "a learned position table's rows",
    "in": "a Linear's input width when no parent names its role",
    "out": "a Linear's output width when no parent names its role",
    "kernel": "a convolution's spatial kernel dimensions",
    "norm": "a normalisation layer's scale and bias",
}


class Axes(tuple):
    """Logical axis names of one param, one per dimension (``None``: no name).

    A tuple subclass, so JAX treats it as one pytree *leaf*: an axes tree has the same
    structure as the params it describes and ``jax.tree.map(f, axes, params)`` pairs them.

    Example:
        >>> Axes(("embed", "mlp"))
        Axes('embed', 'mlp')
    """

    __slots__ = ()
    _pytree_leaf = True  # ParamsDict prints it as one leaf, not a list of names

    def __new__(cls, names=()):
        names = tuple(names)
        for n in names:
            if n is not None and not isinstance(n, str):
                raise TypeError(f"Axes: each name must be a str or None, got {n!r} in {names}")
        return super().__new__(cls, names)

    def __repr__(self) -> str:
        return f"Axes({', '.join(map(repr, self))})"


def _unnamed(aval: Any) -> Axes:
    return Axes((None,) * len(getattr(aval, "shape", ())))


def param_axes(module: Any, params: Any = None) -> ParamsDict:
    """The logical axes of every param of ``module``: a tree like its params with an
    :class:`Axes` leaf per array (``Axes((None, None))`` where nothing is declared).

    A layer declares its axes by defining ``param_axes(self)`` (returning such a tree, or
    None for "not declared"); a composite layer builds its tree from its children's
    (``nl.param_axes(child)``) and may rename them for their role (a transformer MLP's
    ``fc`` is column-parallel: ``("embed", "mlp")``). A layer that declares nothing gets
    unnamed axes, which a strategy shards by its fallback rule (FSDP: the largest
    divisible dimension) or replicates.

    Args:
        module: an nnlite ``Module`` (or anything with ``init(key)``).
        params: its params or their shapes, to check the declaration against (default:
            ``jax.eval_shape(module.init, key)``).

    Returns:
        A ``ParamsDict`` (or list of them) of ``Axes`` with the structure of the params.

    Example:
        >>> import nnlite as nl
        >>> nl.param_axes(nl.Linear(4, 8)).print()
        /W: Axes('in', 'out')
        /b: Axes('out')
        >>> nl.param_axes(nl.TransformerBlock(8, num_heads=2)).mlp.fc.W
        Axes('embed', 'mlp')
    """
    if params is None:
        params = jax.eval_shape(module.init, jax.random.key(0))
    declare = getattr(module, "param_axes", None)
    declared = declare() if callable(declare) else None
    if declared is None:
        return jax.tree.map(_unnamed, params)
    name = type(module).__name__
    p_def, a_def = jax.tree.structure(params), jax.tree.structure(declared)
    if p_def != a_def:
        raise ValueError(
            f"{name}.param_axes() does not match its params: axes tree {a_def} vs params "
            f"tree {p_def}; return one Axes per param array"
        )
    for (path, axes), aval in zip(
        jax.tree_util.tree_leaves_with_path(declared), jax.tree.leaves(params), strict=True
    ):
        ndim = len(getattr(aval, "shape", ()))
        if not isinstance(axes, Axes) or len(axes) != ndim:
            raise ValueError(
                f"{name}.param_axes(): {jax.tree_util.keystr(path)} is {axes!r}, expected "
                f"an Axes of {ndim} names (the param has shape {tuple(aval.shape)})"
            )
    return declared
