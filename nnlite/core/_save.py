"""``nl.save`` / ``nl.load``: any pytree of arrays (params, optimizer state, several named
trees in one dict) as a safetensors file, the one checkpoint format of nnlite and its trainer.

Keys are nnlite's paths of the leaves without the leading ``/``: ``layers[0]/W`` for a
ParamsDict, ``[0]/mu/layer/W`` inside an optax state, ``params/ffn/W`` and
``opt_state[0]/count`` for ``{"params": ..., "opt_state": ...}``; a tree that is one array
has the key ``/``. Older nl.save files, whose keys began with ``/`` (``/layers[0]/W``),
read the same. Metadata is ``str -> str``, beside nl.save's own ``format``,
``format_version`` and ``checksums``.

``checksums`` maps each tensor's key to the CRC-32 of its bytes (``"crc32:%08x"``), so
bytes changed after writing (a bad disk, a partial copy, finite garbage that still parses)
are refused when read, naming the file and the tensor (``CheckpointCorruptError``).
Files written before checksums existed have none and load unchecked.

A file is written to a temporary name beside the target, flushed, fsynced, renamed over
the target and the directory fsynced, so a crash leaves the old file or the new one, never
half of one. No pickle: loading restores into a template (``like=``), or gives a ParamsDict.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

from ._params import ParamsDict, format_path

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "load",
    "load_metadata",
    "save",
    "verify",
]

_FORMAT = "nnlite.save"
_FORMAT_VERSION = "1"
_ROOT = "/"  # the key of a tree that is a single array
CHECKSUMS = "checksums"  # metadata key: JSON {tensor key: "crc32:%08x"}, see the module doc
# metadata key: JSON {key: "{}" or "[]"}, the tree's nodes that hold no array (a layer
# without params in a Sequential, optax's EmptyState), which nl.load(like=None) puts back
EMPTY = "empty_nodes"
OWN_META = ("format", "format_version", CHECKSUMS, EMPTY)  # nl.save's; never the caller's

# safetensors dtype names -> numpy (numpy's safetensors reader lacks bfloat16).
_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": jnp.bfloat16, "F32": np.float32, "F64": np.float64,
}  # fmt: skip


class CheckpointError(ValueError):
    """A file that ``nl.load`` cannot read, or whose contents do not match ``like``."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose bytes are damaged: truncated, not a safetensors file, a shard
    missing, or a tensor whose checksum does not match the one written with it. An older
    checkpoint may still be intact (the trainer falls back to it when resuming)."""


def checksum(a: np.ndarray) -> str:
    """The checksum of a C-contiguous array's bytes, as stored in ``checksums``."""
    return f"crc32:{zlib.crc32(memoryview(a.reshape(-1).view(np.uint8))) & 0xFFFFFFFF:08x}"


def checksums_json(tensors: Mapping[str, np.ndarray]) -> str:
    return json.dumps({k: checksum(v) for k, v in tensors.items()}, sort_keys=True)


def _key(path: tuple, subtree: str = "") -> str:
    """The file's key of the leaf at JAX key path ``path`` (under ``subtree``)."""
    p = format_path(path)
    if subtree:
        return subtree + p
    return p.removeprefix("/") or _ROOT


def _childless(x: Any) -> bool:
    """An empty container: a pytree node (not None) without children."""
    if x is None:
        return False
    treedef = jax.tree_util.tree_structure(x)
    return treedef.num_leaves == 0 and treedef.num_nodes == 1


def empty_nodes(tree: Any) -> dict[str, str]:
    """The file keys of the containers in ``tree`` that hold nothing (an empty ParamsDict,
    list, dict or NamedTuple: a layer without params, optax's EmptyState), each with its
    kind: ``"[]"`` for a list or tuple, ``"{}"`` for any other. With the arrays' keys they
    give the tree's whole shape (a Sequential of layers without params included)."""
    found = {}
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_childless)[0]:
        if path and _childless(node):
            seq = isinstance(node, list | tuple) and not hasattr(node, "_fields")
            found[_key(path)] = "[]" if seq else "{}"
    return found


def _describe(shape: tuple, dtype: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


# -- writing ----------------------------------------------------------------------------------


def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """``tensors`` and ``metadata`` in the safetensors format (the ``safetensors`` package,
    imported on first use: ``import nnlite`` needs only the design card's packages)."""
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(
            "writing a checkpoint needs safetensors: pip install safetensors "
            "(or pip install 'nnlite[train]')"
        ) from None
    return safetensors.numpy.save(dict(tensors), metadata=metadata)


def save(path: str | os.PathLike, tree: Any, *, metadata: Mapping[str, str] | None = None):
    """Write the array leaves of ``tree`` to the safetensors file ``path``, atomically.

    Args:
        path: the file to write (its directory must exist); replaced if it exists. The
            bytes go to ``<name>.<random>.tmp`` beside it first, renamed when complete.
        tree: a ParamsDict, or any pytree of arrays and numbers (an optimizer state, a
            dict of several named trees such as ``{"params": p, "opt_state": s}``).
            Strings in a ParamsDict are static, not saved.
        metadata: extra ``str -> str`` entries for the file's header (``format`` and
            ``format_version`` are nl.save's own); read back by ``nl.load_metadata``.

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
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = _key(p)
        if isinstance(leaf, jax.Array) and not (
            leaf.is_fully_addressable or leaf.is_fully_replicated
        ):
            raise CheckpointError(
                f"nl.save: {key!r} is spread over several processes ({leaf.sharding}); "
                "write it with nl.save_sharded, where each process writes its own shards"
            )
        a = np.asarray(leaf)
        if a.dtype.kind not in "biuf" and a.dtype != jnp.bfloat16:
            raise CheckpointError(
                f"nl.save: {key!r} is a {type(leaf).__name__} of dtype {a.dtype}; only arrays "
                f"and numbers of bool, integer or float dtypes can be saved"
            )
        if key in tensors:  # e.g. {"a/b": x, "a": {"b": y}}
            raise CheckpointError(f"nl.save: two leaves of the tree have the path {key!r}")
        tensors[key] = np.array(a, order="C")  # (ascontiguousarray would make 0-d 1-d)
    meta = {"format": _FORMAT, "format_version": _FORMAT_VERSION}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"nl.save: metadata must map str to str, got {k!r}: {v!r}")
        if k in OWN_META:
            raise CheckpointError(f"nl.save: metadata key {k!r} is nl.save's own; rename it")
        meta[k] = v
    meta[CHECKSUMS] = checksums_json(tensors)
    empties = empty_nodes(tree)
    if empties:
        meta[EMPTY] = json.dumps(empties, sort_keys=True)
    _write_atomically(path, safetensors_bytes(tensors, meta))
    return path


def _write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, whenever the process dies."""
    # A name of its own per write, so that two writers of one path never share a file;
    # os.open (not mkstemp, whose files are 0600) gives the umask's permissions.
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a crash


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- reading ----------------------------------------------------------------------------------
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


class SafetensorsFile:
    """One safetensors file, the one reader of nnlite's checkpoints (``nl.load``) and of
    Hugging Face weights (``nl.hf``): its metadata, and each tensor's dtype, shape and byte
    range, checked against the file when it is opened, so a truncated, empty or foreign
    file is one error naming it (``where``: ``"checkpoint <path>"`` or ``<path>``, of class
    ``error``) before any tensor is read. Tensors are views of a memory map, read from disk
    only where sliced (:meth:`tensor`), or copies checked against the checksums ``nl.save``
    wrote (:meth:`read`).

    ``keys`` maps each tensor's key to its name in the header: files written before
    ``nl.save`` dropped the leading ``/`` (``/layers[0]/W``) read as ``layers[0]/W``."""

    def __init__(
        self,
        path: Path,
        f: BinaryIO | None = None,
        *,
        error: type[Exception] = CheckpointCorruptError,
        where: str | None = None,
    ):
        self.path, self.error = Path(path), error
        self.where = f"checkpoint {path}" if where is None else where
        try:
            if f is None:
                with open(path, "rb") as opened:
                    header, size = self._header(opened)
            else:
                header, size = self._header(f)
        except OSError as e:
            raise error(f"{self.where}: cannot read ({e.strerror or e})") from None
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise error(
                f"{self.where}: not a safetensors file (its __metadata__ is not str -> str)"
            )
        self.meta: dict[str, str] = meta
        self.entries = {k: self._entry(k, info) for k, info in header.items()}
        end = max((e[3] for e in self.entries.values()), default=0)
        if self.start + end > size:
            raise error(
                f"{self.where}: truncated: {size} bytes, its header describes "
                f"{self.start + end} (download or copy it again)"
            )
        self.sums = self._checksums()
        if meta.get("format") == _FORMAT and meta.get("format_version") != _FORMAT_VERSION:
            raise CheckpointError(
                f"{self.where}: format_version {meta.get('format_version')!r} of a newer "
                f"nnlite; this one reads format_version {_FORMAT_VERSION!r}; upgrade nnlite"
            )
        self.keys: dict[str, str] = {}
        for raw in self.entries:
            key = raw[1:] if raw.startswith("/") and raw != _ROOT else raw
            if key in self.keys:
                raise error(f"{self.where}: {raw!r} and {self.keys[key]!r} clash")
            self.keys[key] = raw
        self._map: np.memmap | None = None

    def _header(self, f: BinaryIO) -> tuple[dict, int]:
        """The JSON header of the open file ``f`` and the file's size; sets ``start``."""
        size, where, error = os.fstat(f.fileno()).st_size, self.where, self.error
        head = f.read(8)
        if len(head) < 8:
            raise error(f"{where}: not a safetensors file: {size} bytes (empty or truncated)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:  # no header is that long: another kind of file
            raise error(
                f"{where}: not a safetensors file ({_foreign(head)}: its first 8 bytes give a "
                f"header of {n} bytes)"
            )
        if n > size - 8:
            raise error(
                f"{where}: truncated: {size} bytes, shorter than its {n}-byte header "
                "(download or copy it again)"
            )
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise error(f"{where}: not a safetensors file (its header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise error(f"{where}: not a safetensors file (its header is not a JSON object)")
        self.start = 8 + n
        return header, size

    def _entry(self, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
        """``(dtype, shape, begin, end)`` of a header entry, checked."""
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self.error(
                f"{self.where}: tensor {name!r} has a bad header entry {info!r} (dtypes: "
                f"{', '.join(_DTYPES)})"
            ) from None
        need = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if min(shape, default=0) < 0 or begin < 0 or end - begin != need:
            raise self.error(
                f"{self.where}: tensor {name!r} ({info['dtype']} {list(shape)}) needs {need} "
                f"bytes, its header gives bytes {begin}..{end}"
            )
        return dtype, shape, begin, end

    def _checksums(self) -> dict[str, str] | None:
        if CHECKSUMS not in self.meta:
            return None
        try:
            sums = json.loads(self.meta[CHECKSUMS])
        except ValueError:
            sums = None
        if not isinstance(sums, dict) or set(sums) != set(self.entries):
            raise self.error(f"{self.where}: its {CHECKSUMS!r} metadata do not list its tensors")
        return sums

    def names(self) -> list[str]:
        """The tensors' names, as in the header."""
        return list(self.entries)

    def spec(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        dtype, shape, _, _ = self.entries[self.keys[key]]
        return shape, dtype

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` (as in the header) as a view of the memory-mapped file: read from
        disk only where it is used."""
        dtype, shape, begin, end = self.entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, "r")
        return self._map[self.start + begin : self.start + end].view(dtype).reshape(shape)

    def read(self, key: str, region: tuple | None = None) -> np.ndarray:
        """Tensor ``key``, or its ``region`` (a tuple of slices, as a sharding's index): a
        copy, checked against its checksum when the file has them."""
        raw = self.keys[key]
        out = np.array(self.tensor(raw))
        if self.sums is not None and checksum(out) != self.sums[raw]:
            raise CheckpointCorruptError(
                f"{self.where}: {key!r} does not match its checksum (the file was "
                "damaged after it was written)"
            )
        return out if region is None else np.asarray(out[region])

    def verify(self) -> None:
        """Read every tensor once, checking its checksum (one tensor in memory at a time)."""
        for key in self.keys:
            self.read(key)

    def close(self) -> None:
        self._map = None  # the views still alive keep their own reference to the map


_File = SafetensorsFile  # the name the sharded reader imports


#: The reader of a checkpoint directory: ``_sharded.ShardedFile`` registers itself here (the
#: sharded format extends this one, so this module never imports it).
DIRECTORY_READER = None


@contextlib.contextmanager
def _checkpoint(path: Path):
    """The open checkpoint at ``path``: a safetensors file (``nl.save``) or a sharded
    checkpoint directory (``nl.save_sharded``), with one reading interface."""
    if path.is_dir():
        if DIRECTORY_READER is None:
            raise CheckpointError(f"checkpoint {path}: a directory, and no sharded reader loaded")
        file = DIRECTORY_READER(path)
    else:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path}: no such file") from None
        try:
            file = SafetensorsFile(path, f)
        finally:
            f.close()  # the tensors are read through a memory map
    try:
        yield file
    finally:
        file.close()


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``str -> str`` metadata of the safetensors file ``path`` (or of the sharded
    checkpoint directory ``path``, ``nl.save_sharded``), without its tensors.

    Includes nl.save's own ``format`` and ``format_version`` (files nl.save wrote); the
    header's ``checksums`` entry is checked by ``nl.load`` and ``nl.verify``, not returned.

    Raises:
        CheckpointError: the file is missing, truncated or not a safetensors file.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import nnlite as nl
        >>> path = tempfile.mkdtemp() + "/w.safetensors"
        >>> nl.load_metadata(nl.save(path, jnp.ones(3), metadata={"step": "7"}))["step"]
        '7'
    """
    path = Path(path)
    with _checkpoint(path) as file:
        return {k: v for k, v in file.meta.items() if k not in (CHECKSUMS, EMPTY)}


def verify(path: str | os.PathLike) -> None:
    """Check every tensor of the checkpoint ``path`` (a file or a sharded directory)
    against the checksum written with it, reading one tensor at a time.

    Raises:
        CheckpointCorruptError: a tensor's bytes differ from what was written, or the file
            is truncated, unparseable or misses a shard; the message names the file.
        CheckpointError: ``path`` does not exist.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import nnlite as nl
        >>> nl.verify(nl.save(tempfile.mkdtemp() + "/w.safetensors", jnp.ones(3)))
    """
    with _checkpoint(Path(path)) as file:
        file.verify()


def load(path: str | os.PathLike, like: Any = None, *, subtree: str | None = None) -> Any:
    """Read a safetensors file (written by ``nl.save``) into the structure of ``like``.

    Args:
        path: the safetensors file, or a sharded checkpoint directory (``nl.save_sharded``,
            written by any number of processes): read whole, or placed shard by shard.
        like: the template: a tree with the structure, shapes and dtypes to restore (e.g.
            freshly initialised params, ``optimizer.init(params)``, a dict of both, or
            ``jax.eval_shape`` of them). ``None``: the file's paths rebuilt as a ParamsDict
            of arrays (``ParamsDict.from_flat``; a list of them for a part whose paths
            begin with an index, such as ``"opt_state"``), or one array; the nodes without
            arrays the tree had (a layer without params) come back as empty ParamsDicts.
        subtree: read only the part of the file under this path, e.g. ``"params"`` of a
            file saved from ``{"params": p, "opt_state": s}`` (what the trainer writes);
            ``like`` is then that part's template.

    Returns:
        A tree like ``like`` whose leaves are the file's arrays: ``jax.Array`` where
        ``like`` has one or a ``jax.ShapeDtypeStruct`` (placed on its ``sharding`` if it has
        one: each device's part is read on its own, from the shards that overlap it, so a
        sharded leaf is never whole in memory), numpy arrays and Python numbers where it
        has those.

    Raises:
        CheckpointError: the file is missing, truncated or not a safetensors file; or it
            does not match ``like``: the message names the first missing or unexpected path
            (and how many there are), or a path whose shape or dtype differs.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import nnlite as nl
        >>> p = nl.ParamsDict(W=jnp.ones((2, 3)))
        >>> path = nl.save(tempfile.mkdtemp() + "/c.safetensors", {"params": p, "step": 3})
        >>> nl.load(path, subtree="params").W.shape
        (2, 3)
        >>> nl.load(path, like={"params": p, "step": 0})["step"]
        3
    """
    path = Path(path)
    with _checkpoint(path) as file:
        keys = list(file.keys)
        empties = _empties(file)
        prefix = ""
        if subtree is not None:
            prefix = subtree.removeprefix("/")
            below = (prefix + "/", prefix + "[")
            keys = [k for k in keys if k == prefix or k.startswith(below)]
            empties = {k: v for k, v in empties.items() if k == prefix or k.startswith(below)}
            if not prefix or not (keys or empties):
                parts = sorted({_top(k) for k in [*file.keys, *_empties(file)]} - {""})
                raise CheckpointError(
                    f"checkpoint {path}: no subtree {subtree!r}; its top-level parts are "
                    f"{', '.join(map(repr, parts)) or 'none'}"
                )
        if like is None:
            return _as_params(file, keys, prefix, empties)
        return _restore(file, keys, prefix, like)


def _top(key: str) -> str:
    return key.split("/")[0].split("[")[0]


def _empties(file: Any) -> dict[str, str]:
    """The file's record of its tree's nodes without arrays (:func:`empty_nodes`)."""
    text = file.meta.get(EMPTY)
    if not text:
        return {}
    try:
        found = json.loads(text)
        if isinstance(found, dict) and all(v in ("{}", "[]") for v in found.values()):
            return found
    except ValueError:
        pass
    raise CheckpointCorruptError(f"checkpoint {file.path}: its {EMPTY} metadata is not readable")


def _as_params(file: _File, keys: list[str], prefix: str, empties: dict[str, str]) -> Any:
    """The arrays at ``keys`` as a ParamsDict keyed by their paths below ``prefix`` (a list
    of them where the paths begin with an index, as an optax state's do), with the
    ``empties`` (nodes without arrays) put back in their places."""

    def relative(k: str) -> str:
        r = k[len(prefix) :] if prefix else ("" if k == _ROOT else k)
        return "/" + r if r[:1] not in ("", "/", "[") else r

    rel = {relative(k): k for k in keys}
    if "" in rel and len(rel) == 1:
        return jnp.asarray(file.read(rel[""]))
    made = {relative(k): ParamsDict() if kind == "{}" else [] for k, kind in empties.items()}
    if "" in made:  # the subtree itself holds no array
        return made[""]
    flat = {r: jnp.asarray(file.read(k)) for r, k in sorted(rel.items())} | made
    indexed = any(r.startswith("[") for r in flat)  # a list at the top (an optax state)
    try:
        if indexed:
            return ParamsDict.from_flat({"/root" + r: v for r, v in flat.items()})["root"]
        return ParamsDict.from_flat(flat)
    except (ValueError, KeyError) as e:
        parts = sorted({_top(k) for k in file.keys} - {""})
        raise CheckpointError(
            f"checkpoint {file.path}: its paths do not make one ParamsDict ({e}); pass like= "
            f"(a tree of the structure it was saved from) or subtree= (one of its parts: "
            f"{', '.join(map(repr, parts))})"
        ) from None


def _restore(file: _File, keys: list[str], prefix: str, like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    want = [(_key(p, prefix), leaf) for p, leaf in leaves]
    have = set(keys)
    missing = [k for k, _ in want if k not in have]
    extra = sorted(have - {k for k, _ in want})
    where = f"the file's {prefix!r}" if prefix else "the file"
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} path(s) of the template missing, first {missing[0]!r}")
        if extra:
            parts.append(f"{len(extra)} unexpected path(s), first {extra[0]!r}")
        raise CheckpointError(
            f"checkpoint {file.path}: {where} does not match the template (like=): "
            f"{'; '.join(parts)} ({where} has {len(keys)} arrays, the template {len(want)})"
        )
    for key, leaf in want:  # every check before any tensor is read
        shape, dtype = file.spec(key)
        ref_shape = tuple(np.shape(leaf))
        ref_dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
        if shape != ref_shape or dtype != ref_dtype:
            raise CheckpointError(
                f"checkpoint {file.path}: {key!r} is {_describe(shape, dtype)} in the file, "
                f"the template (like=) expects {_describe(ref_shape, ref_dtype)}"
            )
    return jax.tree.unflatten(treedef, [_read_like(file, k, leaf) for k, leaf in want])


def _read_like(file: Any, key: str, leaf: Any) -> Any:
    """Tensor ``key`` as the kind of leaf ``leaf`` is; a template with a sharding gets
    each device's part read on its own (the regions of several devices read once)."""
    sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.ShapeDtypeStruct) else None
    if sharding is None:
        return _like(file.read(key), leaf)
    shape = file.spec(key)[0]
    parts: dict = {}

    def part(index):
        at = tuple((s.start, s.stop) for s in index)
        if at not in parts:
            parts[at] = file.read(key, index)
        return parts[at]

    return jax.make_array_from_callback(shape, sharding, part)


def _like(value: np.ndarray, leaf: Any) -> Any:
    """``value`` as the kind of leaf ``leaf`` is."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = getattr(leaf, "sharding", None)
        return jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)
    if isinstance(leaf, jax.Array):
        return jnp.asarray(value)
    if isinstance(leaf, (bool, int, float)):
        return type(leaf)(value.item())
    if isinstance(leaf, np.generic):
        return value[()]
    return value
