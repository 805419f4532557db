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

from .grad._rule_table import rule_table as _rule_table
from .grad._vjp_batched import gelu as gelu
from .grad._vjp_batched import gelu_vjp as gelu_vjp
from .grad._vjp_batched import identity as identity
from .grad._vjp_batched import identity_vjp as identity_vjp
from .grad._vjp_batched import log_softmax as log_softmax
from .grad._vjp_batched import log_softmax_vjp as log_softmax_vjp
from .grad._vjp_batched import mean as mean
from .grad._vjp_batched import mean_vjp as mean_vjp
from .grad._vjp_batched import relu as relu
from .grad._vjp_batched import relu_vjp as relu_vjp
from .grad._vjp_batched import sigmoid as sigmoid
from .grad._vjp_batched import sigmoid_vjp as sigmoid_vjp
from .grad._vjp_batched import softmax as softmax
from .grad._vjp_batched import softmax_cross_entropy as softmax_cross_entropy
from .grad._vjp_batched import softmax_cross_entropy_vjp as softmax_cross_entropy_vjp
from .grad._vjp_batched import softmax_vjp as softmax_vjp
from .grad._vjp_batched import softplus as softplus
from .grad._vjp_batched import softplus_vjp as softplus_vjp
from .grad._vjp_batched import sum as sum
from .grad._vjp_batched import sum_vjp as sum_vjp
from .grad._vjp_batched import tanh as tanh
from .grad._vjp_batched import tanh_vjp as tanh_vjp
from .nn._activations import elu as elu
from .nn._activations import elu_vjp as elu_vjp
from .nn._activations import leaky_relu as leaky_relu
from .nn._activations import leaky_relu_vjp as leaky_relu_vjp
from .nn._activations import silu as silu
from .nn._activations import silu_vjp as silu_vjp
from .nn._adaptive_pool import adaptive_avg_pool as adaptive_avg_pool
from .nn._adaptive_pool import adaptive_avg_pool_vjp as adaptive_avg_pool_vjp
from .nn._adaptive_pool import adaptive_max_pool as adaptive_max_pool
from .nn._adaptive_pool import adaptive_max_pool_vjp as adaptive_max_pool_vjp
from .nn._attention import dot_product_attention as dot_product_attention
from .nn._attention import dot_product_attention_vjp as dot_product_attention_vjp
from .nn._attention import slot as slot
from .nn._attention import slot_vjp as slot_vjp
from .nn._conv import conv as conv
from .nn._conv import conv_vjp as conv_vjp
from .nn._conv_transpose import conv_transpose as conv_transpose
from .nn._conv_transpose import conv_transpose_vjp as conv_transpose_vjp
from .nn._dropout import dropout as dropout
from .nn._dropout import dropout_vjp as dropout_vjp
from .nn._embedding import embed as embed
from .nn._embedding import embed_attend as embed_attend
from .nn._embedding import embed_attend_vjp as embed_attend_vjp
from .nn._embedding import embed_vjp as embed_vjp
from .nn._linear import linear as linear
from .nn._linear import linear_vjp as linear_vjp
from .nn._losses import nll_values as nll_values
from .nn._losses import nll_values_vjp as nll_values_vjp
from .nn._losses import squared_error_values as squared_error_values
from .nn._losses import squared_error_values_vjp as squared_error_values_vjp
from .nn._normalisation import group_norm as group_norm
from .nn._normalisation import group_norm_vjp as group_norm_vjp
from .nn._normalisation import layer_norm as layer_norm
from .nn._normalisation import layer_norm_vjp as layer_norm_vjp
from .nn._normalisation import rms_norm as rms_norm
from .nn._normalisation import rms_norm_vjp as rms_norm_vjp
from .nn._ops import add as add
from .nn._ops import add_vjp as add_vjp
from .nn._pool import avg_pool as avg_pool
from .nn._pool import avg_pool_vjp as avg_pool_vjp
from .nn._pool import flatten as flatten
from .nn._pool import flatten_vjp as flatten_vjp
from .nn._pool import max_pool as max_pool
from .nn._pool import max_pool_vjp as max_pool_vjp
from .nn._rnn import gru_cell as gru_cell
from .nn._rnn import gru_cell_vjp as gru_cell_vjp
from .nn._rnn import gru_scan as gru_scan
from .nn._rnn import gru_scan_vjp as gru_scan_vjp
from .nn._rnn import lstm_cell as lstm_cell
from .nn._rnn import lstm_cell_vjp as lstm_cell_vjp
from .nn._rnn import lstm_scan as lstm_scan
from .nn._rnn import lstm_scan_vjp as lstm_scan_vjp
from .nn._rnn import subarray as subarray
from .nn._rnn import subarray_vjp as subarray_vjp
from .nn._rotary import rotary as rotary
from .nn._rotary import rotary_vjp as rotary_vjp

#: ``name -> (f, f_vjp)`` for every layer and loss rule.
RULES: dict[str, tuple[Callable, Callable]] = _rule_table(globals())

__all__ = ["RULES", *sorted(n for pair in RULES for n in (pair, pair + "_vjp"))]
