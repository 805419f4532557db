"""``flash_attention``: fused attention on the CPU, through a kernel compiled at first use.

On the CPU, attention through XLA's ops writes its ``[T, S]`` logits and probabilities to
memory and reads them back several times in the backward pass; at a GPT 6x6x384's layer
(context 256, batch 64) that is 2.2x the time of PyTorch's fused CPU kernel. This module
computes ``softmax(q k^T * scale) v`` in blocks of 64 keys with an online softmax
(FlashAttention, Dao et al. 2022; the backward of FlashAttention-2), the probabilities never
leaving the cache:

* ``_flash.cc`` holds two XLA FFI handlers, compiled at first use (``core/_native.py``)
  with the system's C++ compiler (``$CXX``, ``c++`` or ``g++``; ``-O3 -march=native``) into
  ``$NNLITE_CACHE`` (else ``~/.cache/nnlite``), keyed by the source, jaxlib and the CPU;
* two JAX primitives, ``nnlite_attention_fwd`` (``o`` and the softmax's log-denominator
  ``lse``) and ``nnlite_attention_bwd``, lower to those calls on the CPU; off the CPU, in a
  program XLA partitions over several devices (``fsdp``, ``tensor``: a custom call there
  would be replicated) and where the library is absent, they lower to the same arithmetic
  in XLA ops (``_reference_fwd``, ``_reference_bwd``);
* ``flash_attention`` is a ``jax.custom_vjp`` over them: the backward reads ``o`` and
  ``lse`` saved by the forward instead of recomputing it, in autodiff and in manual mode
  alike (a ``custom_vjp`` is a hand rule there).

Half-precision operands (bfloat16, float16) are widened to float32 on the way in and the
output rounded back on the way out: the kernel computes in float32, as XLA:CPU computes
their products, and a CPU without bfloat16 arithmetic has nothing faster to offer (XLA's
attention in bfloat16 took a 135M Llama's LoRA step about 0.6 s more than this).

``MultiHeadAttention`` takes this path by itself where it applies (``usable``): float32,
bfloat16 or float16 on the CPU, no explicit mask, no attention dropout or soft cap, causal
with a static offset (or not causal), ``head_dim`` a multiple of 16. ``NNLITE_CPU_ATTENTION=xla`` turns it off;
``flash_info()`` says which attention this process runs and why.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from ..core import _jax_private, _native
from ..core._mode import manual_active, manual_tape, note_rule
from ..grad._manual import hand_rule

__all__ = [
    "ENV",
    "flash_attention",
    "fused_attention",
    "fused_attention_vjp",
    "flash_attention_bwd",
    "flash_attention_fwd",
    "flash_info",
    "usable",
]

ENV = "NNLITE_CPU_ATTENTION"  # "fused" (the default) or "xla"
FWD, BWD = "nnlite_attention_fwd", "nnlite_attention_bwd"
_SOURCE = Path(__file__).with_name("_flash.cc")
_native.SETTINGS[ENV] = ("fused", "xla")


# ---------------------------------------------------------------------------- the library


@functools.cache
def _library() -> tuple[bool, str]:
    """Compile (once), load and register the handlers: ``(True, what)`` or ``(False, why)``."""
    if _native.setting(ENV) == "xla":
        return False, f"{ENV}=xla"
    try:
        _, path = _native.load(
            "attention", _SOURCE, {FWD: "NnliteAttentionFwd", BWD: "NnliteAttentionBwd"}
        )
    except _native.BUILD_ERRORS as e:
        return False, f"{type(e).__name__}: {e}"
    return True, f"nnlite's fused kernel ({path.name})"


def flash_info() -> str:
    """Which attention ``MultiHeadAttention`` runs on the CPU in this process, and why.

    Example:
        >>> flash_info().startswith(("fused:", "XLA:"))
        True
    """
    return _native.info("fused", _library)


# ---------------------------------------------------------------------------- reference


def _visible(q, k, mask, causal: bool, offset: int, window: int, masked: bool):
    """``[B, KV, G, T, S]`` (or broadcastable to it): True where query ``i`` sees key ``j``
    (None: every key)."""
    b, t, h, _ = q.shape
    s, kv = k.shape[1], k.shape[2]
    seen = None
    if causal:
        i, j = np.arange(t)[:, None], np.arange(s)[None, :]
        c = j <= i + offset
        if window > 0:
            c &= j > i + offset - window
        seen = jnp.asarray(c)[None, None, None]
    if masked:  # [Bm, Hm, Tm, Sm] -> [Bm, KV or 1, G or 1, Tm, Sm]
        m = (
            mask.reshape(mask.shape[0], kv, h // kv, *mask.shape[2:])
            if mask.shape[1] > 1
            else (mask[:, :, None])
        )
        seen = m if seen is None else seen & m
    return seen


def _grouped(q, k):
    b, t, h, d = q.shape
    kv = k.shape[2]
    return q.reshape(b, t, kv, h // kv, d)


def _logits(q, k, mask, scale, causal, offset, window, masked):
    """Scaled logits ``[B, KV, G, T, S]``, ``-inf`` where a query may not see a key."""
    s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q, k), k) * scale
    seen = _visible(q, k, mask, causal, offset, window, masked)
    return s if seen is None else jnp.where(seen, s, -jnp.inf)


def _reference_fwd(q, k, v, mask, *, scale, causal, offset, window, masked):
    """The forward kernel's arithmetic in XLA ops: ``(o, lse)``."""
    b, t, h, d = q.shape
    s = _logits(q, k, mask, scale, causal, offset, window, masked)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = _probs(s, lse)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, h, d)
    return o, lse.reshape(b, h, t)


def _probs(s, lse):
    """``softmax`` from the logits and their ``lse``; uniform where a query sees no key."""
    empty = jnp.isneginf(lse)[..., None]
    p = jnp.exp(s - jnp.where(empty, 0.0, lse[..., None]))
    return jnp.where(empty, 1.0 / s.shape[-1], p)


def _reference_bwd(q, k, v, mask, o, lse, do, *, scale, causal, offset, window, masked):
    """The backward kernel's arithmetic in XLA ops: ``(dq, dk, dv)``."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    s = _logits(q, k, mask, scale, causal, offset, window, masked)
    lse = lse.reshape(b, kv, h // kv, t)
    p = _probs(s, lse)
    dog = _grouped(do, k)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, dog)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, v)
    delta = jnp.einsum("btkgd,btkgd->bkgt", dog, _grouped(o, k))[..., None]
    ds = jnp.where(jnp.isneginf(lse)[..., None], 0.0, p * (dp - delta)) * scale
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k).reshape(b, t, h, d)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, _grouped(q, k))
    return dq, dk, dv


# ---------------------------------------------------------------------------- primitives

fwd_p = Primitive(FWD)
fwd_p.multiple_results = True
bwd_p = Primitive(BWD)
bwd_p.multiple_results = True


def _check(q, k, v, name):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"{name}: expected q [B, T, H, D] and k, v [B, S, KV, D], got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{name}: q {q.shape} and k {k.shape} differ in batch or head_dim, or KV does "
            "not divide H"
        )


def _check_mask(q, k, mask, name):
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    if (
        mask.dtype != jnp.bool_
        or mask.ndim != 4
        or any(m not in (1, f) for m, f in zip(mask.shape, full, strict=True))
    ):
        raise ValueError(
            f"{name}: mask must be boolean [B, H, T, S] = {list(full)} with axes of size 1 "
            f"where it broadcasts, got {mask.dtype}{list(mask.shape)}"
        )


def _fwd_abstract(q, k, v, mask, **params):
    _check(q, k, v, FWD)
    _check_mask(q, k, mask, FWD)
    b, t, h, _ = q.shape
    avals = (q, k, v, mask)
    return [
        _jax_private.result_aval(FWD, avals, q.shape, q.dtype),
        _jax_private.result_aval(FWD, avals, (b, h, t), q.dtype),
    ]


def _bwd_abstract(q, k, v, mask, o, lse, do, **params):
    _check(q, k, v, BWD)
    _check_mask(q, k, mask, BWD)
    avals = (q, k, v, mask, o, lse, do)
    return [_jax_private.result_aval(BWD, avals, x.shape, x.dtype) for x in (q, k, v)]


fwd_p.def_abstract_eval(_fwd_abstract)
bwd_p.def_abstract_eval(_bwd_abstract)


@functools.cache
def _eager(prim: Primitive, params: tuple):
    return jax.jit(lambda *xs: prim.bind(*xs, **dict(params)))


fwd_p.def_impl(lambda *xs, **p: _eager(fwd_p, tuple(sorted(p.items())))(*xs))
bwd_p.def_impl(lambda *xs, **p: _eager(bwd_p, tuple(sorted(p.items())))(*xs))


def _attrs(scale, causal, offset, window, masked) -> dict[str, Any]:
    return dict(
        scale=np.float32(scale), causal=bool(causal), offset=np.int64(offset),
        window=np.int64(window), masked=bool(masked),
    )  # fmt: skip


def _lowering(prim_name: str, reference):
    ffi = jax.ffi.ffi_lowering(prim_name)
    ref = mlir.lower_fun(reference, multiple_results=True)

    def lower_cpu(ctx, *args, **params):
        floats = [a.dtype for a in ctx.avals_in if a.dtype != jnp.bool_]
        kernel = all(d == jnp.float32 for d in floats) and _library()[0]
        if not kernel or _jax_private.partitioned_lowering(ctx):  # the kernel is float32
            return ref(ctx, *args, **params)
        return ffi(ctx, *args, **_attrs(**params))

    return ref, lower_cpu


for _prim, _reference in ((fwd_p, _reference_fwd), (bwd_p, _reference_bwd)):
    _ref, _cpu = _lowering(_prim.name, _reference)
    mlir.register_lowering(_prim, _ref)
    mlir.register_lowering(_prim, _cpu, platform="cpu")


def _batch(prim: Primitive):
    """vmap: the mapped axis folded into the batch axis ``B`` of every operand (the mask's
    too, where it does not broadcast along ``B`` already)."""

    def rule(args, dims, **params):
        n = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
        q, dq = args[0], dims[0]
        b = q.shape[1] if dq == 0 else q.shape[0]  # q's own batch axis
        flat = []
        for i, (x, d) in enumerate(zip(args, dims, strict=True)):
            if i == 3 and d is None and x.shape[0] == 1:  # a mask shared by everything
                flat.append(x)
                continue
            x = jnp.broadcast_to(x, (n, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
            if i == 3:  # the mask's own B axis may be 1
                x = jnp.broadcast_to(x, (n, b, *x.shape[2:]))
            flat.append(x.reshape(n * x.shape[1], *x.shape[2:]))
        outs = prim.bind(*flat, **params)
        return [y.reshape(n, -1, *y.shape[1:]) for y in outs], [0] * len(outs)

    return rule


batching.primitive_batchers[fwd_p] = _batch(fwd_p)
batching.primitive_batchers[bwd_p] = _batch(bwd_p)


# ---------------------------------------------------------------------------- the function


_NO_MASK = np.ones((1, 1, 1, 1), bool)


def _bind(prim: Primitive, q, k, v, mask, *rest, scale, causal, offset, window, masked):
    """``prim`` on ``(q, k, v, mask, *rest)``, the placeholder mask where none is given."""
    masked = mask is not None if masked is None else bool(masked)
    mask = jnp.asarray(_NO_MASK if mask is None else mask)
    args = _jax_private.match_varying(q, k, v, mask, *rest)
    return tuple(prim.bind(*args, scale=float(scale), causal=bool(causal), offset=int(offset),
                           window=int(window), masked=masked))  # fmt: skip


def flash_attention_fwd(q, k, v, mask=None, *, scale: float, causal: bool = False,
                        offset: int = 0, window: int = 0, masked: bool | None = None):  # fmt: skip
    """``(o, lse)``: the fused forward of ``flash_attention`` (``lse: [B, H, T]``, the log of
    each query's softmax denominator, ``-inf`` where it sees no key). ``mask``: boolean
    ``[B, H, T, S]``, each axis 1 where it broadcasts; ``masked``: whether to read it
    (default: whether one was given)."""
    return _bind(fwd_p, q, k, v, mask, scale=scale, causal=causal, offset=offset,
                 window=window, masked=masked)  # fmt: skip


def flash_attention_bwd(q, k, v, mask, o, lse, do, *, scale: float, causal: bool = False,
                        offset: int = 0, window: int = 0, masked: bool | None = None):  # fmt: skip
    """``(dq, dk, dv)``: the fused backward of ``flash_attention``, from the forward's ``o``
    and ``lse`` and the output's cotangent ``do`` (``mask`` and ``masked`` as the forward's)."""
    return _bind(bwd_p, q, k, v, mask, o, lse, do, scale=scale, causal=causal, offset=offset,
                 window=window, masked=masked)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, mask, scale, causal, offset, window, masked):
    return flash_attention_fwd(q, k, v, mask, scale=scale, causal=causal, offset=offset,
                               window=window, masked=masked)[0]  # fmt: skip


def _flash_fwd(q, k, v, mask, scale, causal, offset, window, masked):
    o, lse = flash_attention_fwd(q, k, v, mask, scale=scale, causal=causal, offset=offset,
                                 window=window, masked=masked)  # fmt: skip
    return o, (q, k, v, mask, o, lse)


def _flash_bwd(scale, causal, offset, window, masked, res, do):
    dq, dk, dv = flash_attention_bwd(*res, do, scale=scale, causal=causal, offset=offset,
                                     window=window, masked=masked)  # fmt: skip
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def fused_attention_vjp(q, k, v, mask, dret, *, scale, causal, offset, window, masked):
    """Hand rule of ``fused_attention``: the forward kernel again for ``o`` and ``lse``,
    then the backward kernel; no cotangent for the mask. (A compiled step does not run the
    forward twice: ``fused_attention`` keeps the forward's ``o`` and ``lse``.)"""
    static = dict(scale=scale, causal=causal, offset=offset, window=window, masked=masked)
    o, lse = flash_attention_fwd(q, k, v, mask, **static)
    dq, dk, dv = flash_attention_bwd(q, k, v, mask, o, lse, dret, **static)
    return dq, dk, dv, None


@hand_rule(fused_attention_vjp)
def fused_attention(q, k, v, mask, *, scale, causal, offset, window, masked):
    """``flash_attention`` with its arguments resolved (``mask`` 4-D, ``masked`` whether
    to read it): the function ``nnlite.rules`` lists, with ``fused_attention_vjp``."""
    return _flash(q, k, v, mask, scale, causal, offset, window, masked)


def _fused(q, k, v, mask, **static):
    """``fused_attention``; in manual mode too through ``_flash``'s own ``custom_vjp`` (its
    backward reuses the forward's ``o`` and ``lse``), the call recorded as the hand rule's
    for ``check_manual`` and ``show_grad`` (which print ``fused_attention_vjp``)."""
    if not manual_active():
        return _flash(q, k, v, mask, **static)
    note_rule(fused_attention)
    out = _flash(q, k, v, mask, **static)
    tape = manual_tape()
    if tape is not None:
        tape.append((fused_attention, (q, k, v, mask), static, out))
    return out


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    q_offset: int | None = None,
    window: int | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """``softmax(q k^T * scale) v`` for ``q: [B, T, H, D]`` and ``k, v: [B, S, KV, D]``
    (``KV`` divides ``H``: query head ``h`` reads kv head ``h // (H // KV)``), fused: on the
    CPU one kernel call forward and one backward, the probabilities never in memory.

    ``mask``: boolean, broadcastable to ``[B, H, T, S]`` (True = attend; a key-padding mask
    ``valid: [B, S]`` is ``valid[:, None, None, :]``), on top of the causal mask; a query
    that sees no key gets the mean of all values (as ``dot_product_attention``).

    ``causal``: query ``i`` sees keys ``j <= i + q_offset`` (default ``S - T``, the last
    query aligned with the last key), and with ``window`` only the ``window`` latest of
    them. ``scale`` defaults to ``1 / sqrt(D)``. Differentiable (reverse mode); the same
    result as ``dot_product_attention`` with that mask, to float32 rounding.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = jnp.ones((1, 4, 2, 16)); kv = jnp.ones((1, 4, 1, 16))
        >>> jax.jit(flash_attention)(q, kv, kv).shape
        (1, 4, 2, 16)
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check(q, k, v, "flash_attention")
    offset = k.shape[1] - q.shape[1] if q_offset is None else int(q_offset)
    if causal and offset < 0:
        raise ValueError(f"flash_attention: q_offset must be >= 0 when causal, got {offset}")
    if window is not None and (not causal or window < 1):
        raise ValueError(f"flash_attention: window={window!r} needs causal=True and >= 1")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    m = jnp.asarray(_NO_MASK) if mask is None else _mask4(jnp.asarray(mask), q, k)
    dtype = jnp.result_type(q, k, v)
    if dtype in _HALF and _kernel_here():  # the kernel is float32: widened, rounded back
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out = _fused(q, k, v, m, scale=scale, causal=bool(causal), offset=offset if causal else 0,
                 window=window or 0, masked=mask is not None)  # fmt: skip
    return out.astype(dtype)


def _mask4(mask, q, k):
    """``mask`` (broadcastable to ``[B, H, T, S]``) as 4 axes, each 1 or full."""
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    try:
        ok = mask.dtype == jnp.bool_ and np.broadcast_shapes(mask.shape, full) == full
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"flash_attention: mask must be boolean and broadcast to [B, H, T, S] = "
            f"{list(full)}, got {mask.dtype}{list(mask.shape)}"
        )
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _kernel_here() -> bool:
    """Whether attention traced now runs on the kernel: the CPU, the kernel built, not held off."""
    return not _native.held_off(ENV) and jax.default_backend() == "cpu" and _library()[0]


def usable(q, k, v, *, causal: bool, q_offset: Any) -> bool:
    """Whether ``flash_attention`` takes this attention on this process's CPU: float32
    operands (or bfloat16 or float16 ones, widened), ``head_dim`` a multiple of 16, a causal
    offset known at trace time and >= 0, the default backend the CPU and the kernel built
    (``flash_info``)."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.float32), *_HALF):
        return False
    if q.ndim != 4 or q.shape[-1] % 16 or 0 in q.shape or 0 in k.shape:
        return False
    if causal:
        offset = k.shape[1] - q.shape[1] if q_offset is None else q_offset
        if not isinstance(offset, int | np.integer) or offset < 0:
            return False
    return _kernel_here()
