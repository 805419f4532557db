"""The config's ``checkpoint`` section: how often, how many, the best k, asynchronous
writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schema import Where, choice


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # write a checkpoint every N steps (0: only at the end)
    keep: int = 3  # keep the newest N checkpoints
    # Also keep the best k checkpoints by an evaluation metric (never removed by the
    # newest-N rotation; train.load_run(dir, which="best")); 0: off
    keep_best: int = 0
    monitor: str = "loss"  # keep_best: the evaluation metric that ranks checkpoints
    mode: str = choice("min", ("min", "max"))  # keep_best: min (lower is better) or max
    # Also checkpoint when this many minutes passed since the last checkpoint (checked at
    # the loop's boundaries; the clock restarts when a run resumes); 0: off
    every_minutes: float = 0.0
    # Write checkpoints on a thread while training goes on (the YAML key is `async`, a
    # Python keyword): at most one write in flight, the end of the run waits for the last
    async_: bool = field(default=False, metadata={"key": "async"})

    def check(self, where: Where) -> None:
        where.at_least("checkpoint.", self, ("keep",), 1)
        if self.every < 0:
            raise where.bad("checkpoint.every", f"must be >= 0, got {self.every}")
        if self.keep_best < 0:
            raise where.bad("checkpoint.keep_best", f"must be >= 0 (0: off), got {self.keep_best}")
        if self.every_minutes < 0:
            raise where.bad(
                "checkpoint.every_minutes", f"must be >= 0 (0: off), got {self.every_minutes}"
            )
        if self.keep_best == 0:  # nothing set silently without effect
            for key, v in (("monitor", "loss"), ("mode", "min")):
                if getattr(self, key) != v:
                    raise where.bad(
                        f"checkpoint.{key}",
                        f"ranks the best checkpoints, but checkpoint.keep_best is 0; set "
                        f"checkpoint.keep_best: k (got checkpoint.{key}={getattr(self, key)!r})",
                    )
        if not self.monitor.strip():
            raise where.bad("checkpoint.monitor", "must name an evaluation metric, got ''")
