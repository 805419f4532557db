"""Model registry: the config's ``model.name`` -> a constructor.

A constructor takes the model config and the data set and returns a model: an nnlite
Module with ``init(key)``, ``__call__(params, x)``, ``task`` and
``loss(params, x, y) -> (per_example_loss, {metric: per_example_values})``.
Adding a model is one file plus one line here.
"""

from . import linreg, mlp

MODELS = {
    "mlp": mlp.build,
    "linreg": linreg.build,
}
