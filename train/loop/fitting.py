"""``train.fit(model, config)``: what ``nnlite-train --config`` runs, from Python.

Example::

    import train
    from mymodels import ResMLP

    run = train.fit(ResMLP(width=64), "configs/digits_mlp.yaml", overrides=["train.steps=300"])
    run.summary["test_accuracy"], run.params, run.run_dir
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import nnlite as nl

from ..config import Config, config_from_dict, read_yaml, to_dict
from ..data.user import with_source
from ..errors import ConfigError
from ..model import registry as models
from ..optim import GIVEN
from ..optim.named import check_transformation
from ..report.loggers import check_object
from .trainer import train


def fit(
    model: Any = None,
    config: str | Path | Mapping | Config | None = None,
    *,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    resume: str = "auto",
    echo: Callable[[str], None] = print,
    callbacks: Sequence[Any] = (),
    optimizer: Any = None,
    loggers: Sequence[Any] = (),
    data: Any = None,
):
    """Train ``model`` per ``config`` exactly as the CLI does; return the ``train.loop.build.Run``
    (``params``, ``opt_state``, a stateful model's ``state``, ``summary`` of final metrics,
    ``run_dir``, ``cfg``).

    Args:
        model: an ``nl.Module`` instance (its fields are the model section; those left
            ``None`` that the data determines are filled from it), a model class (its
            fields come from the config's ``model:`` keys), or None (the config's
            ``model.name``).
        config: a YAML file, a dict of sections (as the YAML holds them), a ``Config``, or
            None (every default).
        overrides: ``--set`` style ``"key=value"`` strings, or a dict ``{"train.steps": 100}``.
        resume: ``"auto"`` (resume from the newest checkpoint if any), ``"require"`` or
            ``"fresh"``.
        echo: where the run's lines go (``print``; a no-op to silence them).
        callbacks: objects with some of the loop's events (``train.Callback``), called
            after the config's ``callbacks:``.
        optimizer: any ``optax.GradientTransformation``; the run's config then says
            ``optimizer.name: given`` (a resume passes the same optimizer again).
        loggers: logger objects (``log(step, metrics)``, ``close()``: docs/loggers.md)
            that get every record, besides the config's ``log.loggers``.
        data: your data instead of the config's ``data.name``: a map-style source
            (``__len__``, ``__getitem__(indices) -> (x, y)``), an iterable of ``(x, y)``
            batches, ``(x, y)`` arrays, a Grain ``MapDataset``/``IterDataset``/``DataLoader``,
            or ``{"train": ..., "test": ...}`` (see train/data/user.py); the config's
            other ``data`` keys (placement, test_fraction, split_seed) still apply.

    Raises ``ConfigError`` for bad input, as the CLI's exit 2.
    """
    if isinstance(overrides, Mapping):
        overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(callbacks, str | bytes) or not isinstance(callbacks, Sequence):
        raise ConfigError(f"train.fit: callbacks must be a list of objects, got {callbacks!r}")
    overrides = list(overrides)
    if optimizer is not None:
        check_transformation(optimizer, "train.fit(optimizer=...)")
        overrides.append(f"optimizer.name={GIVEN}")
    cfg = _config(model, config, overrides)
    if optimizer is not None and (cfg.optimizer.options or cfg.optimizer.name != "given"):
        raise ConfigError(
            "train.fit(optimizer=...) replaces the config's optimizer section; leave out "
            f"its other keys ({', '.join(cfg.optimizer.options)})"
        )
    if data is not None:
        cfg, data = with_source(cfg, data)
    return train(
        cfg,
        resume=resume,
        echo=echo,
        callbacks=callbacks,
        optimizer=optimizer,
        loggers=_loggers(loggers),
        data=data,
    )


def _config(model: Any, config: Any, overrides: list[str]) -> Config:
    if isinstance(config, Config):
        if model is None and not overrides:
            return config
        config = to_dict(config)
    base_dir, source = None, "train.fit(config=...)"
    if isinstance(config, (str, Path)):
        base_dir, source = Path(config).resolve().parent, str(config)
        config = read_yaml(Path(config))
    elif config is not None and not isinstance(config, Mapping):
        raise ConfigError(
            f"train.fit: config must be a YAML path, a dict or a Config, got {type(config).__name__}"
        )
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in dict(config or {}).items()}
    if model is None:
        return config_from_dict(raw, overrides, source=source, base_dir=base_dir)
    cls = model if isinstance(model, type) else type(model)
    if not (isinstance(cls, type) and issubclass(cls, nl.Module)):
        raise ConfigError(f"train.fit: model must be an nl.Module or its class, got {model!r}")
    section = {k: v for k, v in dict(raw.get("model") or {}).items() if k != "name"}
    if not isinstance(model, type):  # an instance: its fields are the model section
        section = {
            f.name: getattr(model, f.name)
            for f in dataclasses.fields(model)
            if f.init and getattr(model, f.name) is not None
        }
    raw["model"] = {"name": models.class_path(cls), **section}
    return config_from_dict(raw, overrides, source=source, base_dir=base_dir, model_class=cls)


def _loggers(loggers: Any) -> list:
    """``train.fit(loggers=...)``: a list of logger objects, checked before the run."""
    if isinstance(loggers, str | bytes) or not isinstance(loggers, Sequence):
        raise ConfigError(f"train.fit: loggers must be a list of logger objects, got {loggers!r}")
    for i, obj in enumerate(loggers):
        check_object(obj, f"train.fit(loggers=...)[{i}]")
    return list(loggers)
