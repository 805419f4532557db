"""Linear regression, the JAX tutorial's ``y = w * x + b`` (any number of features)."""

import jax

import nnlite as nl


class LinReg(nl.Module):
    """``y = x @ W + b`` trained with mean squared error. Params: ``/W``, ``/b``."""

    in_features: int
    out_features: int = 1

    task = "regression"
    grad_modes = ("autodiff", "manual")

    @property
    def linear(self) -> nl.Linear:
        return nl.Linear(self.in_features, self.out_features, w_init="zeros")

    def init(self, key: jax.Array) -> nl.ParamsDict:
        return self.linear.init(key)

    def __call__(self, params, x, *, key=None):
        return self.linear(params, x)

    def loss(self, params, x, y):
        """Per-example squared error (mean over outputs); no other metrics."""
        return nl.mse(self(params, x), y), {}

    def objective(self, params, x, y, *, grad="autodiff"):
        """Mean squared error over the batch."""
        return nl.reduce(self.loss(params, x, y)[0], "mean"), {}


def build(cfg, data) -> LinReg:
    return LinReg(data.in_features, data.out_features)
