"""``nnlite-train verify PATH [PATH ...]``: are a run's checkpoints intact?

Each PATH is a run directory (every checkpoint in its ``checkpoints/``), a checkpoints
directory, or one checkpoint (a ``.safetensors`` file or a sharded ``.shards``
directory). Every tensor is read back against the checksum written with it
(``nl.verify``), one tensor at a time; one line per checkpoint. Resuming does the same
check and falls back to the newest intact checkpoint (docs/faults.md).

Exit statuses: 0 every checkpoint intact, 1 one is damaged (its line names the file and
the tensor), 2 bad input (no such path, nothing to check there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nnlite as nl

from . import faults
from .checkpoint import store
from .config import ArgumentParser
from .errors import ConfigError, not_found


def parse_args(argv):
    ap = ArgumentParser(
        prog="nnlite-train verify",
        description="Check checkpoints against the checksums written with them, tensor by "
        "tensor (nl.verify); one line per checkpoint.",
        epilog="exit statuses: 0 all intact, 1 a checkpoint is damaged, 2 bad input",
    )
    ap.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a run directory (all its checkpoints), its checkpoints/ directory, or one "
        "checkpoint (a .safetensors file or a .shards directory)",
    )
    return ap.parse_args(argv)


def checkpoints_of(path: Path) -> list[Path]:
    """The checkpoints ``path`` names, oldest first (ConfigError: none there)."""
    if not path.exists():
        raise ConfigError(not_found(path, "no such file or directory"))
    if path.is_file() or store.is_sharded(path):
        return [path]
    for directory in (path / "checkpoints", path):
        found = store.list_checkpoints(directory)
        if found:
            return found
    raise ConfigError(
        f"{path}: no checkpoint there (expected a run directory, a checkpoints/ directory, "
        "or a ckpt_*.safetensors file)"
    )


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        todo = [(p, checkpoints_of(Path(p))) for p in args.paths]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return faults.EXIT_BAD_INPUT

    damaged = 0
    for _, paths in todo:
        for path in paths:
            try:
                nl.verify(path)
            except nl.CheckpointError as e:
                damaged += 1
                print(f"damaged: {' '.join(str(e).split())}")
            else:
                print(f"intact: {path}")
    total = sum(len(paths) for _, paths in todo)
    if damaged:
        print(f"{damaged} of {total} checkpoint(s) damaged", file=sys.stderr)
        return faults.EXIT_FAILURE
    return faults.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
