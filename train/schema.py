"""The config schema's machinery, shared by every section: a section is a frozen dataclass
(typed fields with defaults), read from a YAML mapping by :func:`build` (types checked and
converted by :func:`coerce`), checked by its own ``check(where)``; :class:`Where` says where
each key was set, so every error is one line naming the key, the file (or ``--set``) and
what is valid.

A section that reads itself differently (``model``: a class's fields; ``optimizer``: a
factory's arguments) has a classmethod ``from_raw(raw, where)``; one that writes itself
differently to YAML has ``to_raw()``. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

MAX_INT = 2**63 - 1  # what numpy and XLA can hold
MAX_SEED = 2**31 - 1  # numpy's generators want >= 0; the init key takes int32


def choice(default: Any, choices: tuple) -> Any:
    """A dataclass field whose value must be one of ``choices``."""
    return field(default=default, metadata={"choices": choices})


@dataclass(frozen=True)
class Where:
    """Where a config's keys came from: ``source`` (the file, or "the config"), except the
    dotted keys in ``sources`` (``--set ...``); ``search``: the directories a user's
    ``module:name`` is imported from first; ``model_class``: the class ``train.fit`` gave."""

    source: str = "the config"
    sources: Mapping[str, str] = field(default_factory=dict)
    search: tuple[Path, ...] = ()
    model_class: type | None = None

    def of(self, key: str) -> str:
        """Where ``key`` (dotted) was set."""
        return self.sources.get(key, self.source)

    def bad(self, key: str, rule: str) -> ConfigError:
        """``FILE: key rule``, the one line of a value that breaks a rule."""
        return ConfigError(f"{self.of(key)}: {key} {rule}")

    def at_least(self, prefix: str, section: Any, names: tuple[str, ...], low: int) -> None:
        """Each of the ``names`` fields of ``section`` is null or >= ``low``."""
        for name in names:
            v = getattr(section, name)
            if v is not None and v < low:
                raise self.bad(f"{prefix}{name}", f"must be >= {low}, got {v}")


def key_of(f: dataclasses.Field) -> str:
    """A field's key in YAML (``checkpoint.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


# Unparametrized annotations YAML spells as a list / a mapping (``hidden: tuple = (8,)``)
_SEQUENCES = (tuple, list, collections.abc.Sequence)
_MAPPINGS = (dict, collections.abc.Mapping)
# YAML 1.1 (PyYAML) floats need a dot: 1.0e-4 is a float, 1e-4 a string. Users write 1e-4.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def type_name(tp: Any) -> str:
    """An annotation as a message says it (``list of int``, ``float or null``)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp) or (tp if tp in _SEQUENCES + _MAPPINGS else None)
    if origin in _SEQUENCES:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in _MAPPINGS and typing.get_args(tp):
        k_tp, v_tp = typing.get_args(tp)
        return f"mapping of {type_name(k_tp)} to {type_name(v_tp)}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _finite(value: int | float, where: str, shown: str | None = None) -> float:
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"{where}: expected a finite number, got {shown or value}")
    return out


def _expected(tp: Any, value: Any, where: str) -> ConfigError:
    return ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (lists -> tuples,
    an Enum's value -> its member). ``where`` starts the error's line."""
    origin = typing.get_origin(tp)
    if origin is None and tp in _SEQUENCES + _MAPPINGS:
        origin = tp  # bare ``tuple``, ``list``, ``dict``: of anything
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, float) and float in typing.get_args(tp):
            _finite(value, where)  # say "finite", not "expected float or null"
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, where)
            except ConfigError:
                continue
        raise _expected(tp, value, where)
    if origin in _SEQUENCES:
        if not isinstance(value, (list, tuple)):
            raise _expected(tp, value, where)
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [Any]
        if origin is tuple and len(args) > 1:  # tuple[int, str]: one type per position
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
            return tuple(coerce(v, a, where) for v, a in zip(value, args, strict=True))
        return tuple(coerce(v, args[0], where) for v in value)
    if origin in _MAPPINGS:
        if not isinstance(value, dict):
            raise _expected(tp, value, where)
        k_tp, v_tp = typing.get_args(tp) or (Any, Any)
        return {coerce(k, k_tp, where): coerce(v, v_tp, f"{where}.{k}") for k, v in value.items()}
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(
            f"{where}: {value!r} is not one of {', '.join(map(repr, typing.get_args(tp)))}"
        )
    return _scalar(value, tp, where)


def _scalar(value: Any, tp: Any, where: str) -> Any:
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -MAX_INT <= value <= MAX_INT:
                raise ConfigError(f"{where}: {value} is out of range (at most {MAX_INT})")
            return value
    elif tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            # YAML 1.1 reads 1e-4 (no dot) as a string
            return _finite(float(value), where, shown=value.strip())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(value, where)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):  # a type YAML cannot spell otherwise
        return value
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):  # written as its value
        try:
            return tp(value)
        except (ValueError, TypeError):
            values = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{where}: {value!r} is not one of {values}") from None
    raise _expected(tp, value, where)


def mapping(raw: Any, section: str, where: Where) -> dict:
    """``raw`` (a section as YAML gave it) as a dict: null is ``{}``, a non-mapping an error."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        name = section.rstrip(".") or "the top level"
        raise ConfigError(f"{where.of(section.rstrip('.'))}: {name} must be a mapping, got {raw!r}")
    return raw


def as_list(raw: Any, where: str, key: str, form: str) -> list | tuple:
    """``raw``, a list in the config (null: empty); anything else one line saying that
    ``key`` must be a list of ``form``."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"{where}: {key} must be a list of {form}, got {raw!r}")
    return raw


def build(cls: type, raw: Any, prefix: str, where: Where) -> Any:
    """The section ``cls`` from ``raw`` (its YAML mapping; ``prefix``: its dotted key and a
    dot, ``"train."``): unknown keys, wrong types and bad choices refused in one line. A
    field whose type has ``from_raw`` (a section of its own) is read by it, one whose
    metadata has ``build`` by that function, ``(value, where) -> value``."""
    raw = mapping(raw, prefix, where)
    hints = typing.get_type_hints(cls)
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            section = prefix.rstrip(".") or "the top level"
            raise ConfigError(
                f"{where.of(prefix + key)}: unknown key '{prefix}{key}'; valid keys in "
                f"{section}: {', '.join(fields)}"
            )
        kwargs[fields[key].name] = _value(
            fields[key], hints[fields[key].name], value, prefix, where
        )
    return cls(**kwargs)


def _value(f: dataclasses.Field, tp: Any, value: Any, prefix: str, where: Where) -> Any:
    key = f"{prefix}{key_of(f)}"
    if "build" in f.metadata:
        return f.metadata["build"](value, where)
    if hasattr(tp, "from_raw"):
        return tp.from_raw(value, where)
    inner = optional_dataclass(tp)
    if inner is not None and value is not None:  # e.g. train.early_stopping
        if not isinstance(value, dict):
            keys = ", ".join(f"{key_of(g)}: ..." for g in dataclasses.fields(inner))
            raise ConfigError(
                f"{where.of(key)}: {key}: expected a mapping {{{keys}}} or null, got {value!r}"
            )
        return build(inner, value, f"{key}.", where)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, f"{key}.", where)
    value = coerce(value, tp, f"{where.of(key)}: {key}")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{where.of(key)}: {key}: {value!r} is not one of {', '.join(map(str, choices))}"
        )
    return value


def optional_dataclass(tp: Any) -> type | None:
    """``X`` for an annotation ``X | None`` where X is a dataclass, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def plain(v: Any) -> Any:
    """A section (or any value of one) as plain YAML/JSON-able data: tuples become lists,
    an Enum its value, a section with ``to_raw()`` what that returns."""
    if isinstance(v, tuple):
        return [plain(x) for x in v]
    if isinstance(v, enum.Enum):  # a model field's Enum: its value (read back by coerce)
        return plain(v.value)
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if hasattr(v, "to_raw") and dataclasses.is_dataclass(v):
        return plain(v.to_raw())
    if dataclasses.is_dataclass(v):
        return {key_of(f): plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return v


def to_dict(cfg: Any) -> dict:
    """A config (or a section) as plain YAML/JSON-able data (tuples become lists)."""
    return plain(cfg)


def dump_yaml(cfg: Any) -> str:
    """A config as the YAML a run directory keeps (``config.yaml``), keys in field order."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def default_of(f: dataclasses.Field) -> Any:
    """A field's default (``dataclasses.MISSING``: none)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def frozen(value: Any) -> Any:
    """Lists as tuples, at any depth (in mappings too)."""
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: frozen(v) for k, v in value.items()}
    return value


def same(a: Any, b: Any) -> bool:
    """Equal as a class's own ``==`` sees it (``1 == 1.0``), NaN equal to NaN, but a bool
    never equal to a number (``true`` is no ``1``)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object whose == is not a bool
        return False
