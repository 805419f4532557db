"""Safetensors files of a Hugging Face model directory, read lazily and written in shards.

Each file is read by nnlite's one safetensors reader (``nl.load``'s, ``SafetensorsFile``): its
JSON header checked against the file, the file memory-mapped, a tensor a numpy view of the
mapped bytes read from disk only when (and where) it is sliced, so loading a model holds at
most the tensor being placed in host memory, not the checkpoint. A sharded
checkpoint (``model.safetensors.index.json`` naming ``model-0000i-of-0000n.safetensors``
files) is read file by file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..core._save import _DTYPES, SafetensorsFile

__all__ = ["SafetensorsDir", "open_file", "write_safetensors"]

_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def open_file(path: Path, error: type[Exception]) -> SafetensorsFile:
    """``path`` read by nnlite's one safetensors reader, its errors ``error``s naming it."""
    return SafetensorsFile(path, error=error, where=str(path))


class SafetensorsDir:
    """The weights of a model directory by name, file by file.

    ``files()`` yields ``(file, names)`` so a loader can place one file's tensors and drop its
    map before opening the next."""

    def __init__(self, directory: str | os.PathLike, error: type[Exception] = ValueError):
        d = Path(directory)
        self.error = error
        self.where: dict[str, str] = {}
        if (d / INDEX).is_file():
            self.where = self._index(d / INDEX, error)
        elif (d / SINGLE).is_file():
            f = open_file(d / SINGLE, error)
            self.where = dict.fromkeys(f.entries, str(d / SINGLE))
        else:
            pickled = sorted(p.name for p in d.glob("*.bin")) if d.is_dir() else []
            hint = (
                f" (it has {pickled[0]}, a pickle: nnlite reads no pickle; convert it to "
                "safetensors with transformers' save_pretrained(safe_serialization=True))"
                if pickled
                else ""
            )
            raise error(f"{d}: no {SINGLE} nor {INDEX}{hint}")
        self._open: dict[str, SafetensorsFile] = {}

    @staticmethod
    def _index(path: Path, error: type[Exception]) -> dict[str, str]:
        """``{tensor: file}`` of a sharded checkpoint's index; every shard it names must be
        there."""
        try:
            index = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise error(f"{path}: not a safetensors index (not JSON: {e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise error(f"{path}: not a safetensors index (no weight_map of tensor -> file)")
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:
                raise error(f"{path}: shard {shard!r} is not a file name in the directory")
            if not (path.parent / shard).is_file():
                raise error(f"{path}: shard {shard} is missing from {path.parent}")
        return {k: str(path.parent / v) for k, v in weight_map.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def file_of(self, name: str) -> str:
        return self.where[name]

    def _file(self, name: str) -> SafetensorsFile:
        path = self.where[name]
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = open_file(Path(path), self.error)
        if name not in f.entries:
            raise self.error(f"{path}: the index names {name!r} in this file, it is not there")
        return f

    def tensor(self, name: str) -> np.ndarray:
        return self._file(name).tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from its file's header (nothing read)."""
        return self._file(name).entries[name][1]

    def check(self) -> None:
        """Open every file's header (each checked against its file): a broken shard is an
        error now, before any tensor is read."""
        for name in {v: k for k, v in self.where.items()}.values():
            self._file(name)

    def close(self, path: str | None = None) -> None:
        """Drop the map of ``path`` (every file when None)."""
        for p in [path] if path else list(self._open):
            f = self._open.pop(p, None)
            if f is not None:
                f.close()


def _chunks(tensors: dict[str, np.ndarray], max_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    chunk: dict[str, np.ndarray] = {}
    size = 0
    for name, a in tensors.items():
        if chunk and size + a.nbytes > max_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = a
        size += a.nbytes
    if chunk:
        yield chunk


def _write_one(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, a in tensors.items():
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_safetensors(
    directory: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or, past ``max_shard_bytes``, as
    ``model-0000i-of-0000n.safetensors`` files and their index; returns the files written."""
    d = Path(directory)
    meta = {"format": "pt"}  # what transformers expects of a PyTorch model's weights
    chunks = [tensors] if max_shard_bytes is None else list(_chunks(tensors, max_shard_bytes))
    if len(chunks) <= 1:
        _write_one(d / SINGLE, tensors, meta)
        return [SINGLE]
    n = len(chunks)
    names, weight_map = [], {}
    for i, chunk in enumerate(chunks):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        _write_one(d / name, chunk, meta)
        names.append(name)
        weight_map.update(dict.fromkeys(chunk, name))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / INDEX).write_text(json.dumps(index, indent=2))
    return [*names, INDEX]
