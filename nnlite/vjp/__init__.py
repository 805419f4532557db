"""Hand-derived vector-Jacobian products, the seed's way: rules, a checker, a plug-in.

This is the seed's name for ``nnlite.rules.seed`` (and ``nnlite.vjp.batched`` for
``nnlite.rules.batched``): ``nnlite.rules`` is the one home of every rule and rule tool;
these names stay so that the seed's code runs unchanged.

``nnlite.vjp`` is the awf-jaxutils VJP library with its names and conventions -- column
vectors (``mm(W1, x)`` with ``x: [in]``), ``softmax`` over axis 0, ``sum`` of a list,
``index_vjp -> dx`` -- so the seed's examples run unchanged. ``nnlite.vjp.batched`` holds
the same kind of rules for row-vector batches (``x: [batch, in] @ W: [in, out]``, class
axis last): the convention of nnlite's layers and gradient modes.

``relu`` is a forward function, ``relu_vjp(x, dret) -> dx`` its hand-derived backward
rule. ``check_vjp(relu, relu_vjp, x)`` (the seed's ``check``) compares the rule with
``jax.vjp``. ``custom_vjp(relu, relu_vjp)`` (or ``@with_vjp(relu_vjp)``) gives a function
that ``jax.grad`` differentiates with the hand rule, and ``hand.relu`` is that function,
ready-made for every rule in ``RULES``.

Integer arguments (labels, indices) are not differentiable: rules return ``None`` for
them (or leave them out, as ``index_vjp`` does), ``check_vjp`` accepts that, and the
plug-in turns it into the zero cotangent JAX expects.

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

from ..grad import _vjp
from ..grad._check import VJPCheckError as VJPCheckError
from ..grad._check import allclose as allclose
from ..grad._check import check as check
from ..grad._check import check_vjp as check_vjp
from ..grad._check import default_tolerances as default_tolerances
from ..grad._check import ensure_tuple as ensure_tuple
from ..grad._check import randlike as randlike
from ..grad._check import tree_all as tree_all
from ..grad._check import tree_allclose as tree_allclose
from ..grad._check import tree_close as tree_close
from ..grad._custom_vjp import custom_vjp as custom_vjp
from ..grad._custom_vjp import match_primal as match_primal
from ..grad._custom_vjp import with_vjp as with_vjp
from ..grad._rule_table import hand_functions as _hand_functions
from ..grad._rule_table import rule_table as _rule_table
from ..grad._vjp import *  # noqa: F403 -- the rules are this module's public surface
from ..grad._vjp import __all__ as _rule_names
from . import batched as batched

#: ``name -> (f, f_vjp)`` for every rule in this module.
RULES: dict[str, tuple[Callable, Callable]] = _rule_table(vars(_vjp), _rule_names)

#: Every rule as a ``jax.custom_vjp`` function: ``hand.mm(W, x)`` computes ``mm`` and is
#: differentiated by ``mm_vjp``.
hand = _hand_functions(RULES)

__all__ = [
    *_rule_names,
    "RULES",
    "VJPCheckError",
    "allclose",
    "batched",
    "check",
    "check_vjp",
    "custom_vjp",
    "default_tolerances",
    "ensure_tuple",
    "hand",
    "match_primal",
    "randlike",
    "tree_all",
    "tree_allclose",
    "tree_close",
    "with_vjp",
]
