"""What the machine has: the CPU's model and matrix ISA, or the accelerator's kind.

The run's banner names it, so a user reading a speed knows what it was measured on, and
why ``train.precision: bfloat16`` is not faster on a CPU without bfloat16 hardware: there
XLA computes each bfloat16 dot in float32 (converts around an f32 GEMM; see
benchmarks/README.md, "XLA:CPU flags and the bfloat16 matmul").
"""

from __future__ import annotations

from nnlite.core._host_memory import kept as host_memory_kept
from nnlite.core._native import BF16_FLAGS, cpuinfo_text
from nnlite.core._native import parse_cpu_flags as cpu_flags

# /proc/cpuinfo flag -> what the banner calls it, in the order it lists them: the vector
# and matrix extensions XLA's and PyTorch's CPU GEMMs choose their kernels by
ISA = (
    ("avx2", "AVX2"),
    ("avx512f", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("amx_bf16", "AMX"),
)

BF16_EMULATED = (
    "note: train.precision bfloat16 on a CPU without AVX512-BF16 or AMX: its matrix "
    "products run in float32 here (the operands widened), so it saves activation memory, "
    "not time, on this machine"
)


def cpu_model(cpuinfo: str) -> str | None:
    """The first processor's ``model name``, whitespace collapsed."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return " ".join(value.split()) or None
    return None


def isa_names(flags: frozenset[str]) -> list[str]:
    """The :data:`ISA` extensions among ``flags``, by their banner names."""
    return [name for flag, name in ISA if flag in flags]


def describe_cpu(cpuinfo: str) -> str | None:
    """``Intel(R) Xeon(R) Platinum 8480+ (AVX2, AVX-512, AVX512-BF16, AMX)`` from a
    /proc/cpuinfo text; None when the text has no flags (then nothing is said)."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return None
    names = isa_names(flags)
    isa = ", ".join(names) if names else "none of AVX2, AVX-512, AVX512-BF16, AMX"
    return f"{cpu_model(cpuinfo) or 'unknown model'} ({isa})"


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text; '' where there is none (macOS, Windows). Read once, with
    nnlite's kernels (``nnlite.core._native.cpuinfo_text``)."""
    return cpuinfo_text()


HOST_MEMORY_KEPT = (
    "host memory: freed blocks kept for the next step (NNLITE_CPU_MEMORY=keep; "
    "resident memory stays at its peak)"
)


def machine_lines(
    device, precision: str = "float32", cpuinfo: str | None = None, kept: bool | None = None
) -> list[str]:
    """The banner's lines about the machine for a run on ``device`` (a jax Device) in
    ``precision``: ``cpu: MODEL (ISA)``, for bfloat16 on a CPU without bfloat16 hardware
    :data:`BF16_EMULATED`, and :data:`HOST_MEMORY_KEPT` where the process keeps freed host
    memory (``nnlite.keep_host_memory``); on an accelerator, its platform and device kind.
    ``cpuinfo``: a /proc/cpuinfo text (default: this machine's); ``kept``: default, whether
    this process keeps it."""
    if device.platform != "cpu":
        return [f"{device.platform}: {getattr(device, 'device_kind', device.platform)}"]
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    cpu = describe_cpu(text)
    if cpu is None:
        return []
    lines = [f"cpu: {cpu}"]
    if precision == "bfloat16" and not cpu_flags(text) & BF16_FLAGS:
        lines.append(BF16_EMULATED)
    if host_memory_kept() if kept is None else kept:
        lines.append(HOST_MEMORY_KEPT)
    return lines
