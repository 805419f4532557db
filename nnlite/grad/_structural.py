"""Hand-derived VJPs of JAX's structural and linear primitives.

One pair per primitive, named after it and taking its parameters as keywords:
``broadcast_in_dim(x, shape=..., broadcast_dimensions=...)`` and
``broadcast_in_dim_vjp(x, dret, shape=..., broadcast_dimensions=...)``, in the seed's form
(one cotangent per operand, ``None`` for integer operands). ``manual_grads`` applies them to
the equations of a user's loss that compute on param-derived values outside any layer's
rule (``tok + pos``, ``jnp.mean(h, axis=-2)``, ``h[:, 0]``, ``x.reshape(...)``, ...), and
``show_grad`` prints them. Each is exact: the primitive is linear in the operands it is
applied to (``mul`` and ``div`` only when the other operand, the divisor, ``dot_general``
only when one side is not differentiated; ``manual_grads`` checks that).

The rules live in ``_prim_layout.py`` (broadcast, reshape, transpose, casts, sums,
concatenation), ``_prim_arith.py`` (``+``, ``-``, products with a constant factor) and
``_prim_index.py`` (slices, pad, gather, scatter, select); ``nnlite.rules`` lists them. They
read their operands' shapes and, only where the math needs it, values (the factor of
``mul``, the indices of ``gather``). Axes may be negative when called directly. This module
holds the table of which primitive has which rule, and when it applies.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

from . import _prim_arith as A
from . import _prim_index as I
from . import _prim_layout as L

__all__ = ["PRIMITIVE_RULES", "PrimitiveRule"]


# --- the table manual_grads and show_grad read --------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """The hand rule of one primitive, and when it applies.

    ``linear_in``: operand positions the primitive is linear in *jointly*, or ``None`` for
    all of them. A rule applies when the differentiated operands are among ``linear_in``
    and, for a product (``mul``, ``dot_general``), at most one of them is differentiated.
    The rule functions take the primitive's parameters they need as keywords; others
    (``out_dtype=None`` of an arithmetic primitive, the ``update_jaxpr`` of a scatter) are
    not passed.
    """

    f: Callable
    f_vjp: Callable
    linear_in: tuple[int, ...] | None = None
    product: bool = False
    requires: Callable | None = None  # params -> reason it does not apply, or None

    def refusal(self, params: dict, diff: Sequence[bool]) -> str | None:
        """Why this rule does not give the exact VJP for these operands, or ``None``."""
        which = [i for i, d in enumerate(diff) if d]
        if self.linear_in is not None and any(i not in self.linear_in for i in which):
            return "it is not linear in the differentiated operand"
        if self.product and len(which) > 1:
            return (
                "both factors depend on the params: a product is linear in each factor "
                "alone, not in both"
            )
        return self.requires(params) if self.requires is not None else None

    def params(self, params: dict) -> dict:
        """The primitive's parameters that the rule functions take."""
        names = _keywords(self.f_vjp)
        return {k: v for k, v in params.items() if k in names}


@functools.cache
def _keywords(f: Callable) -> frozenset[str]:
    return frozenset(
        n for n, p in inspect.signature(f).parameters.items() if p.kind is p.KEYWORD_ONLY
    )


def _distinct_indices(params: dict) -> str | None:
    if params.get("unique_indices"):
        return None
    return (
        "`x.at[idx].set(u)` with indices that may repeat keeps one of the updates, which one "
        "XLA decides; use distinct (static) indices, or .at[idx].add"
    )


#: primitive name -> its rule.
PRIMITIVE_RULES: dict[str, PrimitiveRule] = {
    "broadcast_in_dim": PrimitiveRule(L.broadcast_in_dim, L.broadcast_in_dim_vjp),
    "reshape": PrimitiveRule(L.reshape, L.reshape_vjp),
    "transpose": PrimitiveRule(L.transpose, L.transpose_vjp),
    "squeeze": PrimitiveRule(L.squeeze, L.squeeze_vjp),
    "rev": PrimitiveRule(L.rev, L.rev_vjp),
    "tile": PrimitiveRule(L.tile, L.tile_vjp),
    "copy": PrimitiveRule(L.copy, L.copy_vjp),
    "copy_p": PrimitiveRule(L.copy, L.copy_vjp),
    "convert_element_type": PrimitiveRule(L.convert_element_type, L.convert_element_type_vjp),
    "add": PrimitiveRule(A.add, A.add_vjp),
    "sub": PrimitiveRule(A.sub, A.sub_vjp),
    "neg": PrimitiveRule(A.neg, A.neg_vjp),
    "mul": PrimitiveRule(A.mul, A.mul_vjp, product=True),
    "div": PrimitiveRule(A.div, A.div_vjp, linear_in=(0,)),
    "dot_general": PrimitiveRule(A.dot_general, A.dot_general_vjp, product=True),
    "reduce_sum": PrimitiveRule(L.reduce_sum, L.reduce_sum_vjp),
    "cumsum": PrimitiveRule(L.cumsum, L.cumsum_vjp),
    "concatenate": PrimitiveRule(L.concatenate, L.concatenate_vjp),
    "split": PrimitiveRule(L.split, L.split_vjp),
    "stack": PrimitiveRule(L.stack, L.stack_vjp),
    "slice": PrimitiveRule(I.slice, I.slice_vjp),
    "dynamic_slice": PrimitiveRule(I.dynamic_slice, I.dynamic_slice_vjp, linear_in=(0,)),
    "dynamic_update_slice": PrimitiveRule(
        I.dynamic_update_slice, I.dynamic_update_slice_vjp, linear_in=(0, 1)
    ),
    "pad": PrimitiveRule(I.pad, I.pad_vjp),
    "gather": PrimitiveRule(I.gather, I.gather_vjp, linear_in=(0,)),
    "scatter-add": PrimitiveRule(I.scatter_add, I.scatter_add_vjp, linear_in=(0, 2)),
    "scatter": PrimitiveRule(
        I.scatter, I.scatter_vjp, linear_in=(0, 2), requires=_distinct_indices
    ),
    "select_n": PrimitiveRule(I.select_n, I.select_n_vjp, linear_in=None),
    "pvary": PrimitiveRule(L.pvary, L.pvary_vjp),
}
