"""Linear regression, the JAX tutorial's ``y = w * x + b`` (any number of features)."""

import jax

import nnlite as nl


class LinReg(nl.Module):
    """``y = x @ W + b`` trained with mean squared error (the regression task's loss).
    Params: ``/W``, ``/b``."""

    in_features: int
    out_features: int = 1

    task = "regression"

    @property
    def linear(self) -> nl.Linear:
        return nl.Linear(self.in_features, self.out_features, w_init="zeros")

    def init(self, key: jax.Array) -> nl.ParamsDict:
        return self.linear.init(key)

    def __call__(self, params, x, *, key=None):
        return self.linear(params, x)
