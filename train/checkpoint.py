"""Checkpoints: safetensors files, written atomically, restored into a template.

Crash safety: a checkpoint is written to ``<name>.tmp``, fsynced, renamed, and the
directory fsynced, so a process killed at any moment leaves either the complete file or a
temporary one; only complete names count as checkpoints, and ``clean_temporary`` removes
the leftovers when the run resumes.

Keys are ``params<path>`` and ``opt_state<path>`` with nnlite's paths (``params/ffn/layers[0]/W``,
``opt_state[0]/mu/head/b``); metadata (step, data position, RNG, config, format version) is
stored as strings. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors
import safetensors.numpy

import nnlite as nl

from .config import ConfigError

FORMAT_VERSION = "1"
_NAME = re.compile(r"^ckpt_(\d{8,})\.safetensors$")  # 8 digits or more (steps >= 10^8)
_TMP_SUFFIX = ".tmp"


def flatten_with_paths(prefix: str, tree: Any) -> dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + nl.format_path(path): leaf for path, leaf in leaves}


def save(
    ckpt_dir: Path, step: int, params: Any, opt_state: Any, metadata: dict[str, Any], keep: int
) -> Path:
    """Write ``ckpt_<step>.safetensors`` atomically (temp file, fsync, rename), keep the newest ``keep``."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensors = {**flatten_with_paths("params", params), **flatten_with_paths("opt_state", opt_state)}
    tensors = {k: np.array(v, order="C") for k, v in tensors.items()}  # keeps 0-d shapes
    meta = {"format_version": FORMAT_VERSION, "step": str(step)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    data = safetensors.numpy.save(tensors, metadata=meta)
    final = ckpt_dir / f"ckpt_{step:08d}.safetensors"
    tmp = final.with_name(final.name + _TMP_SUFFIX)
    pause = _test_pause()
    with open(tmp, "wb") as f:
        if pause:  # test hook: leave a half-written temporary file for a while
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(pause)
            data = data[len(data) // 2 :]
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if pause:  # test hook: complete but not yet renamed
        time.sleep(pause)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


# Test hook, never set in normal runs: seconds to pause twice inside every checkpoint write
# (half-written, then written but not renamed), so tests can SIGKILL a process there.
TEST_PAUSE_ENV = "NNLITE_TEST_CHECKPOINT_PAUSE_S"


def _test_pause() -> float:
    return float(os.environ.get(TEST_PAUSE_ENV) or 0)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary files are not checkpoints)."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=step_of)


def clean_temporary(ckpt_dir: Path) -> list[Path]:
    """Remove temporary files left by an interrupted write; return what was removed."""
    if not ckpt_dir.is_dir():
        return []
    removed = [p for p in ckpt_dir.iterdir() if p.name.endswith(_TMP_SUFFIX)]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def read_metadata(path: Path) -> dict[str, str]:
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ConfigError(f"checkpoint {path}: not a readable safetensors file ({e})") from None


def restore(path: Path, params_template: Any, opt_template: Any) -> tuple[Any, Any, dict[str, str]]:
    """Load ``path`` into the structure of the templates; a mismatch names the first differing path."""
    meta = read_metadata(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION!r}"
        )
    _check_metadata(path, meta)
    try:
        tensors = safetensors.numpy.load_file(str(path))
    except Exception as e:
        raise ConfigError(f"checkpoint {path}: cannot read tensors ({e})") from None

    def fill(prefix: str, template: Any) -> Any:
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
        out = []
        for p, leaf in leaves_with_path:
            key = prefix + nl.format_path(p)
            if key not in tensors:
                raise ConfigError(
                    f"checkpoint {path}: missing {key!r} that the model/optimizer expects"
                )
            value = tensors.pop(key)
            want_shape, want_dtype = np.shape(leaf), np.asarray(leaf).dtype
            if value.shape != want_shape or value.dtype != want_dtype:
                raise ConfigError(
                    f"checkpoint {path}: {key!r} is {value.dtype}{list(value.shape)}, the model/optimizer "
                    f"expects {want_dtype}{list(want_shape)}"
                )
            out.append(value)
        return jax.tree_util.tree_unflatten(treedef, out)

    params = fill("params", params_template)
    opt_state = fill("opt_state", opt_template)
    if tensors:
        raise ConfigError(
            f"checkpoint {path}: unexpected entry {sorted(tensors)[0]!r} not in the model/optimizer"
        )
    bad = _first_nonfinite(
        {**flatten_with_paths("params", params), **flatten_with_paths("opt_state", opt_state)}
    )
    if bad is not None:
        raise ConfigError(
            f"checkpoint {path}: {bad!r} holds non-finite values, so it cannot be resumed; "
            "delete it to resume from an older checkpoint, or use --fresh"
        )
    return params, opt_state, meta


def _first_nonfinite(tensors: dict[str, np.ndarray]) -> str | None:
    for key, v in tensors.items():
        if np.issubdtype(v.dtype, np.inexact) and not np.all(np.isfinite(v)):
            return key
    return None


def _check_metadata(path: Path, meta: dict[str, str]) -> None:
    """The metadata is untrusted text: ``step`` must be the step in the file's name."""
    raw = meta.get("step")
    if raw is None:
        raise ConfigError(f"checkpoint {path}: its metadata has no 'step'")
    if not raw.isdecimal() or not raw.isascii():
        raise ConfigError(f"checkpoint {path}: its metadata 'step' is {raw!r}, not an integer")
    m = _NAME.match(path.name)
    if m is not None and int(m.group(1)) != int(raw):
        raise ConfigError(
            f"checkpoint {path}: its metadata says step {int(raw)} but its name says "
            f"step {int(m.group(1))}"
        )
    skipped = meta.get("skipped_steps", "0")
    if not skipped.isdecimal() or not skipped.isascii():
        raise ConfigError(
            f"checkpoint {path}: its metadata 'skipped_steps' is {skipped!r}, not an integer"
        )


def step_of(path: Path) -> int:
    """The step in a checkpoint's file name."""
    return int(_NAME.match(path.name).group(1))
