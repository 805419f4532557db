"""LoRA (Hu et al. 2021): a frozen ``Linear`` plus a trainable low-rank update, with its
hand rule; and the helpers that pick, split and fold adapters in a model's params.

``y = x W + b + (alpha / rank) (x A) B`` with ``A: [in, rank]``, ``B: [rank, out]``. ``W`` and
``b`` keep the wrapped layer's names, so a LoRA-wrapped model reads the base checkpoint
unchanged and only adds ``lora_a`` and ``lora_b`` beside them. The base is frozen: its
cotangents are zero under autodiff (``stop_gradient``) and in the hand rule, which never
forms ``x^T dy`` for ``W`` -- the saving a LoRA step is for. ``B`` starts at zero, so a
freshly wrapped model computes exactly what the base model does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ..core._axes import Axes
from ..core._gemm import matmul
from ..core._module import Module
from ..core._params import ParamsDict
from ..core._select import matches
from ..grad._manual import hand_rule
from ._dropout import check_rate, dropout
from ._linear import Linear, linear_axes, rows_matmul

__all__ = [
    "ADAPTER_NAMES",
    "LoRA",
    "freeze_base",
    "adapter_axes",
    "lora_join",
    "lora_linear",
    "lora_linear_dropout",
    "lora_linear_vjp",
    "lora_mask",
    "lora_split",
    "match_targets",
]

#: The param names a LoRA adds beside its base ``W`` and ``b``.
ADAPTER_NAMES = ("lora_a", "lora_b")


def lora_linear_vjp(x, W, b, A, B, dret, *, scale: float):
    """Hand rule of ``lora_linear``: ``dx = dy W^T + s (dy B^T) A^T``, ``dA = s x^T (dy
    B^T)``, ``dB = s (x A)^T dy``, every leading axis contracted; zeros for the frozen
    ``W`` and ``b``."""
    s = jnp.asarray(scale, dret.dtype)
    dy2 = dret.reshape(-1, W.shape[1])
    x2 = x.reshape(-1, W.shape[0])
    dxa = rows_matmul(dy2, B, transpose_w=True) * s  # [N, rank]
    dx = rows_matmul(dy2, W, transpose_w=True) + rows_matmul(dxa, A, transpose_w=True)
    dA = matmul(x2, dxa, transpose_a=True)
    dB = matmul(rows_matmul(x2, A) * s, dy2, transpose_a=True)
    dx = dx.reshape(x.shape)
    db = None if b is None else jnp.zeros_like(b)
    return dx, jnp.zeros_like(W), db, dA, dB


@hand_rule(lora_linear_vjp)
def lora_linear(x, W, b, A, B, *, scale: float) -> jax.Array:
    """``x W + b + scale (x A) B`` for ``x: [..., in]``, ``W: [in, out]``, ``b: [out]`` or
    None, ``A: [in, rank]``, ``B: [rank, out]``; ``W`` and ``b`` are frozen (no gradient)."""
    W = jax.lax.stop_gradient(W)
    y = rows_matmul(x, W) + rows_matmul(rows_matmul(x, A) * jnp.asarray(scale, x.dtype), B)
    if b is None:
        return y
    return y + jnp.broadcast_to(jax.lax.stop_gradient(b), y.shape)


def lora_linear_dropout_vjp(x, xd, W, b, A, B, dret, *, scale: float):
    """Hand rule of ``lora_linear_dropout``: ``dx = dy W^T``, ``dxd = s (dy B^T) A^T``, ``dA =
    s xd^T (dy B^T)``, ``dB = s (xd A)^T dy``; zeros for the frozen ``W`` and ``b``."""
    s = jnp.asarray(scale, dret.dtype)
    dy2 = dret.reshape(-1, W.shape[1])
    xd2 = xd.reshape(-1, W.shape[0])
    dxa = rows_matmul(dy2, B, transpose_w=True) * s  # [N, rank]
    dx = rows_matmul(dy2, W, transpose_w=True).reshape(x.shape)
    dxd = rows_matmul(dxa, A, transpose_w=True).reshape(xd.shape)
    db = None if b is None else jnp.zeros_like(b)
    dA = matmul(xd2, dxa, transpose_a=True)
    dB = matmul(rows_matmul(xd2, A) * s, dy2, transpose_a=True)
    return dx, dxd, jnp.zeros_like(W), db, dA, dB


@hand_rule(lora_linear_dropout_vjp)
def lora_linear_dropout(x, xd, W, b, A, B, *, scale: float) -> jax.Array:
    """``x W + b + scale (xd A) B``: ``lora_linear`` whose adapter branch reads ``xd`` (``x``
    after dropout, as peft's ``lora_dropout``) while the frozen base reads ``x``."""
    W = jax.lax.stop_gradient(W)
    y = rows_matmul(x, W) + rows_matmul(rows_matmul(xd, A) * jnp.asarray(scale, x.dtype), B)
    if b is None:
        return y
    return y + jnp.broadcast_to(jax.lax.stop_gradient(b), y.shape)


class LoRA(Module):
    """A ``Linear`` with a low-rank adapter (LoRA; ``peft.LoraConfig`` in PyTorch):
    ``base(x) + (alpha / rank) (x A) B``, only ``A`` and ``B`` trained.

    Initialisers (as ``peft``): ``A`` uniform in ``±1/sqrt(in_features)``, ``B`` zeros.

    Args:
        base: the wrapped ``nl.Linear`` (its params keep their names ``W``, ``b``).
        rank: the adapter's rank.
        alpha: scale numerator: the update is multiplied by ``alpha / rank``.
        dropout: dropout rate on the adapter branch's input (peft's ``lora_dropout``), in
            training only (a call with a ``key``); the frozen base reads the input as is.

    Params: ``/W``, ``/b`` (the base's, frozen), ``/lora_a: [in, rank]``, ``/lora_b: [rank,
    out]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> layer = LoRA(Linear(6, 4), rank=2, alpha=4)
        >>> p = jax.jit(layer.init)(jax.random.key(0))
        >>> p.print()
        /W: f32[6,4]
        /b: f32[4]
        /lora_a: f32[6,2]
        /lora_b: f32[2,4]
        >>> x = jnp.ones((3, 6))
        >>> @jax.jit
        ... def adapted_and_merged(p, x):  # LoRA's output; the plain layer's on merged weights
        ...     return layer(p, x), Linear(6, 4)(layer.merge(p), x)
        >>> y, y_merged = adapted_and_merged(p, x)
        >>> bool(jnp.allclose(y, y_merged))
        True
    """

    base: Linear
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_rate("LoRA", "dropout", self.dropout)
        if not isinstance(self.base, Linear):
            raise TypeError(f"LoRA: base must be an nl.Linear, got {type(self.base).__name__}")
        self._check_positive_ints("rank")
        if not isinstance(self.alpha, int | float) or isinstance(self.alpha, bool):
            raise ValueError(f"LoRA: alpha must be a number, got {self.alpha!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @property
    def param_dtype(self) -> str:
        return self.base.param_dtype

    @property
    def uses_key(self) -> bool:
        return self.dropout > 0

    def _args_repr(self) -> str:
        return f"LoRA({self.base.in_features}, {self.base.out_features}, rank={self.rank})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = dict(self.base.param_shapes())
        shapes["lora_a"] = (self.base.in_features, self.rank)
        shapes["lora_b"] = (self.rank, self.base.out_features)
        return shapes

    def adapters(self, key: jax.Array) -> ParamsDict:
        """Fresh ``lora_a`` (uniform ``±1/sqrt(in)``) and ``lora_b`` (zeros)."""
        bound = 1.0 / math.sqrt(self.base.in_features)
        a = jax.random.uniform(
            key, (self.base.in_features, self.rank), self.base.param_dtype, -bound, bound
        )
        b = jnp.zeros((self.rank, self.base.out_features), self.base.param_dtype)
        return ParamsDict(lora_a=a, lora_b=b)

    def init(self, key: jax.Array) -> ParamsDict:
        k_base, k_ad = jax.random.split(key)
        p = self.base.init(k_base)
        ad = self.adapters(k_ad)
        p.lora_a, p.lora_b = ad.lora_a, ad.lora_b
        return p

    def param_axes(self) -> ParamsDict:
        return adapter_axes(self, "in", "out")

    def merge(self, params: ParamsDict) -> ParamsDict:
        """The base ``Linear``'s params with the update folded in: ``W + (alpha/rank) A B``."""
        self.check_params(params)
        dtype = params["W"].dtype
        delta = (params["lora_a"] @ params["lora_b"]).astype(jnp.float32) * self.scale
        merged = ParamsDict(W=(params["W"].astype(jnp.float32) + delta).astype(dtype))
        if self.base.use_bias:
            merged.b = params["b"]
        return merged

    def __call__(self, params: ParamsDict, x: jax.Array, *, key: jax.Array | None = None):
        self.base.check_input(x, self.base.in_features)
        self.check_params(params)
        names = ["W", "b"] if self.base.use_bias else ["W"]
        arrays = [params[n] for n in names] + [params["lora_a"], params["lora_b"]]
        dtype = self.base.compute_dtype(x, *arrays)
        W, *rest = (a.astype(dtype) for a in arrays)
        b = rest.pop(0) if self.base.use_bias else None
        x = x.astype(dtype)
        if key is None or self.dropout == 0:
            return lora_linear(x, W, b, *rest, scale=self.scale)
        xd = dropout(x, key, self.dropout)
        return lora_linear_dropout(x, xd, W, b, *rest, scale=self.scale)


def adapter_axes(layer: Linear | LoRA, in_name: str | None, out_name: str | None) -> ParamsDict:
    """``linear_axes`` for a ``Linear`` or a ``LoRA``: the adapters' ``A`` shards like ``W``'s
    input dimension, ``B`` like its output; the rank dimension is never split."""
    if isinstance(layer, Linear):
        return linear_axes(layer, in_name, out_name)
    p = linear_axes(layer.base, in_name, out_name)
    p.lora_a = Axes((in_name, None))
    p.lora_b = Axes((None, out_name))
    return p


def wrap(linear: Linear, on: bool, rank: int, alpha: float, dropout: float = 0.0):
    """``LoRA(linear, rank, alpha, dropout)`` when ``on``, else ``linear``: how a layer builds
    a child that its ``lora`` field names."""
    return LoRA(linear, rank, alpha, dropout) if on else linear


def split_key(key: jax.Array | None, n: int) -> list:
    """``n`` keys from ``key`` for a layer's children (``n`` Nones for ``key=None``:
    inference), so a layer whose LoRA children take dropout passes each its own."""
    return [None] * n if key is None else list(jax.random.split(key, n))


def match_targets(targets: Iterable[str], paths: Iterable[str], where: str = "LoRA") -> set[str]:
    """The ``paths`` (of Linear layers, ``/blocks[0]/attn/q``) that a glob in ``targets``
    matches (``nl.path_mask``'s notation: ``*`` spans ``/``; ``*/attn/[qv]``,
    ``blocks/0/attn/q``); a glob may also name the
    weight (``.../W``). A glob that matches nothing is an error listing the paths."""
    paths = list(paths)
    chosen: set[str] = set()
    for glob in targets:
        hit = {p for p in paths if matches(glob, p) or matches(glob, p + "/W")}
        if not hit:
            shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
            raise ValueError(
                f"{where}: target {glob!r} matches no linear layer; the layers are: {shown}"
            )
        chosen |= hit
    return chosen


def lora_mask(params: Any) -> Any:
    """A tree like ``params`` with ``True`` at the adapters (``lora_a``, ``lora_b``) and
    ``False`` elsewhere: the labels for ``optax.masked`` / ``optax.multi_transform``."""
    leaves = jax.tree_util.tree_flatten_with_path(params)

    def is_adapter(path) -> bool:
        last = path[-1] if path else None
        return getattr(last, "key", None) in ADAPTER_NAMES

    mask = [is_adapter(path) for path, _ in leaves[0]]
    return jax.tree.unflatten(leaves[1], mask)


def lora_split(params: ParamsDict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(adapters, frozen)``: flat ``{path: array}`` dicts of the adapter leaves and of
    everything else; differentiate with respect to the first only (``jax.grad`` then
    computes and returns no gradient for the frozen params)."""
    flat = params.to_flat()
    adapters = {k: v for k, v in flat.items() if k.rsplit("/", 1)[-1] in ADAPTER_NAMES}
    frozen = {k: v for k, v in flat.items() if k not in adapters}
    return adapters, frozen


def lora_join(adapters: dict[str, Any], frozen: dict[str, Any]) -> ParamsDict:
    """The inverse of :func:`lora_split`."""
    return ParamsDict.from_flat({**frozen, **adapters})


def freeze_base(optimizer):
    """``optimizer`` on the adapters only: every other param gets a zero update and no
    optimizer state (``optax.multi_transform`` with ``optax.set_to_zero``), so weight decay
    cannot move the frozen weights and Adam keeps no moments for them.

    Example:
        >>> import jax, optax
        >>> p = jax.jit(LoRA(Linear(4, 3), rank=2).init)(jax.random.key(0))
        >>> opt = freeze_base(optax.adamw(0.1))
        >>> grads = jax.tree.map(jax.numpy.ones_like, p)
        >>> first_step = jax.jit(lambda grads, p: opt.update(grads, opt.init(p), p))
        >>> updates, _ = first_step(grads, p)
        >>> float(abs(updates.W).max()), float(abs(updates.lora_b).max()) > 0
        (0.0, True)
    """
    from ..core._select import freeze

    return freeze(optimizer, lora_mask, label="adapter")
