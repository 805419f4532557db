"""The data sets a config's ``data.name`` names: the built-in ones in :data:`DATA_SETS`
(one line each), or a user's factory ``"module:function"``.

One convention for both: a data set is a function called with keyword arguments, those
of ``data.options`` and, when its signature names them, ``data`` (the whole ``data``
section) and ``context`` (the model's window length, for token windows; a function that
requires it needs a model with one). It returns a data source (train/data/source.py) or
a built ``Dataset``. ``data.options`` are checked against its signature when the config
is read."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..registry import Registry

#: Built-in data sets: config name -> ``"module:function"`` (imported on first use), each
#: ``f(data=<the section>, context=...)`` by the convention above.
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
#: Built-in data sets whose labels' dtype decides the task (integers: classes, floats:
#: regression targets), so a wrong dtype reads as the other task.
TASK_FROM_DTYPE = ("npz",)


def size_key(name: str) -> str:
    """The config key that makes data set ``name`` smaller."""
    return "data.path" if name in NEEDS_PATH else "data.num_samples"


#: What a data-set function may take besides ``data.options``, given by the trainer.
GIVEN_ARGS = ("data", "context")


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
    given = {k: None for k in GIVEN_ARGS if k in sig.parameters and k not in options}
    try:
        sig.bind(**given, **options)
    except TypeError as e:
        raise ConfigError(
            f"{where}: data.options {sorted(options)} do not fit {name}{sig} ({e})"
        ) from None
    return fn


def arguments(fn: Any, section: Any, context: int | None, where: str) -> dict:
    """The keyword arguments ``fn`` (a data-set function) is called with: ``data.options``,
    and ``data`` / ``context`` where its signature names them."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(section.options)
    given = {"data": section, "context": context}
    kwargs = {k: v for k, v in given.items() if k in params and k not in section.options}
    ctx = params.get("context")
    if context is None and ctx is not None and ctx.default is inspect.Parameter.empty:
        raise ConfigError(f"{where} needs a model with a context length")
    return {**kwargs, **section.options}


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
