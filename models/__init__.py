"""Model registry: the config's ``model.name`` -> a constructor.

A constructor takes the model config and the data set and returns a model: an nnlite
Module with ``init(key)``, ``__call__(params, x)``, ``task`` ("classification" or
"regression"), ``grad_modes`` (the ``loss.grad`` choices it supports),
``loss(params, x, y) -> (per_example_loss, {metric: per_example_values})``,
``objective(params, x, y, *, grad) -> (mean_loss, {metric: mean})`` (what training
differentiates) and, optionally, ``accumulate(params, x, y, grads_in, *, grad)`` for a
hand-derived pass that adds into gradient buffers (used with ``train.grad_accum_steps``).
Adding a model is one file plus one line here.
"""

from . import cnn, gpt, linreg, mlp

#: Models with a fused hand-written backward pass (``loss.grad=fused``); ``manual`` and
#: ``autodiff`` work for every model.
FUSED = ("mlp",)

MODELS = {
    "mlp": mlp.build,
    "linreg": linreg.build,
    "cnn": cnn.build,
    "gpt": gpt.build,
}
