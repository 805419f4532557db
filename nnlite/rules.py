"""Every nnlite layer's and loss's array function with its hand-derived VJP, by name.

``linear`` / ``linear_vjp``, ``conv`` / ``conv_vjp``, ``relu`` / ``relu_vjp``, ... : the
pairs that ``nl.manual_grads`` plugs into ``jax.custom_vjp`` and that ``nl.show_grad``
prints. ``RULES`` maps each name to its ``(f, f_vjp)``. Each rule has the seed's form
``f_vjp(*args, dret, **hyperparameters) -> one cotangent per argument``.

Example:
    >>> import jax.numpy as jnp
    >>> from nnlite.rules import linear, linear_vjp
    >>> x, W, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4)
    >>> dx, dW, db = linear_vjp(x, W, b, jnp.ones((2, 4)))
    >>> dW.shape, db.tolist()
    ((3, 4), [2.0, 2.0, 2.0, 2.0])
"""

from collections.abc import Callable

from ._attention import dot_product_attention as dot_product_attention
from ._attention import dot_product_attention_vjp as dot_product_attention_vjp
from ._attention import slot as slot
from ._attention import slot_vjp as slot_vjp
from ._conv import conv as conv
from ._conv import conv_vjp as conv_vjp
from ._dropout import dropout as dropout
from ._dropout import dropout_vjp as dropout_vjp
from ._embedding import embed as embed
from ._embedding import embed_attend as embed_attend
from ._embedding import embed_attend_vjp as embed_attend_vjp
from ._embedding import embed_vjp as embed_vjp
from ._linear import linear as linear
from ._linear import linear_vjp as linear_vjp
from ._losses import cross_entropy_values as cross_entropy_values
from ._losses import cross_entropy_values_vjp as cross_entropy_values_vjp
from ._losses import mean as mean
from ._losses import mean_vjp as mean_vjp
from ._losses import nll_values as nll_values
from ._losses import nll_values_vjp as nll_values_vjp
from ._losses import squared_error_values as squared_error_values
from ._losses import squared_error_values_vjp as squared_error_values_vjp
from ._losses import total as total
from ._losses import total_vjp as total_vjp
from ._nn import gelu as gelu
from ._nn import identity as identity
from ._nn import relu as relu
from ._nn import sigmoid as sigmoid
from ._nn import softplus as softplus
from ._nn import tanh as tanh
from ._normalisation import group_norm as group_norm
from ._normalisation import group_norm_vjp as group_norm_vjp
from ._normalisation import layer_norm as layer_norm
from ._normalisation import layer_norm_vjp as layer_norm_vjp
from ._normalisation import rms_norm as rms_norm
from ._normalisation import rms_norm_vjp as rms_norm_vjp
from ._ops import add as add
from ._ops import add_vjp as add_vjp
from ._pool import avg_pool as avg_pool
from ._pool import avg_pool_vjp as avg_pool_vjp
from ._pool import flatten as flatten
from ._pool import flatten_vjp as flatten_vjp
from ._pool import max_pool as max_pool
from ._pool import max_pool_vjp as max_pool_vjp
from ._vjp import gelu_vjp as gelu_vjp
from ._vjp import identity_vjp as identity_vjp
from ._vjp import log_softmax as log_softmax
from ._vjp import log_softmax_vjp as log_softmax_vjp
from ._vjp import relu_vjp as relu_vjp
from ._vjp import sigmoid_vjp as sigmoid_vjp
from ._vjp import softmax as softmax
from ._vjp import softmax_vjp as softmax_vjp
from ._vjp import softplus_vjp as softplus_vjp
from ._vjp import tanh_vjp as tanh_vjp

#: ``name -> (f, f_vjp)`` for every layer and loss rule.
RULES: dict[str, tuple[Callable, Callable]] = {
    name: (f, globals()[name + "_vjp"])
    for name, f in dict(globals()).items()
    if callable(f) and not name.endswith("_vjp") and name + "_vjp" in globals()
}

__all__ = ["RULES", *sorted(n for pair in RULES for n in (pair, pair + "_vjp"))]
