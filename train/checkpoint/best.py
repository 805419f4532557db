"""The best k checkpoints by an evaluation metric (``checkpoint.keep_best``), kept beside
the newest N.

At every evaluation the loop asks :meth:`BestCheckpoints.consider` whether this step's
metric enters the best k; if so it checkpoints at this boundary (whatever
``checkpoint.every`` says). The ranking travels in every checkpoint's metadata
(``best_checkpoints``), so a resumed run ranks exactly as the uninterrupted one, and the
newest-N rotation (``store._keep_newest``) never removes a step in it. ``find`` reads the
ranking back for ``train.load_run(dir, which="best")``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ConfigError
from . import store

META_KEY = "best_checkpoints"  # checkpoint metadata: JSON {monitor, mode, k, best: [...]}
WHICH = ("latest", "last", "best")  # train.load_run(which=...) ("last" = "latest"), --best


class BestCheckpoints:
    """The best ``k`` evaluated steps by ``monitor`` (``mode`` min or max), best first."""

    def __init__(self, k: int, monitor: str, mode: str):
        self.k, self.monitor, self.mode = k, monitor, mode
        self.entries: list[dict] = []  # [{"step": int, "value": float}], best first

    def __bool__(self) -> bool:
        return self.k > 0

    def _rank(self, entry: dict) -> tuple:
        sign = 1.0 if self.mode == "min" else -1.0
        return (sign * entry["value"], entry["step"])  # ties: the earlier step ranks first

    def consider(self, step: int, metrics: dict) -> bool:
        """Whether ``step`` (just evaluated, ``metrics``) enters the best k: it is then
        ranked, and the step must be checkpointed now. A non-finite value never enters."""
        if not self or self.monitor not in metrics:
            return False
        value = float(metrics[self.monitor])
        if not math.isfinite(value):
            return False
        new = {"step": int(step), "value": value}
        ranked = sorted([e for e in self.entries if e["step"] != step] + [new], key=self._rank)
        self.entries = ranked[: self.k]
        return new in self.entries

    def steps(self) -> set[int]:
        """The steps the rotation must keep."""
        return {e["step"] for e in self.entries}

    def state(self) -> str:
        """The ranking as checkpoint metadata (JSON)."""
        return json.dumps(
            {"monitor": self.monitor, "mode": self.mode, "k": self.k, "best": self.entries}
        )

    def load(self, text: str | None, where: str) -> None:
        """The ranking of the checkpoint a run resumes from (none: start empty)."""
        if not text:
            return
        saved = _parse(text, where)
        if (saved["monitor"], saved["mode"]) != (self.monitor, self.mode):
            raise ConfigError(
                f"{where} ranks its best checkpoints by {saved['monitor']} ({saved['mode']}) "
                f"but the config says checkpoint.monitor={self.monitor}, checkpoint.mode="
                f"{self.mode}; keep them, or use --fresh to start over"
            )
        self.entries = sorted(saved["best"], key=self._rank)[: self.k]


def _parse(text: str, where: str) -> dict:
    try:
        saved = json.loads(text)
        best = [{"step": int(e["step"]), "value": float(e["value"])} for e in saved["best"]]
        return {"monitor": str(saved["monitor"]), "mode": str(saved["mode"]), "best": best}
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{where}: its {META_KEY} metadata is not readable") from None


def find(run_dir: Path, which: str) -> Path:
    """The checkpoint ``which`` (``latest``, also spelled ``last``, or ``best``) of the
    run in ``run_dir``."""
    if which not in WHICH:
        raise ConfigError(
            f"train.load_run: which must be one of {', '.join(map(repr, WHICH))}, got {which!r}"
        )
    found = store.list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise ConfigError(f"run {str(run_dir)!r}: no checkpoint in {run_dir / 'checkpoints'}")
    if which in ("latest", "last"):
        return found[-1]
    text = store.read_metadata(found[-1]).get(META_KEY)
    if not text:
        raise ConfigError(
            f"run {str(run_dir)!r} kept no best checkpoints (its config has "
            "checkpoint.keep_best: 0); train with checkpoint.keep_best: k, or load the latest"
        )
    saved = _parse(text, f"checkpoint {found[-1]}")
    by_step = {store.step_of(p): p for p in found}
    for entry in saved["best"]:  # best first; one whose file is gone (a damaged newest
        if entry["step"] in by_step:  # checkpoint resumed past) gives way to the next
            return by_step[entry["step"]]
    raise ConfigError(
        f"run {str(run_dir)!r}: none of its best checkpoints (steps "
        f"{', '.join(str(e['step']) for e in saved['best']) or 'none yet'}) is on disk"
    )
