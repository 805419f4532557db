"""A directory written aside and renamed into place: what ``--out`` of prepare goes through.

Work happens in ``.<name>.prepare-<pid>-<random>`` beside the destination; ``commit``
fsyncs it and renames it to the destination, so a process killed at any moment leaves
either the complete directory or a staging one, never a half-written destination.
``clean_leftovers`` removes the staging directories whose process is gone (SIGKILLed
runs) and leaves those of running processes alone.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ...errors import ConfigError

_STAGING = re.compile(r"^\.(?P<name>.+)\.(prepare|replaced)-(?P<pid>\d+)-[0-9a-f]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_leftovers(out: Path) -> list[Path]:
    """Remove the staging directories of ``out`` left by killed runs (their process is gone)."""
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _STAGING.match(p.name)
        if (
            m
            and m["name"] == out.name
            and int(m["pid"]) != os.getpid()
            and not _alive(int(m["pid"]))
        ):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def check_out(out: Path, force: bool) -> None:
    """``--out`` must be a new or empty directory (or any directory with ``--force``)."""
    where = f"--out {str(out)!r}"
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ConfigError(f"{where}: exists and is not a directory; expected a directory")
        if not force and any(out.iterdir()):
            raise ConfigError(
                f"{where}: exists and is not empty; choose another directory or use --force "
                "to replace it"
            )
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{where}: {parent} is not a directory")
            break


def create(out: Path) -> tuple[Path, list[Path]]:
    """``(a new staging directory for out, the leftovers removed meanwhile)``."""
    where = f"--out {str(out)!r}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        removed = clean_leftovers(out)
        path = out.parent / f".{out.name}.prepare-{os.getpid()}-{os.urandom(4).hex()}"
        path.mkdir()
    except OSError as e:
        raise ConfigError(f"{where}: cannot create a directory beside it ({e.strerror})") from None
    return path, removed


def commit(staging: Path, out: Path, force: bool) -> None:
    """Rename the complete ``staging`` directory to ``out`` (replacing it with ``force``)."""
    _fsync(staging)
    check_out(out, force)  # again: it may have appeared meanwhile
    old = None
    if out.exists() and any(out.iterdir()):
        old = out.parent / f".{out.name}.replaced-{os.getpid()}-{os.urandom(4).hex()}"
        os.rename(out, old)
    os.replace(staging, out)  # replaces an empty directory
    _fsync(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
