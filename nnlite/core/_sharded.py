"""``nl.save_sharded``: a checkpoint of sharded arrays that no process gathers, read back
by ``nl.load`` whole or placed shard by shard on any other sharding.

A sharded checkpoint is a directory of safetensors files written by ``nl.save``'s atomic
writer::

    ckpt_00000100.shards/
        shards_00000.safetensors   # process 0: the replica-0 shards its devices hold
        shards_00001.safetensors   # process 1: its own
        index.safetensors          # written last: no tensors; every leaf's dtype and shape,
                                   # the number of processes, the caller's metadata

Each process writes only the shards of its own devices whose ``replica_id`` is 0, so a
replicated leaf is stored once and no array is ever assembled in one process. A shard's
key is ``<n>:<leaf key>``; the file's metadata ``shards`` maps it to its leaf key and its
global index (``[[start, stop], ...]`` per dimension), and its ``checksums`` hold each
shard's CRC-32 (as ``nl.save``'s do), checked whenever a shard is read. Leaves that are not
``jax.Array`` (numpy arrays, Python numbers) are written whole by process 0.

The directory is written under ``<name>.tmp`` and renamed to ``<name>`` once the index is
in it, so a process killed at any moment leaves the previous checkpoint and a ``.tmp``
directory, never a directory that looks complete. Several processes write into one
directory: they need a shared file system and a ``barrier`` between the phases.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _save
from ._save import (
    CHECKSUMS,
    EMPTY,
    CheckpointCorruptError,
    CheckpointError,
    _File,
    _fsync_dir,
    _key,
    _write_atomically,
    checksums_json,
    empty_nodes,
    safetensors_bytes,
)

__all__ = ["INDEX", "is_sharded", "save_sharded"]

_FORMAT = "nnlite.sharded"
_FORMAT_VERSION = "1"
INDEX = "index.safetensors"  # the file whose presence makes the directory a checkpoint
_OWN_META = ("format", "format_version", "leaves", "processes", CHECKSUMS, EMPTY)


def _shard_file(process: int) -> str:
    return f"shards_{process:05d}.safetensors"


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by :func:`save_sharded`."""
    return Path(path).is_dir()


def _bounds(index: tuple, shape: tuple) -> list[list[int]]:
    """A shard's index (a tuple of slices) as ``[[start, stop], ...]`` per dimension."""
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise CheckpointError(f"nl.save_sharded: a shard with stride {step} is not supported")
        out.append([start, stop])
    return out


def _host(value: Any, key: str) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype.kind not in "biuf" and a.dtype != jnp.bfloat16:
        raise CheckpointError(
            f"nl.save_sharded: {key!r} is a {type(value).__name__} of dtype {a.dtype}; only "
            "arrays and numbers of bool, integer or float dtypes can be saved"
        )
    return np.array(a, order="C")


def _own_shards(tree: Any) -> tuple[dict, dict, dict]:
    """``(tensors, shards, leaves)`` of this process: the replica-0 shards its devices hold
    (``n:key -> array``), each one's ``[leaf key, bounds]``, and every leaf's dtype and shape."""
    me = jax.process_index()
    tensors, shards, leaves = {}, {}, {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = _key(p)
        if key in leaves:
            raise CheckpointError(f"nl.save_sharded: two leaves of the tree have the path {key!r}")
        if isinstance(leaf, jax.Array):
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
            pieces = [
                (s.data, _bounds(s.index, shape))
                for s in leaf.addressable_shards
                if s.replica_id == 0
            ]
        else:
            whole = _host(leaf, key)
            shape, dtype = whole.shape, whole.dtype
            pieces = [(whole, [[0, n] for n in shape])] if me == 0 else []
        leaves[key] = [dtype.name, list(shape)]
        for data, bounds in pieces:
            name = f"{len(shards)}:{key}"
            tensors[name] = _host(data, key)
            shards[name] = [key, bounds]
    return tensors, shards, leaves


def save_sharded(
    path: str | os.PathLike,
    tree: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    barrier: Callable[[str], None] | None = None,
) -> Path:
    """Write ``tree`` as a sharded checkpoint directory: each process writes the shards
    its own devices hold, and nothing is gathered (see the module docstring).

    Args:
        path: the directory to write (its parent must exist); replaced if it exists.
        tree: a pytree of ``jax.Array`` s sharded any way (``NamedSharding``, one device,
            replicated), numpy arrays and numbers: params, an optimizer state, a dict of
            several named trees.
        metadata: extra ``str -> str`` entries of the index, read back by
            ``nl.load_metadata(path)``.
        barrier: ``barrier(name)`` returns once every process has called it with ``name``
            (with a time limit of its own); required with several processes, which must
            all call ``save_sharded`` with the same ``path`` and tree structure.

    Returns:
        ``path``, as a ``pathlib.Path``, once the checkpoint is complete.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> import nnlite as nl
        >>> mesh = jax.make_mesh((len(jax.devices()),), ("x",))
        >>> W = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P("x")))
        >>> path = nl.save_sharded(tempfile.mkdtemp() + "/ckpt.shards", {"W": W})
        >>> nl.load(path)["W"].shape  # read back whole, in one process
        (8, 3)
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise CheckpointError(f"nl.save_sharded: directory {path.parent} does not exist")
    if jax.process_count() > 1 and barrier is None:
        raise CheckpointError(
            f"nl.save_sharded: {jax.process_count()} processes write {path} together; pass "
            "barrier= (a function that returns when every process has called it)"
        )
    sync = barrier or (lambda name: None)
    meta = {"format": _FORMAT, "format_version": _FORMAT_VERSION}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(
                f"nl.save_sharded: metadata must map str to str, got {k!r}: {v!r}"
            )
        if k in _OWN_META:
            raise CheckpointError(f"nl.save_sharded: metadata key {k!r} is nl's own; rename it")
        meta[k] = v
    tensors, shards, leaves = _own_shards(tree)  # before any file: bad leaves write nothing
    tmp = path.with_name(path.name + ".tmp")
    main = jax.process_index() == 0
    if main:  # a directory left by an interrupted write of the same step
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    sync(f"{path.name}:begin")
    meta_shards = {"shards": json.dumps(shards), CHECKSUMS: checksums_json(tensors)}
    data = safetensors_bytes(tensors, meta_shards)
    _write_atomically(tmp / _shard_file(jax.process_index()), data)
    sync(f"{path.name}:shards")
    if main:
        meta |= {"leaves": json.dumps(leaves), "processes": str(jax.process_count())}
        empties = empty_nodes(tree)
        if empties:  # what nl.load(like=None) puts back (see _save.EMPTY)
            meta[EMPTY] = json.dumps(empties, sort_keys=True)
        _write_atomically(tmp / INDEX, safetensors_bytes({}, meta))
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    sync(f"{path.name}:done")
    return path


def _looks_sharded(path: Path) -> bool:
    """A directory ``save_sharded`` wrote, or began to (its name or its shard files)."""
    return path.name.endswith((".shards", ".shards.tmp")) or any(path.glob("shards_*"))


def _not_a_checkpoint(path: Path) -> str:
    """The line for a directory given as a checkpoint that is none: which file to give."""
    inside = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = sorted(
        p.name
        for p in inside.glob("*")
        if p.name.endswith(".safetensors") or (p.is_dir() and p.name.endswith(".shards"))
    )
    if found:
        newest = inside / found[-1]
        hint = f"it holds {len(found)} checkpoint(s), the last by name {newest}: give one of them"
    else:
        hint = "it holds no checkpoint (ckpt_*.safetensors); give a checkpoint file"
    if inside != path:
        hint += f" (a training run: nnlite.train.load_run({str(path)!r}) loads its newest)"
    return f"checkpoint {path}: a directory, not a checkpoint; {hint}"


class ShardedFile:
    """An open sharded checkpoint: the same reading interface as ``_File`` (``keys``,
    ``spec``, ``read``, ``meta``), reading each leaf, or a region of it, from the shards
    that overlap it."""

    def __init__(self, path: Path):
        self.path = path
        self._open: list = []
        try:
            self._read_tables(path)
        except BaseException:
            self.close()
            raise

    def _read_tables(self, path: Path) -> None:
        index = path / INDEX
        if not index.is_file() and not _looks_sharded(path):
            raise CheckpointError(_not_a_checkpoint(path))
        if not index.is_file():
            raise CheckpointCorruptError(
                f"checkpoint {path}: a directory, not a safetensors file nor a complete "
                f"sharded checkpoint (it has no {INDEX})"
            )
        meta = self._file(index).meta
        if meta.get("format") != _FORMAT:
            raise CheckpointError(
                f"checkpoint {path}: {INDEX} has format {meta.get('format')!r}, expected {_FORMAT!r}"
            )
        if meta.get("format_version") != _FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path}: format_version {meta.get('format_version')!r}; this nnlite "
                f"reads format_version {_FORMAT_VERSION!r}; upgrade nnlite"
            )
        try:
            leaves = json.loads(meta["leaves"])
            n = int(meta["processes"])
            self.specs = {
                k: (tuple(int(d) for d in shape), np.dtype(jnp.dtype(dtype)))
                for k, (dtype, shape) in leaves.items()
            }
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointCorruptError(
                f"checkpoint {path}: {INDEX} has a bad leaf table ({e})"
            ) from None
        self.meta = {k: v for k, v in meta.items() if k not in ("leaves", CHECKSUMS)}
        self.keys = {k: k for k in self.specs}
        self.pieces: dict[str, list] = {k: [] for k in self.specs}
        for p in range(n):
            f = self._file(path / _shard_file(p))
            try:
                table = json.loads(f.meta.get("shards", "{}"))
                for name, (key, bounds) in table.items():
                    self.pieces[key].append((f, name, [tuple(b) for b in bounds]))
            except (KeyError, ValueError, TypeError) as e:
                raise CheckpointCorruptError(
                    f"checkpoint {f.path}: a bad shard table ({e})"
                ) from None
        for key, (shape, _) in self.specs.items():
            covered = sum(math.prod(b - a for a, b in bounds) for _, _, bounds in self.pieces[key])
            if covered != math.prod(shape):
                raise CheckpointCorruptError(
                    f"checkpoint {path}: the shards of {key!r} hold {covered} of its "
                    f"{math.prod(shape)} elements"
                )

    def _file(self, p: Path) -> _File:
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            raise CheckpointCorruptError(f"checkpoint {self.path}: {p.name} is missing") from None
        self._open.append(f)
        return _File(p, f)

    def close(self) -> None:
        for f in self._open:
            f.close()

    def spec(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        return self.specs[key]

    def verify(self) -> None:
        """Read every shard once, checking its checksum."""
        for pieces in self.pieces.values():
            for f, name, _ in pieces:
                f.read(name)

    def read(self, key: str, region: tuple | None = None) -> np.ndarray:
        """Leaf ``key``, or its ``region`` (a tuple of slices, as a sharding's index)."""
        shape, dtype = self.specs[key]
        want = _bounds(region or (), shape)
        out = np.empty([b - a for a, b in want], dtype)
        for f, name, have in self.pieces[key]:
            lo = [max(a, c) for (a, _), (c, _) in zip(want, have, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(want, have, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)) and math.prod(shape):
                continue
            piece = f.read(name)
            src = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, have, strict=True))
            dst = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, want, strict=True))
            out[dst] = piece[src]
        return out


_save.DIRECTORY_READER = ShardedFile
