"""Model registry: a config's ``model.name`` -> a model class.

A name with a colon, ``"package.module:Class"``, is a user's model: the module is
imported from the config file's directory, the current directory, or ``sys.path``. A name
without one is a shipped model below. Every model follows the contract of
``train/model/contract.py`` (task, data-filled fields, optional loss/objective); adding a model
to the repository is one file plus one line in :data:`MODELS`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..registry import PACKAGE, Registry
from .contract import ModelError, check_model_class

#: Where the shipped models live: ``models`` beside ``train`` in a checkout,
#: ``nnlite.models`` beside ``nnlite.train`` when installed (a user's own ``models``
#: package keeps its name either way).
SHIPPED = PACKAGE.rpartition(".")[0] + ".models" if "." in PACKAGE else "models"

#: Shipped models: config name -> "module:Class" (imported on first use).
MODELS = Registry(
    "shipped model",
    {
        "mlp": f"{SHIPPED}.mlp:MLP",
        "linreg": f"{SHIPPED}.linreg:LinReg",
        "cnn": f"{SHIPPED}.cnn:CNN",
        "gpt": f"{SHIPPED}.gpt:GPT",
        "resnet": f"{SHIPPED}.resnet:ResNet",
    },
    form="module:Class",
    error=ModelError,
)


#: ``model.name: "hf:DIR"``: the model (and weights) of a Hugging Face model directory.
HF_PREFIX = "hf:"


def resolve(name: str, search: tuple[Path, ...] = ()) -> type:
    """The model class that ``model.name`` names; ModelError (one line) when it cannot be
    imported or is not a model. ``search``: directories to import a user's module from,
    first (the config file's directory, then the current one)."""
    where = f"model.name={name}"
    if name.startswith(HF_PREFIX):  # a Hugging Face model directory (docs/pretrained.md)
        import nnlite as nl  # start-up: JAX, which a config naming no hf model never needs

        return nl.hf.Pretrained
    if ":" not in name and name in MODELS:
        _check_shipped_package(where)
    cls = MODELS.get(name, where, search)
    if not isinstance(cls, type):
        raise ModelError(f"{where}: {cls!r} is not a class")
    check_model_class(cls, where)
    return cls


def class_path(cls: type) -> str:
    """The ``module:Class`` that :func:`resolve` reads back (a shipped model's short name)."""
    return MODELS.short_name(cls) or f"{cls.__module__}:{cls.__qualname__}"


def is_shipped(cls: type) -> bool:
    return MODELS.short_name(cls) is not None


def _check_shipped_package(where: str) -> None:
    """A user's own ``models`` package imported earlier under the shipped models' name (a
    checkout's ``python -m train`` from a project with its own ``models/``)."""
    loaded = sys.modules.get(SHIPPED)
    if loaded is None:
        return
    here = Path(__file__).resolve().parents[2]
    origin = Path(getattr(loaded, "__file__", None) or "?").resolve().parent
    if origin != here / "models" and origin.name == "models" and origin.parent != here:
        raise ModelError(
            f"{where}: the shipped models' package name {SHIPPED!r} is taken by your own "
            f"{origin}; run the installed trainer (nnlite-train)"
        )


MODEL_SOURCE_KEY = "model_source"  # checkpoint metadata: where a user's module was found


def model_source(model: Any) -> str | None:
    """The directory to import a user's model module from again (None: a shipped model or
    an installed package)."""
    cls = type(model)
    if is_shipped(cls):
        return None

    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    top = Path(file).resolve().parent
    for _ in cls.__module__.split(".")[1:]:  # a package module: up to the package's parent
        top = top.parent
    return str(top)
