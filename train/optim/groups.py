"""The shape of ``optimizer.frozen`` and ``optimizer.param_groups``, checked when the config
is read (no JAX import: the config reads this); their globs are matched against the
model's params in ``params.py``."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from . import GIVEN

PARAM_KEYS = ("frozen", "param_groups")  # the trainer's keys in any optimizer section
GROUP_KEYS = ("params", "lr_scale", "weight_decay")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_param_settings(cfg, sources: dict, source: str) -> None:
    """The shape of ``optimizer.frozen`` and ``optimizer.param_groups`` (their globs are
    matched against the model's params later, when the model is built)."""
    for i, glob in enumerate(cfg.frozen):
        if not isinstance(glob, str) or not glob.strip():
            src = sources.get("optimizer.frozen", source)
            raise ConfigError(f"{src}: optimizer.frozen[{i}]: expected a glob, got {glob!r}")
    factory = cfg.name == GIVEN or ":" in cfg.name
    for i, group in enumerate(cfg.param_groups):
        src = sources.get("optimizer.param_groups", source)
        where = f"{src}: optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise ConfigError(
                f"{where}: expected a mapping {{params: glob, lr_scale: ..., weight_decay: ...}}, "
                f"got {group!r}"
            )
        unknown = sorted(set(group) - set(GROUP_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(GROUP_KEYS)}"
            )
        globs = group.get("params")
        globs = [globs] if isinstance(globs, str) else globs
        if not (isinstance(globs, list | tuple) and globs) or not all(
            isinstance(g, str) and g.strip() for g in globs
        ):
            raise ConfigError(
                f"{where}.params: expected a glob or a list of globs, got {group.get('params')!r}"
            )
        scale = group.get("lr_scale", 1.0)
        if not _number(scale) or not scale > 0:
            raise ConfigError(
                f"{where}.lr_scale: expected a number > 0 (to stop training params, list them "
                f"in optimizer.frozen), got {scale!r}"
            )
        wd = group.get("weight_decay")
        if wd is not None and (not _number(wd) or wd < 0):
            raise ConfigError(f"{where}.weight_decay: expected a number >= 0, got {wd!r}")
        if wd is not None and factory:
            raise ConfigError(
                f"{where}.weight_decay: optimizer.name={cfg.name} builds its own optimizer, "
                "whose weight decay the trainer cannot change; use a named optimizer "
                "(adamw, ...) or set it in your factory"
            )


def group_globs(group: dict) -> tuple[str, ...]:
    g = group["params"]
    return (g,) if isinstance(g, str) else tuple(g)
