"""The XLA options nnlite compiles its programs with: ``compiler_options``.

On the CPU, XLA (jaxlib 0.10) hands every matrix product to a YNNPACK fusion by default.
At the shapes of a transformer's layers that is slower than XLA's own dot (Eigen's GEMM):
measured side by side on a 2-core Intel Xeon with AVX-512, ``[16384, 384] @ [384, 1152]``
at 106 GFLOP/s against 174, a batched attention product at 38 against 53, and the
GPT 6x6x384 training step 10.5 s against 7.8 s. So nnlite's programs turn the YNNPACK
fusions off on the CPU, unless the process's ``XLA_FLAGS`` set that option itself (the user's
choice wins). Elsewhere the options are XLA's defaults.
"""

from __future__ import annotations

import os

import jax

__all__ = ["compiler_options"]

# XLA:CPU's option naming the kinds of op YNNPACK may take; empty: none.
_YNN = "xla_cpu_experimental_ynn_fusion_type"
CPU_OPTIONS = {_YNN: ""}


def compiler_options(backend: str | None = None) -> dict[str, str]:
    """The XLA options nnlite's own programs are compiled with on ``backend`` (default
    ``jax.default_backend()``): on the CPU XLA's own dot instead of YNNPACK's fusions,
    elsewhere none. An option the process's ``XLA_FLAGS`` already sets is left out, so
    ``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot`` brings YNNPACK back.

    Pass them to your own programs for the same speed::

        step = jax.jit(train_step, compiler_options=nl.compiler_options())

    Example:
        >>> compiler_options("cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""} or (
        ...     "xla_cpu_experimental_ynn_fusion_type" in os.environ.get("XLA_FLAGS", ""))
        True
        >>> compiler_options("gpu")
        {}
    """
    if (backend or jax.default_backend()) != "cpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in CPU_OPTIONS.items() if f"--{k}" not in flags}
