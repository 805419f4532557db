"""MLP classifier: an nnlite FFN body with a softmax classification head."""

import jax.numpy as jnp

import nnlite as nl

from .mlp_fused import fused_grad_accum, mlp_loss


class MLP(nl.Module):
    """``in_features -> hidden_sizes (activation after each) -> num_classes`` logits.

    Params: ``/ffn/layers[i]/{W,b}`` for the hidden layers and ``/head/{W,b}``.
    """

    in_features: int
    num_classes: int
    hidden_sizes: tuple[int, ...] = (64,)  # width of each hidden layer
    activation: str = "relu"  # after each hidden layer

    task = "classification"
    grad_modes = ("fused",)  # one hand-written pass, beside autodiff and manual

    def __post_init__(self):
        super().__post_init__()
        if not self.hidden_sizes or min(self.hidden_sizes) < 1:
            raise ValueError(
                f"hidden_sizes must be a non-empty list of positive ints, got "
                f"{list(self.hidden_sizes)}"
            )
        nl.get_activation(self.activation)  # a ValueError naming the valid ones

    def setup(self):  # the children: init is derived from them (one key each, in order)
        *inner, last = self.hidden_sizes
        self.ffn = nl.FFN(
            self.in_features, tuple(inner), last, self.activation, activate_final=True
        )
        self.head = nl.SoftmaxHead(self.hidden_sizes[-1], self.num_classes)

    def param_axes(self) -> nl.ParamsDict:
        """The body's Megatron pairs (``nl.FFN``), and the head continuing them: row-parallel
        after a column-parallel last layer (its input is then split across a tensor axis)."""
        column_last = len(self.ffn.layers) % 2 == 1
        head = nl.linear_axes(self.head.linear, "mlp" if column_last else "embed", None)
        return nl.ParamsDict(ffn=nl.param_axes(self.ffn), head=head)

    def __call__(self, params, x, *, key=None):
        """Logits ``[batch, num_classes]``."""
        return self.head.logits(params.head, self.ffn(params.ffn, x))

    def loss(self, params, x, y):
        """Per-example cross-entropy and ``{"accuracy": per-example 0/1}``."""
        logits = self(params, x)
        per_example = nl.softmax_cross_entropy(logits, y)
        return per_example, {"accuracy": self._correct(logits, y)}

    def objective(self, params, x, y, *, grad="autodiff"):
        """Mean loss and metrics, differentiable by ``jax.grad`` in gradient mode ``grad``
        (``manual``: the caller wraps this in ``nl.manual_grads``; ``fused``: one hand pass)."""
        if grad == "fused":
            loss = mlp_loss(params, x, y, activation=self.activation, mode="fused")
            return loss, {"accuracy": jnp.mean(self._correct(self(params, x), y))}
        per_example, metrics = self.loss(params, x, y)
        return nl.reduce(per_example, "mean"), {k: jnp.mean(v) for k, v in metrics.items()}

    def accumulate(self, params, x, y, grads_in, *, grad="fused"):
        """``(loss, metrics, grads_in + grads)`` by the fused, gradient-accumulating hand pass."""
        loss, grads = fused_grad_accum(params, x, y, grads_in, activation=self.activation)
        return loss, {"accuracy": jnp.mean(self._correct(self(params, x), y))}, grads

    @staticmethod
    def _correct(logits, y):
        return nl.accuracy(logits, y)
