"""Safetensors files of a Hugging Face model directory, read lazily and written in shards.

A reader parses each file's JSON header and memory-maps the file: a tensor is a numpy view
of the mapped bytes, read from disk only when (and where) it is sliced, so loading a model
holds at most the tensor being placed in host memory, not the checkpoint. A sharded
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

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsDir", "write_safetensors"]

_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
}  # fmt: skip
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class _File:
    """One safetensors file: its header, and its tensors as views of a memory map."""

    def __init__(self, path: Path, error: type[Exception]):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise error(f"{path}: not a readable safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self.header, self.start = header, 8 + n
        self._map: np.memmap | None = None

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, "r")
        raw = self._map[self.start + begin : self.start + end]
        return raw.view(dtype).reshape(info["shape"])

    def close(self) -> None:
        self._map = None  # the views still alive keep their own reference to the map


class SafetensorsDir:
    """The weights of a model directory by name, file by file.

    ``files()`` yields ``(file, names)`` so a loader can place one file's tensors and drop its
    map before opening the next."""

    def __init__(self, directory: str | os.PathLike, error: type[Exception] = ValueError):
        d = Path(directory)
        self.error = error
        self.where: dict[str, str] = {}
        if (d / INDEX).is_file():
            try:
                weight_map = json.loads((d / INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise error(f"{d / INDEX}: not a safetensors index ({e})") from None
            self.where = {k: str(d / v) for k, v in weight_map.items()}
        elif (d / SINGLE).is_file():
            f = _File(d / SINGLE, error)
            self.where = dict.fromkeys(f.header, str(d / SINGLE))
        else:
            pickled = [p for p in ("pytorch_model.bin", "model.bin") if (d / p).exists()]
            hint = (
                f" (it has {pickled[0]}, a pickle: nnlite reads no pickle; convert it to "
                "safetensors with transformers' save_pretrained(safe_serialization=True))"
                if pickled
                else ""
            )
            raise error(f"{d}: no {SINGLE} nor {INDEX}{hint}")
        self._open: dict[str, _File] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def file_of(self, name: str) -> str:
        return self.where[name]

    def tensor(self, name: str) -> np.ndarray:
        path = self.where[name]
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = _File(Path(path), self.error)
        if name not in f.header:
            raise self.error(f"{path}: the index names {name!r} in this file, it is not there")
        return f.tensor(name)

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
