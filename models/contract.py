"""The model contract: what any model trained by ``python -m train`` provides.

A model is an ``nl.Module`` (a frozen dataclass of hyperparameters) with:

- ``task``, a class attribute: ``"classification"`` (``__call__`` returns logits
  ``[batch, num_classes]`` for int labels), ``"regression"`` (predictions
  ``[batch, out_features]`` for float targets) or ``"language_model"`` (logits
  ``[batch, T, vocab_size]`` for int tokens ``[batch, T]``, targets the next tokens);
- ``init(key) -> ParamsDict`` and ``__call__(params, x, *, key=None)``;
- its hyperparameters as dataclass fields: the config's ``model:`` keys are validated
  against them. The fields that the data determines are filled from the data set when
  the config leaves them out, under these names (:data:`DATA_FIELDS`): ``in_features``
  (flat inputs) or ``in_shape`` (the shape of one example), ``num_classes``
  (classification), ``out_features`` (regression), ``vocab_size`` and ``context``
  (language models);
- optionally ``uses_key`` (a bool, or a property): training passes a random key per step
  to ``__call__`` (dropout); derived from the seed and the step, so resume stays exact;
- optionally its own ``loss(params, x, y) -> (per_example_loss, {metric: per_example})``
  and ``objective(params, x, y, *, key=None) -> (mean_loss, {metric: mean})`` (what
  training differentiates); by default they come from the task (:data:`TASKS`):
  softmax cross-entropy + accuracy, mean squared error, next-token cross-entropy + bits
  per character;
- optionally ``grad_modes``: the ``loss.grad`` modes beyond ``autodiff`` and ``manual``
  that its ``objective(..., grad=...)`` implements (the MLP's ``fused``); a list that
  names ``autodiff`` is the complete list (``("autodiff",)``: a model that must not run
  with hand rules; ``loss.grad: auto`` then resolves to autodiff).

Example (a residual MLP classifier in a user's own file, ``model.name:
"mymodels:ResMLP"`` in the config):

    >>> import jax, nnlite as nl
    >>> class ResMLP(nl.Module):
    ...     in_features: int
    ...     num_classes: int
    ...     width: int = 32
    ...     task = "classification"
    ...     def init(self, key):
    ...         k1, k2, k3 = jax.random.split(key, 3)
    ...         return nl.ParamsDict(
    ...             inp=nl.Linear(self.in_features, self.width).init(k1),
    ...             res=nl.Linear(self.width, self.width).init(k2),
    ...             out=nl.Linear(self.width, self.num_classes).init(k3))
    ...     def __call__(self, params, x, *, key=None):
    ...         h = jax.nn.relu(nl.Linear(self.in_features, self.width)(params.inp, x))
    ...         h = h + jax.nn.relu(nl.Linear(self.width, self.width)(params.res, h))
    ...         return nl.Linear(self.width, self.num_classes)(params.out, h)
    >>> check_model_class(ResMLP, "model.name=mymodels:ResMLP")
    >>> sorted(data_fields(ResMLP))
    ['in_features', 'num_classes']
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

import nnlite as nl

LN2 = math.log(2.0)

TASKS = ("classification", "regression", "language_model")

#: Fields that the data set fills when the config leaves them out, and what fills them.
DATA_FIELDS = {
    "in_features": "the number of input features (x [n, features])",
    "in_shape": "the shape of one input example (x.shape[1:])",
    "num_classes": "the number of classes (largest label + 1)",
    "out_features": "the number of regression targets (y [n, outputs])",
    "vocab_size": "the vocabulary size of the text",
    "context": "the text window length (data.context)",
}

#: The gradient modes every model supports (``loss.grad``); a model adds its own through
#: ``grad_modes`` and an ``objective(..., grad=...)`` that implements them.
BASE_GRAD_MODES = ("autodiff", "manual")


class Model(Protocol):
    """What the trainer uses of a model (see the module docstring)."""

    task: ClassVar[str]

    def init(self, key: jax.Array) -> nl.ParamsDict: ...

    def __call__(self, params: nl.ParamsDict, x: jax.Array, *, key: jax.Array | None = None): ...


class ModelError(ValueError):
    """A class or its configuration does not fit the model contract (one line)."""


def check_model_class(cls: Any, where: str) -> None:
    """Raise ModelError unless ``cls`` is an ``nl.Module`` subclass with a valid ``task``."""
    if not (isinstance(cls, type) and issubclass(cls, nl.Module)):
        what = f"class {cls.__name__}" if isinstance(cls, type) else type(cls).__name__
        raise ModelError(f"{where}: {what} is not an nnlite Module (subclass nl.Module)")
    task = getattr(cls, "task", None)
    if task not in TASKS:
        raise ModelError(
            f"{where}: {cls.__name__}.task must be one of {', '.join(TASKS)} (a class "
            f"attribute), got {task!r}"
        )
    if cls.init is nl.Module.init:
        raise ModelError(f"{where}: {cls.__name__} does not define init(self, key)")


def fields(cls: type) -> dict[str, dataclasses.Field]:
    """The hyperparameter fields of a model class, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def field_types(cls: type) -> dict[str, Any]:
    """Each field's type, with string annotations (``from __future__ import annotations``)
    resolved in the class's module."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: take them as written
        hints = {}
    return {name: hints.get(name, f.type) for name, f in fields(cls).items()}


def has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def data_fields(cls: type) -> list[str]:
    """The fields of ``cls`` that a data set can fill."""
    return [name for name in fields(cls) if name in DATA_FIELDS]


def grad_modes(model: Any) -> tuple[str, ...]:
    """The ``loss.grad`` modes ``model`` supports (``auto`` aside: it resolves to one of
    these): autodiff, manual and the model's own, or its list alone when that names
    autodiff."""
    extra = tuple(getattr(model, "grad_modes", ()))
    if "autodiff" in extra:
        return extra
    return BASE_GRAD_MODES + tuple(m for m in extra if m not in BASE_GRAD_MODES)


def uses_key(model: Any) -> bool:
    """Whether training ``model`` needs a random key per step (dropout)."""
    return bool(getattr(model, "uses_key", False))


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


# -- the task defaults -----------------------------------------------------------------------
def task_loss(task: str, out: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
    """Per-example loss and metrics of a task from the model's output ``out``."""
    if task == "classification":
        return nl.softmax_cross_entropy(out, y), {"accuracy": nl.accuracy(out, y)}
    if task == "regression":
        return nl.mse(out, y), {}
    ce = nl.softmax_cross_entropy(out, y)  # language model: [batch, T]
    per_window = jnp.mean(ce, axis=-1)
    return per_window, {"bits_per_char": per_window / LN2}


def task_objective(task: str, out: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
    """Mean loss (what training differentiates) and mean metrics of a task."""
    if task == "language_model":
        loss = nl.reduce(nl.softmax_cross_entropy(out, y), "mean")  # every token counts once
        return loss, {"bits_per_char": jax.lax.stop_gradient(loss) / LN2}
    per_example, metrics = task_loss(task, out, y)
    return nl.reduce(per_example, "mean"), {k: jnp.mean(v) for k, v in metrics.items()}


def per_example_loss(model: Any, params, x, y) -> tuple[jax.Array, dict]:
    """``model.loss`` if it has one, else its task's: per-example loss and metrics
    (inference: no key)."""
    if hasattr(model, "loss"):
        return model.loss(params, x, y)
    return task_loss(model.task, model(params, x), y)


def objective_fn(model: Any, grad: str = "autodiff") -> Callable:
    """``(params, x, y, *, key=None) -> (mean loss, {metric: mean})``: ``model.objective``
    if it has one (given ``grad=`` when it takes it), else the task's on ``model(...)``."""
    own = getattr(model, "objective", None)
    if own is not None:
        pass_grad = _accepts(own, "grad")
        pass_key = _accepts(own, "key")

        def objective(params, x, y, *, key=None):
            kw = {"grad": grad} if pass_grad else {}
            if pass_key:
                kw["key"] = key
            return own(params, x, y, **kw)

        return objective

    def default(params, x, y, *, key=None):
        out = model(params, x, key=key) if key is not None else model(params, x)
        return task_objective(model.task, out, y)

    return default
