"""One registration mechanism for everything a config names: models, data sets, optimizers,
schedules, loggers, callbacks, metrics.

A :class:`Registry` maps short names to ``"module:attr"`` import paths within the trainer
(imported on first use, so validating a config imports nothing heavy) and accepts a
user's own ``"module:attr"`` import path, imported from the config file's directory, the
current directory, or ``sys.path``. Adding a shipped data set, optimizer, logger or
callback is one file plus one line in its table; :func:`Registry.register` adds one at
run time (a decorator for a user's own code).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: The trainer's own package: ``train`` in a checkout, ``nnlite.train`` when installed.
PACKAGE = __name__.rpartition(".")[0]


class Registry:
    """Named objects of one kind (``kind``: "built-in data set", "named optimizer", ...).

    ``entries``: short name -> ``"module:attr"``, where a module starting with a dot is
    relative to the trainer's package (``".data.builtin:digits"``).
    """

    def __init__(
        self, kind: str, entries: dict[str, str], *, form: str = "module:name", error=ConfigError
    ):
        self.kind, self.form, self.error = kind, form, error
        self._entries: dict[str, str | Any] = dict(entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self):
        return iter(self.names)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def register(self, name: str) -> Callable[[Any], Any]:
        """A decorator: ``@OPTIMIZERS.register("lion_wd")`` makes a config's short name
        refer to the decorated object."""

        def add(obj):
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str, where: str, search: Iterable[Path] = ()) -> Any:
        """The object ``name`` refers to: a registered short name, or a user's
        ``module:attr`` (imported from ``search`` first). ``where`` names the config key
        in errors (``optimizer.name=lamb``)."""
        if ":" not in name:
            if name not in self._entries:
                raise self.error(
                    f"{where} is not a {self.kind} ({', '.join(self._entries)}) and not an "
                    f"import path '{self.form}' of your own"
                )
            entry = self._entries[name]
            if not isinstance(entry, str):
                return entry
            name, search = entry, ()
        return import_path(
            name, where, search, error=self.error, classes=self.form.endswith(":Class")
        )

    def short_name(self, obj: Any) -> str | None:
        """The short name a registered object goes by (None: not registered)."""
        for name, entry in self._entries.items():
            if entry is obj:
                return name
            if isinstance(entry, str) and _path_of(obj) == _absolute(entry):
                return name
        return None


def _absolute(entry: str) -> str:
    return PACKAGE + entry if entry.startswith(".") else entry


def _path_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"


def import_path(
    spec: str,
    where: str,
    search: Iterable[Path] = (),
    *,
    error: type = ConfigError,
    classes: bool = False,
) -> Any:
    """The object that ``"module:attr"`` names (``attr`` may be dotted). A module starting
    with a dot is the trainer's own. Every failure is one line naming ``where``."""
    module_name, _, attr = _absolute(spec).partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise error(f"{where}: expected 'module:name', e.g. 'mypackage.parts:Thing'")
    module = import_module(module_name, where, tuple(search), error=error)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            names = vars(module).items()
            public = sorted(
                n
                for n, v in names
                if not n.startswith("_") and (isinstance(v, type) or not classes)
            )
            what = "its classes" if classes else "it defines"
            raise error(
                f"{where}: module {module_name} ({getattr(module, '__file__', '?')}) has no "
                f"{attr}; {what}: {', '.join(public[:20]) or 'none'}"
            )
    return obj


def import_module(module_name: str, where: str, search: tuple[Path, ...], *, error=ConfigError):
    """Import ``module_name``, looking first in the ``search`` directories (a file
    ``a/b.py`` or package ``a/b/`` there), then on ``sys.path``."""
    top = module_name.split(".")[0]
    for directory in search:
        directory = Path(directory).resolve()
        if (directory / f"{top}.py").is_file() or (directory / top).is_dir():
            loaded = sys.modules.get(top)
            origin = Path(getattr(loaded, "__file__", None) or ".").resolve()
            if loaded is not None and directory not in origin.parents:
                raise error(
                    f"{where}: your module {top!r} in {directory} has the name of a module "
                    f"already imported from {origin}; rename your module"
                )
            if str(directory) not in sys.path:
                sys.path.insert(0, str(directory))
            break
    try:
        return importlib.import_module(module_name)
    except error:
        raise
    except ModuleNotFoundError as e:
        if e.name and e.name in module_name and module_name.startswith(e.name.split(".")[0]):
            dirs = ", ".join(str(d) for d in search) or "sys.path"
            raise error(
                f"{where}: no module named {e.name!r} (looked in {dirs} and sys.path)"
            ) from None
        raise error(f"{where}: importing {module_name} failed: {e}") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise error(
            f"{where}: importing {module_name} failed: {type(e).__name__}: {first}"
        ) from None


def check_kwargs(fn: Any, options: dict, where: str, prefix: str) -> None:
    """Refuse, in one line, a config key that ``fn``'s signature does not take or a
    required argument the config leaves out (``prefix``: the keys' section, ``optimizer.``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes = [n for n, p in params.items() if p.kind in named]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for key in options:
            if key not in takes:
                raise ConfigError(
                    f"{where}: unknown key '{prefix}{key}'; {getattr(fn, '__qualname__', fn)} "
                    f"takes {', '.join(takes) or 'no arguments'}"
                )
    for n in takes:
        if params[n].default is inspect.Parameter.empty and n not in options:
            raise ConfigError(
                f"{where}: {prefix}{n} is required by {getattr(fn, '__qualname__', fn)}; add it"
            )
