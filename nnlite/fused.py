"""The MLP-only gradient helpers: one fused hand-written backward pass for a chain of Linear
layers with a softmax cross-entropy, and the MLP loss in each gradient mode.

``manual`` gradients for any model come from ``nnlite.manual_grads`` (every layer's hand
VJP); this module keeps the hand-optimised pass for the one model shape it was written for.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import nnlite as nl
    >>> params = nl.FFN(4, (8,), 3).init(jax.random.key(0))
    >>> x, y = jnp.ones((2, 4)), jnp.array([0, 2])
    >>> loss, grads = nl.fused.fused_loss_and_grad(params, x, y)
    >>> grads.layers[0].W.shape
    (4, 8)
"""

from ._grad_modes import HAND_ACTIVATIONS as HAND_ACTIVATIONS
from ._grad_modes import fused_grad_accum as fused_grad_accum
from ._grad_modes import fused_loss_and_grad as fused_loss_and_grad
from ._grad_modes import loss_and_grad as loss_and_grad
from ._grad_modes import mlp_layers as mlp_layers
from ._grad_modes import mlp_logits as mlp_logits
from ._grad_modes import mlp_loss as mlp_loss

__all__ = [
    "HAND_ACTIVATIONS",
    "fused_grad_accum",
    "fused_loss_and_grad",
    "loss_and_grad",
    "mlp_layers",
    "mlp_logits",
    "mlp_loss",
]
