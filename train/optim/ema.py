"""An exponential moving average of the params (``train.ema_decay``), kept in the optimizer
state.

``with_ema(optimizer, decay)`` is ``optimizer`` whose state also holds, beside the
params' own, ``ema = decay * ema + (1 - decay) * new_params`` in float32, updated inside
the compiled step by the optimizer's ``update``. Being optimizer state, it is checkpointed
(``opt_state/ema/<param path>``), sharded like the params under fsdp, kept unchanged by a
skipped non-finite step, and resumed bit for bit, with no code of its own in the loop.
Frozen params (whose average is themselves) get no copy (``optax.MaskedNode``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnlite as nl

from ..errors import ConfigError

EMA_FIELD = "/ema"  # the average's field in :class:`EmaState`


class EmaState(NamedTuple):
    inner: Any  # the optimizer's own state
    ema: Any  # params-shaped, float32 (MaskedNode at frozen params)


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def with_ema(optimizer, decay: float, trainable=None) -> optax.GradientTransformation:
    """``optimizer`` that also keeps the params' moving average (module docstring);
    ``trainable``: params -> tree of bools (None: all), the params averaged."""

    def init(params):
        if type(params).__name__ == "_ParamsPlaceholder":  # optax.tree_map_params: like params
            return EmaState(optimizer.init(params), params)
        mask = jax.tree.map(lambda _: True, params) if trainable is None else trainable(params)
        ema = jax.tree.map(
            lambda p, m: jnp.array(p, jnp.float32, copy=True) if m else optax.MaskedNode(),
            params,
            mask,
        )
        return EmaState(optimizer.init(params), ema)

    def update(updates, state, params=None):
        updates, inner = optimizer.update(updates, state.inner, params)
        new = optax.apply_updates(params, updates)

        def step(e, p):
            if _masked(e):
                return e
            return e + (1.0 - decay) * (jnp.asarray(p, jnp.float32) - e)

        ema = jax.tree.map(step, state.ema, new, is_leaf=_masked)
        return updates, EmaState(inner, ema)

    return optax.GradientTransformation(init, update)


def ema_prefix(o_avals) -> str:
    """Where the average sits in an optimizer state's paths (``/ema``, or under the
    wrappers around it, e.g. float16's loss scale: ``/inner/ema``); '' if it keeps none."""
    is_ema = lambda x: isinstance(x, EmaState)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(o_avals, is_leaf=is_ema)[0]:
        if is_ema(node):
            return nl.format_path(path) + EMA_FIELD
    return ""


def ema_index(p_avals, o_avals) -> list[tuple[int, int]]:
    """``(optimizer-state leaf, param leaf)`` index pairs of the average's leaves."""
    prefix = ema_prefix(o_avals)
    if not prefix:
        return []
    p_paths = {
        nl.format_path(p): i
        for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(p_avals)[0])
    }
    out = []
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(o_avals)[0]):
        text = nl.format_path(path)
        if text.startswith(prefix + "/") or text.startswith(prefix + "["):
            out.append((i, p_paths[text[len(prefix) :]]))
    return out


def swap_in(p_leaves: list, o_leaves: list, index: list[tuple[int, int]]) -> list:
    """``p_leaves`` with each averaged param replaced by its average (in the param's dtype)."""
    out = list(p_leaves)
    for o, p in index:
        out[p] = o_leaves[o].astype(np.dtype(p_leaves[p].dtype))
    return out


def ema_params(
    params: nl.ParamsDict, checkpoint, where: str, trainable=None, prefix: str = EMA_FIELD
) -> nl.ParamsDict:
    """``params`` with the averages a checkpoint holds (``opt_state/ema/...``) in place of
    the trained params; ``trainable``: the tree of bools of the params averaged (None:
    all), the frozen ones staying as they are; ``prefix``: the average's place in the
    optimizer state (:func:`ema_prefix`)."""
    mask = jax.tree.map(lambda _: True, params) if trainable is None else trainable
    like = jax.tree.map(
        lambda p, m: jax.ShapeDtypeStruct(np.shape(p), np.float32) if m else optax.MaskedNode(),
        params,
        mask,
    )
    try:
        ema = nl.load(checkpoint, like, subtree="opt_state" + prefix)
    except nl.CheckpointError as e:
        raise ConfigError(
            f"{where}: checkpoint {checkpoint} holds no moving average of these params (the "
            f"run trained without train.ema_decay?): {e}"
        ) from None
    return jax.tree.map(
        lambda p, e: p if _masked(e) else np.asarray(e).astype(np.asarray(p).dtype),
        params,
        ema,
        is_leaf=_masked,
    )
