"""The config's ``optimizer`` section: a named optimizer's settings (the fields below), or
a user's factory ``"module:function"`` whose other keys are its keyword arguments, or
``given``: the object passed to ``train.fit(optimizer=...)``. No JAX or optax here."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..registry import check_kwargs
from ..schema import Where, build, choice, mapping
from . import GIVEN, OPTIMIZERS, SCHEDULES
from .groups import PARAM_KEYS, check_param_settings


@dataclass(frozen=True)
class OptimizerConfig:
    """A named optimizer (train/optim/__init__.py), whose keys are the fields below; or a
    user's factory ``"module:function"`` returning an optax.GradientTransformation, whose
    other keys are its keyword arguments (``options``); or ``given``: the object passed to
    ``train.fit(optimizer=...)``."""

    name: str = "adam"  # sgd, momentum, adam, adamw, lion, or "module:function"
    learning_rate: float = 1e-3  # peak learning rate
    # learning-rate schedule over train.steps: constant, cosine, warmup_cosine, exponential,
    # or "module:function" called with learning_rate and total_steps (those it takes)
    schedule: str = "constant"
    warmup_steps: int = 0  # warmup_cosine: linear warmup length
    end_lr_fraction: float = 0.0  # cosine/warmup_cosine: final lr as a fraction of peak
    decay_rate: float = 0.1  # exponential: lr multiplier reached after train.steps
    momentum: float = 0.9  # name=momentum: the momentum coefficient
    weight_decay: float = 0.0  # decoupled for adamw/lion; added to the gradient otherwise
    # Which params weight decay applies to: "all", or "matrices" (ndim >= 2: weights and
    # embeddings, not biases or norm scales, as nanoGPT decays)
    decay: str = choice("all", ("all", "matrices"))
    b1: float = 0.9  # adam/adamw/lion: first-moment decay
    b2: float | None = None  # adam/adamw/lion: second-moment decay (unset: 0.999; lion 0.99)
    clip_norm: float | None = None  # clip gradients to this global norm first
    options: dict = field(default_factory=dict)  # name "module:function": its arguments
    # Params never trained: globs over ParamsDict paths ("embed/*", "blocks/0/*"); no
    # update, no optimizer state, and no weight gradient computed (train/optim/params.py)
    frozen: tuple[str, ...] = ()
    # Per-glob settings: [{params: "glob" or [globs], lr_scale: 0.1, weight_decay: 0.0}];
    # a param takes the first group that matches it, the others the section's settings
    param_groups: tuple[dict, ...] = ()

    @property
    def is_factory(self) -> bool:
        """Whether the optimizer is a user's factory or a given object (not a named one,
        so the section's own settings other than ``frozen``/``param_groups`` do not apply)."""
        return bool(self.options) or self.name == GIVEN or ":" in self.name

    def to_raw(self) -> dict:
        if not self.is_factory:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        ours = {k: getattr(self, k) for k in PARAM_KEYS if getattr(self, k)}
        return {"name": self.name, **self.options, **ours}

    @classmethod
    def from_raw(cls, raw: Any, where: Where) -> OptimizerConfig:
        """A named optimizer's fields, or a user's factory (``module:function``, imported
        now) with the other keys as its arguments."""
        raw = mapping(raw, "optimizer", where)
        name = raw.get("name", cls.name)
        src = where.of("optimizer.name")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                f"{src}: optimizer.name: expected an optimizer name or 'module:function', "
                f"got {name!r}"
            )
        name = name.strip()
        if name == GIVEN or ":" in name:
            ours = {k: raw[k] for k in PARAM_KEYS if k in raw}  # the trainer's, not the factory's
            options = {k: v for k, v in raw.items() if k != "name" and k not in ours}
            if ":" in name:
                _check_factory(name, options, src, where)
            cfg = build(cls, ours, "optimizer.", where)
            cfg = dataclasses.replace(cfg, name=name, options=options)
            check_param_settings(cfg, where.sources, where.source)
            return cfg
        if name not in OPTIMIZERS:
            OPTIMIZERS.get(name, f"{src}: optimizer.name={name}")  # raises, listing the names
        cfg = build(cls, raw, "optimizer.", where)
        if cfg.options:
            raise ConfigError(
                f"{where.of('optimizer.options')}: optimizer.options is for a factory "
                f"optimizer ('module:function'); optimizer.name={name} takes the section's "
                "own keys"
            )
        if ":" in cfg.schedule or cfg.schedule not in SCHEDULES:  # names: no import (start-up)
            at = f"{where.of('optimizer.schedule')}: optimizer.schedule={cfg.schedule}"
            SCHEDULES.get(cfg.schedule, at, where.search)
        check_param_settings(cfg, where.sources, where.source)
        return cfg

    def check(self, where: Where) -> None:
        if self.learning_rate <= 0:
            raise where.bad("optimizer.learning_rate", f"must be > 0, got {self.learning_rate}")
        for key in ("b1", "b2"):
            v = getattr(self, key)
            if v is not None and not 0.0 <= v < 1.0:
                raise where.bad(f"optimizer.{key}", f"must be in [0, 1), got {v}")


def _check_factory(name: str, options: dict, src: str, where: Where) -> None:
    """Import a user's optimizer factory and check ``options`` against its signature (a
    required ``learning_rate`` left out takes the section's default)."""
    factory = OPTIMIZERS.get(name, f"{src}: optimizer.name={name}", where.search)
    if not callable(factory):
        raise ConfigError(f"{src}: optimizer.name={name} is not callable")
    if "learning_rate" not in options and _requires(factory, "learning_rate"):
        options["learning_rate"] = OptimizerConfig.learning_rate  # the key's default
    check_kwargs(factory, options, f"{src}: optimizer.name={name}", "optimizer.")


def _requires(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name`` without a default."""
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return p is not None and p.kind in keyword and p.default is inspect.Parameter.empty
