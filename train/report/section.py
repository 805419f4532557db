"""The config's ``log`` section: where records go (the loggers of train/report/loggers.py),
progress, curves, profiling, the norms logged."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import Where
from . import loggers
from .profile import parse as parse_profile


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs"  # run directories are <dir>/<name>/
    progress: bool = True  # show a tqdm progress bar
    plot: bool = True  # draw curves.png at the end
    # where records go besides metrics.jsonl (always written): jsonl, tensorboard, csv,
    # wandb, mlflow, a "module:Class" of your own, or {name: ..., its arguments}
    # (train/report/loggers.py, docs/loggers.md)
    loggers: tuple[str | dict, ...] = ("jsonl",)
    # the same as listing tensorboard in loggers: TensorBoard event files in
    # <run dir>/tensorboard (needs tensorboardX: pip install 'nnlite[tensorboard]')
    tensorboard: bool = False
    # "START:STOP": a jax.profiler trace of those steps in <run dir>/profile (--profile)
    profile: str | None = None
    # grad_norm, update_norm and param_norm in every train record (computed in the step)
    norms: bool = True
    # issue 34: log each layer's cotangent norm (leaving its input) and params' gradient
    # norm, computed inside the compiled step (cotangent_norm/<layer>, grad_norm/<layer>)
    grad_by_layer: bool = False

    def profile_span(self, where: Where) -> tuple[int, int] | None:
        """``log.profile`` as (START, STOP) steps (None: off)."""
        if self.profile is None:
            return None
        try:
            return parse_profile(self.profile)
        except ValueError as e:
            raise where.bad("log.profile", str(e)) from None

    def check(self, where: Where) -> None:
        """A user's logger class is imported now, like a model."""
        self.profile_span(where)
        loggers.check(self.loggers, self.tensorboard, where.of("log.loggers"), where.search)
