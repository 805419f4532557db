"""The config's ``train`` and ``eval`` sections: the loop's cadences, precision, fault
handling and evaluation. No JAX here (the config is read before JAX imports)."""

from __future__ import annotations

from dataclasses import dataclass

from ..callbacks import EarlyStoppingConfig
from ..model.metrics import check_specs
from ..schema import Where, choice

NONFINITE = ("stop", "skip")
PRECISIONS = ("float32", "bfloat16", "float16")  # train.precision (train/step/precision.py)
# optax counts steps in int32 (schedules go wrong past it); at 10^5 steps/s that is 6 hours.
MAX_STEPS = 2**31 - 1


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 128  # global batch (split over devices)
    steps: int = 1000  # optimizer steps in total
    eval_every: int = 200  # evaluate on the test set every N steps (and at the end)
    log_every: int = 50  # write train metrics every N steps
    steps_per_call: int = 1  # optimizer steps per compiled call (lax.scan) when > 1
    grad_accum_steps: int = 1  # microbatches summed into one update (divides per-device batch)
    # A step whose loss, gradients or new params are not finite: "stop" the run (exit 4,
    # naming the step and the first bad leaf) or "skip" its update and count it.
    nonfinite: str = choice("stop", NONFINITE)
    # Seconds within which every compiled call must finish, else every process ends with
    # exit 5 naming the step (a stuck collective, a hung peer). null: automatic (the first
    # call may take STARTUP_TIMEOUT_S, later ones max(STEP_TIMEOUT_FLOOR_S, 20 x the first
    # call's time)); 0: no watchdog.
    step_timeout: float | None = None
    # Debugging: train on the same N batches (the first N of the data order) again and
    # again, and evaluate on them; the loss of a model that can learn goes to ~0. 0: off.
    overfit_batches: int = 0
    # Stop when an evaluation metric stops improving: {monitor: loss, mode: min, patience: 3,
    # min_delta: 0.0}, the same as callbacks: [{name: early_stopping, ...}]; null: off
    early_stopping: EarlyStoppingConfig | None = None
    # Compute dtype of the step and evaluation: params, optimizer state and loss stay
    # float32; float16 adds dynamic loss scaling starting at loss_scale (train/step/precision.py).
    precision: str = choice("float32", PRECISIONS)
    loss_scale: float = 32768.0  # float16: the initial dynamic loss scale (>= 1)
    # An exponential moving average of the params, kept in float32 in the optimizer state
    # (checkpointed, sharded like the params) and updated inside the step; null: none
    ema_decay: float | None = None
    # issue 34: before step 0, check every hand rule the model runs against jax.vjp at the
    # run's shapes, dtype and strategy, print a per-layer table, refuse a wrong rule
    check_grads: bool = False

    def check(self, where: Where) -> None:
        counts = ("batch_size", "steps", "eval_every", "log_every", "steps_per_call")
        where.at_least("train.", self, (*counts, "grad_accum_steps"), 1)
        if self.steps > MAX_STEPS:
            raise where.bad(
                "train.steps",
                f"must be at most {MAX_STEPS} (the optimizer counts steps in int32), "
                f"got {self.steps}",
            )
        if self.overfit_batches < 0:
            raise where.bad(
                "train.overfit_batches", f"must be >= 0 (0: off), got {self.overfit_batches}"
            )
        if self.step_timeout is not None and self.step_timeout < 0:
            raise where.bad(
                "train.step_timeout",
                f"must be >= 0 seconds (0: no watchdog, null: automatic), got {self.step_timeout}",
            )
        if not 1.0 <= self.loss_scale <= 2.0**100:
            raise where.bad(
                "train.loss_scale",
                "must be between 1 and 2**100 (float16's initial loss scale), "
                f"got {self.loss_scale}",
            )
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise where.bad(
                "train.ema_decay", f"must be in (0, 1) (e.g. 0.999), got {self.ema_decay}"
            )
        if self.early_stopping is not None:
            self.early_stopping.check(where)


@dataclass(frozen=True)
class EvalConfig:
    # Your metrics, each "module:function" with function(outputs, labels) -> a value per
    # example or one for the batch, computed in the compiled evaluation and logged under
    # the function's name (train/model/metrics.py)
    metrics: tuple[str, ...] = ()
    use_ema: bool = False  # evaluate the params' moving average (needs train.ema_decay)

    def check(self, where: Where) -> None:
        """A user's metric is imported now, like a model."""
        check_specs(self.metrics, where.search, where.of("eval.metrics"))
