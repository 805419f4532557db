"""hand rules of JAX's primitives: the table ``manual_grads`` and ``show_grad`` read.

One pair per primitive, named after it and taking its parameters as keywords:
``broadcast_in_dim(x, shape=..., broadcast_dimensions=...)`` and
``broadcast_in_dim_vjp(x, dret, shape=..., broadcast_dimensions=...)``, in the seed's form
(one cotangent per operand, ``None`` for integer operands). ``manual_grads`` applies them to
the equations of a user's loss that compute on param-derived values outside any layer's
rule (``tok + pos``, ``jnp.mean(h, axis=-2)``, ``h[:, 0]``, ``jnp.sin(h)``, ``x * y``,
``jnp.max``, ...), and ``show_grad`` prints them.

The rules live in ``_prim_layout.py`` (broadcast, reshape, transpose, casts, sums,
concatenation), ``_prim_arith.py`` (``+``, ``-``, ``*``, ``/``, ``dot_general``),
``_prim_index.py`` (slices, pad, gather, scatter, select), ``_prim_math.py`` (the
elementwise math: ``exp``, ``log``, ``sin``, ``pow``, ``max``, ``clamp``, ...),
``_prim_reduce.py`` (``reduce_max``, ``reduce_prod``, cumulative reductions, ``sort``,
``top_k``) and ``_prim_conv.py`` (``conv_general_dilated``); ``nnlite.rules`` lists them.
Axes may be negative when called directly. This module holds the table of which primitive
has which rule, and when it applies.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import jax

from . import _prim_arith as A
from . import _prim_conv as C
from . import _prim_index as I
from . import _prim_layout as L
from . import _prim_math as M
from . import _prim_reduce as R
from ._rule_table import register_pairs

__all__ = ["PRIMITIVE_RULES", "PrimitiveRule"]


# --- the table manual_grads and show_grad read --------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """The hand rule of one primitive, and when it applies.

    ``linear_in``: the operand positions the rule differentiates, or ``None`` for all of
    them (the start indices of a ``dynamic_slice`` are integers: only the operand). The
    rule functions take the primitive's parameters they need as keywords; those in
    ``IGNORED_PARAMS`` (``out_dtype`` of an arithmetic primitive, the ``update_jaxpr`` of
    a scatter) are not passed, and any other parameter -- one a newer JAX added -- makes
    the rule refuse, naming it, rather than compute a gradient it was not written for.
    """

    f: Callable
    f_vjp: Callable
    linear_in: tuple[int, ...] | None = None
    requires: Callable | None = None  # params -> reason it does not apply, or None

    def refusal(self, params: dict, diff: Sequence[bool]) -> str | None:
        """Why this rule does not give the exact VJP for these operands, or ``None``."""
        unknown = self.unknown(params)
        if unknown:
            return (
                f"the primitive has parameter(s) {', '.join(unknown)}, unknown to nnlite's rule "
                f"(JAX {jax.__version__}; nnlite is tested with {TESTED_JAX})"
            )
        which = [i for i, d in enumerate(diff) if d]
        if self.linear_in is not None and any(i not in self.linear_in for i in which):
            return "it is not linear in the differentiated operand"
        return self.requires(params) if self.requires is not None else None

    def unknown(self, params: dict) -> list[str]:
        """The primitive's parameters this rule was not written for (a newer JAX's)."""
        return sorted(set(params) - _keywords(self.f_vjp) - IGNORED_PARAMS)

    def params(self, params: dict) -> dict:
        """The primitive's parameters that the rule functions take."""
        names = _keywords(self.f_vjp)
        return {k: v for k, v in params.items() if k in names}


#: The JAX versions nnlite's primitive rules are written for (pyproject.toml says the same).
TESTED_JAX = "jax>=0.10,<0.11"

#: Parameters a rule may ignore: they change how the forward is computed or laid out
#: (accuracy, output sharding, a scatter's combining jaxpr), not its derivative.
IGNORED_PARAMS = frozenset(
    {
        "accuracy",
        "out_dtype",
        "out_sharding",
        "sharding",
        "precision",
        "preferred_element_type",
        "update_jaxpr",
        "update_consts",
        "indices_are_sorted",
        "weak_type",
    }
)


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
    "mul": PrimitiveRule(A.mul, A.mul_vjp),
    "div": PrimitiveRule(A.div, A.div_vjp),
    "dot_general": PrimitiveRule(A.dot_general, A.dot_general_vjp),
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
    "conv_general_dilated": PrimitiveRule(C.conv_general_dilated, C.conv_general_dilated_vjp),
    # the elementwise math (_prim_math.py) and the nonlinear reductions (_prim_reduce.py)
    **{
        name: PrimitiveRule(getattr(M, name), getattr(M, name + "_vjp"))
        for name in M.__all__
        if not name.endswith("_vjp")
    },
    **{
        name: PrimitiveRule(getattr(R, name), getattr(R, name + "_vjp"))
        for name in R.__all__
        if not name.endswith("_vjp")
    },
}


def rule_for(eqn) -> PrimitiveRule | None:
    """The library rule of an equation: by its primitive, or for a ``jax.custom_jvp``
    function nnlite has a rule for (``jax.nn.relu``), by the function's name."""
    name = eqn.primitive.name
    if name == "custom_jvp_call":
        return CUSTOM_JVP_RULES.get(custom_jvp_name(eqn) or "")
    return PRIMITIVE_RULES.get(name)


def custom_jvp_name(eqn) -> str | None:
    """The name of the function a ``custom_jvp_call`` equation calls."""
    if eqn.primitive.name != "custom_jvp_call":
        return None
    body = eqn.params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    return getattr(info, "func_name", None)


#: ``jax.custom_jvp`` functions whose derivative choice at a kink a rule reproduces
#: (``jax.nn.relu``: 0 at 0); others are walked into and their body's primitives used.
#: Filled by the modules defining the rules (``_small_rules.py``).
CUSTOM_JVP_RULES: dict[str, PrimitiveRule] = {}

# The primitives' rules in the one table (``nnlite.rules``), each under its primitive's name.
for _module in (A, C, I, L, M, R):
    register_pairs(vars(_module), _module.__all__)
