"""The run directory: checked before anything is written, opened, and its metrics.jsonl.

``log.dir/name/`` holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON
record per log/eval), ``curves.png`` and ``checkpoints/``. Only process 0 writes it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TextIO

import numpy as np

from ..config import Config, dump_yaml
from ..errors import ConfigError
from . import store as ckpt

# Keys in metrics.jsonl that measure time; everything else is deterministic.
TIMING_KEYS = ("time", "examples_per_s", "tokens_per_s")


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that cannot be written as a run needs it, before anything
    is written (a file where a directory must be, a directory that is read-only)."""
    log_dir = run_dir.parent
    expected = {
        log_dir: "a directory (log.dir)",
        run_dir: "the run directory (log.dir/name)",
        run_dir / "checkpoints": "the checkpoint directory",
    }
    for path, what in expected.items():
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{path} is a file, but it must be {what}; move it away")
    for name in ("metrics.jsonl", "config.yaml", "curves.png"):
        if (run_dir / name).is_dir():
            raise ConfigError(f"{run_dir / name} is a directory, but the run writes a file there")
    existing = next(p for p in (run_dir / "checkpoints", run_dir, *run_dir.parents) if p.exists())
    for path in {existing, *(p for p in (run_dir, run_dir / "checkpoints") if p.exists())}:
        _probe_writable(path)


def _probe_writable(directory: Path) -> None:
    """Create and remove a file in ``directory`` (what counts, for root and read-only
    mounts alike, is whether a write works)."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".nnlite-probe-")
    except OSError as e:
        raise ConfigError(
            f"cannot write in {directory} ({e.strerror}); the run needs it writable (log.dir)"
        ) from None
    os.close(fd)
    os.unlink(name)


def read_metrics(path: Path) -> list[tuple[str, dict]]:
    """``(line, record)`` for each complete line of metrics.jsonl; a torn last line (a kill
    mid-write) is dropped."""
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append((ln, json.loads(ln)))
        except json.JSONDecodeError:
            continue  # only a write cut short by a kill leaves a line like this
    return out


def rewrite_metrics(path: Path, upto_step: int) -> None:
    """Drop metrics logged after ``upto_step`` (they will be logged again) and torn lines."""
    if not path.exists():
        return
    kept = [ln for ln, record in read_metrics(path) if record["step"] <= upto_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def open_run_dir(run_dir: Path, cfg: Config, resume: str, start: int) -> None:
    """Create the run directory, clear it for --fresh, write config.yaml and cut
    metrics.jsonl back to ``start`` (what a resumed run logs again)."""
    ckpt_dir, metrics_path = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    if resume == "fresh" and run_dir.exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        metrics_path.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.clean_temporary(ckpt_dir)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    rewrite_metrics(metrics_path, start)


class MetricsLog:
    """Where a run's records go: ``metrics.jsonl`` (one JSON object per line, strict JSON:
    a non-finite value is written as null) and, with ``log.tensorboard``, TensorBoard
    event files in ``<run dir>/tensorboard`` (``<split>/<metric>`` scalars by step; a
    resumed run purges the events after its starting step)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, start: int = 0):
        self.file: TextIO | None = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start or None)

    def write(self, record: dict) -> None:
        record = {
            k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in record.items()
        }
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            split, step = record["split"], record["step"]
            for k, v in record.items():
                if k not in ("step", "split") and isinstance(v, (int, float)) and v is not None:
                    self.tb.add_scalar(f"{split}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def check_tensorboard() -> None:
    """ConfigError unless the optional TensorBoard writer is installed."""
    import importlib.util

    if importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(
            "log.tensorboard=true needs the tensorboardX package: pip install 'nnlite[tensorboard]'"
        )
