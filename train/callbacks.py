"""Callbacks: your code at the training loop's events.

A callback is any object with some of these methods (subclass :class:`Callback` to get
no-op defaults for the rest):

- ``on_fit_start(loop)``: the run is built, its starting state agreed (``loop.step`` is
  0, or the step a resumed run starts at);
- ``on_step_end(loop, step, metrics)``: at each of the loop's boundaries (the log,
  evaluation and checkpoint cadences and the end): ``metrics`` are the train metrics
  logged there (their means since the last log; ``{}`` at a boundary that logs nothing);
- ``on_eval_end(loop, step, metrics)``: after an evaluation (``loss``, ``accuracy``...);
- ``on_checkpoint(loop, step, path)``: after a checkpoint was written;
- ``on_fit_end(loop, summary)``: after the last step (or a requested stop);
- ``state_dict() -> dict`` and ``load_state_dict(state)``: JSON-able state saved in every
  checkpoint and given back on resume, so a resumed run's callbacks decide as the
  uninterrupted run's did.

``loop`` (:class:`LoopState`) reads the run: ``step``, ``cfg``, ``model``, ``run_dir``,
``params()`` and ``opt_state()`` (host copies, fetched only when called), and
``stop(reason)`` asks the loop to end cleanly: it checkpoints at this boundary and
finishes; rerunning the command says the run stopped early instead of training again.

Callbacks run in Python at boundaries the loop stops at anyway (never per step), on
process 0 of a multi-process run (where metrics are logged); a stop is agreed by all
processes. Resume: a checkpoint holds each callback's ``state_dict()`` as it was when the
checkpoint was written; the resumed run loads it and calls ``on_checkpoint`` once more for
the checkpoint it starts from, so state that ``on_checkpoint`` changes resumes exactly too
(keep it idempotent: it may run twice for one checkpoint after a crash).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, users_code, users_error
from .registry import Registry, check_kwargs
from .schema import Where, as_list, choice

EVENTS = ("on_fit_start", "on_step_end", "on_eval_end", "on_checkpoint", "on_fit_end")

#: Built-in callbacks by ``callbacks: [{name: ...}]``; anything else is ``"module:Class"``.
CALLBACKS = Registry("built-in callback", {"early_stopping": ".callbacks:EarlyStopping"})


@dataclass(frozen=True)
class CallbackConfig:
    """One entry of ``callbacks:``: a built-in callback's name or a user's
    ``"module:Class"``; every other key is an argument of its constructor."""

    name: str
    options: dict = field(default_factory=dict)
    cls: Any = field(default=None, compare=False, repr=False)  # what ``name`` resolved to

    def to_raw(self) -> dict:
        """Flat, as written: the name and the arguments."""
        return {"name": self.name, **self.options}


def callbacks_section(raw: Any, where: Where) -> tuple[CallbackConfig, ...]:
    """The config's ``callbacks`` list: each a name or ``{name: ..., constructor
    arguments}``, resolved (a user's class imported now) and its arguments checked."""
    src = where.of("callbacks")
    out = []
    for i, entry in enumerate(
        as_list(raw, src, "callbacks", "names or {name: 'module:Class', ...}")
    ):
        at = f"{src}: callbacks[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(
                f"{at}: expected a name or a mapping with a 'name' key, got {entry!r}"
            )
        options = {k: v for k, v in entry.items() if k != "name"}
        cls = CALLBACKS.get(entry["name"], f"{at}.name={entry['name']}", where.search)
        if not callable(cls):
            raise ConfigError(f"{at}.name={entry['name']} is not a class or factory")
        check_kwargs(cls, options, f"{at}.name={entry['name']}", f"callbacks[{i}].")
        out.append(CallbackConfig(entry["name"], options, cls))
    return tuple(out)


@dataclass(frozen=True)
class EarlyStoppingConfig:
    """``train.early_stopping``: an alias of ``callbacks: [{name: early_stopping, ...}]``
    (the documented spelling), its keys that callback's arguments; the callback's state is
    checkpointed under the key ``train.early_stopping``."""

    monitor: str = "loss"  # a metric the evaluation logs (loss, accuracy, bits_per_char...)
    mode: str = choice("min", ("min", "max"))  # min: lower is better; max: higher is better
    patience: int = 3  # evaluations without an improvement before the run stops
    min_delta: float = 0.0  # the smallest change that counts as an improvement

    def as_callback(self) -> CallbackConfig:
        """The ``callbacks:`` entry this alias stands for."""
        options = {f: getattr(self, f) for f in ("monitor", "mode", "patience", "min_delta")}
        return CallbackConfig("early_stopping", options, CALLBACKS.get("early_stopping", ""))

    def check(self, where: Where, prefix: str = "train.early_stopping.") -> None:
        if self.patience < 1:
            raise where.bad(f"{prefix}patience", f"must be >= 1, got {self.patience}")
        if self.min_delta < 0:
            raise where.bad(f"{prefix}min_delta", f"must be >= 0, got {self.min_delta}")
        if not self.monitor.strip():
            raise where.bad(f"{prefix}monitor", "must name an evaluation metric, got ''")


class Callback:
    """No-op defaults for every event (subclass and override what you need)."""

    def on_fit_start(self, loop: LoopState) -> None:
        pass

    def on_step_end(self, loop: LoopState, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_eval_end(self, loop: LoopState, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_checkpoint(self, loop: LoopState, step: int, path: Path) -> None:
        pass

    def on_fit_end(self, loop: LoopState, summary: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class LoopState:
    """What a callback reads of the run, and its way to stop it."""

    def __init__(self, cfg, model, run_dir: Path, host_state: Callable[[], tuple]):
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        self.step = 0
        self.stop_reason: str | None = None
        self._host_state = host_state

    def params(self):
        """The current params, as host numpy arrays in their tree (gathered if sharded)."""
        return self._host_state()[0]

    def opt_state(self):
        """The current optimizer state, as host numpy arrays in its tree."""
        return self._host_state()[1]

    def stop(self, reason: str) -> None:
        """End the run cleanly at this boundary: checkpoint, finish, say ``reason``."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"stop(reason): expected a non-empty string, got {reason!r}")
        if self.stop_reason is None:
            self.stop_reason = reason.strip().splitlines()[0]


class Callbacks:
    """The run's callbacks, called in order, with their checkpointed state."""

    def __init__(self, callbacks: Sequence[Any], names: Sequence[str]):
        for cb, name in zip(callbacks, names):
            if not any(callable(getattr(cb, e, None)) for e in EVENTS):
                raise ConfigError(
                    f"callback {name}: {type(cb).__name__} has none of the events "
                    f"{', '.join(EVENTS)}; subclass train.Callback and override one"
                )
        self.items = list(callbacks)
        # the key of each callback's state in a checkpoint: its place and name
        self.keys = [f"{i}:{name}" for i, name in enumerate(names)]

    def __bool__(self) -> bool:
        return bool(self.items)

    def call(self, event: str, *args) -> None:
        for cb in self.items:
            fn = getattr(cb, event, None)
            if callable(fn):
                with users_code("callback"):
                    fn(*args)

    def state(self) -> str:
        """Every callback's ``state_dict()`` as one JSON string (checkpoint metadata)."""
        states = {}
        for key, cb in zip(self.keys, self.items):
            fn = getattr(cb, "state_dict", None)
            with users_code("callback"):
                state = fn() if callable(fn) else {}
            try:
                states[key] = json.loads(json.dumps(state))
            except (TypeError, ValueError) as e:
                raise ConfigError(
                    f"callback {key}: state_dict() must return JSON-able data (numbers, "
                    f"strings, lists, dicts), got {type(state).__name__}: {e}"
                ) from None
        return json.dumps(states, sort_keys=True)

    def load(self, text: str | None, where: str) -> None:
        """Give each callback its state from a checkpoint's metadata (``text``); a callback
        the checkpoint has no state for starts fresh."""
        if not text:
            return
        try:
            states = json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{where}: its callbacks metadata is not valid JSON") from None
        for key, cb in zip(self.keys, self.items):
            fn = getattr(cb, "load_state_dict", None)
            if key in states and callable(fn):
                with users_code("callback"):
                    fn(states[key])


def build_callbacks(
    specs: Sequence[CallbackConfig],
    early_stopping: EarlyStoppingConfig | None = None,
    given: Sequence[Any] = (),
) -> Callbacks:
    """The config's callbacks (``specs``, constructed with their arguments), then ``given``
    objects (``train.fit(callbacks=[...])``), then ``train.early_stopping``'s (the alias's)
    callback, under its own key in checkpoints."""
    made, names = [], []
    for spec in specs:
        try:
            made.append(spec.cls(**spec.options))
        except Exception as e:
            err = users_error("callback", e)  # its own __init__ raised
            if err is not None:
                raise err from e
            if not isinstance(e, TypeError | ValueError):
                raise
            raise ConfigError(f"callbacks: {spec.name}: {e}") from None
        names.append(spec.name)
    for cb in given:
        made.append(cb)
        names.append(type(cb).__qualname__)
    if early_stopping is not None:  # the alias: the built-in callback, as the list names it
        spec = early_stopping.as_callback()
        made.append(spec.cls(**spec.options))
        names.append(EARLY_STOPPING_KEY)
    out = Callbacks(made, names)
    if early_stopping is not None:
        out.keys[-1] = EARLY_STOPPING_KEY  # whatever other callbacks the run has
    return out


EARLY_STOPPING_KEY = "train.early_stopping"


class EarlyStopping(Callback):
    """Stop when an evaluation metric has not improved for ``patience`` evaluations.

    Args:
        monitor: a metric the evaluation logs (``loss``, ``accuracy``, ``bits_per_char``...).
        mode: ``min`` (lower is better) or ``max``.
        patience: evaluations without an improvement of more than ``min_delta`` before
            stopping.
        min_delta: the smallest change that counts as an improvement.
    """

    def __init__(
        self, monitor: str = "loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta!r}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.bad = 0  # evaluations since the best

    def on_eval_end(self, loop: LoopState, step: int, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise ConfigError(
                f"early stopping: monitor={self.monitor!r} is not an evaluation metric; "
                f"the evaluation logs {', '.join(metrics)}"
            )
        value = float(metrics[self.monitor])
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad = value, 0
            return
        self.bad += 1
        if self.bad >= self.patience:
            loop.stop(
                f"early stopping: {self.monitor} has not improved on {self.best:.6g} for "
                f"{self.bad} evaluations (patience {self.patience})"
            )

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "monitor": self.monitor, "mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        # a run resumed with another monitor or mode counts that one from the resume
        if (state.get("monitor", self.monitor), state.get("mode", self.mode)) != (
            self.monitor,
            self.mode,
        ):
            return
        self.best, self.bad = state.get("best"), int(state.get("bad", 0))
