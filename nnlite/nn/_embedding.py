"""Embedding: integer ids -> learned vectors, and the tied output head ``x @ W.T``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core._axes import Axes
from ..core._gemm import matmul
from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ._linear import rows_matmul
from ._names import get_initializer

__all__ = ["Embedding", "embed", "embed_attend", "embed_attend_vjp", "embed_vjp"]


def embed_vjp(W, ids, dret):
    """Hand rule of ``embed``: the rows' cotangents scatter-added into the table (ids out of
    range, whose rows were NaN, add nothing); ``ids`` get none.

    Summed in float32 for a 16-bit table, as PyTorch's embedding backward does: a row's
    gradient sums every position that looked it up, thousands for a character vocabulary.
    In bfloat16 the sum rounds at each add (it stops growing at 256 times an addend), and on
    a GPU a 16-bit scatter-add is a compare-and-swap loop those positions contend for (the
    trainer's bfloat16 GPT step took 2.35x its float32 step on an H200 for it alone)."""
    flat_ids = ids.reshape(-1)
    acc = jnp.promote_types(W.dtype, jnp.float32)
    rows = dret.reshape(-1, W.shape[1]).astype(acc)
    dW = jnp.zeros(W.shape, acc).at[flat_ids].add(rows, mode="drop")
    return dW.astype(W.dtype), None


def embed_attend_vjp(W, x, dret):
    """Hand rule of ``embed_attend``: ``(dW, dx) = (dret^T x, dret W)``, ``dW`` contracted
    over every leading axis in one matmul."""
    d2 = dret.reshape(-1, W.shape[0])
    return matmul(d2, x.reshape(-1, W.shape[1]), transpose_a=True), rows_matmul(dret, W)


@hand_rule(embed_vjp)
def embed(W: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows ``W[ids]``: ``[..., features]`` for integer ``ids: [...]``. Ids outside
    ``[-num_embeddings, num_embeddings)`` give NaN rows (``jnp.take`` with ``mode="fill"``)
    rather than a silently clamped row. A 16-bit table is looked up through a float32 copy
    (the same values), so that autodiff's transpose, the scatter-add, sums in float32 as the
    hand rule does."""
    acc = jnp.promote_types(W.dtype, jnp.float32)
    rows = jnp.take(W.astype(acc), ids, axis=0, mode="fill", fill_value=jnp.nan)
    return rows.astype(W.dtype)


@hand_rule(embed_attend_vjp)
def embed_attend(W: jax.Array, x: jax.Array) -> jax.Array:
    """``x @ W.T``: scores of ``x: [..., features]`` against every row of ``W``."""
    return rows_matmul(x, W, transpose_w=True)  # dW a 2-D product (see rows_matmul)


class Embedding(Module):
    """A lookup table of ``num_embeddings`` learned vectors (Flax ``nn.Embed``, Equinox
    ``eqx.nn.Embedding``), with ``attend`` for a tied output head (as Flax's ``Embed.attend``).

    Initialiser: ``W`` from ``N(0, 1)`` (``w_init="normal"``, as Equinox and PyTorch; Flax's
    ``Embed`` uses variance ``1 / features`` instead, and GPT-2 uses ``"normal_0.02"``).

    Args:
        num_embeddings: vocabulary size (ids are ``0 .. num_embeddings - 1``).
        features: vector size.
        w_init: initializer name (see ``nnlite.INITIALIZERS``).
        param_dtype: dtype of ``W``.
        dtype: compute dtype of the outputs (``None``: ``param_dtype``).

    Params: ``W: [num_embeddings, features]``.

    ``__call__(params, ids)``: integer ``ids: [...]`` (any shape) -> ``[..., features]``.
    Non-integer ids are refused. Concrete ids out of range are refused; traced ids out of
    range give NaN rows (negative ids in range count from the end, as numpy's).

    ``attend(params, x)`` (alias ``as_logits``): ``x: [..., features]`` ->
    ``x @ W.T: [..., num_embeddings]``, the logits of a tied output head.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> emb = Embedding(10, 4)
        >>> p = emb.init(jax.random.key(0))
        >>> p.print()
        /W: f32[10,4]
        >>> h = emb(p, jnp.array([[1, 2, 3], [4, 5, 6]]))
        >>> h.shape
        (2, 3, 4)
        >>> emb.attend(p, h).shape  # tied output head: logits over the vocabulary
        (2, 3, 10)
    """

    num_embeddings: int
    features: int
    w_init: str = "normal"
    param_dtype: str = "float32"
    dtype: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("num_embeddings", "features")
        self._check_dtypes()
        get_initializer(self.w_init)

    def _short_repr(self) -> str:
        return f"Embedding(num_embeddings={self.num_embeddings}, features={self.features})"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"W": (self.num_embeddings, self.features)}

    def param_axes(self) -> ParamsDict:
        """``W: ("vocab", "embed")``: a tensor axis splits the table by rows (token ids)."""
        return ParamsDict(W=Axes(("vocab", "embed")))

    def init(self, key: jax.Array) -> ParamsDict:
        shape = (self.num_embeddings, self.features)
        return ParamsDict(W=get_initializer(self.w_init)(key, shape, self.param_dtype))

    def _dtype(self, *arrays):
        return self.compute_dtype(*arrays)

    def __call__(self, params: ParamsDict, ids: jax.Array, *, key: jax.Array | None = None):
        self.check_params(params)
        dtype = getattr(ids, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(
                f"{self._short_repr()}: expected integer ids, got "
                f"{f'dtype {dtype}' if dtype is not None else type(ids).__name__}"
                f"{f' (shape {tuple(ids.shape)})' if dtype is not None else ''}; "
                "cast token ids with .astype(jnp.int32)"
            )
        if not isinstance(ids, jax.core.Tracer) and ids.size:
            host = np.asarray(ids)  # a concrete array closed over by a jit: read it, not trace it
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(
                    f"{self._short_repr()}: ids must lie in [0, {self.num_embeddings}), got "
                    f"values from {lo} to {hi}"
                )
        return embed(params["W"].astype(self._dtype(params["W"])), ids)

    def attend(self, params: ParamsDict, x: jax.Array) -> jax.Array:
        """Logits ``x @ W.T: [..., num_embeddings]`` for ``x: [..., features]`` (a tied head)."""
        self.check_input(x, self.features)
        self.check_params(params)
        dtype = self._dtype(x, params["W"])
        return embed_attend(params["W"].astype(dtype), x.astype(dtype))

    as_logits = attend
