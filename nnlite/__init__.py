"""nnlite: a small neural-network library on JAX.

Parameters live in ``ParamsDict`` pytrees; layers are frozen dataclasses of
hyperparameters with ``init(key)`` and ``__call__(params, x)``.
"""

from . import rules as rules
from . import vjp as vjp
from .core._axes import AXIS_NAMES as AXIS_NAMES
from .core._axes import Axes as Axes
from .core._axes import param_axes as param_axes
from .core._batch_axis import batch_axis as batch_axis
from .core._batch_axis import current_batch_axis as current_batch_axis
from .core._compile import compiler_options as compiler_options
from .core._compile import jit as jit
from .core._flops import flops as flops
from .core._gemm import gemm_info as gemm_info
from .core._gemm import matmul as matmul
from .core._host_memory import keep_host_memory as keep_host_memory
from .core._jax_private import lowered_cost_analysis as cost_analysis

# issue 34 (gradtrain helper): a trace-time hook around each layer call (per-layer backward
# diagnostics and policies by path in the trainer)
from .core._layer_hook import LayerCall as LayerCall
from .core._layer_hook import layer_hook as layer_hook

# Choosing params by path (issue 32): globs over ParamsDict paths, freezing what they choose
from .core._mode import frozen_scope as frozen_scope
from .core._module import Module as Module
from .core._module import ParamsMismatchError as ParamsMismatchError
from .core._params import ParamsDict as ParamsDict
from .core._params import format_path as format_path
from .core._params import leaf_str as leaf_str

# issue 32 (perf helper): a compute-dtype scope for cast params, the model summary
from .core._precision import precision as precision
from .core._save import CheckpointCorruptError as CheckpointCorruptError
from .core._save import CheckpointError as CheckpointError
from .core._save import load as load
from .core._save import load_metadata as load_metadata
from .core._save import save as save
from .core._save import verify as verify
from .core._select import freeze as freeze
from .core._select import match_paths as match_paths
from .core._select import path_mask as path_mask
from .core._sharded import save_sharded as save_sharded
from .core._summary import Summary as Summary
from .core._summary import summary as summary
from .grad._check_model import check_rules as check_rules

# issue 34 (grad helper): the rule contract's error, per-layer rule checks
from .grad._contract import RuleContractError as RuleContractError
from .grad._manual import ManualGradError as ManualGradError
from .grad._manual import check_manual as check_manual
from .grad._manual import hand_rule as hand_rule
from .grad._manual import manual_grads as manual_grads
from .grad._policy import BackwardPolicy as BackwardPolicy
from .grad._policy import backward_policy as backward_policy
from .grad._show_grad import show_forward as show_forward
from .grad._show_grad import show_grad as show_grad
from .grad._show_grad import show_value_and_grad as show_value_and_grad
from .grad._small_rules import gelu as gelu
from .grad._small_rules import identity as identity
from .grad._small_rules import relu as relu
from .grad._small_rules import sigmoid as sigmoid
from .grad._small_rules import softplus as softplus
from .grad._small_rules import tanh as tanh
from .nn._activations import elu as elu
from .nn._activations import leaky_relu as leaky_relu
from .nn._activations import silu as silu
from .nn._adaptive_pool import AdaptiveAvgPool as AdaptiveAvgPool
from .nn._adaptive_pool import AdaptiveMaxPool as AdaptiveMaxPool

# Pretrained decoders (issue 33): grouped-query attention, SwiGLU, the Llama block, LoRA;
# nl.hf (loaded on first use: it is the only part that reads tokenizers/config files).
from .nn._attention import GroupedQueryAttention as GroupedQueryAttention
from .nn._attention import MultiHeadAttention as MultiHeadAttention
from .nn._batch_norm import BatchNorm as BatchNorm
from .nn._conv import Conv as Conv
from .nn._conv_transpose import ConvTranspose as ConvTranspose
from .nn._dropout import Dropout as Dropout
from .nn._embedding import Embedding as Embedding
from .nn._equinox import EquinoxLayer as EquinoxLayer
from .nn._equinox import from_equinox as from_equinox
from .nn._flash import flash_attention as flash_attention
from .nn._flash import flash_attention_bwd as flash_attention_bwd
from .nn._flash import flash_attention_fwd as flash_attention_fwd
from .nn._flash import flash_info as flash_info
from .nn._linear import FFN as FFN
from .nn._linear import Activation as Activation
from .nn._linear import Linear as Linear
from .nn._linear import Sequential as Sequential
from .nn._linear import SoftmaxHead as SoftmaxHead
from .nn._linear import linear as linear
from .nn._linear import linear_axes as linear_axes
from .nn._llama import LlamaBlock as LlamaBlock
from .nn._lm_head import label_log_probs as label_log_probs
from .nn._lora import LoRA as LoRA
from .nn._lora import freeze_base as freeze_base
from .nn._lora import lora_join as lora_join
from .nn._lora import lora_mask as lora_mask
from .nn._lora import lora_split as lora_split
from .nn._losses import REDUCTIONS as REDUCTIONS
from .nn._losses import accuracy as accuracy
from .nn._losses import mse as mse
from .nn._losses import nll as nll
from .nn._losses import reduce as reduce
from .nn._losses import softmax_cross_entropy as softmax_cross_entropy
from .nn._names import ACTIVATIONS as ACTIVATIONS
from .nn._names import INITIALIZERS as INITIALIZERS
from .nn._names import get_activation as get_activation
from .nn._names import get_initializer as get_initializer
from .nn._normalisation import GroupNorm as GroupNorm
from .nn._normalisation import LayerNorm as LayerNorm
from .nn._normalisation import RMSNorm as RMSNorm
from .nn._ops import add as add
from .nn._pool import AvgPool as AvgPool
from .nn._pool import Flatten as Flatten
from .nn._pool import MaxPool as MaxPool
from .nn._rnn import RNN as RNN
from .nn._rnn import GRUCell as GRUCell
from .nn._rnn import LSTMCell as LSTMCell
from .nn._rotary import RotaryEmbedding as RotaryEmbedding
from .nn._rotary import rope_frequencies as rope_frequencies
from .nn._segments import segment_mask as segment_mask
from .nn._segments import segment_positions as segment_positions
from .nn._stack import REMAT_POLICIES as REMAT_POLICIES
from .nn._stack import Remat as Remat
from .nn._stack import Stack as Stack
from .nn._swiglu import SwiGLU as SwiGLU
from .nn._transformer import TransformerBlock as TransformerBlock

# show_jaxpr's printer imports the modules of every JAX primitive it knows (about 0.3 s):
# loaded on first use (PEP 562, see __getattr__), so that training, which never prints,
# does not pay it.
_LAZY = {
    "UnsupportedPrimitiveError": ".jaxpr._show_jaxpr",
    "roundtrip": ".jaxpr._show_jaxpr",
    "show_jaxpr": ".jaxpr._show_jaxpr",
    "show_jaxpr_and_xla": ".jaxpr._show_jaxpr",
    "show_xla": ".jaxpr._show_jaxpr",
    "hf": ".hf",
}

# Names that left the library, with where they went: MLP-only code lives with the MLP
# model, the training CLI's settings with the CLI. No shim can return them (nnlite never
# imports models/ or train/), so the error says where to look.
_MOVED_OUT = {
    "fused": "the MLP's fused hand pass (fused_grad_accum, fused_loss_and_grad, mlp_loss, "
    "loss_and_grad, mlp_layers, HAND_ACTIVATIONS) moved to models/mlp_fused.py",
    "GRAD_MODES": "the gradient modes are the training CLI's setting (train.config.GRAD_MODES); "
    "each model lists those it supports in its grad_modes (the MLP's: "
    "models.mlp_fused.GRAD_MODES)",
}

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name], __name__)
        value = module if module.__name__.endswith("." + name) else getattr(module, name)
        globals()[name] = value
        return value
    # Deprecated names: still importable, with a warning that says what replaces them.
    if name == "PathKey":
        import warnings

        import jax

        warnings.warn(
            "nl.PathKey is deprecated: ParamsDict key paths now use JAX's standard "
            "jax.tree_util.DictKey (orbax and keystr read it); nl.PathKey is that "
            "class (its .key is the old .name), and nl.format_path(path) still prints "
            "'/layers[0]/W'",
            DeprecationWarning,
            stacklevel=2,
        )
        return jax.tree_util.DictKey
    if name in _MOVED_OUT:
        raise AttributeError(f"module 'nnlite' has no attribute {name!r}: {_MOVED_OUT[name]}")
    raise AttributeError(f"module 'nnlite' has no attribute {name!r}")


__all__ = [
    "freeze",
    "frozen_scope",
    "match_paths",
    "path_mask",
    "freeze_base",
    "segment_mask",
    "segment_positions",
    "rope_frequencies",
    "lora_split",
    "lora_mask",
    "lora_join",
    "hf",
    "SwiGLU",
    "LoRA",
    "LlamaBlock",
    "GroupedQueryAttention",
    "ACTIVATIONS",
    "AXIS_NAMES",
    "Axes",
    "FFN",
    "INITIALIZERS",
    "REDUCTIONS",
    "REMAT_POLICIES",
    "RNN",
    "Activation",
    "AdaptiveAvgPool",
    "AdaptiveMaxPool",
    "AvgPool",
    "BatchNorm",
    "CheckpointCorruptError",
    "CheckpointError",
    "Conv",
    "ConvTranspose",
    "Dropout",
    "Embedding",
    "EquinoxLayer",
    "Flatten",
    "GRUCell",
    "GroupNorm",
    "LSTMCell",
    "LayerNorm",
    "Linear",
    "ManualGradError",
    "BackwardPolicy",
    "RuleContractError",
    "MaxPool",
    "Module",
    "MultiHeadAttention",
    "ParamsDict",
    "ParamsMismatchError",
    "RMSNorm",
    "Remat",
    "RotaryEmbedding",
    "Sequential",
    "SoftmaxHead",
    "Stack",
    "TransformerBlock",
    "UnsupportedPrimitiveError",
    "accuracy",
    "add",
    "batch_axis",
    "backward_policy",
    "layer_hook",  # issue 34 (gradtrain)
    "LayerCall",
    "check_manual",
    "check_rules",
    "compiler_options",
    "flash_attention",
    "flash_attention_bwd",
    "flash_attention_fwd",
    "flash_info",
    "gemm_info",
    "matmul",
    "keep_host_memory",
    "jit",
    "cost_analysis",
    "flops",
    "current_batch_axis",
    "elu",
    "format_path",
    "from_equinox",
    "gelu",
    "get_activation",
    "get_initializer",
    "hand_rule",
    "identity",
    "label_log_probs",
    "leaf_str",
    "leaky_relu",
    "linear",
    "linear_axes",
    "load",
    "load_metadata",
    "manual_grads",
    "mse",
    "nll",
    "param_axes",
    "reduce",
    "relu",
    "roundtrip",
    "rules",
    "save",
    "save_sharded",
    "show_forward",
    "show_grad",
    "show_value_and_grad",
    "show_jaxpr",
    "show_jaxpr_and_xla",
    "show_xla",
    "sigmoid",
    "silu",
    "softmax_cross_entropy",
    "softplus",
    "tanh",
    "verify",
    "vjp",
    # issue 32 (perf helper)
    "precision",
    "summary",
    "Summary",
]


def __dir__() -> list[str]:
    # The subpackages (core, nn, grad, jaxpr) are the library's layout, not its API: their
    # names appear in globals() once imported, but every public name is re-exported here.
    return sorted((set(globals()) | set(_LAZY)) - {"core", "grad", "jaxpr", "nn"})
