"""nnlite: a small neural-network library on JAX.

Parameters live in ``ParamsDict`` pytrees; layers are frozen dataclasses of
hyperparameters with ``init(key)`` and ``__call__(params, x)``.
"""

from . import fused as fused
from . import rules as rules
from . import vjp as vjp
from ._attention import MultiHeadAttention as MultiHeadAttention
from ._attention import TransformerBlock as TransformerBlock
from ._conv import Conv as Conv
from ._dropout import Dropout as Dropout
from ._embedding import Embedding as Embedding
from ._equinox import EquinoxLayer as EquinoxLayer
from ._equinox import from_equinox as from_equinox
from ._grad_modes import GRAD_MODES as GRAD_MODES
from ._linear import FFN as FFN
from ._linear import Activation as Activation
from ._linear import Linear as Linear
from ._linear import Sequential as Sequential
from ._linear import SoftmaxHead as SoftmaxHead
from ._linear import linear as linear
from ._losses import REDUCTIONS as REDUCTIONS
from ._losses import accuracy as accuracy
from ._losses import mse as mse
from ._losses import nll as nll
from ._losses import reduce as reduce
from ._losses import softmax_cross_entropy as softmax_cross_entropy
from ._manual import ManualGradError as ManualGradError
from ._manual import hand_rule as hand_rule
from ._manual import manual_grads as manual_grads
from ._module import Module as Module
from ._module import ParamsMismatchError as ParamsMismatchError
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
from ._normalisation import GroupNorm as GroupNorm
from ._normalisation import LayerNorm as LayerNorm
from ._normalisation import RMSNorm as RMSNorm
from ._ops import add as add
from ._params import ParamsDict as ParamsDict
from ._params import format_path as format_path
from ._params import leaf_str as leaf_str
from ._pool import AvgPool as AvgPool
from ._pool import Flatten as Flatten
from ._pool import MaxPool as MaxPool
from ._save import CheckpointError as CheckpointError
from ._save import load as load
from ._save import load_metadata as load_metadata
from ._save import save as save
from ._show_grad import show_grad as show_grad

# show_jaxpr's printer imports the modules of every JAX primitive it knows (about 0.3 s):
# loaded on first use (PEP 562, see __getattr__), so that training, which never prints,
# does not pay it.
_LAZY = {
    "UnsupportedPrimitiveError": "._show_jaxpr",
    "roundtrip": "._show_jaxpr",
    "show_jaxpr": "._show_jaxpr",
    "show_jaxpr_and_xla": "._show_jaxpr",
    "show_xla": "._show_jaxpr",
}

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
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
    raise AttributeError(f"module 'nnlite' has no attribute {name!r}")


__all__ = [
    "ACTIVATIONS",
    "FFN",
    "GRAD_MODES",
    "INITIALIZERS",
    "REDUCTIONS",
    "Activation",
    "AvgPool",
    "CheckpointError",
    "Conv",
    "Dropout",
    "Embedding",
    "EquinoxLayer",
    "Flatten",
    "GroupNorm",
    "LayerNorm",
    "Linear",
    "ManualGradError",
    "MaxPool",
    "Module",
    "MultiHeadAttention",
    "ParamsDict",
    "ParamsMismatchError",
    "RMSNorm",
    "Sequential",
    "SoftmaxHead",
    "TransformerBlock",
    "UnsupportedPrimitiveError",
    "accuracy",
    "add",
    "format_path",
    "from_equinox",
    "fused",
    "gelu",
    "get_activation",
    "get_initializer",
    "hand_rule",
    "identity",
    "leaf_str",
    "linear",
    "load",
    "load_metadata",
    "manual_grads",
    "mse",
    "nll",
    "reduce",
    "relu",
    "roundtrip",
    "rules",
    "save",
    "show_grad",
    "show_jaxpr",
    "show_jaxpr_and_xla",
    "show_xla",
    "sigmoid",
    "softmax_cross_entropy",
    "softplus",
    "tanh",
    "vjp",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
