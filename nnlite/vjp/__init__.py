"""The seed's (awf-jaxutils) names for nnlite's rules: the one compatibility module.

Every rule here is the very object of ``nnlite.rules`` with the same name -- ``mm``,
``mm_vjp``, ``axpy``, ``xpyzt``, ``softmax``, ``sum``, ``index``, ``pow``, ``transpose``,
... -- so the seed's code runs unchanged against the one home of rules. The seed's
conventions are these functions' defaults: ``mm(W, x)`` with ``W: [out, in]`` and a column
vector ``x: [in]`` (``mm`` also takes nnlite's row-vector batches, ``mm(x, W)``),
``softmax`` over axis 0, ``sum`` of a list, ``index_vjp(x, i, dret) -> dx``. ``check`` and
``check_vjp`` are ``nnlite.rules.check_rule``; ``hand`` is ``nnlite.rules.plugged`` (each
rule as a ``jax.custom_vjp`` function). The seed's helpers that are not rules
(``allclose``, ``tree_close``, ``randlike``, ``ensure_tuple``, ``mm_scaled_vjp_simple``,
``range_vjp``, ...) live here only. See ``docs/awf_jaxutils.md``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from nnlite.vjp import check_vjp, hand, mm, mm_vjp, relu, relu_vjp
    >>> W, x = jnp.ones((2, 3)), jnp.array([-1.0, 2.0, 0.5])
    >>> check_vjp(mm, mm_vjp, W, x)  # matrix @ column vector
    >>> jax.grad(lambda x: hand.dotall(hand.relu(x), x))(x)
    Array([0., 4., 1.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable

from .. import rules as _rules
from ..grad._check import allclose as allclose
from ..grad._check import check as check
from ..grad._check import default_tolerances as default_tolerances
from ..grad._check import ensure_tuple as ensure_tuple
from ..grad._check import randlike as randlike
from ..grad._check import tree_all as tree_all
from ..grad._check import tree_allclose as tree_allclose
from ..grad._check import tree_close as tree_close
from ..grad._small_rules import mm_scaled_vjp_simple as mm_scaled_vjp_simple
from ..grad._small_rules import range_vjp as range_vjp
from ..rules import VJPCheckError as VJPCheckError
from ..rules import check_vjp as check_vjp
from ..rules import custom_vjp as custom_vjp
from ..rules import match_primal as match_primal
from ..rules import with_vjp as with_vjp

#: The seed's rules (awf-jaxutils' ``vjp.py``), each ``nnlite.rules``' object of its name.
SEED_RULES = (
    "add", "axpy", "dotall", "dup", "exp", "gelu", "identity", "index", "log", "mm",
    "mm_scaled", "mul", "negate", "pair", "pow", "recip", "relu", "scale", "sigmoid",
    "softmax", "softplus", "sum", "tanh", "transpose", "xpyzt",
)  # fmt: skip

#: ``name -> (f, f_vjp)`` for the seed's rules (``nnlite.rules.RULES`` has every rule).
RULES: dict[str, tuple[Callable, Callable]] = {name: _rules.RULES[name] for name in SEED_RULES}

globals().update({name: f for name, (f, _) in RULES.items()})
globals().update({name + "_vjp": f_vjp for name, (_, f_vjp) in RULES.items()})

#: Every rule as a ``jax.custom_vjp`` function (``nnlite.rules.plugged``).
hand = _rules.plugged

#: ``nnlite.vjp.batched`` was a second rule library, removed: where each thing went (what
#: importing it raises).
BATCHED_GONE = (
    "nnlite.vjp.batched is gone: its rules are in nnlite.rules under the same names (mm, axpy, "
    "xpyzt, mm_scaled serve row-vector batches too), except hand -> plugged, softmax(x) -> "
    "softmax(x, axis=-1), sum(x) -> reduce_sum(x), softmax_cross_entropy -> "
    "softmax_cross_entropy_values, and index_vjp returns dx alone; see docs/gradients.md"
)


__all__ = [
    *sorted(n for name in SEED_RULES for n in (name, name + "_vjp")),
    "RULES",
    "SEED_RULES",
    "VJPCheckError",
    "allclose",
    "check",
    "check_vjp",
    "custom_vjp",
    "default_tolerances",
    "ensure_tuple",
    "hand",
    "match_primal",
    "mm_scaled_vjp_simple",
    "randlike",
    "range_vjp",
    "tree_all",
    "tree_allclose",
    "tree_close",
    "with_vjp",
]
