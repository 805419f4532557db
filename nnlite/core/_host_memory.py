"""Host memory kept for reuse between a CPU program's runs (glibc's malloc tuned once).

XLA:CPU allocates each run's temporaries as one block and frees it when the run ends: 1.4 GB
for a 135M Llama's LoRA step at 4 x 256 tokens, 2.5 GB for the 6x6x384 GPT's step. glibc
serves a block that large with ``mmap`` and gives it back to the kernel at ``free``, so
every step first-touches all of it again: 350,000 minor page faults for the LoRA step,
650,000 for the GPT step, each page zeroed by the kernel.

:func:`keep_host_memory` tells glibc to keep freed memory for reuse: one arena for every
thread (``M_ARENA_MAX``: a thread's own arena cannot hold a block over 64 MB, so it would
``mmap`` it anyway), no ``mmap`` for large blocks (``M_MMAP_MAX``) and no trimming of the
heap (``M_TRIM_THRESHOLD``). Measured on 2 cores of an Intel Xeon (benchmarks/README.md,
session 17) it made those steps 5-20% faster. The price is resident memory: the process
keeps its peak, and where a run's temporaries are allocated before the last run's are
freed, or small blocks split a freed one, the heap grows by another block before it
settles (the LoRA step: 4.3 GB resident against a 4.1 GB peak; the GPT step: 10.7 GB
against 5.9 GB). So it is a choice, not a default: ``NNLITE_CPU_MEMORY=keep`` makes
``nnlite-train`` call it before JAX starts; ``release`` makes it do nothing anywhere;
``auto`` (the default) leaves glibc alone unless a script calls it.

It has to run before JAX's backend starts (the first computation, ``jax.devices()``): by then
XLA's threads have their own arenas, which a later call cannot take back.
"""

from __future__ import annotations

import ctypes
import sys
import warnings

from ._jax_private import backend_started
from ._native import SETTINGS, setting

__all__ = ["ENV", "keep_host_memory", "kept", "keep_if_asked"]

ENV = "NNLITE_CPU_MEMORY"
SETTINGS[ENV] = ("auto", "keep", "release")

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_KEPT = False


def _glibc():
    """This process's C library when it is glibc (the one :func:`keep_host_memory` tunes),
    else None (musl, macOS, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: not musl)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_host_memory(*, warn: bool = True) -> bool:
    """Keep host memory that XLA:CPU frees for the next run instead of returning it to the
    kernel (see the module's text). Call it first thing, before JAX's backend starts.

    True when it took effect (now or before). False, and nothing changed, where
    ``NNLITE_CPU_MEMORY=release``, where the C library is not glibc, or where JAX's backend
    has started already (with a warning, unless ``warn=False``). A value of
    ``NNLITE_CPU_MEMORY`` other than ``auto``/``keep``/``release`` is a ValueError."""
    global _KEPT
    if setting(ENV) == "release":
        return False
    if _KEPT:
        return True
    libc = _glibc()
    if libc is None:
        return False
    if backend_started():
        if warn:
            warnings.warn(
                "nnlite.keep_host_memory(): JAX's backend has started already, so XLA's "
                "threads keep their own malloc arenas; call it before the first computation",
                stacklevel=2,
            )
        return False
    for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)):
        if libc.mallopt(param, value) != 1:  # -1 as size_t: never trim
            raise RuntimeError(f"glibc's mallopt({param}, {value}) failed")
    _KEPT = True
    return True


def keep_if_asked() -> bool:
    """:func:`keep_host_memory` where ``NNLITE_CPU_MEMORY=keep`` (``nnlite-train`` and the
    benchmarks call it first thing); whether the memory is kept."""
    return setting(ENV) == "keep" and keep_host_memory(warn=False)


def kept() -> bool:
    """Whether :func:`keep_host_memory` took effect in this process."""
    return _KEPT
