"""Hand-derived vector-Jacobian products: rules, a checker, and a ``custom_vjp`` plug-in.

``nnlite.vjp.relu`` is the forward function, ``nnlite.vjp.relu_vjp`` its hand-derived
backward rule ``relu_vjp(x, dret) -> dx``. ``check_vjp(relu, relu_vjp, x)`` compares the
rule with ``jax.vjp``. ``custom_vjp(relu, relu_vjp)`` (or the ``@with_vjp(relu_vjp)``
decorator) gives a function that ``jax.grad`` differentiates with the hand rule, and
``hand.relu`` is that function, ready-made for every rule in ``RULES``: a loss written
with ``hand.*`` ops is differentiated by hand rules only.

Integer arguments (labels, indices) are not differentiable: rules return ``None`` for
them, ``check_vjp`` accepts ``None`` (or JAX's float0 zeros), and the plug-in turns it
into the zero cotangent JAX expects.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from nnlite.vjp import check_vjp, hand, relu, relu_vjp
    >>> x = jnp.array([-1.0, 2.0])
    >>> check_vjp(relu, relu_vjp, x)
    >>> jax.grad(lambda x: hand.sum(hand.relu(x)))(x)
    Array([0., 1.], dtype=float32)
"""

from __future__ import annotations

import types
from collections.abc import Callable

from . import _vjp
from ._vjp import *  # noqa: F403 -- the rules are this module's public surface
from ._vjp import __all__ as _rule_names
from ._vjp_tools import VJPCheckError as VJPCheckError
from ._vjp_tools import check_vjp as check_vjp
from ._vjp_tools import custom_vjp as custom_vjp
from ._vjp_tools import default_tolerances as default_tolerances
from ._vjp_tools import with_vjp as with_vjp

#: ``name -> (f, f_vjp)`` for every rule in this module.
RULES: dict[str, tuple[Callable, Callable]] = {
    name: (getattr(_vjp, name), getattr(_vjp, name + "_vjp"))
    for name in _rule_names
    if not name.endswith("_vjp") and name + "_vjp" in _rule_names
}

#: Every rule as a ``jax.custom_vjp`` function: ``hand.mm(A, B)`` computes ``mm`` and is
#: differentiated by ``mm_vjp``.
hand = types.SimpleNamespace(**{name: custom_vjp(f, f_vjp) for name, (f, f_vjp) in RULES.items()})

__all__ = [
    *_rule_names,
    "RULES",
    "VJPCheckError",
    "check_vjp",
    "custom_vjp",
    "default_tolerances",
    "hand",
    "with_vjp",
]
