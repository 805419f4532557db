"""The model contract: what any model trained by ``nnlite-train`` provides.

A model is an ``nl.Module`` (a frozen dataclass of hyperparameters) with:

- ``task``, a class attribute: ``"classification"`` (``__call__`` returns logits
  ``[batch, num_classes]`` for int labels), ``"regression"`` (predictions
  ``[batch, out_features]`` for float targets) or ``"language_model"`` (logits
  ``[batch, T, vocab_size]`` for int tokens ``[batch, T]``, targets the next tokens; rows
  ``[batch, 2, T]`` of tokens and segment ids, ``data.name: chat``'s packed documents, call
  the model with ``segment_ids=`` and their targets ``-1`` take no loss);
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
- optionally, a language model's ``token_log_probs(params, tokens, labels, *, key=None)
  -> [batch, T]`` (each label's log-probability): the task's loss is then its negated
  mean, computed without the ``[batch, T, vocab]`` logits (the shipped GPT's and
  ``nl.hf``'s compute their head in chunks, ``nl.label_log_probs``);
- optionally ``trainable(params) -> tree of bools`` (or None: all): which params train
  (``nl.hf.Pretrained`` with LoRA: the adapters only); the rest are frozen as
  ``optimizer.frozen`` freezes them (train/optim/params.py). A model without it may
  define ``wrap_optimizer(optimizer) -> optimizer`` instead (applied as is);
- optionally ``checkpointed(params) -> tree of bools`` (or None: all): the params its
  checkpoints hold, the rest being its ``init``'s (``nl.hf.Pretrained`` with LoRA: the
  adapters; the base is read again from its directory), with ``checkpoint_metadata() ->
  dict`` recorded in each checkpoint and ``check_checkpoint(meta, where)`` raising a
  ValueError (one line) for a checkpoint it cannot continue (the base's hash changed);
- optionally ``grad_modes``: the ``loss.grad`` modes beyond ``autodiff`` and ``manual``
  that its ``objective(..., grad=...)`` implements (the MLP's ``fused``); a list that
  names ``autodiff`` is the complete list (``("autodiff",)``: a model that must not run
  with hand rules; ``loss.grad: auto`` then resolves to autodiff);
- optionally state (BatchNorm's running statistics, see docs/state.md): a model that
  defines ``init_state() -> ParamsDict`` is *stateful*; its call is ``__call__(params, x,
  *, state, train=False, key=None) -> (output, new_state)``, training calls it with
  ``train=True`` and carries the state from step to step (the optimizer never sees it),
  evaluation and inference with ``train=False``. Its own ``objective`` then takes
  ``state=`` and returns ``(mean_loss, metrics, new_state)``, its own ``loss`` takes
  ``state=`` (eval mode).

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
    if is_stateful(cls):
        _check_stateful_class(cls, where)


def param_shapes(model: Any) -> Any:
    """``model.init``'s params as shapes and dtypes (``jax.ShapeDtypeStruct`` leaves): traced,
    nothing computed. The key is made inside the trace: made eagerly, ``jax.random.key(0)``
    compiles two programs (~0.1 s of every run's start-up)."""
    return jax.eval_shape(lambda: model.init(jax.random.key(0)))


def is_stateful(model: Any) -> bool:
    """Whether ``model`` (an instance or a class) has state: it defines ``init_state``."""
    return callable(getattr(model, "init_state", None))


def init_state(model: Any) -> nl.ParamsDict | None:
    """The model's initial state, or None for a stateless model."""
    return model.init_state() if is_stateful(model) else None


STATEFUL_CALL = "out, new_state = model(params, x, state=state, train=True) (see docs/state.md)"


def _check_stateful_class(cls: type, where: str) -> None:
    name = cls.__name__
    try:
        required = [
            p.name
            for p in list(inspect.signature(cls.init_state).parameters.values())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if required:
        raise ModelError(
            f"{where}: {name}.init_state must take no arguments (it returns the initial "
            f"state ParamsDict), but it requires {', '.join(required)}"
        )
    missing = [k for k in ("state", "train") if not accepts(cls.__call__, k)]
    if missing:
        raise ModelError(
            f"{where}: {name} defines init_state, so it is stateful and its __call__ must "
            f"take the keyword argument(s) {', '.join(missing)}: {STATEFUL_CALL}"
        )
    own = getattr(cls, "objective", None)
    if own is not None and not accepts(own, "state"):
        raise ModelError(
            f"{where}: {name} is stateful (it defines init_state), so its objective must "
            "take state= and return (mean_loss, metrics, new_state)"
        )


def call_stateful(model: Any, params, x, state, *, train: bool, **kwargs) -> tuple:
    """``model(params, x, state=state, train=train)`` -> ``(out, new_state)``, with a
    ModelError (at trace time) when the model does not return a pair whose state has the
    structure of the state it was given."""
    result = model(params, x, state=state, train=train, **kwargs)
    name = type(model).__name__
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ModelError(
            f"{name} is stateful (it defines init_state), so its __call__ must return "
            f"(output, new_state); it returned {type(result).__name__}: {STATEFUL_CALL}"
        )
    check_same_state(name, state, result[1])
    return result


def check_same_state(name: str, state, new_state) -> None:
    """A ModelError naming the first path where ``new_state`` differs in structure,
    shape or dtype from ``state``."""
    was = dict(_state_items(state))
    now = dict(_state_items(new_state))
    for path in [*was, *(p for p in now if p not in was)]:
        a, b = was.get(path), now.get(path)
        if a is None or b is None or a != b:
            what = "is missing" if b is None else "is new" if a is None else f"is {b}, was {a}"
            raise ModelError(
                f"{name}: the state it returns differs from the state it was given: "
                f"{path} {what} (a stateful call returns the state with the structure, "
                "shapes and dtypes of init_state())"
            )


def _state_items(state):
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [
        (nl.format_path(path) or "/", (tuple(jnp.shape(v)), jnp.result_type(v).name))
        for path, v in leaves
    ]


def fields(cls: type) -> dict[str, dataclasses.Field]:
    """The hyperparameter fields of a model class, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def field_types(cls: type) -> dict[str, Any]:
    """Each field's type, with string annotations (``from __future__ import annotations``)
    resolved in the class's module."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: the others still check
        hints = {name: _field_type(cls, f) for name, f in fields(cls).items()}
    return {name: hints.get(name, Any) for name in fields(cls)}


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    """One field's annotation resolved in its class's module; Any (the value as YAML gives
    it) when it names what the module does not define at run time (``TYPE_CHECKING``)."""
    if not isinstance(f.type, str):
        return f.type
    import sys

    module = vars(sys.modules.get(cls.__module__, typing))
    try:
        return eval(f.type, dict(module), dict(vars(cls)))  # noqa: S307 - the class's own annotation
    except Exception:  # noqa: BLE001
        return Any


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


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


# -- the task defaults -----------------------------------------------------------------------
def call(model: Any, params, x, **kw):
    """``model(params, x)``; a language model's rows of packed documents (``x [batch, 2,
    T]``: tokens and segment ids, the chat data set's) call it with ``segment_ids=``, and
    rows of pairs (``x [batch, 2, 2, T]``, preference pairs) give ``[batch, 2, T, vocab]``."""
    ndim = getattr(x, "ndim", 0)
    if getattr(model, "task", None) != "language_model" or ndim not in (3, 4):
        return model(params, x, **kw)
    if ndim == 4:
        b, t = x.shape[0], x.shape[-1]
        out = model(
            params, x[:, :, 0].reshape(b * 2, t), segment_ids=x[:, :, 1].reshape(b * 2, t), **kw
        )
        return out.reshape(b, 2, *out.shape[1:])
    return model(params, x[:, 0], segment_ids=x[:, 1], **kw)


def masked_token_loss(out: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(cross-entropy [batch, T] with 0 where y < 0, float mask [batch, T] of y >= 0)``:
    targets ``-1`` (a chat's user tokens, padding, document ends) take no loss."""
    keep = y >= 0
    ce = nl.softmax_cross_entropy(out, jnp.where(keep, y, 0))
    return jnp.where(keep, ce, jnp.zeros((), ce.dtype)), keep.astype(ce.dtype)


def task_loss(task: str, out: jax.Array, y: jax.Array, x=None) -> tuple[jax.Array, dict]:
    """Per-example loss and metrics of a task from the model's output ``out`` (``x``: the
    inputs, which say whether a language model's targets are masked)."""
    if task == "language_model" and getattr(x, "ndim", 0) == 3:  # rows with masked targets
        ce, keep = masked_token_loss(out, y)
        per_row = jnp.sum(ce, axis=-1) / jnp.maximum(jnp.sum(keep, axis=-1), 1)
        return per_row, {"bits_per_char": per_row / LN2}
    if task == "classification":
        return nl.softmax_cross_entropy(out, y), {"accuracy": nl.accuracy(out, y)}
    if task == "regression":
        return nl.mse(out, y), {}
    ce = nl.softmax_cross_entropy(out, y)  # language model: [batch, T]
    per_window = jnp.mean(ce, axis=-1)
    return per_window, {"bits_per_char": per_window / LN2}


def task_objective(task: str, out: jax.Array, y: jax.Array, x=None) -> tuple[jax.Array, dict]:
    """Mean loss (what training differentiates) and mean metrics of a task (``x`` as
    :func:`task_loss`'s: the mean of a masked language model's loss is over its kept
    tokens)."""
    if task == "language_model" and getattr(x, "ndim", 0) == 3:
        ce, keep = masked_token_loss(out, y)
        loss = jnp.sum(ce) / jnp.maximum(jnp.sum(keep), 1)
        return loss, {"bits_per_char": jax.lax.stop_gradient(loss) / LN2}
    if task == "language_model":
        loss = nl.reduce(nl.softmax_cross_entropy(out, y), "mean")  # every token counts once
        return loss, {"bits_per_char": jax.lax.stop_gradient(loss) / LN2}
    per_example, metrics = task_loss(task, out, y)
    return nl.reduce(per_example, "mean"), {k: jnp.mean(v) for k, v in metrics.items()}


def label_log_probs_fn(model: Any) -> Callable | None:
    """A stateless language model's ``token_log_probs(params, tokens, labels, *, key=None)
    -> [batch, T]`` (the labels' log-probabilities with its head in chunks: the loss then
    never holds all the logits), or None: the task's loss on the model's logits."""
    if getattr(model, "task", None) != "language_model" or is_stateful(model):
        return None
    return getattr(model, "token_log_probs", None)


def _lm_token_loss(log_probs_fn: Callable | None, params, x, y, key=None):
    """``(cross-entropy [batch, T], float mask of the kept targets or None: all)`` from
    ``token_log_probs`` (its head in chunks), or None where the logits path applies: no
    such method, preference pairs (``x [batch, 2, 2, T]``), or packed rows (``x [batch, 2,
    T]``: tokens and segment ids, targets ``-1`` take no loss) for a model whose
    ``token_log_probs`` takes no ``segment_ids``."""
    ndim = getattr(x, "ndim", 0)
    if log_probs_fn is None or ndim not in (2, 3):
        return None
    kw = {"key": key} if key is not None else {}
    if ndim == 2:  # every target kept
        return -log_probs_fn(params, x, y, **kw), None
    if not accepts(log_probs_fn, "segment_ids"):
        return None
    keep = y >= 0
    lp = log_probs_fn(params, x[:, 0], jnp.where(keep, y, 0), segment_ids=x[:, 1], **kw)
    return jnp.where(keep, -lp, jnp.zeros((), lp.dtype)), keep.astype(lp.dtype)


def per_example_loss(model: Any, params, x, y, state=None) -> tuple[jax.Array, dict]:
    """``model.loss`` if it has one, else its task's: per-example loss and metrics
    (inference: no key; a stateful model in eval mode with ``state``)."""
    stateful = is_stateful(model)
    if hasattr(model, "loss"):
        return model.loss(params, x, y, state=state) if stateful else model.loss(params, x, y)
    lm = _lm_token_loss(label_log_probs_fn(model), params, x, y)
    if lm is not None:
        ce, keep = lm
        if keep is None:
            per_window = jnp.mean(ce, axis=-1)
        else:
            per_window = jnp.sum(ce, axis=-1) / jnp.maximum(jnp.sum(keep, axis=-1), 1)
        return per_window, {"bits_per_char": per_window / LN2}
    if stateful:
        out = call_stateful(model, params, x, state, train=False)[0]
    else:
        out = call(model, params, x)
    return task_loss(model.task, out, y, x)


def objective_fn(model: Any, grad: str = "autodiff") -> Callable:
    """``(params, x, y, *, key=None) -> (mean loss, {metric: mean})``: ``model.objective``
    if it has one (given ``grad=`` when it takes it), else the task's on ``model(...)``.

    A stateful model's (see :func:`is_stateful`) is ``(params, x, y, *, state, key=None)
    -> (mean loss, {metric: mean}, new_state)``, its call in train mode."""
    own = getattr(model, "objective", None)
    stateful = is_stateful(model)
    if own is not None:
        pass_grad = accepts(own, "grad")
        pass_key = accepts(own, "key")

        def objective(params, x, y, *, key=None, **state):
            kw = {"grad": grad} if pass_grad else {}
            if pass_key:
                kw["key"] = key
            result = own(params, x, y, **kw, **state)
            if stateful and not (isinstance(result, tuple) and len(result) == 3):
                raise ModelError(
                    f"{type(model).__name__} is stateful, so its objective must return "
                    f"(mean_loss, metrics, new_state); it returned a {type(result).__name__}"
                    + (f" of {len(result)}" if isinstance(result, tuple) else "")
                )
            return result

        return objective

    if stateful:

        def stateful_default(params, x, y, *, state, key=None):
            kw = {"key": key} if key is not None else {}
            out, new_state = call_stateful(model, params, x, state, train=True, **kw)
            return (*task_objective(model.task, out, y), new_state)

        return stateful_default

    log_probs = label_log_probs_fn(model)

    def default(params, x, y, *, key=None):
        lm = _lm_token_loss(log_probs, params, x, y, key)
        if lm is not None:  # every kept token counts once; no [batch, T, vocab] logits
            ce, keep = lm
            if keep is None:
                loss = nl.reduce(ce, "mean")
            else:
                loss = jnp.sum(ce) / jnp.maximum(jnp.sum(keep), 1)
            return loss, {"bits_per_char": jax.lax.stop_gradient(loss) / LN2}
        out = call(model, params, x, key=key) if key is not None else call(model, params, x)
        return task_objective(model.task, out, y, x)

    return default
