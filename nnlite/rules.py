"""nnlite's one public home for hand-derived VJPs: every rule, by name, and the tools.

The layers' and losses' array functions (``linear`` / ``linear_vjp``, ``conv`` /
``conv_vjp``, ``relu`` / ``relu_vjp``, ...), and the structural and linear primitives of
JAX, named after the primitive (``broadcast_in_dim``, ``reshape``, ``transpose``,
``reduce_sum``, ``add``, ``mul``, ``gather``, ``dynamic_slice``, ``concatenate``, ``pad``,
``select_n``, ``convert_element_type``, ...), which ``nl.manual_grads`` applies to the plain
``jnp`` between layers: the pairs that ``nl.manual_grads`` plugs into ``jax.custom_vjp``
and that ``nl.show_grad`` prints. ``RULES`` maps each name to its ``(f, f_vjp)``. Each rule
has the seed's form ``f_vjp(*args, dret, **hyperparameters) -> one cotangent per
argument``; a primitive's rule takes the primitive's parameters as keywords.

The same namespace holds the rule tools (``check_vjp``, ``custom_vjp``/``with_vjp``,
``hand_rule``, ``check_rules``, ``RuleContractError``), ``PRIMITIVES`` (which JAX
primitive has which rule) and the seed's two small-VJP libraries by their layout
convention: ``nnlite.rules.batched`` (row-vector batches, nnlite's layers' convention) and
``nnlite.rules.seed`` (the awf-jaxutils column-vector library). ``nnlite.vjp`` and
``nnlite.vjp.batched`` are those two libraries under the seed's names, kept as aliases:
one library, several names, never two rules for one name.

Example:
    >>> import jax.numpy as jnp
    >>> from nnlite.rules import linear, linear_vjp
    >>> x, W, b = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.zeros(4)
    >>> dx, dW, db = linear_vjp(x, W, b, jnp.ones((2, 4)))
    >>> dW.shape, db.tolist()
    ((3, 4), [2.0, 2.0, 2.0, 2.0])
"""

from collections.abc import Callable

from . import vjp as seed  # noqa: E402
from .grad._check import check_vjp as check_vjp  # noqa: E402
from .grad._check_model import check_rules as check_rules  # noqa: E402
from .grad._contract import RuleContractError as RuleContractError  # noqa: E402
from .grad._contract import VJPCheckError as VJPCheckError  # noqa: E402
from .grad._custom_vjp import custom_vjp as custom_vjp  # noqa: E402
from .grad._custom_vjp import with_vjp as with_vjp  # noqa: E402
from .grad._manual import hand_rule as hand_rule  # noqa: E402
from .grad._policy import clip_cotangent as clip_cotangent  # noqa: E402
from .grad._policy import clip_cotangent_vjp as clip_cotangent_vjp  # noqa: E402
from .grad._policy import scale_cotangent as scale_cotangent  # noqa: E402
from .grad._policy import scale_cotangent_vjp as scale_cotangent_vjp  # noqa: E402
from .grad._policy import stop_cotangent as stop_cotangent  # noqa: E402
from .grad._policy import stop_cotangent_vjp as stop_cotangent_vjp  # noqa: E402
from .grad._prim_arith import div as div
from .grad._prim_arith import div_vjp as div_vjp
from .grad._prim_arith import dot_general as dot_general
from .grad._prim_arith import dot_general_vjp as dot_general_vjp
from .grad._prim_arith import mul as mul
from .grad._prim_arith import mul_vjp as mul_vjp
from .grad._prim_arith import neg as neg
from .grad._prim_arith import neg_vjp as neg_vjp
from .grad._prim_arith import sub as sub
from .grad._prim_arith import sub_vjp as sub_vjp
from .grad._prim_conv import conv_general_dilated as conv_general_dilated
from .grad._prim_conv import conv_general_dilated_vjp as conv_general_dilated_vjp
from .grad._prim_index import dynamic_slice as dynamic_slice
from .grad._prim_index import dynamic_slice_vjp as dynamic_slice_vjp
from .grad._prim_index import dynamic_update_slice as dynamic_update_slice
from .grad._prim_index import dynamic_update_slice_vjp as dynamic_update_slice_vjp
from .grad._prim_index import gather as gather
from .grad._prim_index import gather_vjp as gather_vjp
from .grad._prim_index import pad as pad
from .grad._prim_index import pad_vjp as pad_vjp
from .grad._prim_index import scatter as scatter
from .grad._prim_index import scatter_add as scatter_add
from .grad._prim_index import scatter_add_vjp as scatter_add_vjp
from .grad._prim_index import scatter_vjp as scatter_vjp
from .grad._prim_index import select_n as select_n
from .grad._prim_index import select_n_vjp as select_n_vjp
from .grad._prim_index import slice as slice
from .grad._prim_index import slice_vjp as slice_vjp
from .grad._prim_layout import broadcast_in_dim as broadcast_in_dim
from .grad._prim_layout import broadcast_in_dim_vjp as broadcast_in_dim_vjp
from .grad._prim_layout import concatenate as concatenate
from .grad._prim_layout import concatenate_vjp as concatenate_vjp
from .grad._prim_layout import convert_element_type as convert_element_type
from .grad._prim_layout import convert_element_type_vjp as convert_element_type_vjp
from .grad._prim_layout import copy as copy
from .grad._prim_layout import copy_vjp as copy_vjp
from .grad._prim_layout import cumsum as cumsum
from .grad._prim_layout import cumsum_vjp as cumsum_vjp
from .grad._prim_layout import pvary as pvary
from .grad._prim_layout import pvary_vjp as pvary_vjp
from .grad._prim_layout import reduce_sum as reduce_sum
from .grad._prim_layout import reduce_sum_vjp as reduce_sum_vjp
from .grad._prim_layout import reshape as reshape
from .grad._prim_layout import reshape_vjp as reshape_vjp
from .grad._prim_layout import rev as rev
from .grad._prim_layout import rev_vjp as rev_vjp
from .grad._prim_layout import split as split
from .grad._prim_layout import split_vjp as split_vjp
from .grad._prim_layout import squeeze as squeeze
from .grad._prim_layout import squeeze_vjp as squeeze_vjp
from .grad._prim_layout import stack as stack
from .grad._prim_layout import stack_vjp as stack_vjp
from .grad._prim_layout import stop_gradient as stop_gradient
from .grad._prim_layout import stop_gradient_vjp as stop_gradient_vjp
from .grad._prim_layout import tile as tile
from .grad._prim_layout import tile_vjp as tile_vjp
from .grad._prim_layout import transpose as transpose
from .grad._prim_layout import transpose_vjp as transpose_vjp
from .grad._prim_math import *  # noqa: F403 -- exp, log, sin, pow, max, clamp, ... and rules
from .grad._prim_reduce import *  # noqa: F403 -- reduce_max, cumprod, sort, top_k, ... and rules
from .grad._rule_table import rule_table as _rule_table
from .grad._structural import PRIMITIVE_RULES as _PRIMITIVE_RULES  # noqa: E402
from .grad._structural import TESTED_JAX as TESTED_JAX  # noqa: E402
from .grad._vjp_batched import gelu as gelu
from .grad._vjp_batched import gelu_vjp as gelu_vjp
from .grad._vjp_batched import identity as identity
from .grad._vjp_batched import identity_vjp as identity_vjp
from .grad._vjp_batched import log_softmax as log_softmax
from .grad._vjp_batched import log_softmax_vjp as log_softmax_vjp
from .grad._vjp_batched import logaddexp as logaddexp
from .grad._vjp_batched import logaddexp2 as logaddexp2
from .grad._vjp_batched import logaddexp2_vjp as logaddexp2_vjp
from .grad._vjp_batched import logaddexp_vjp as logaddexp_vjp
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
from .nn._activations import softcap as softcap
from .nn._activations import softcap_vjp as softcap_vjp
from .nn._adaptive_pool import adaptive_avg_pool as adaptive_avg_pool
from .nn._adaptive_pool import adaptive_avg_pool_vjp as adaptive_avg_pool_vjp
from .nn._adaptive_pool import adaptive_max_pool as adaptive_max_pool
from .nn._adaptive_pool import adaptive_max_pool_vjp as adaptive_max_pool_vjp
from .nn._attention import dot_product_attention as dot_product_attention
from .nn._attention import dot_product_attention_vjp as dot_product_attention_vjp
from .nn._attention import slot as slot
from .nn._attention import slot_vjp as slot_vjp
from .nn._batch_norm import batch_norm_eval as batch_norm_eval
from .nn._batch_norm import batch_norm_eval_vjp as batch_norm_eval_vjp
from .nn._batch_norm import batch_norm_train as batch_norm_train
from .nn._batch_norm import batch_norm_train_vjp as batch_norm_train_vjp
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
from .nn._gqa import grouped_attention as grouped_attention
from .nn._gqa import grouped_attention_vjp as grouped_attention_vjp
from .nn._linear import linear as linear
from .nn._linear import linear_vjp as linear_vjp
from .nn._lm_head import chunked_log_probs as chunked_log_probs
from .nn._lm_head import chunked_log_probs_vjp as chunked_log_probs_vjp
from .nn._lora import lora_linear as lora_linear
from .nn._lora import lora_linear_dropout as lora_linear_dropout
from .nn._lora import lora_linear_dropout_vjp as lora_linear_dropout_vjp
from .nn._lora import lora_linear_vjp as lora_linear_vjp
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
from .nn._rope_scaling import rope as rope
from .nn._rope_scaling import rope_vjp as rope_vjp
from .nn._rotary import rotary as rotary
from .nn._rotary import rotary_vjp as rotary_vjp
from .nn._stack import stack_scan as stack_scan
from .nn._stack import stack_scan_vjp as stack_scan_vjp
from .nn._swiglu import geglu as geglu
from .nn._swiglu import geglu_vjp as geglu_vjp
from .nn._swiglu import swiglu as swiglu
from .nn._swiglu import swiglu_vjp as swiglu_vjp
from .vjp import batched as batched  # noqa: E402 -- the seed's libraries, by convention

#: ``name -> (f, f_vjp)`` for every layer, loss and primitive rule.
RULES: dict[str, tuple[Callable, Callable]] = _rule_table(globals())

#: ``primitive name -> (f, f_vjp)``: the JAX primitives manual mode differentiates by hand
#: (``jax.nn.relu``, a ``jax.custom_jvp`` function, by its own rule: ``relu``).
PRIMITIVES: dict[str, tuple[Callable, Callable]] = {
    name: (rule.f, rule.f_vjp) for name, rule in sorted(_PRIMITIVE_RULES.items())
}

__all__ = [
    "PRIMITIVES",
    "RULES",
    "RuleContractError",
    "TESTED_JAX",
    "VJPCheckError",
    "batched",
    "check_rules",
    "check_vjp",
    "custom_vjp",
    "hand_rule",
    "seed",
    "with_vjp",
    *sorted(n for pair in RULES for n in (pair, pair + "_vjp")),
]
