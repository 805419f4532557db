"""The config's ``model`` section: ``name`` (a shipped model, a user's ``module:Class`` or
``hf:DIR``) and that class's own fields, each checked against its annotation; and the
check that a run's config.yaml reads back as the model it trained.

Importing this module does not import JAX (the model's class is resolved when the section
is read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errors import ConfigError
from ..schema import Where, coerce, default_of, frozen, plain, same, type_name


@dataclass(frozen=True)
class ModelConfig:
    """``model.name`` is a shipped model (mlp, linreg, cnn, gpt: see models/) or your own,
    ``module:Class``; every other key of the section is one of that model's dataclass fields
    (``options``), checked against the field's type. Fields the data determines
    (``in_features``, ``in_shape``, ``num_classes``, ``out_features``, ``vocab_size``,
    ``context``) are filled from the data set when left out."""

    name: str = "mlp"
    options: dict = field(default_factory=dict)  # the model's own fields, by name
    # the class ``name`` resolved to (not part of the config's text)
    cls: type | None = field(default=None, compare=False, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)

    def to_raw(self) -> dict:
        """Flat, as written: the name and the fields."""
        return {"name": self.name, **self.options}

    @classmethod
    def from_raw(cls, raw: Any, where: Where) -> ModelConfig:
        return build_model(raw, where)


def build_model(raw: Any, where: Where) -> ModelConfig:
    """The ``model`` section: its ``name`` resolved to a class (a shipped model or a user's
    ``module:Class``, imported from ``where.search`` first), every other key checked against
    that class's fields and types, and the fields the config leaves out that have defaults
    filled in (those the data determines stay out until the data set is loaded).
    ``where.model_class``: the class itself (``train.fit``), instead of resolving the name."""
    # start-up: the contract imports JAX, which a config that names no model never needs
    from .contract import DATA_FIELDS, check_model_class, field_types, fields, has_default
    from .registry import ModelError, resolve

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.of('model')}: model must be a mapping, got {raw!r}")
    raw = dict(raw)
    name = raw.pop("name", ModelConfig.name)
    src = where.of("model.name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{src}: model.name: expected a model name or 'module:Class', got {name!r}"
        )
    cls = where.model_class
    try:
        if cls is None:
            cls = resolve(name.strip(), where.search)
        else:
            check_model_class(cls, f"model {cls.__name__}")
    except ModelError as e:
        raise ConfigError(f"{src}: {e}") from None
    own, types_ = fields(cls), field_types(cls)
    if name.strip().startswith("hf:"):  # model.name: "hf:DIR" -> nl.hf.Pretrained(path=DIR)
        directory = name.strip()[3:]
        if raw.setdefault("path", directory) != directory:
            raise ConfigError(
                f"{where.of('model.path')}: model.path={raw['path']!r} differs from "
                f"model.name={name.strip()}; leave model.path out"
            )
    options = {}
    for key, value in raw.items():
        src = where.of(f"model.{key}")
        if key not in own:
            raise ConfigError(
                f"{src}: unknown key 'model.{key}'; model.name={name} ({cls.__name__}) takes "
                f"{', '.join(own) or 'no fields'}"
            )
        options[key] = _model_value(value, types_[key], own[key], f"{src}: model.{key}")
    for key, f in own.items():
        if key in options:
            continue
        if has_default(f):
            options[key] = frozen(default_of(f))
        elif key not in DATA_FIELDS:
            raise ConfigError(
                f"{where.source}: model.{key} is required by model.name={name} "
                f"({cls.__name__}.{key}: {type_name(types_[key])}); add it under model:"
            )
    options = {k: options[k] for k in own if k in options}  # in the class's field order
    return ModelConfig(name.strip(), options, cls)


def _model_value(value: Any, tp: Any, f: dataclasses.Field, where: str) -> Any:
    """A model field's value from YAML: checked against its annotation, lists as tuples (a
    model is hashable), and the field's own default accepted whatever the annotation says
    (``x: int = None``, ``clip: float = math.inf``: what a run's config.yaml writes back)."""
    try:
        return frozen(coerce(value, tp, where))
    except ConfigError:
        default = frozen(default_of(f))
        if default is not dataclasses.MISSING and same(frozen(value), default):
            return default
        raise


def check_model_round_trip(spec: ModelConfig, model: Any) -> None:
    """Raise ConfigError (one line, naming the field) unless the model section a run writes
    to its config.yaml (``spec``: every field, resolved) reads back as ``model`` itself: a
    field whose value YAML cannot hold (a function, an object), or one that its class
    changes so that the value written is not accepted or not equal when read back, would
    make a run that ``train.load_run``, ``train.sample`` or resuming cannot load."""
    cls = spec.cls
    name = cls.__name__
    for key, value in spec.options.items():
        try:
            yaml.safe_dump(plain(ModelConfig(spec.name, {key: value})))
        except yaml.YAMLError:
            named = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
            shown = f"{named} (a {type(value).__name__})" if named else repr(value)
            raise ConfigError(
                f"model.{key}: {name}.{key} = {shown} cannot be written to the run's "
                "config.yaml (a model field holds YAML data: numbers, strings, booleans, "
                "null, lists, mappings or an Enum), so the run could not be loaded back; "
                "make it, e.g., a name that __call__ looks up"
            ) from None
    text = yaml.safe_dump(plain(spec), sort_keys=False)
    where = f"model.name={spec.name} ({name})"
    try:
        back = build_model(yaml.safe_load(text), Where("its config.yaml", model_class=cls))
        again = cls(**back.options)
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{where}: the run's config.yaml would not load back: {e}; keep each field's "
            "value one that its annotation accepts"
        ) from None
    for key, value in spec.options.items():
        if not same(frozen(getattr(again, key, None)), frozen(value)):
            raise ConfigError(
                f"{where}: model.{key} = {value!r} reads back from the run's config.yaml as "
                f"{getattr(again, key, None)!r}, so the run would not load back as it trained; "
                f"make {name}.{key} hold the value it was given"
            )
