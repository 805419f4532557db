"""``matmul``: nnlite's matrix product, on Intel MKL's GEMM where MKL is installed.

On the CPU, XLA (jaxlib 0.10) multiplies matrices with its own GEMM, which at a
transformer's shapes runs at 0.5-1.0x the rate of MKL, the GEMM PyTorch calls: on a 2-core
Xeon with AVX-512, a GPT 6x6x384's `[16384,384] x [384,1152]` at 146 GFLOP/s against MKL's
314, a 135M Llama's tied head at 213 against 293 (``benchmarks/README.md``). MKL ships on
the package registry (``pip install "nnlite[mkl]"``, the ``mkl`` wheel's ``libmkl_rt``), so
where it is installed nnlite's layers multiply through it:

* on the CPU, a float32, float64 or bfloat16 product of at least ``MIN_FLOPS`` binds the
  primitive ``nnlite_gemm``, which lowers to an XLA FFI call (``_gemm.cc``, compiled at
  first use by ``_native``) of MKL's ``cblas_sgemm``/``cblas_dgemm``, or for bfloat16
  operands ``cblas_gemm_bf16bf16f32`` (a float32 result, as XLA's CPU dot computes it;
  MKL runs it on AMX or AVX512-BF16 where the CPU has them; elsewhere the handler widens
  the operands to float32 block by block for sgemm, never whole). MKL runs single-threaded (its
  sequential layer) and the handler cuts each product into pieces on XLA's own threads, so
  MKL's threads and XLA's never contend for the cores;
* elsewhere (a GPU, float16, a small product, MKL or a compiler absent,
  ``NNLITE_CPU_GEMM=xla``) it is ``jax.lax.dot_general``: the jaxpr XLA alone would see.

The primitive is a first-class JAX op: its JVP and transpose are two more ``nnlite_gemm``
products (``jax.grad`` and the layers' hand rules both run on MKL), it batches under
``jax.vmap``, and in a program XLA partitions over several devices (``fsdp``, ``tensor``:
a custom call there would be replicated) it lowers to ``dot_general``; inside a manual
``shard_map`` body (one device's share) it stays an MKL call. ``nl.gemm_info()`` says which
GEMM this process runs and why.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib.metadata
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _jax_private, _native

__all__ = ["ENV", "MIN_FLOPS", "gemm_info", "gemm_p", "matmul", "on_mkl"]

TARGET = "nnlite_gemm"
ENV = "NNLITE_CPU_GEMM"  # "auto" (the default: MKL where installed), "mkl" or "xla"
CHOICES = ("auto", "mkl", "xla")
# Below this many FLOPs a product stays XLA's: it may fuse into its neighbours, and the
# call's fixed cost is no longer small against the product (the digits MLP's
# [128,64]x[64,128] step ran 1.12x slower on MKL; a 784-512-512-10 MLP's products at
# batch 256 at parity, a 1024-4096-4096-10's at 0.72x).
MIN_FLOPS = 2 * 128**3
_SOURCE = Path(__file__).with_name("_gemm.cc")
_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL


# ---------------------------------------------------------------------------- the library


def _mkl_candidates() -> list[str]:
    """Where ``libmkl_rt`` may be: the ``mkl`` wheel's files, this environment's ``lib``
    folder (where the wheel puts it), then the system's loader path."""
    found = []
    try:
        for f in importlib.metadata.files("mkl") or ():
            if f.name.startswith("libmkl_rt.so"):
                found.append(str(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = Path(prefix) / "lib"
        found += sorted(str(p) for p in lib.glob("libmkl_rt.so*") if p.exists())
    system = ctypes.util.find_library("mkl_rt")
    return list(dict.fromkeys([*found, *([system] if system else [])]))


def _load_mkl() -> tuple[ctypes.CDLL, bool]:
    """``libmkl_rt`` loaded, and whether its calls run single-threaded (its sequential
    layer; another part of the process may have chosen MKL's threads first)."""
    errors = []
    for path in _mkl_candidates():
        try:
            mkl = ctypes.CDLL(path)
            mkl.MKL_Set_Threading_Layer.restype = ctypes.c_int
            layer = mkl.MKL_Set_Threading_Layer(_SEQUENTIAL)
            mkl.cblas_sgemm, mkl.cblas_dgemm, mkl.cblas_gemm_bf16bf16f32  # noqa: B018 (all exist)
        except (OSError, AttributeError) as e:
            errors.append(f"{path}: {e}")
            continue
        return mkl, layer == _SEQUENTIAL
    raise OSError(
        "no Intel MKL (libmkl_rt) found"
        + (f" ({'; '.join(errors)})" if errors else ": pip install 'nnlite[mkl]'")
    )


_native.SETTINGS[ENV] = CHOICES


@functools.cache
def _choice() -> str:
    """``NNLITE_CPU_GEMM``, checked (every ``matmul`` reads it, so a bad value is an error
    even where no product is large enough to take MKL)."""
    return _native.setting(ENV)


@functools.cache
def _library() -> tuple[bool, str]:
    """Load MKL, compile (once) and register the handler: ``(True, what)`` or ``(False, why)``."""
    choice = _choice()
    if choice == "xla":
        return False, f"{ENV}=xla"
    try:
        mkl, sequential = _load_mkl()
        lib, _ = _native.load("gemm", _SOURCE, {TARGET: "NnliteGemm"})
        lib.nnlite_gemm_set_blas.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
        _HANDED.update(lib=lib, mkl=mkl, sequential=sequential)
        hand_blas(bf16_gemm=_bf16_arithmetic())
    except _native.BUILD_ERRORS as e:
        if choice == "mkl":
            raise RuntimeError(f"{ENV}=mkl, but {type(e).__name__}: {e}") from None
        return False, f"{type(e).__name__}: {e}"
    _native.keep(mkl)
    threads = "in pieces on XLA's threads" if sequential else "on MKL's own threads"
    bf16 = "gemm_bf16bf16f32" if _bf16_arithmetic() else "bfloat16 widened in blocks for sgemm"
    return True, f"Intel MKL (sgemm, dgemm, {bf16}) through {TARGET}, {threads}"


_HANDED: dict = {}  # the handler's library, MKL and its threading, once loaded


def hand_blas(*, bf16_gemm: bool) -> None:
    """Hand MKL's GEMMs to the loaded handler: bfloat16 products on MKL's bfloat16 GEMM
    (``bf16_gemm``: what a CPU with bfloat16 arithmetic gets) or widened in blocks for sgemm
    (what others get; the tests switch between the two on one machine)."""
    mkl = _HANDED["mkl"]
    gemms = (mkl.cblas_sgemm, mkl.cblas_dgemm, mkl.cblas_gemm_bf16bf16f32 if bf16_gemm else None)
    pointers = [None if f is None else ctypes.cast(f, ctypes.c_void_p).value for f in gemms]
    _HANDED["lib"].nnlite_gemm_set_blas(*pointers, int(_HANDED["sequential"]))


@functools.cache
def _bf16_arithmetic() -> bool:
    """Whether this CPU computes in bfloat16 (AVX512-BF16 or AMX). With it, MKL's bfloat16
    GEMM runs on that hardware; without, the handler widens a bfloat16 product's operands
    block by block in cache for MKL's sgemm (the same numbers: MKL's bfloat16 GEMM widens
    them too, more slowly: a 135M Llama's bfloat16 forward took 1.87 s that way against
    1.65 s with the operands widened whole by XLA, 2.07 s on XLA's dot)."""
    return bool(_native.cpu_flags() & _native.BF16_FLAGS)


def forced(mkl: bool):
    """A context: products traced inside take XLA's dot (``mkl=False``: ``_native.off``), or
    the route ``NNLITE_CPU_GEMM`` and this machine give (``True``)."""
    return contextlib.nullcontext() if mkl else _native.off(ENV)


def _on() -> bool:
    return not _native.held_off(ENV) and jax.default_backend() == "cpu" and _library()[0]


def gemm_info() -> str:
    """Which GEMM nnlite's layers run on this process's default backend, and why.

    Example:
        >>> gemm_info().startswith(("MKL:", "XLA:"))
        True
    """
    return _native.info("MKL", _library)


# ---------------------------------------------------------------------------- the primitive

gemm_p = Primitive(TARGET)


def _dims(shape_a, shape_b, transpose_a: bool, transpose_b: bool):
    """``(batch, m, k, n)`` of ``op(a) @ op(b)``, or a ValueError naming the shapes."""
    if len(shape_a) != len(shape_b) or len(shape_a) < 2:
        raise ValueError(f"{TARGET}: operands of equal rank >= 2, got {shape_a} and {shape_b}")
    m, k = shape_a[-2:][:: -1 if transpose_a else 1]
    k2, n = shape_b[-2:][:: -1 if transpose_b else 1]
    batch = []
    for x, y in zip(shape_a[:-2], shape_b[:-2], strict=True):
        if x != y and 1 not in (x, y):
            raise ValueError(f"{TARGET}: batch axes of {shape_a} and {shape_b} do not broadcast")
        batch.append(max(x, y))
    if k != k2:
        raise ValueError(
            f"{TARGET}: contracted sizes differ ({k} and {k2}) in {shape_a} x {shape_b} "
            f"(transpose_a={transpose_a}, transpose_b={transpose_b})"
        )
    return tuple(batch), m, k, n


def _result_dtype(dtype, rounded: bool):
    """The product's dtype: for bfloat16 operands float32 (MKL accumulates and writes it in
    float32, as XLA's CPU dot does), or that rounded to bfloat16 in the handler where
    ``rounded``; else the operands'."""
    wide = dtype == jnp.bfloat16 and not rounded
    return jnp.dtype(jnp.float32) if wide else jnp.dtype(dtype)


def _abstract_eval(a, b, *, transpose_a, transpose_b, rounded):
    if a.dtype != b.dtype:
        raise TypeError(f"{TARGET}: operands of one dtype, got {a.dtype} and {b.dtype}")
    batch, m, _, n = _dims(a.shape, b.shape, transpose_a, transpose_b)
    out = _result_dtype(a.dtype, rounded)
    return _jax_private.result_aval(TARGET, (a, b), (*batch, m, n), out)


@functools.cache
def _eager(transpose_a: bool, transpose_b: bool, rounded: bool):
    return jax.jit(
        functools.partial(
            gemm_p.bind, transpose_a=transpose_a, transpose_b=transpose_b, rounded=rounded
        )
    )


gemm_p.def_abstract_eval(_abstract_eval)
gemm_p.def_impl(lambda a, b, **p: _eager(**p)(a, b))


def _bind(a, b, transpose_a: bool, transpose_b: bool, rounded: bool = False):
    """``gemm_p``; ``rounded``: bfloat16 operands' float32 product rounded to bfloat16 by
    the handler (the same numbers as rounding it after, without writing it in float32)."""
    a, b = _jax_private.match_varying(a, b)
    rounded = bool(rounded) and jnp.result_type(a) == jnp.bfloat16
    return gemm_p.bind(
        a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), rounded=rounded
    )


def _unbroadcast(x, shape):
    """Sum ``x`` over the batch axes that ``shape`` broadcast (size 1 there)."""
    axes = tuple(i for i, (s, t) in enumerate(zip(shape[:-2], x.shape[:-2])) if s == 1 != t)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _summed(shape, ct_shape) -> bool:
    """Whether an operand of ``shape`` broadcast batch axes that its cotangent sums over."""
    return any(s == 1 != t for s, t in zip(shape[:-2], ct_shape[:-2]))


def _transpose_a(ct, a, b, *, transpose_a, transpose_b, rounded):
    # bfloat16 operands: the float32 cotangent rounded to theirs (by the handler, unless
    # broadcast batch axes are summed after: that sum is float32's). The primal's own
    # `rounded` says nothing about its cotangents.
    del rounded
    dtype = a.aval.dtype
    ct = ct.astype(dtype)
    narrow = not _summed(a.aval.shape, ct.shape)
    if transpose_a:  # a: [..., k, m]; d a = op(b) ct^T
        out = _bind(b, ct, transpose_b, True, narrow)
    else:  # d a = ct op(b)^T
        out = _bind(ct, b, False, not transpose_b, narrow)
    return _unbroadcast(out, a.aval.shape).astype(dtype)


def _transpose_b(ct, a, b, *, transpose_a, transpose_b, rounded):
    del rounded  # as _transpose_a
    dtype = b.aval.dtype
    ct = ct.astype(dtype)
    narrow = not _summed(b.aval.shape, ct.shape)
    if transpose_b:  # b: [..., n, k]; d b = ct^T op(a)
        out = _bind(ct, a, True, transpose_a, narrow)
    else:  # d b = op(a)^T ct
        out = _bind(a, ct, not transpose_a, False, narrow)
    return _unbroadcast(out, b.aval.shape).astype(dtype)


ad.defbilinear(gemm_p, _transpose_a, _transpose_b)


def _batch(args, dims, *, transpose_a, transpose_b, rounded):
    a, b = (x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True))
    if dims[1] is None and not transpose_a and b.ndim == 2:
        # One weight for every example: the examples are more rows of one product.
        rows = a.reshape(-1, a.shape[-1])
        out = _bind(rows, b, False, transpose_b, rounded)
        return out.reshape(*a.shape[:-1], out.shape[-1]), 0
    a = a if dims[0] is not None else a[None]
    b = b if dims[1] is not None else b[None]
    return _bind(a, b, transpose_a, transpose_b, rounded), 0


batching.primitive_batchers[gemm_p] = _batch


def _op(x, transpose: bool):
    return jnp.swapaxes(x, -1, -2) if transpose else x


def _dot(a, b, *, transpose_a, transpose_b, preferred_element_type=None):
    """``op(a) @ op(b)`` as ``jnp.matmul`` (XLA folds the transposes into its dot): the
    product where MKL is not taken, and the primitive's lowering where it may not be."""
    return jnp.matmul(
        _op(a, transpose_a), _op(b, transpose_b), preferred_element_type=preferred_element_type
    )


def _dot_prim(a, b, *, transpose_a, transpose_b, rounded):
    """The primitive's arithmetic in XLA's dot (its result dtype: ``_result_dtype``)."""
    out = _result_dtype(a.dtype, rounded)
    pref = out if out != a.dtype else None
    return _dot(a, b, transpose_a=transpose_a, transpose_b=transpose_b, preferred_element_type=pref)


_lower_dot = mlir.lower_fun(_dot_prim, multiple_results=False)
_lower_mkl = jax.ffi.ffi_lowering(TARGET)


def _lower_cpu(ctx, a, b, *, transpose_a, transpose_b, rounded):
    if _jax_private.partitioned_lowering(ctx) or not _library()[0]:
        return _lower_dot(
            ctx, a, b, transpose_a=transpose_a, transpose_b=transpose_b, rounded=rounded
        )
    # the result's dtype (float32 or bfloat16) says whether the handler rounds
    return _lower_mkl(ctx, a, b, transpose_a=transpose_a, transpose_b=transpose_b)


mlir.register_lowering(gemm_p, _lower_dot)
mlir.register_lowering(gemm_p, _lower_cpu, platform="cpu")


# ---------------------------------------------------------------------------- the function


def _worthy(a, b, flops: int, preferred) -> bool:
    dtype = jnp.result_type(a)
    if dtype == jnp.bfloat16:  # MKL's product is float32: rounded back where none is asked
        kept = preferred is None or jnp.dtype(preferred) in (jnp.float32, jnp.bfloat16)
    else:
        kept = dtype in (jnp.float32, jnp.float64) and (
            preferred is None or jnp.dtype(preferred) == dtype
        )
    return flops >= MIN_FLOPS and dtype == jnp.result_type(b) and kept and _on()


def on_mkl(a: jax.Array, b: jax.Array, *, transpose_a=False, transpose_b=False) -> bool:
    """Whether :func:`matmul` of these operands (no ``preferred_element_type``) binds
    ``nnlite_gemm`` here: MKL on the CPU (in a program XLA partitions, it lowers to XLA's
    dot all the same)."""
    batch, m, k, n = _dims(jnp.shape(a), jnp.shape(b), transpose_a, transpose_b)
    return _worthy(a, b, 2 * math.prod(batch) * m * k * n, None)


def matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    preferred_element_type=None,
) -> jax.Array:
    """``op(a) @ op(b)`` with ``op(x) = x^T`` (its last two axes swapped) where ``transpose_x``.

    ``b`` 2-D: ``a: [..., m, k]`` (any leading axes, folded into the rows unless
    ``transpose_a``). Otherwise ``a`` and ``b`` have one rank and leading (batch) axes that
    are equal or 1. ``preferred_element_type`` as ``jnp.matmul``'s (MKL where it is the
    operands' dtype, or float32 for bfloat16 operands). On the CPU with MKL installed, a
    float32, float64 or bfloat16 product of at least ``MIN_FLOPS`` runs on MKL
    (``nl.gemm_info()``); anywhere else this is ``jax.lax.dot_general``. Differentiable (both modes), batchable, and usable inside
    ``jax.jit`` and ``shard_map``.

    Example:
        >>> import jax.numpy as jnp
        >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((5, 4))
        >>> matmul(x, w, transpose_b=True).shape
        (2, 3, 5)
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul: operands of 2 or more axes, got {a.shape} and {b.shape}")
    if b.ndim == 2 and a.ndim != 2 and not transpose_a:
        lead = a.shape[:-1]
        out = matmul(
            a.reshape(-1, a.shape[-1]),
            b,
            transpose_b=transpose_b,
            preferred_element_type=preferred_element_type,
        )
        return out.reshape(*lead, out.shape[-1])
    batch, m, k, n = _dims(a.shape, b.shape, transpose_a, transpose_b)
    _choice()
    if _worthy(a, b, 2 * math.prod(batch) * m * k * n, preferred_element_type):
        want = jnp.dtype(preferred_element_type or a.dtype)
        out = _bind(a, b, transpose_a, transpose_b, rounded=want == jnp.bfloat16)
        return out.astype(want)
    return _dot(
        a,
        b,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        preferred_element_type=preferred_element_type,
    )
