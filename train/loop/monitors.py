"""The evaluation metrics a run logs, known before it trains: ``train.early_stopping``,
an ``early_stopping`` callback and ``checkpoint.keep_best`` name one (``monitor``), and a
name the evaluation does not log is refused before anything is written."""

from __future__ import annotations

import jax
import numpy as np

from ..callbacks import EARLY_STOPPING_KEY, EarlyStopping
from ..data.dataset import batch_dtype
from ..data.feed import eval_chunk
from ..data.text.units import name_metrics
from ..errors import ConfigError


def eval_metric_names(r, prep) -> list[str]:
    """The keys of this run's evaluation records (traced with ``jax.eval_shape``, not run)."""
    aval = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)  # noqa: E731
    evaluate = getattr(prep.evaluate, "__wrapped__", prep.evaluate)  # no wait for its compile
    params = jax.tree.map(aval, prep.params0)
    state = () if prep.state0 is None else (jax.tree.map(aval, prep.state0),)
    if r.data.streamed:
        chunk = eval_chunk(r.data)
        x, y = (
            jax.ShapeDtypeStruct((chunk, *a.shape[1:]), batch_dtype(a))
            for a in (r.data.x_test, r.data.y_test)
        )
        out = jax.eval_shape(evaluate, params, x, y, jax.ShapeDtypeStruct((), np.int32), *state)
        out = out[0]
    elif prep.Y_test is None:  # a text split on the device, in chunks (build.device_eval)
        out = jax.eval_shape(evaluate, params, *prep.X_test[0], *state)[0]
    else:
        out = jax.eval_shape(evaluate, params, prep.X_test, prep.Y_test, *state)
    named = name_metrics(dict.fromkeys(out, 1.0), r.data.loss_unit, r.data.chars_per_token)
    return list(named)


def check_monitors(r, prep, callbacks) -> None:
    """Refuse a ``monitor`` (early stopping, best checkpoints) that the evaluation does not
    log, naming what it logs."""
    wanted = []
    if r.cfg.checkpoint.keep_best:
        wanted.append(("checkpoint.monitor", r.cfg.checkpoint.monitor))
    for key, cb in zip(callbacks.keys, callbacks.items):
        if isinstance(cb, EarlyStopping):
            label = f"{key}.monitor" if key == EARLY_STOPPING_KEY else f"callbacks {key}: monitor"
            wanted.append((label, cb.monitor))
    if not wanted:
        return
    names = eval_metric_names(r, prep)
    for key, monitor in wanted:
        if monitor not in names:
            raise ConfigError(
                f"{key}={monitor!r} is not a metric the evaluation logs; it logs {', '.join(names)}"
            )
