"""Initializers and activations by name, so hyperparameters stay hashable strings."""

from __future__ import annotations

from collections.abc import Callable

import jax

from ..grad._small_rules import gelu, identity, relu, sigmoid, softplus, tanh
from ._activations import elu, leaky_relu, silu

__all__ = ["ACTIVATIONS", "INITIALIZERS", "get_activation", "get_initializer"]

_inits = jax.nn.initializers

# Named as in the literature; each maps (key, shape, dtype) -> array. Fan-in/fan-out are
# read from a (in_features, out_features) weight shape.
INITIALIZERS: dict[str, Callable] = {
    "zeros": _inits.zeros,
    "ones": _inits.ones,
    "normal": _inits.normal(stddev=1.0),
    "normal_0.02": _inits.normal(stddev=0.02),  # GPT-2's weights and embeddings
    "lecun_normal": _inits.lecun_normal(),
    "lecun_uniform": _inits.lecun_uniform(),
    "glorot_normal": _inits.glorot_normal(),
    "glorot_uniform": _inits.glorot_uniform(),
    "he_normal": _inits.he_normal(),
    "he_uniform": _inits.he_uniform(),
    "orthogonal": _inits.orthogonal(),  # recurrent weights (GRUCell, LSTMCell: per gate)
}


# The activation functions live in the batched VJP library, each beside its hand rule
# (relu and relu_vjp, ...), and in nn/_activations.py (silu, leaky_relu, elu), declared
# with @hand_rule there: manual-gradient mode differentiates them with those rules.
ACTIVATIONS: dict[str, Callable] = {
    "relu": relu,
    "gelu": gelu,
    "tanh": tanh,
    "sigmoid": sigmoid,
    "softplus": softplus,
    "identity": identity,
    "silu": silu,
    "leaky_relu": leaky_relu,  # negative_slope 0.01 (call nl.leaky_relu for another)
    "elu": elu,  # alpha 1
}


def _lookup(table: dict, kind: str, name: str | Callable) -> Callable:
    if callable(name):
        return name
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(table)}") from None


def get_activation(name: str | Callable) -> Callable:
    """The activation function called ``name`` (or ``name`` itself if callable)."""
    return _lookup(ACTIVATIONS, "activation", name)


def get_initializer(name: str | Callable) -> Callable:
    """The initializer called ``name`` (or ``name`` itself if callable)."""
    return _lookup(INITIALIZERS, "initializer", name)
