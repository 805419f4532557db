"""The data sets a config's ``data.name`` names: the built-in ones in :data:`DATA_SETS`
(one line each), or a user's factory ``"module:function"`` whose keyword arguments are
``data.options`` (checked against its signature when the config is read)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..registry import Registry

#: Built-in data sets: config name -> ``"module:function"`` of a loader
#: ``(cfg: DataConfig, context: int | None) -> Dataset`` (imported on first use).
DATA_SETS = Registry(
    "built-in data set",
    {
        "digits": ".data.builtin:digits",
        "mnist1d": ".data.builtin:mnist1d",
        "linreg": ".data.builtin:linreg",
        "npz": ".data.builtin:npz",
        "text": ".data.builtin:text",
        "shakespeare_char": ".data.builtin:shakespeare_char",
        "tokens": ".data.streamed:tokens",
        "arrays": ".data.streamed:arrays",
        "chat": ".data.chat:chat",
    },
    form="module:function",
)
#: Built-in data sets read from ``data.path``.
NEEDS_PATH = ("npz", "text", "tokens", "arrays", "chat")
#: Built-in data sets of token windows, which need the model's context length.
TEXT = ("text", "shakespeare_char", "tokens", "chat")


def is_given(name: str) -> bool:
    """Whether ``data.name`` records a source given to ``train.fit(data=...)``: ``<Name>``,
    which a config cannot build (nothing to import)."""
    return name.startswith("<") and name.endswith(">")


def is_factory(name: str) -> bool:
    """Whether ``data.name`` is a user's ``module:function`` (else a built-in's name)."""
    return ":" in name


def factory(name: str, options: dict, search: Iterable[Path] = (), where: str = "") -> Any:
    """The user's factory ``data.name`` names, its ``data.options`` bound to its signature
    (one line naming both when they do not fit)."""
    where = where or f"data.name={name}"
    fn = DATA_SETS.get(name, where, search)
    if not callable(fn):
        raise ConfigError(
            f"{where}: {fn!r} is not callable; expected a function returning a source"
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    try:
        sig.bind(**options)
    except TypeError as e:
        raise ConfigError(
            f"{where}: data.options {sorted(options)} do not fit {name}{sig} ({e})"
        ) from None
    return fn


def check(name: str, options: dict, search: Iterable[Path], where: str) -> None:
    """Config-time check of ``data.name`` and ``data.options`` (``where``: the config)."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: data.name: expected a data set name or 'module:function'")
    if is_given(name) and not options:
        return  # a run's record of train.fit(data=...): checked when it is built
    if not is_factory(name):
        if name not in DATA_SETS:
            raise ConfigError(
                f"{where}: data.name={name} is not a built-in data set "
                f"({', '.join(DATA_SETS.names)}) and not an import path 'module:function'"
            )
        if options:
            raise ConfigError(
                f"{where}: data.options are the arguments of a data.name 'module:function' "
                f"factory; data.name={name} takes none (got {sorted(options)})"
            )
        return
    factory(name, options, search, f"{where}: data.name={name}")


#: Built-in data sets of regression targets (no accuracy: their curves plot the loss alone).
REGRESSION = ("linreg",)


def plots_accuracy(name: str | None) -> bool:
    """Whether a run on data set ``name`` has an accuracy curve (the curve plotter starts
    before the data loads, so it asks the name)."""
    return name not in REGRESSION
