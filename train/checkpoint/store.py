"""Checkpoints of a run: ``ckpt_<step>.safetensors`` files written by ``nl.save``, or
``ckpt_<step>.shards`` directories written by ``nl.save_sharded`` when the strategy's
state is sharded (each process writes its own shards; nothing is gathered).

Every byte goes through ``nl.save`` / ``nl.load`` (atomic write: temporary name, fsync,
rename, directory fsync), so a process killed at any moment leaves either the complete
file or a ``*.tmp`` one; only complete names count as checkpoints, and ``clean_temporary``
removes the leftovers when the run resumes. This module names the files, keeps the newest
N, and owns what resuming needs: the metadata (step, data position, RNG, config as
strings) and its checks.

A checkpoint is ``nl.save(path, {"params": params, "opt_state": opt_state})``: keys
``params/<path>`` and ``opt_state<path>`` (``params/ffn/layers[0]/W``,
``opt_state[0]/mu/head/b``); a stateful model's state adds ``state/<path>``
(``state/blocks[0]/bn1/mean``). For inference, ``nl.load(path, subtree="params")`` gives
the params as a ParamsDict, and ``like=model.init(key)`` with it restores them checked.

A sharded checkpoint holds the same keys, split into shards (see ``nnlite/core/_sharded.py``):
written under ``ckpt_<step>.shards.tmp`` with the index last, then renamed. ``nl.load``
reads it whole, or places each device's part straight onto another sharding (a restore
onto another mesh), so resuming, ``train.load_run`` and the library read either kind.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl

from ..errors import ConfigError
from ..parallel import distributed as dist
from ..parallel.finite import finite_on_devices

FORMAT_VERSION = "1"  # nl.save's format_version that resuming accepts
# 8 digits or more (steps >= 10^8); a file, or a sharded checkpoint's directory
_NAME = re.compile(r"^ckpt_(\d{8,})\.(safetensors|shards)$")
_TMP_SUFFIX = ".tmp"


def flatten_with_paths(prefix: str, tree: Any) -> dict[str, Any]:
    """``{key: leaf}`` with the keys a checkpoint stores ``tree`` under (``prefix`` is
    ``"params"`` or ``"opt_state"``)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {prefix + nl.format_path(path): leaf for path, leaf in leaves}


def kept_params(model: Any, params: Any) -> Any:
    """The params a checkpoint of ``model`` holds: all of them, or the subset its
    ``checkpointed(params)`` marks (LoRA: the adapters; ``nl.hf.Pretrained``), as a
    ParamsDict of those paths."""
    mask = _kept_mask(model, params)
    if mask is None:
        return params
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    kept = {
        nl.format_path(p): v for (p, v), m in zip(leaves, jax.tree.leaves(mask), strict=True) if m
    }
    return nl.ParamsDict.from_flat(kept)


def _kept_mask(model: Any, params: Any) -> Any:
    fn = getattr(model, "checkpointed", None)
    return fn(params) if callable(fn) else None


def _tree(params: Any, opt_state: Any, state: Any = None) -> OrderedDict:
    """The tree a checkpoint holds; ordered (JAX sorts a dict's keys), so that a mismatch
    names a path of the params before one of the optimizer state derived from them. A
    stateless model's has no ``state`` entry (its files are as they were before state)."""
    tree = OrderedDict(params=params, opt_state=opt_state)
    if state is not None:
        tree["state"] = state
    return tree


def _string_metadata(step: int, metadata: dict[str, Any]) -> dict[str, str]:
    """The step and ``metadata`` as safetensors metadata: strings, others as JSON."""
    meta = {"step": str(step)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    return meta


def save(
    ckpt_dir: Path,
    step: int,
    params: Any,
    opt_state: Any,
    metadata: dict[str, Any],
    keep: int,
    *,
    state: Any = None,
    protect: frozenset = frozenset(),
    model: Any = None,
) -> Path:
    """Write ``ckpt_<step>.safetensors`` atomically (``nl.save``), keep the newest ``keep``
    and the steps in ``protect`` (the best k: ``best.py``).

    ``metadata`` values that are not strings are stored as JSON; ``state``: a stateful
    model's state (None: stateless); ``model``: the params its ``checkpointed`` keeps
    (:func:`kept_params`; None: all)."""
    params = kept_params(model, params)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    meta = _string_metadata(step, metadata)
    final = nl.save(
        path_of(ckpt_dir, step, sharded=False), _tree(params, opt_state, state), metadata=meta
    )
    _keep_newest(ckpt_dir, final, keep, protect)
    return final


def save_sharded(
    ckpt_dir: Path,
    step: int,
    params: Any,
    opt_state: Any,
    metadata: dict[str, Any],
    keep: int,
    barrier=None,
    *,
    state: Any = None,
    protect: frozenset = frozenset(),
    model: Any = None,
) -> Path:
    """Write ``ckpt_<step>.shards`` (``nl.save_sharded``): every process calls this with its
    placed, sharded state and writes the shards its devices hold; process 0 writes the
    index (the metadata) last, renames the directory and keeps the newest ``keep``.

    ``barrier``: ``train.parallel.distributed.barrier`` (bounded waits) with several processes;
    ``state``: a stateful model's (placed) state, None for a stateless model; ``model``: as
    :func:`save`."""
    params = kept_params(model, params)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    meta = _string_metadata(step, metadata)
    final = nl.save_sharded(
        path_of(ckpt_dir, step, sharded=True),
        _tree(params, opt_state, state),
        metadata=meta,
        barrier=barrier,
    )
    if dist.is_main():
        _keep_newest(ckpt_dir, final, keep, protect)
    return final


def path_of(ckpt_dir: Path, step: int, *, sharded: bool) -> Path:
    """The name of the checkpoint of ``step``: a file, or a sharded checkpoint's directory."""
    return ckpt_dir / f"ckpt_{step:08d}.{'shards' if sharded else 'safetensors'}"


def is_sharded(path: Path) -> bool:
    return path.name.endswith(".shards")


def _keep_newest(ckpt_dir: Path, written: Path, keep: int, protect=frozenset()) -> None:
    """Remove all but the newest ``keep`` checkpoints and those of the steps in
    ``protect``, and one of the other kind at the step just written (a run that changed
    strategy)."""
    found = list_checkpoints(ckpt_dir)
    old = [p for p in found if step_of(p) == step_of(written) and p != written]
    rest = [p for p in found if p not in old][:-keep]
    for p in old + [p for p in rest if step_of(p) not in protect]:
        _remove(p)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary files and directories are not
    checkpoints; a ``.shards`` directory is renamed to its name once complete)."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=step_of)


def clean_temporary(ckpt_dir: Path) -> list[Path]:
    """Remove temporary files and directories left by an interrupted write; return what
    was removed."""
    if not ckpt_dir.is_dir():
        return []
    removed = [p for p in ckpt_dir.iterdir() if p.name.endswith(_TMP_SUFFIX)]
    for p in removed:
        _remove(p)
    return removed


def read_metadata(path: Path) -> dict[str, str]:
    """The checkpoint's metadata (strings), without reading its tensors."""
    try:
        return nl.load_metadata(path)
    except nl.CheckpointError as e:
        raise ConfigError(str(e)) from None


def restore(
    path: Path, params_template: Any, opt_template: Any, state_template: Any = None
) -> tuple[Any, Any, Any, dict[str, str]]:
    """``(params, opt_state, state, metadata)``: ``path`` loaded into the structure of the
    templates (arrays or ``jax.ShapeDtypeStruct``s; a template with a sharding is placed on
    it part by part: a restore onto another mesh; ``state_template`` None for a stateless
    model, whose state is then None); a mismatch names the first differing path. Raises
    ConfigError for a checkpoint that cannot be resumed (unreadable, another structure,
    bad metadata, non-finite values).

    With several processes and templates sharded over all of them, every process calls it
    (the check for non-finite values is a computation over the placed arrays)."""
    meta = read_metadata(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION!r}"
        )
    _check_metadata(path, meta)
    state = _load(path, _tree(params_template, opt_template, state_template))
    bad = _first_nonfinite(
        {
            **flatten_with_paths("params", state["params"]),
            **flatten_with_paths("opt_state", state["opt_state"]),
            **flatten_with_paths("state", state.get("state")),
        }
    )
    if bad is not None:
        raise ConfigError(
            f"checkpoint {path}: {bad!r} holds non-finite values, so it cannot be resumed; "
            "delete it to resume from an older checkpoint, or use --fresh"
        )
    return state["params"], state["opt_state"], state.get("state"), meta


def _load(path: Path, like: Any, subtree: str | None = None) -> Any:
    try:
        return nl.load(path, like, subtree=subtree)
    except nl.CheckpointError as e:
        raise ConfigError(str(e)) from None


def _first_nonfinite(tensors: dict[str, Any]) -> str | None:
    # jnp.issubdtype: numpy's does not count bfloat16 as inexact
    floats = {k: v for k, v in tensors.items() if jnp.issubdtype(v.dtype, jnp.inexact)}
    placed = [k for k, v in floats.items() if isinstance(v, jax.Array)]
    # where they are placed (a sharded leaf is never gathered), in one program
    flags = dict(zip(placed, finite_on_devices([floats[k] for k in placed])))
    for key, v in floats.items():
        if not (flags[key] if key in flags else np.all(np.isfinite(np.asarray(v)))):
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


def load_state(path: Path, state_template: Any) -> Any:
    """Only a stateful model's state (running statistics) of checkpoint ``path``."""
    return _load(path, state_template, subtree="state")


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


# --- a checkpoint that holds part of the params (LoRA: the adapters) ---------------------------
# A model's ``checkpointed(params)`` marks the params its checkpoints hold; the others are the
# model's own ``init`` (LoRA: the base read from its directory), filled in on restore, and its
# ``check_checkpoint(meta, where)`` refuses a checkpoint whose base has changed.


def _check_base(model: Any, path: Path) -> None:
    check = getattr(model, "check_checkpoint", None)
    if callable(check):
        try:
            check(read_metadata(path), f"checkpoint {path}")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _fill(model: Any, template: Any, kept: Any) -> Any:
    """``template``'s tree with ``kept``'s leaves, the others from ``template`` when it
    holds arrays, else from ``model.init`` (placed as the template's leaves are)."""
    have = kept.to_flat()
    flat = dict(template.to_flat())
    missing = [k for k in flat if k not in have]
    if any(not isinstance(flat[k], jax.Array | np.ndarray) for k in missing):
        leaves, treedef = jax.tree.flatten(template)
        shardings = [getattr(v, "sharding", None) for v in leaves]
        placed = treedef.unflatten(shardings) if all(shardings) else None
        init = jax.jit(model.init, out_shardings=placed)
        inited = init(jax.random.key(0)).to_flat()
        for k in missing:
            flat[k] = inited[k].astype(flat[k].dtype)
    flat.update(have)
    return nl.ParamsDict.from_flat(flat)


def _kept_template(model: Any, params_template: Any) -> Any:
    """The template of the params a checkpoint of ``model`` holds (None: all of them)."""
    if _kept_mask(model, params_template) is None:
        return None
    return kept_params(model, params_template)


def restore_model(
    model: Any, path: Path, params_template: Any, opt_template: Any, state_template: Any = None
):
    """``restore`` for ``model``, also from a checkpoint of its other params layout
    (converted, on the default device: the caller places it); otherwise the error names
    the first path that differs from this layout. A model whose checkpoints hold part of
    its params gets the rest from its template or its ``init``."""
    kept = _kept_template(model, params_template)
    if kept is not None:
        _check_base(model, path)
        params, opt_state, state, meta = restore(path, kept, opt_template, state_template)
        return _fill(model, params_template, params), opt_state, state, meta
    try:
        return restore(path, params_template, opt_template, state_template)
    except ConfigError:
        found = _other_layout(model, params_template)
        if found is None:
            raise
        other, alt = found
        alt_opt = jax.eval_shape(
            lambda o: _convert_like(o, params_template, other.convert_params), opt_template
        )
        try:
            params, opt_state, state, meta = restore(path, alt, alt_opt, state_template)
        except ConfigError:
            pass
        else:
            back = model.convert_params
            return back(params), _convert_like(opt_state, alt, back), state, meta
    return restore(path, params_template, opt_template, state_template)  # this layout's error


def load_model_params(model: Any, path: Path, params_template: Any) -> Any:
    """``load_params`` for ``model``, also from a checkpoint of its other params layout, or
    of part of its params (the rest from its ``init``)."""
    kept = _kept_template(model, params_template)
    if kept is not None:
        _check_base(model, path)
        return _fill(model, params_template, load_params(path, kept))
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


def newest_intact(existing: list[Path], say=None) -> Path | None:
    """The newest of ``existing`` (oldest first) whose tensors match their checksums
    (``nl.verify``); damaged ones newer than it are skipped with one line to ``say``
    (default: stderr). None when ``existing`` is empty; ConfigError when none is intact."""
    damaged: list[str] = []
    for path in reversed(existing):
        try:
            nl.verify(path)
        except nl.CheckpointCorruptError as e:
            damaged.append(str(e))
            continue
        if damaged:
            line = (
                f"note: resume: skipped {len(damaged)} damaged checkpoint(s), newest first: "
                f"{damaged[0]}; resuming from the newest intact one, {path.name}"
            )
            (say or _stderr)(line)
        return path
    if damaged:
        raise ConfigError(
            f"{damaged[0]}; no older checkpoint is intact ({len(damaged)} damaged); "
            "use --fresh to start over"
        )
    return None


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)
