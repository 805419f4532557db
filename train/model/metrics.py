"""Your evaluation metrics: ``eval.metrics: ["module:function"]``.

A metric is a function ``metric(outputs, labels)`` of what the model returns for a batch
(logits ``[batch, classes]`` for a classifier, ``[batch, T, vocab]`` for a language model,
predictions for a regression) and the batch's labels or targets, returning one value per
example (``[batch]``) or one value for the batch (a scalar: its mean over the batch).

The evaluation applies it to each example as a batch of one (``jax.vmap``), inside the
compiled evaluation, and averages the values over the held-out split as it averages the
built-in metrics; the mean is logged under the function's name (``test/top3``), so it can
be monitored (``early_stopping``'s ``monitor``). That is exact for any metric that is a
mean over examples (accuracy, top-k accuracy, a per-example error); a metric that is not
(F1, AUC) needs the whole split at once, which this does not compute.

This module imports JAX only when a run is built (the config reads the names).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError, users_error
from ..registry import import_path

FORM = "metric(outputs, labels) -> a value per example [batch] or a scalar for the batch"


def name_of(spec: str) -> str:
    """The name a metric is logged under: its function's (``"mymetrics:top3"`` -> ``top3``)."""
    return spec.partition(":")[2].rsplit(".", 1)[-1]


def names(specs: Sequence[str]) -> list[str]:
    """The names ``eval.metrics`` adds to the evaluation's metrics."""
    return [name_of(s) for s in specs]


def resolve(spec: str, where: str, search: Iterable[Path] = ()) -> Callable:
    """The function ``spec`` names, checked to take ``(outputs, labels)``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{where}: expected 'module:function' ({FORM}), got {spec!r}")
    fn = import_path(spec.strip(), where, search)
    if isinstance(fn, type) or not callable(fn):
        raise ConfigError(f"{where}: expected a function {FORM}, got {type(fn).__name__} {fn!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call decides
        return fn
    try:
        sig.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"{where}: {name_of(spec)}{sig} cannot be called as {name_of(spec)}(outputs, "
            f"labels); expected {FORM}"
        ) from None
    return fn


def check_specs(specs: Sequence[str], search: Iterable[Path], source: str) -> None:
    """Import every ``eval.metrics`` entry now (a bad path or signature is one line) and
    refuse two metrics of one name."""
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        where = f"{source}: eval.metrics[{i}]={spec}"
        resolve(spec, where, search)
        name = name_of(spec)
        if name == "loss":
            raise ConfigError(f"{where}: 'loss' is the evaluation's own metric; rename {name}")
        if name in seen:
            raise ConfigError(
                f"{where}: eval.metrics[{seen[name]}] is logged as {name!r} too; each metric "
                "is logged under its function's name, so give them different names"
            )
        seen[name] = i


# -- in the compiled evaluation ------------------------------------------------------------


def forward(model: Any, params, x, state=None):
    """The model's outputs in inference mode (a stateful model's with its state)."""
    from .contract import call, call_stateful, is_stateful  # start-up: JAX (config reads this)

    if is_stateful(model):
        return call_stateful(model, params, x, state, train=False)[0]
    return call(model, params, x)


def per_example(model: Any, params, x, y, state=None, metrics: Sequence = ()) -> tuple:
    """``(per-example loss, {metric: per-example values})``: the model's (or its task's)
    loss and metrics, and each of ``metrics`` (``(name, function)`` pairs) on its outputs."""
    from .contract import per_example_loss, task_loss  # start-up: JAX (config reads this)

    if not metrics:
        return per_example_loss(model, params, x, y, state)
    if hasattr(model, "loss"):  # its own loss: the outputs take a forward pass of their own
        loss, values = per_example_loss(model, params, x, y, state)
        out = forward(model, params, x, state)
    else:
        out = forward(model, params, x, state)
        loss, values = task_loss(model.task, out, y, x)
    values = dict(values)
    for name, fn in metrics:
        values[name] = each_example(fn, out, y)
    return loss, values


def each_example(fn: Callable, out, y):
    """``fn`` applied to each example of ``(out, y)`` as a batch of one: ``[batch]`` float32."""
    import jax
    import jax.numpy as jnp

    def one(o, t):
        value = fn(jax.tree.map(lambda a: a[None], o), t[None])
        return jnp.reshape(jnp.asarray(value), ()).astype(jnp.float32)

    return jax.vmap(one)(out, y)


def prepare(specs: Sequence[str], model: Any, data: Any) -> tuple:
    """``(name, function)`` pairs of ``eval.metrics``, each checked on the model's outputs
    for one example of the held-out split (shapes only: ``jax.eval_shape``). A function
    that fails there, returns more than one value per example, or takes a name the
    evaluation already logs is one line (ConfigError)."""
    if not specs:
        return ()
    import jax
    import numpy as np

    from ..data.dataset import batch_dtype  # start-up: numpy (config reads this module)
    from .contract import init_state, param_shapes, per_example_loss  # start-up: JAX

    params = param_shapes(model)
    state = jax.eval_shape(lambda: init_state(model))
    x1, y1 = (
        jax.ShapeDtypeStruct((1, *a.shape[1:]), batch_dtype(a)) for a in (data.x_test, data.y_test)
    )
    own = jax.eval_shape(
        lambda p, s, x, y: per_example_loss(model, p, x, y, s)[1], *(params, state, x1, y1)
    )
    out = jax.eval_shape(lambda p, s, x: forward(model, p, x, s), params, state, x1)
    made = []
    for i, spec in enumerate(specs):
        where = f"eval.metrics[{i}]={spec}"
        fn, name = resolve(spec, where, (Path.cwd(),)), name_of(spec)
        if name in own:
            raise ConfigError(
                f"{where}: the evaluation already logs {name!r} ({', '.join(['loss', *own])}); "
                "rename your function"
            )
        try:
            value = jax.eval_shape(fn, out, y1)
            if getattr(value, "shape", None) in ((), (1,)):
                jax.eval_shape(lambda o, t, fn=fn: each_example(fn, o, t), out, y1)
        except Exception as e:  # noqa: BLE001 -- the user's code: one line, whatever it raised
            on = f"on outputs {_shapes(out)} and labels {_shapes(y1)}, a batch of 1"
            err = users_error("metric", e, on)
            if err is not None:
                raise err from e
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(
                f"{where}: {name}(outputs, labels) failed on outputs {_shapes(out)} and labels "
                f"{_shapes(y1)} (one example, a batch of 1): {type(e).__name__}: {first}"
            ) from None
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if shape not in ((), (1,)) or dtype is None or not _real(np.dtype(dtype)):
            raise ConfigError(
                f"{where}: {name}(outputs, labels) returned {_shapes(value)} for a batch of 1; "
                "expected a real number per example ([batch]) or one for the batch (a scalar)"
            )
        made.append((name, fn))
    return tuple(made)


def _real(dtype) -> bool:
    import numpy as np

    return bool(np.issubdtype(dtype, np.number) or dtype == np.bool_) and not np.issubdtype(
        dtype, np.complexfloating
    )


def _shapes(tree) -> str:
    import jax

    leaves = jax.tree.leaves(tree)
    if not leaves:
        return repr(tree)
    shown = [
        f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}" for a in leaves
    ]
    return shown[0] if len(shown) == 1 else "(" + ", ".join(shown) + ")"
