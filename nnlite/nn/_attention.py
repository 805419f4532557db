"""Multi-head attention: ``dot_product_attention`` with its hand rule, and the layer.

``MultiHeadAttention`` exposes its three stages as public methods, ``qkv``, ``attend`` and
``project``, so a decoder with a key/value cache can call them one at a time (project the
new token, write its k/v into the cache, attend over the cache with ``q_offset``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._mode import manual_active
from ..core._module import Module
from ..core._params import ParamsDict
from ..grad._manual import hand_rule
from ._dropout import check_rate, dropout
from ._linear import Linear, linear_axes, linear_like
from ._rotary import RotaryEmbedding

__all__ = [
    "IMPLEMENTATIONS",
    "MultiHeadAttention",
    "causal_mask",
    "dot_product_attention",
]

# None and "xla": jax.nn.dot_product_attention's XLA path; "cudnn": its fused GPU kernel
# (fp16/bf16 on NVIDIA GPUs only); "plain": the einsum-softmax-einsum below (always used
# when attention dropout is active, which jax.nn.dot_product_attention does not support).
IMPLEMENTATIONS = (None, "xla", "cudnn", "plain")


def causal_mask(t_q: int, t_k: int, q_offset: Any = None, window: int | None = None) -> jax.Array:
    """``[t_q, t_k]`` boolean mask, True where query ``i`` may see key ``j``:
    ``j <= i + q_offset``. ``q_offset`` is the position of the first query among the keys;
    the default ``t_k - t_q`` aligns the last query with the last key. ``window`` (sliding-
    window attention, Mistral's and Gemma 2's): also ``j > i + q_offset - window``, the
    ``window`` latest keys, the query's own included.

    Example:
        >>> causal_mask(4, 4, window=2).astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    offset = t_k - t_q if q_offset is None else q_offset
    i = jnp.arange(t_q)[:, None]
    j = jnp.arange(t_k)[None, :]
    at = jnp.broadcast_to(i + offset, (t_q, t_k))  # the query's own position among the keys
    if window is None:
        return j <= at
    return (j <= at) & (j > at - window)


_BIG_NEGATIVE = -0.7 * np.finfo(np.float32).max


def dot_product_attention_vjp(q, k, v, mask, dret, *, key=None, dropout_rate=0.0):
    """Hand VJP of ``dot_product_attention``: ``(dq, dk, dv, None)``.

    With ``s = q k^T * scale`` (masked), ``p = softmax(s)``, ``p' = dropout(p)`` and
    ``o = p' v``: ``dv = p'^T do``, ``dp' = do v^T``, ``dp`` = the same dropout mask and
    scale on ``dp'``, ``ds = p * (dp - sum(p * dp))`` (softmax's rule) zeroed where masked,
    then ``dq = ds k * scale`` and ``dk = ds^T q * scale``.
    """
    acc = jnp.promote_types(q.dtype, jnp.float32)
    scale = jnp.asarray(1.0 / math.sqrt(q.shape[-1]), acc)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=acc) * scale
    if mask is not None:
        mask = jnp.broadcast_to(mask, logits.shape)
        logits = jnp.where(mask, logits, jnp.asarray(_BIG_NEGATIVE, acc))
    probs = jax.nn.softmax(logits, axis=-1)
    dropped = dropout(probs.astype(v.dtype), key, dropout_rate)
    dv = jnp.einsum("bnts,btnh->bsnh", dropped, dret)
    d_dropped = jnp.einsum("btnh,bsnh->bnts", dret, v, preferred_element_type=acc)
    d_probs = dropout(d_dropped, key, dropout_rate)
    d_logits = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    if mask is not None:
        d_logits = jnp.where(mask, d_logits, jnp.zeros((), acc))
    d_logits = d_logits * scale
    dq = jnp.einsum("bnts,bsnh->btnh", d_logits, k.astype(acc)).astype(q.dtype)
    dk = jnp.einsum("bnts,btnh->bsnh", d_logits, q.astype(acc)).astype(k.dtype)
    return dq, dk, dv, None


@hand_rule(dot_product_attention_vjp)
def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
    dropout_rate: float = 0.0,
) -> jax.Array:
    """``softmax(q k^T / sqrt(head_dim)) v`` for ``q: [B, Tq, H, D]``, ``k, v: [B, Tk, H, D]``
    and a boolean ``mask`` broadcastable to ``[B, H, Tq, Tk]`` (True = attend), with
    dropout on the attention weights when ``key`` is given. Logits and softmax in float32,
    masked logits set to a large negative number: the same arithmetic as
    ``jax.nn.dot_product_attention``'s XLA path, so the two agree."""
    acc = jnp.promote_types(q.dtype, jnp.float32)  # float32 logits, float64 stays float64
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=acc)
    logits = logits * jnp.asarray(scale, acc)
    if mask is not None:
        big_negative = jnp.asarray(_BIG_NEGATIVE, acc)
        logits = jnp.where(jnp.broadcast_to(mask, logits.shape), logits, big_negative)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    probs = dropout(probs, key, dropout_rate)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def slot_vjp(y, dret, *, index):
    """Hand VJP of ``slot``: the cotangent placed back in its slot, zeros elsewhere."""
    return jnp.zeros_like(y).at[..., index, :, :].set(dret)


@hand_rule(slot_vjp)
def slot(y: jax.Array, *, index: int) -> jax.Array:
    """``y[..., index, :, :]``: one of the stacked q, k, v of ``[..., T, 3, heads, head_dim]``."""
    return y[..., index, :, :]


class MultiHeadAttention(Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017) with fused q/k/v
    projections, as nanoGPT's ``CausalSelfAttention`` (Flax ``nn.MultiHeadDotProductAttention``,
    Equinox ``eqx.nn.MultiheadAttention``, both with separate q/k/v weights).

    ``qkv`` projects ``x`` to queries, keys and values (``W: [features, 3 * features]``,
    columns ``[q | k | v]``, each split into ``num_heads`` contiguous heads of ``head_dim =
    features // num_heads``); ``attend`` computes ``softmax(q k^T / sqrt(head_dim)) v`` per
    head; ``project`` merges the heads and applies the output ``Linear``.

    Masks: ``mask`` is boolean, True where a query may attend to a key, broadcastable
    (numpy rules) to ``[..., num_heads, T_q, T_k]`` where ``...`` are the input's batch
    axes; e.g. a key-padding mask ``valid: [B, T]`` is passed as ``valid[:, None, None, :]``.
    With ``causal=True`` query ``i`` also sees only keys ``j <= i + q_offset`` (see
    ``attend``). A query that may see no key gets the mean of all values (finite, not NaN).

    Dropout (``dropout_rate``, as nanoGPT): on the attention weights and on the output
    projection, each with its own half of ``key`` (``jax.random.split``); ``key=None`` is
    inference.

    Rotary position embeddings (``rotary=True``): ``qkv`` rotates q and k by their
    positions (``RotaryEmbedding``), ``0 .. T - 1`` or, for a decoder with a key/value
    cache, ``offset ..`` (``qkv(params, x, offset=pos)``): cached keys are stored rotated
    at their absolute positions. No params are added; the default (``False``) adds no
    position information, as before.

    Initialisers: ``W`` by ``w_init`` (LeCun normal, as Flax), ``b`` zeros.

    Args:
        features: model width (last axis of ``x``); a multiple of ``num_heads``.
        num_heads: number of heads.
        causal: apply the causal mask.
        use_bias: biases in the q/k/v and output projections.
        dropout_rate: dropout probability, ``0 <= rate < 1``.
        w_init: initializer of the projection weights.
        rotary: rotate q and k by position (RoPE); ``head_dim`` must be even.
        rotary_base: RoPE's wavelength scale (``RotaryEmbedding.base``).
        implementation: ``None``/``"xla"``/``"cudnn"`` pass to
            ``jax.nn.dot_product_attention`` (``"cudnn"``: fused GPU kernel, fp16/bf16);
            ``"plain"`` uses the einsum path (also used whenever attention dropout is on).
        param_dtype, dtype: parameter and compute dtypes (``dtype=None``: promote).

    Params: ``/qkv/W: [features, 3 * features]``, ``/qkv/b``, ``/out/W: [features,
    features]``, ``/out/b``.

    ``__call__(params, x, *, mask=None, key=None)``: ``x: [..., T, features]`` ->
    ``[..., T, features]``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> mha = MultiHeadAttention(8, num_heads=2, causal=True)
        >>> p = jax.jit(mha.init)(jax.random.key(0))
        >>> p.print()
        /qkv/W: f32[8,24]
        /qkv/b: f32[24]
        /out/W: f32[8,8]
        /out/b: f32[8]
        >>> x = jnp.ones((3, 5, 8))  # batch 3, 5 positions
        >>> jax.jit(mha)(p, x).shape
        (3, 5, 8)
        >>> q, k, v = jax.jit(mha.qkv)(p, x)  # the pieces, for a key/value-cache decoder
        >>> q.shape
        (3, 5, 2, 4)
        >>> jax.jit(lambda p, q, k, v: mha.project(p, mha.attend(q, k, v)))(p, q, k, v).shape
        (3, 5, 8)
    """

    features: int
    num_heads: int
    causal: bool = False
    use_bias: bool = True
    dropout_rate: float = 0.0
    w_init: str = "lecun_normal"
    implementation: str | None = None
    param_dtype: str = "float32"
    dtype: str | None = None
    rotary: bool = False
    rotary_base: float = 10000.0

    @property
    def uses_key(self) -> bool:
        """A key turns dropout on: only when ``dropout_rate > 0``."""
        return self.dropout_rate > 0

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints("features", "num_heads")
        if self.features % self.num_heads:
            raise ValueError(
                f"MultiHeadAttention: features={self.features} must be a multiple of "
                f"num_heads={self.num_heads}"
            )
        check_rate("MultiHeadAttention", "dropout_rate", self.dropout_rate)
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"MultiHeadAttention: unknown implementation {self.implementation!r}; valid: "
                + ", ".join(map(repr, IMPLEMENTATIONS))
            )
        self.qkv_linear  # validates w_init and the dtypes  # noqa: B018
        if self.rotary and self.head_dim % 2:
            raise ValueError(
                f"MultiHeadAttention: rotary=True needs an even head_dim, got features="
                f"{self.features} // num_heads={self.num_heads} = {self.head_dim}"
            )
        if self.rotary:
            self.rotary_embedding  # validates rotary_base  # noqa: B018

    @property
    def head_dim(self) -> int:
        return self.features // self.num_heads

    @property
    def rotary_embedding(self) -> RotaryEmbedding:
        """The rotation ``qkv`` applies to q and k when ``rotary``: over ``head_dim``, the
        positions along the T axis of ``[..., T, num_heads, head_dim]``."""
        return RotaryEmbedding(self.head_dim, self.rotary_base, seq_axis=-3)

    @property
    def qkv_linear(self) -> Linear:
        """The fused q/k/v projection, ``features -> 3 * features``."""
        return linear_like(self, self.features, 3 * self.features)

    @property
    def out_linear(self) -> Linear:
        """The output projection, ``features -> features``."""
        return linear_like(self, self.features, self.features)

    def param_axes(self) -> ParamsDict:
        """Megatron's attention: ``qkv`` column-parallel (``W: ("embed", "qkv")``), ``out``
        row-parallel (``W: ("heads", "embed")``), so a tensor axis splits the heads."""
        return ParamsDict(
            qkv=linear_axes(self.qkv_linear, "embed", "qkv"),
            out=linear_axes(self.out_linear, "heads", "embed"),
        )

    def init(self, key: jax.Array) -> ParamsDict:
        k_qkv, k_out = jax.random.split(key)
        return ParamsDict(qkv=self.qkv_linear.init(k_qkv), out=self.out_linear.init(k_out))

    def qkv(
        self, params: ParamsDict, x: jax.Array, *, offset: Any = 0
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of ``x: [..., T, features]``, each
        ``[..., T, num_heads, head_dim]``; with ``rotary``, q and k rotated at positions
        ``offset .. offset + T - 1`` (``offset``: where ``x`` starts in the sequence, an
        int that may be traced; a cached decoder passes the new token's position)."""
        self.check_input(x, self.features, min_rank=2)
        p_qkv = self.child(params, "qkv")
        with self.params_scope("/qkv"):
            y = self.qkv_linear(p_qkv, x)
        y = y.reshape(*x.shape[:-1], 3, self.num_heads, self.head_dim)
        q, k, v = slot(y, index=0), slot(y, index=1), slot(y, index=2)
        if self.rotary:
            rope = self.rotary_embedding
            q, k = rope(ParamsDict(), q, offset=offset), rope(ParamsDict(), k, offset=offset)
        return q, k, v

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        mask: jax.Array | None = None,
        key: jax.Array | None = None,
        q_offset: Any = None,
    ) -> jax.Array:
        """``softmax(q k^T / sqrt(head_dim)) v`` per head, with this module's causal mask and
        attention dropout.

        Args:
            q: ``[..., T_q, num_heads, head_dim]``.
            k, v: ``[..., T_k, num_heads, head_dim]`` (same batch axes as ``q``).
            mask: boolean, True = attend, broadcastable to ``[..., num_heads, T_q, T_k]``.
            key: dropout key for the attention weights (``None``: no dropout).
            q_offset: causal alignment, the position of ``q``'s first row among the keys:
                query ``i`` sees keys ``j <= i + q_offset``. Default ``T_k - T_q``, which
                aligns the last query with the last key (the usual case, and decoding with a
                cache that holds exactly the past keys). With a fixed-size cache of length
                ``T_k`` filled up to position ``n`` and one new query at position ``n``,
                pass ``q_offset=n`` (may be traced): it also hides the unfilled slots.

        Returns:
            ``[..., T_q, num_heads, head_dim]``.
        """
        head = (self.num_heads, self.head_dim)
        if q.ndim < 3 or q.shape[-2:] != head or k.shape[-2:] != head or v.shape != k.shape:
            raise ValueError(
                f"{self._short_repr()}.attend: expected q [..., T_q, {self.num_heads}, "
                f"{self.head_dim}] and k, v [..., T_k, {self.num_heads}, {self.head_dim}], got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        batch = q.shape[:-3]
        if k.shape[:-3] != batch:
            raise ValueError(
                f"{self._short_repr()}.attend: q and k must share their batch axes, got q "
                f"{tuple(q.shape)} and k {tuple(k.shape)}"
            )
        t_q, t_k = q.shape[-3], k.shape[-3]
        full = (*batch, self.num_heads, t_q, t_k)
        if mask is not None:
            mask = self._check_mask(mask, full)
        if self.causal:
            c = causal_mask(t_q, t_k, q_offset)
            c = jnp.broadcast_to(c, full)
            mask = c if mask is None else jnp.logical_and(mask, c)
        b = math.prod(batch)
        q4, k4, v4 = (a.reshape(b, *a.shape[-3:]) for a in (q, k, v))
        m4 = None if mask is None else jnp.broadcast_to(mask, full).reshape(b, *full[-3:])
        dropping = key is not None and self.dropout_rate > 0
        # Manual-gradient mode: the plain path, whose hand VJP is dot_product_attention_vjp.
        # float16 too: jax.nn's XLA path asks for the F16_F16_F32 dot algorithm, which
        # XLA:CPU refuses (train.precision=float16 under autodiff).
        f16 = q4.dtype == jnp.float16
        if dropping or self.implementation == "plain" or manual_active() or f16:
            out = dot_product_attention(q4, k4, v4, m4, key=key, dropout_rate=self.dropout_rate)
        else:
            out = jax.nn.dot_product_attention(
                q4, k4, v4, mask=m4, implementation=self.implementation
            )
        return out.reshape(*batch, *out.shape[-3:])

    def _check_mask(self, mask: Any, full: tuple[int, ...]) -> jax.Array:
        shape = tuple(getattr(mask, "shape", ()))
        dtype = getattr(mask, "dtype", None)
        if dtype is None or dtype != jnp.bool_:
            raise ValueError(
                f"{self._short_repr()}: mask must be a boolean array (True = attend), got "
                f"{f'dtype {dtype}' if dtype is not None else type(mask).__name__}"
            )
        try:
            ok = np.broadcast_shapes(shape, full) == full
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"{self._short_repr()}: mask of shape {shape} does not broadcast to "
                f"[..., num_heads, T_q, T_k] = {full}; a key-padding mask valid: [B, T] "
                "is passed as valid[:, None, None, :]"
            )
        return jnp.broadcast_to(mask, full)

    def project(self, params: ParamsDict, o: jax.Array) -> jax.Array:
        """Merge the heads of ``o: [..., T, num_heads, head_dim]`` and apply the output
        projection: ``[..., T, features]``."""
        if o.ndim < 3 or o.shape[-2:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"{self._short_repr()}.project: expected [..., T, {self.num_heads}, "
                f"{self.head_dim}], got shape {tuple(o.shape)}"
            )
        p_out = self.child(params, "out")
        with self.params_scope("/out"):
            return self.out_linear(p_out, o.reshape(*o.shape[:-2], self.features))

    def __call__(
        self,
        params: ParamsDict,
        x: jax.Array,
        *,
        mask: jax.Array | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        k_attn, k_out = (None, None) if key is None else jax.random.split(key)
        q, k, v = self.qkv(params, x)
        o = self.attend(q, k, v, mask=mask, key=k_attn)
        return dropout(self.project(params, o), k_out, self.dropout_rate)
