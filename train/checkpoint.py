"""Checkpoints of a run: ``ckpt_<step>.safetensors`` files written by ``nl.save``.

Every byte goes through ``nl.save`` / ``nl.load`` (atomic write: temporary name, fsync,
rename, directory fsync), so a process killed at any moment leaves either the complete
file or a ``*.tmp`` one; only complete names count as checkpoints, and ``clean_temporary``
removes the leftovers when the run resumes. This module names the files, keeps the newest
N, and owns what resuming needs: the metadata (step, data position, RNG, config as
strings) and its checks.

A checkpoint is ``nl.save(path, {"params": params, "opt_state": opt_state})``: keys
``params/<path>`` and ``opt_state<path>`` (``params/ffn/layers[0]/W``,
``opt_state[0]/mu/head/b``). For inference, ``nl.load(path, subtree="params")`` gives the
params as a ParamsDict, and ``like=model.init(key)`` with it restores them checked.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl

from .config import ConfigError

FORMAT_VERSION = "1"  # nl.save's format_version that resuming accepts
_NAME = re.compile(r"^ckpt_(\d{8,})\.safetensors$")  # 8 digits or more (steps >= 10^8)
_TMP_SUFFIX = ".tmp"

# Test hook, never set in normal runs: seconds that nl.save pauses twice inside every
# checkpoint write (half-written, then written but not renamed), so tests can SIGKILL a
# process there. nl.save reads it (TEST_PAUSE_ENV in nnlite/core/_save.py).
TEST_PAUSE_ENV = "NNLITE_TEST_CHECKPOINT_PAUSE_S"


def flatten_with_paths(prefix: str, tree: Any) -> dict[str, Any]:
    """``{key: leaf}`` with the keys a checkpoint stores ``tree`` under (``prefix`` is
    ``"params"`` or ``"opt_state"``)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + nl.format_path(path): leaf for path, leaf in leaves}


def _tree(params: Any, opt_state: Any) -> OrderedDict:
    """The tree a checkpoint holds; ordered (JAX sorts a dict's keys), so that a mismatch
    names a path of the params before one of the optimizer state derived from them."""
    return OrderedDict(params=params, opt_state=opt_state)


def save(
    ckpt_dir: Path, step: int, params: Any, opt_state: Any, metadata: dict[str, Any], keep: int
) -> Path:
    """Write ``ckpt_<step>.safetensors`` atomically (``nl.save``), keep the newest ``keep``.

    ``metadata`` values that are not strings are stored as JSON."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    meta = {"step": str(step)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    final = nl.save(
        ckpt_dir / f"ckpt_{step:08d}.safetensors",
        _tree(params, opt_state),
        metadata=meta,
    )
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


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
    """The checkpoint's metadata (strings), without reading its tensors."""
    try:
        return nl.load_metadata(path)
    except nl.CheckpointError as e:
        raise ConfigError(str(e)) from None


def restore(path: Path, params_template: Any, opt_template: Any) -> tuple[Any, Any, dict[str, str]]:
    """Load ``path`` into the structure of the templates (arrays or ``jax.ShapeDtypeStruct``s);
    a mismatch names the first differing path. Raises ConfigError for a checkpoint that
    cannot be resumed (unreadable, another structure, bad metadata, non-finite values)."""
    meta = read_metadata(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION!r}"
        )
    _check_metadata(path, meta)
    state = _load(path, _tree(params_template, opt_template))
    bad = _first_nonfinite(
        {
            **flatten_with_paths("params", state["params"]),
            **flatten_with_paths("opt_state", state["opt_state"]),
        }
    )
    if bad is not None:
        raise ConfigError(
            f"checkpoint {path}: {bad!r} holds non-finite values, so it cannot be resumed; "
            "delete it to resume from an older checkpoint, or use --fresh"
        )
    return state["params"], state["opt_state"], meta


def _load(path: Path, like: Any, subtree: str | None = None) -> Any:
    try:
        return nl.load(path, like, subtree=subtree)
    except nl.CheckpointError as e:
        raise ConfigError(str(e)) from None


def _first_nonfinite(tensors: dict[str, Any]) -> str | None:
    for key, v in tensors.items():
        # jnp.issubdtype: numpy's does not count bfloat16 as inexact
        if jnp.issubdtype(v.dtype, jnp.inexact) and not np.all(np.isfinite(np.asarray(v))):
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


def load_params(path: Path, params_template: Any) -> Any:
    """Only the params of checkpoint ``path``, in the structure of ``params_template``
    (arrays or ``jax.ShapeDtypeStruct``s): what inference needs (no optimizer state)."""
    return _load(path, params_template, subtree="params")


# --- a checkpoint of the model's other params layout ------------------------------------------
# A model may hold the same parameters in two layouts (the GPT's blocks as a list, or stacked
# for ``scan_layers``). Such a model has ``other_layout()`` (the same model in the other
# layout) and ``convert_params(params)`` (params of either layout in its own); a checkpoint
# that does not fit the model's template is then tried in the other layout and converted:
# the params, and each subtree of the optimizer state shaped like them (Adam's moments).


def _convert_like(tree: Any, like: Any, fn: Any) -> Any:
    """``tree`` with every subtree of ``like``'s structure replaced by ``fn(subtree)``."""
    struct = jax.tree.structure(like)

    def match(t):
        return jax.tree.structure(t) == struct

    return jax.tree.map(lambda t: fn(t) if match(t) else t, tree, is_leaf=match)


def _other_layout(model: Any, params_template: Any):
    """``(the model in its other layout, that layout's params template)``, or None for a
    model with one layout."""
    other_of = getattr(model, "other_layout", None)
    if other_of is None or not hasattr(model, "convert_params"):
        return None
    other = other_of()
    alt = jax.eval_shape(other.convert_params, params_template)
    return other, alt


def restore_model(model: Any, path: Path, params_template: Any, opt_template: Any):
    """``restore`` for ``model``, also from a checkpoint of its other params layout
    (converted); otherwise the error names the first path that differs from this layout."""
    try:
        return restore(path, params_template, opt_template)
    except ConfigError:
        found = _other_layout(model, params_template)
        if found is None:
            raise
        other, alt = found
        alt_opt = jax.eval_shape(
            lambda o: _convert_like(o, params_template, other.convert_params), opt_template
        )
        try:
            params, opt_state, meta = restore(path, alt, alt_opt)
        except ConfigError:
            pass
        else:
            back = model.convert_params
            return back(params), _convert_like(opt_state, alt, back), meta
    return restore(path, params_template, opt_template)  # raises this layout's error


def load_model_params(model: Any, path: Path, params_template: Any) -> Any:
    """``load_params`` for ``model``, also from a checkpoint of its other params layout."""
    try:
        return load_params(path, params_template)
    except ConfigError:
        found = _other_layout(model, params_template)
        if found is None:
            raise
        try:
            return model.convert_params(load_params(path, found[1]))
        except ConfigError:
            pass
    return load_params(path, params_template)
