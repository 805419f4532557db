"""Model registry: a config's ``model.name`` -> a model class.

A name with a colon, ``"package.module:Class"``, is a user's model: the module is
imported from the config file's directory, the current directory, or ``sys.path``. A name
without one is a shipped model below. Every model follows the contract of
``models/contract.py`` (task, data-filled fields, optional loss/objective); adding a model
to the repository is one file plus one line in :data:`MODELS`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from .contract import ModelError, check_model_class

#: Shipped models: config name -> "module:Class" (imported on first use).
MODELS = {
    "mlp": "models.mlp:MLP",
    "linreg": "models.linreg:LinReg",
    "cnn": "models.cnn:CNN",
    "gpt": "models.gpt:GPT",
    "resnet": "models.resnet:ResNet",
}


def resolve(name: str, search: tuple[Path, ...] = ()) -> type:
    """The model class that ``model.name`` names; ModelError (one line) when it cannot be
    imported or is not a model. ``search``: directories to import a user's module from,
    first (the config file's directory, then the current one)."""
    where = f"model.name={name}"
    if ":" not in name:
        if name not in MODELS:
            raise ModelError(
                f"{where} is not a shipped model ({', '.join(MODELS)}) and not an import path "
                "'module:Class' of your own model"
            )
        name, search = MODELS[name], ()  # a shipped model: this package, nothing else
    module_name, _, class_name = name.partition(":")
    if not module_name or not class_name.isidentifier():
        raise ModelError(f"{where}: expected 'module:Class', e.g. 'mymodels:ResMLP'")
    module = _import(module_name, search, where)
    cls = getattr(module, class_name, None)
    if cls is None:
        public = sorted(n for n, v in vars(module).items() if isinstance(v, type) and n[0] != "_")
        raise ModelError(
            f"{where}: module {module_name} ({getattr(module, '__file__', '?')}) has no "
            f"{class_name}; its classes: {', '.join(public) or 'none'}"
        )
    check_model_class(cls, where)
    return cls


def class_path(cls: type) -> str:
    """The ``module:Class`` that :func:`resolve` reads back (a shipped model's short name)."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    short = {v: k for k, v in MODELS.items()}
    return short.get(path, path)


def _import(module_name: str, search: tuple[Path, ...], where: str):
    """Import ``module_name``, looking first in the ``search`` directories (a file
    ``a/b.py`` or package ``a/b/`` there), then on ``sys.path``."""
    top = module_name.split(".")[0]
    for directory in search:
        directory = Path(directory).resolve()
        if (directory / f"{top}.py").is_file() or (directory / top).is_dir():
            loaded = sys.modules.get(top)
            origin = Path(getattr(loaded, "__file__", None) or ".").resolve()
            if loaded is not None and directory not in origin.parents:
                raise ModelError(
                    f"{where}: your module {top!r} in {directory} has the name of a module "
                    f"already imported from {origin}; rename your module"
                )
            if str(directory) not in sys.path:
                sys.path.insert(0, str(directory))
            break
    try:
        return importlib.import_module(module_name)
    except ModelError:
        raise
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name.split(".")[0]) and e.name in module_name:
            dirs = ", ".join(str(d) for d in search) or "sys.path"
            raise ModelError(
                f"{where}: no module named {e.name!r} (looked in {dirs} and sys.path)"
            ) from None
        raise ModelError(f"{where}: importing {module_name} failed: {e}") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(
            f"{where}: importing {module_name} failed: {type(e).__name__}: {first}"
        ) from None


__all__ = ["MODELS", "ModelError", "class_path", "resolve"]
