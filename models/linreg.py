"""Linear regression, the JAX tutorial's ``y = w * x + b`` (any number of features)."""

import nnlite as nl


class LinReg(nl.Module):
    """``y = x @ W + b`` trained with mean squared error (the regression task's loss).
    Params: ``/W``, ``/b``."""

    in_features: int
    out_features: int = 1

    task = "regression"
    params_of = "linear"  # the model's params are its Linear's (/W, /b), not nested

    def setup(self):  # the child: init is derived from it
        self.linear = nl.Linear(self.in_features, self.out_features, w_init="zeros")

    def __call__(self, params, x, *, key=None):
        return self.linear(params, x)
