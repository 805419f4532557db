"""``nl.save`` / ``nl.load``: any pytree of arrays (params, optimizer state) as safetensors.

The file is the checkpoint format: one tensor per array leaf, keyed by nnlite's path of
the leaf (``/layers[0]/W``, what ``ParamsDict.print`` shows; ``[0]/mu/layer/W`` inside an
optax state), and string metadata. It is written to a temporary file beside the target,
fsynced and renamed, so a crash leaves the old file or the new one, never half of one.
No pickle: loading needs a template (``like=``) for the structure, or gives a ParamsDict.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from ._params import ParamsDict, format_path

__all__ = ["CheckpointError", "load", "save"]

_FORMAT = "nnlite.save"
_FORMAT_VERSION = "1"
_ROOT = "/"  # the key of a tree that is a single array

# safetensors dtype names -> numpy (numpy's safetensors reader lacks bfloat16).
_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": jnp.bfloat16, "F32": np.float32, "F64": np.float64,
}  # fmt: skip


class CheckpointError(ValueError):
    """A file that ``nl.load`` cannot read, or whose contents do not match ``like``."""


def _flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(format_path(p) or _ROOT, leaf) for p, leaf in leaves], treedef


def _describe(a: Any) -> str:
    return f"{np.dtype(a.dtype).name}{list(np.shape(a))}"


def save(path: str | os.PathLike, tree: Any, *, metadata: Mapping[str, str] | None = None):
    """Write the array leaves of ``tree`` to the safetensors file ``path``, atomically.

    Args:
        path: the file to write (its directory must exist); replaced if it exists.
        tree: a ParamsDict, or any pytree of arrays and numbers (an optimizer state, a
            tuple of both). Strings in a ParamsDict are static, not saved.
        metadata: extra ``str -> str`` entries for the file's header.

    Returns:
        The path written, as a ``pathlib.Path``.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import nnlite as nl
        >>> params = nl.ParamsDict(layer=nl.ParamsDict(W=jnp.ones((2, 3)), b=jnp.zeros(3)))
        >>> path = nl.save(tempfile.mkdtemp() + "/params.safetensors", params)
        >>> nl.load(path, like=params).layer.W.shape
        (2, 3)
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"nl.save: {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise CheckpointError(f"nl.save: directory {path.parent} does not exist")
    tensors = {}
    for key, leaf in _flatten(tree)[0]:
        a = np.asarray(leaf)
        if a.dtype.kind not in "biuf" and a.dtype != jnp.bfloat16:
            raise CheckpointError(
                f"nl.save: {key} is a {type(leaf).__name__} of dtype {a.dtype}; only arrays "
                f"and numbers of bool, integer or float dtypes can be saved"
            )
        tensors[key] = np.array(a, order="C")  # (ascontiguousarray would make 0-d 1-d)
    meta = {"format": _FORMAT, "format_version": _FORMAT_VERSION}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"nl.save: metadata must map str to str, got {k!r}: {v!r}")
        meta[k] = v
    data = safetensors.numpy.save(tensors, metadata=meta)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    return path


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse a safetensors file: ``({key: array}, metadata)``; anything else is refused."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"nl.load: no such file {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"nl.load: {path} is a directory, not a safetensors file") from None
    bad = f"nl.load: {path} is not a safetensors file"
    if len(data) < 8:
        raise CheckpointError(f"{bad} ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CheckpointError(f"{bad} (its first 8 bytes do not give a header length)")
    try:
        header = json.loads(data[8 : 8 + n])
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        body = memoryview(data)[8 + n :]
        tensors = {}
        for key, info in header.items():
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            if not 0 <= start <= end <= len(body) or end - start != dtype.itemsize * int(
                np.prod(shape, dtype=np.int64)
            ):
                raise ValueError(f"tensor {key!r}: data offsets do not match its shape")
            tensors[key] = np.frombuffer(body[start:end], dtype).reshape(shape).copy()
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{bad} (bad header: {e})") from None
    return tensors, meta


def load(path: str | os.PathLike, like: Any = None) -> Any:
    """Read a file written by ``nl.save``, into the structure of ``like``.

    Args:
        path: the safetensors file.
        like: a tree with the structure, shapes and dtypes to restore (e.g. freshly
            initialised params, or ``optimizer.init(params)``). ``None``: the file's paths
            rebuilt as a ParamsDict of arrays (``ParamsDict.from_flat``).

    Returns:
        A tree like ``like`` whose leaves are the file's arrays (``jax.Array`` where
        ``like`` has one, numpy arrays and Python numbers where it has those).

    Raises:
        CheckpointError: the file is missing or not a safetensors file; or it does not
            match ``like``: the message names the first missing or unexpected path (and
            how many there are), or a path whose shape or dtype differs.
    """
    path = Path(path)
    tensors, _ = _read(path)
    if like is None:
        if _ROOT in tensors:
            return jnp.asarray(tensors[_ROOT])
        try:
            flat = ParamsDict.from_flat({k: jnp.asarray(tensors[k]) for k in sorted(tensors)})
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"nl.load: {path}: its keys are not ParamsDict paths ({e}); pass like= to load "
                f"it into another structure"
            ) from None
        return flat
    leaves, treedef = _flatten(like)
    want = [k for k, _ in leaves]
    missing = [k for k in want if k not in tensors]
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} path(s) of `like` missing from the file, first {missing[0]}"
            )
        if extra:
            parts.append(f"{len(extra)} unexpected path(s) in the file, first {extra[0]}")
        raise CheckpointError(
            f"nl.load: {path} does not match `like`: {'; '.join(parts)} (the file has "
            f"{len(tensors)} arrays, `like` {len(want)})"
        )
    out = []
    for key, leaf in leaves:
        value = tensors[key]
        ref = np.asarray(leaf)
        if value.shape != ref.shape or value.dtype != ref.dtype:
            raise CheckpointError(
                f"nl.load: {path}: {key} is {_describe(value)} in the file, `like` has "
                f"{_describe(ref)}"
            )
        if isinstance(leaf, jax.Array):
            value = jnp.asarray(value)
        elif not isinstance(leaf, np.ndarray):  # a Python or numpy scalar
            value = type(leaf)(value.item()) if isinstance(leaf, (bool, int, float)) else value[()]
        out.append(value)
    return jax.tree.unflatten(treedef, out)
