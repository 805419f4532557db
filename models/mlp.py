"""MLP classifier: an nnlite FFN body with a softmax classification head."""

import jax
import jax.numpy as jnp

import nnlite as nl


class MLP(nl.Module):
    """``in_features -> hidden_sizes (activation after each) -> num_classes`` logits.

    Params: ``/ffn/layers[i]/{W,b}`` for the hidden layers and ``/head/{W,b}``.
    """

    in_features: int
    hidden_sizes: tuple[int, ...]
    num_classes: int
    activation: str = "relu"

    task = "classification"

    @property
    def ffn(self) -> nl.FFN:
        *inner, last = self.hidden_sizes
        return nl.FFN(self.in_features, tuple(inner), last, self.activation, activate_final=True)

    @property
    def head(self) -> nl.SoftmaxHead:
        return nl.SoftmaxHead(self.hidden_sizes[-1], self.num_classes)

    def init(self, key: jax.Array) -> nl.ParamsDict:
        k_ffn, k_head = jax.random.split(key)
        return nl.ParamsDict(ffn=self.ffn.init(k_ffn), head=self.head.init(k_head))

    def __call__(self, params, x, *, key=None):
        """Logits ``[batch, num_classes]``."""
        return self.head.logits(params.head, self.ffn(params.ffn, x))

    def loss(self, params, x, y):
        logits = self(params, x)
        per_example = nl.softmax_cross_entropy(logits, y)
        correct = (jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
        return per_example, {"accuracy": correct}


def build(cfg, data) -> MLP:
    return MLP(data.in_features, tuple(cfg.hidden_sizes), data.num_classes, cfg.activation)
