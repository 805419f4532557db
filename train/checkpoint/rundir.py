"""The run directory: checked before anything is written, opened, and its metrics.jsonl.

``log.dir/name/`` holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON
record per log/eval, written by train/report/loggers.py), ``curves.png`` and
``checkpoints/``. Only process 0 writes it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import ERROR_LOG, ConfigError
from ..schema import dump_yaml
from . import store as ckpt

# Keys in metrics.jsonl that measure time; everything else is deterministic.
TIMING_KEYS = ("time", "examples_per_s", "tokens_per_s", "flops_per_s", "mfu")  # MFU: perf.py


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


def open_run_dir(run_dir: Path, cfg, resume: str, start: int) -> None:
    """Create the run directory, clear it for --fresh, write config.yaml and cut
    metrics.jsonl back to ``start`` (what a resumed run logs again)."""
    ckpt_dir, metrics_path = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    if resume == "fresh" and run_dir.exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        metrics_path.unlink(missing_ok=True)
        (run_dir / ERROR_LOG).unlink(missing_ok=True)  # a failure of the run started over
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt.clean_temporary(ckpt_dir)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    rewrite_metrics(metrics_path, start)
