"""nnlite: a small neural-network library on JAX.

Parameters live in ``ParamsDict`` pytrees; layers are frozen dataclasses of
hyperparameters with ``init(key)`` and ``__call__(params, x)``.
"""

from . import vjp as vjp
from ._grad_modes import GRAD_MODES as GRAD_MODES
from ._grad_modes import HAND_ACTIVATIONS as HAND_ACTIVATIONS
from ._grad_modes import fused_grad_accum as fused_grad_accum
from ._grad_modes import fused_loss_and_grad as fused_loss_and_grad
from ._grad_modes import loss_and_grad as loss_and_grad
from ._grad_modes import mlp_layers as mlp_layers
from ._grad_modes import mlp_logits as mlp_logits
from ._grad_modes import mlp_loss as mlp_loss
from ._layers import FFN as FFN
from ._layers import Activation as Activation
from ._layers import Linear as Linear
from ._layers import Sequential as Sequential
from ._layers import SoftmaxHead as SoftmaxHead
from ._losses import REDUCTIONS as REDUCTIONS
from ._losses import accuracy as accuracy
from ._losses import mse as mse
from ._losses import nll as nll
from ._losses import reduce as reduce
from ._losses import softmax_cross_entropy as softmax_cross_entropy
from ._module import Module as Module
from ._nn import ACTIVATIONS as ACTIVATIONS
from ._nn import INITIALIZERS as INITIALIZERS
from ._nn import gelu as gelu
from ._nn import get_activation as get_activation
from ._nn import get_initializer as get_initializer
from ._nn import identity as identity
from ._nn import relu as relu
from ._nn import sigmoid as sigmoid
from ._nn import softplus as softplus
from ._nn import tanh as tanh
from ._params import ParamsDict as ParamsDict
from ._params import PathKey as PathKey
from ._params import format_path as format_path
from ._params import leaf_str as leaf_str

# show_jaxpr's printer imports the modules of every JAX primitive it knows (about 0.3 s):
# loaded on first use (PEP 562), so that training, which never prints, does not pay it.
_LAZY = {
    "UnsupportedPrimitiveError": "._show_jaxpr",
    "roundtrip": "._show_jaxpr",
    "show_jaxpr": "._show_jaxpr",
}

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "FFN",
    "GRAD_MODES",
    "HAND_ACTIVATIONS",
    "INITIALIZERS",
    "REDUCTIONS",
    "Activation",
    "Linear",
    "Module",
    "ParamsDict",
    "PathKey",
    "Sequential",
    "SoftmaxHead",
    "UnsupportedPrimitiveError",
    "accuracy",
    "format_path",
    "fused_grad_accum",
    "fused_loss_and_grad",
    "gelu",
    "get_activation",
    "get_initializer",
    "identity",
    "leaf_str",
    "loss_and_grad",
    "mlp_layers",
    "mlp_logits",
    "mlp_loss",
    "mse",
    "nll",
    "reduce",
    "relu",
    "roundtrip",
    "show_jaxpr",
    "sigmoid",
    "softmax_cross_entropy",
    "softplus",
    "tanh",
    "vjp",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
