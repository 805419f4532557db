"""Hand-derived VJPs for row-vector batches: the convention of nnlite's layers.

``x: [..., in] @ W: [in, out]`` with any number of leading batch axes, ``bias_add`` over
the batch, ``softmax``/``log_softmax``/``softmax_cross_entropy`` over the last (class)
axis, ``sum``/``mean`` of one array's elements, ``index_vjp -> (dx, None)``. The checker
and plug-in are those of ``nnlite.vjp`` (``check_vjp``, ``custom_vjp``); ``RULES`` and
``hand`` here are this library's.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from nnlite.vjp import check_vjp
    >>> from nnlite.vjp.batched import bias_add, bias_add_vjp, hand
    >>> x, b = jnp.ones((4, 3)), jnp.arange(3.0)  # a batch of 4
    >>> check_vjp(bias_add, bias_add_vjp, x, b)
    >>> jax.grad(lambda b: hand.sum(hand.bias_add(x, b)))(b)
    Array([4., 4., 4.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable

from ..grad import _vjp_batched
from ..grad._rule_table import hand_functions as _hand_functions
from ..grad._rule_table import rule_table as _rule_table
from ..grad._vjp_batched import *  # noqa: F403 -- the rules are this module's public surface
from ..grad._vjp_batched import __all__ as _rule_names
from ..grad._vjp_batched import gelu_grad as gelu_grad

#: ``name -> (f, f_vjp)`` for every rule in this module.
RULES: dict[str, tuple[Callable, Callable]] = _rule_table(vars(_vjp_batched), _rule_names)

#: Every rule as a ``jax.custom_vjp`` function: ``hand.mm(x, W)`` computes ``mm`` and is
#: differentiated by ``mm_vjp``.
hand = _hand_functions(RULES)

__all__ = [*_rule_names, "RULES", "gelu_grad", "hand"]
