"""nnlite's one home for rules: every rule by name, generated from the one rule table.

A *rule* is a function ``f`` and its hand-derived vector-Jacobian product ``f_vjp``, in
the seed's form ``f_vjp(*args, dret, **hyperparameters) -> one cotangent per argument``.
This namespace holds every rule nnlite defines, each name one function, ``f`` and
``f + "_vjp"``: the layers' and losses' (``linear``, ``conv``, ``layer_norm``,
``softmax_cross_entropy_values``, ...), the activations (``relu``, ``gelu``, ...), the small
composable rules (``mm``, ``axpy``, ``scale``, ``dotall``, ``dup``, ``pair``, ``index``,
``sum`` of a list, ...), and JAX's primitives' rules by the primitive's name
(``broadcast_in_dim``, ``reshape``, ``transpose``, ``reduce_sum``, ``add``, ``mul``,
``exp``, ``gather``, ...), which ``nl.manual_grads`` applies to the plain ``jnp`` between
layers. ``RULES`` maps each name to its ``(f, f_vjp)``; ``PRIMITIVES`` says which JAX
primitive has which rule; ``plugged.<name>`` is each rule as a ``jax.custom_vjp`` function.

Every rule registers itself in the table where it is defined (``@hand_rule``, or
``register_pairs`` for plain pairs): importing the modules below fills it, and the names
here are read from it. The tools: ``check_rule`` (one rule against ``jax.vjp``; the seed's
``check_vjp``), ``check_rules`` (every rule a model's loss runs), ``custom_vjp`` /
``with_vjp`` (a pair as a ``jax.custom_vjp`` function), ``hand_rule``. ``nnlite.vjp`` is the
seed's (awf-jaxutils) names for these same objects.

Example:
    >>> import jax.numpy as jnp
    >>> from nnlite.rules import linear, linear_vjp
    >>> x, W, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4)
    >>> dx, dW, db = linear_vjp(x, W, b, jnp.ones((2, 4)))
    >>> dW.shape, db.tolist()
    ((3, 4), [2.0, 2.0, 2.0, 2.0])
"""

from collections.abc import Callable

# Each module imported here registers its rules in the table (``grad/_rule_table.py``).
from .grad import _policy, _small_rules, _structural  # noqa: F401
from .grad._check import check_rule as check_rule
from .grad._check import check_vjp as check_vjp
from .grad._check_model import check_rules as check_rules
from .grad._contract import RuleContractError as RuleContractError
from .grad._contract import VJPCheckError as VJPCheckError
from .grad._custom_vjp import custom_vjp as custom_vjp
from .grad._custom_vjp import match_primal as match_primal
from .grad._custom_vjp import with_vjp as with_vjp
from .grad._manual import hand_rule as hand_rule
from .grad._rule_table import RULE_TABLE as _RULE_TABLE
from .grad._rule_table import hand_functions as _hand_functions
from .grad._rule_table import register as _register
from .grad._small_rules import gelu_grad as gelu_grad
from .grad._structural import PRIMITIVE_RULES as _PRIMITIVE_RULES
from .grad._structural import TESTED_JAX as TESTED_JAX
from .nn import (  # noqa: F401
    _activations,
    _adaptive_pool,
    _attention,
    _batch_norm,
    _conv,
    _conv_transpose,
    _dropout,
    _embedding,
    _linear,
    _lm_head,
    _lora,
    _losses,
    _normalisation,
    _ops,
    _pool,
    _rnn,
    _rotary,
    _stack,
    _swiglu,
)

# ``stack_scan`` carries its pair by hand (its layer's rules scanned), not by hand_rule.
_register(_stack.stack_scan, _stack.stack_scan_vjp)

#: ``name -> (f, f_vjp)`` for every rule: the table, as it stands once nnlite is imported.
RULES: dict[str, tuple[Callable, Callable]] = dict(_RULE_TABLE)

globals().update({name: f for name, (f, _) in RULES.items()})
globals().update({name + "_vjp": f_vjp for name, (_, f_vjp) in RULES.items()})

#: ``primitive name -> (f, f_vjp)``: the JAX primitives manual mode differentiates by hand
#: (``jax.nn.relu``, a ``jax.custom_jvp`` function, by its own rule: ``relu``).
PRIMITIVES: dict[str, tuple[Callable, Callable]] = {
    name: (rule.f, rule.f_vjp) for name, rule in sorted(_PRIMITIVE_RULES.items())
}

#: Every rule as a ``jax.custom_vjp`` function: ``plugged.mm(x, W)`` computes ``mm`` and
#: ``jax.grad`` differentiates it with ``mm_vjp`` (``nnlite.vjp.hand`` is this namespace).
plugged = _hand_functions(RULES)

__all__ = [
    "PRIMITIVES",
    "RULES",
    "RuleContractError",
    "TESTED_JAX",
    "VJPCheckError",
    "check_rule",
    "check_rules",
    "check_vjp",
    "custom_vjp",
    "gelu_grad",
    "hand_rule",
    "match_primal",
    "plugged",
    "with_vjp",
    *sorted(n for name in RULES for n in (name, name + "_vjp")),
]

#: Spellings of this namespace's earlier days: where each thing went.
_MOVED = {
    "softmax_cross_entropy": "nnlite.rules.softmax_cross_entropy_values (the per-example rule; "
    "nl.softmax_cross_entropy is the loss that checks and reduces)",
    "softmax_cross_entropy_vjp": "nnlite.rules.softmax_cross_entropy_values_vjp",
    "batched": "nnlite.rules itself (one library for both layouts; see nnlite.vjp.batched's "
    "ImportError for the renamed few)",
    "hand": "nnlite.rules.plugged",
    "seed": "nnlite.vjp (the seed's names for this namespace's objects)",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"nnlite.rules.{name} is now {_MOVED[name]}")
    raise AttributeError(f"module 'nnlite.rules' has no attribute {name!r}")
