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


def _foreign(head: bytes) -> str:
    """What a file that is not safetensors looks like, from its first bytes."""
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch .bin/.pt checkpoint?)"
    if head[:1] == b"\x80":
        return "a pickle (a PyTorch .bin checkpoint?)"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer (the weights were not downloaded: git lfs pull)"
    if head.startswith((b"{", b"<", b"#")) or head.isascii():
        return "text"
    return "not safetensors"


class _File:
    """One safetensors file: its header, and its tensors as views of a memory map.

    The header is checked against the file when it is opened (every tensor's dtype, shape
    and byte range, and the file long enough to hold them), so a truncated, empty or
    foreign file is one error naming it before any tensor is read."""

    def __init__(self, path: Path, error: type[Exception]):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise error(
                        f"{path}: not a safetensors file: {size} bytes (empty or truncated)"
                    )
                (n,) = struct.unpack("<Q", head)
                if n > 100_000_000:  # no header is that long: another kind of file
                    raise error(
                        f"{path}: not a safetensors file ({_foreign(head)}: its first 8 "
                        f"bytes give a header of {n} bytes)"
                    )
                if n > size - 8:
                    raise error(
                        f"{path}: truncated: {size} bytes, shorter than its {n}-byte header "
                        "(download or copy it again)"
                    )
                header = json.loads(f.read(n))
        except OSError as e:
            raise error(f"{path}: cannot read ({e.strerror or e})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise error(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise error(f"{path}: not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        self.header, self.start = header, 8 + n
        self._check(size, error)
        self._map: np.memmap | None = None

    def _check(self, size: int, error: type[Exception]) -> None:
        end = 0
        for name, info in self.header.items():
            try:
                dtype = np.dtype(_DTYPES[info["dtype"]])
                shape = [int(d) for d in info["shape"]]
                begin, stop = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise error(
                    f"{self.path}: tensor {name!r} has a bad header entry {info!r} (dtypes: "
                    f"{', '.join(_DTYPES)})"
                ) from None
            need = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            if stop - begin != need or begin < 0:
                raise error(
                    f"{self.path}: tensor {name!r} ({info['dtype']} {shape}) needs {need} bytes, "
                    f"its header gives bytes {begin}..{stop}"
                )
            end = max(end, stop)
        if self.start + end > size:
            raise error(
                f"{self.path}: truncated: {size} bytes, its header describes "
                f"{self.start + end} (download or copy it again)"
            )

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, "r")
        raw = self._map[self.start + begin : self.start + end]
        return raw.view(dtype).reshape(info["shape"])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

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
            self.where = self._index(d / INDEX, error)
        elif (d / SINGLE).is_file():
            f = _File(d / SINGLE, error)
            self.where = dict.fromkeys(f.header, str(d / SINGLE))
        else:
            pickled = sorted(p.name for p in d.glob("*.bin")) if d.is_dir() else []
            hint = (
                f" (it has {pickled[0]}, a pickle: nnlite reads no pickle; convert it to "
                "safetensors with transformers' save_pretrained(safe_serialization=True))"
                if pickled
                else ""
            )
            raise error(f"{d}: no {SINGLE} nor {INDEX}{hint}")
        self._open: dict[str, _File] = {}

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

    def _file(self, name: str) -> _File:
        path = self.where[name]
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = _File(Path(path), self.error)
        if name not in f.header:
            raise self.error(f"{path}: the index names {name!r} in this file, it is not there")
        return f

    def tensor(self, name: str) -> np.ndarray:
        return self._file(name).tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from its file's header (nothing read)."""
        return self._file(name).shape(name)

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
