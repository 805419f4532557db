"""The XLA flags of every test process: conftest.py puts them in ``XLA_FLAGS`` (so every
subprocess inherits them), and a test that starts a subprocess with another device count
keeps the rest with :func:`xla_flags`.

``--xla_backend_optimization_level=0``: LLVM's optimisation is most of the time XLA:CPU
spends compiling the suite's hundreds of tiny programs, and the tests check what the
programs compute, not how fast: level 0 takes the suite from about 9.5 to 7.5 minutes on
2 cores. The code it makes rounds a little differently from the default's, so every
process that a test compares bit for bit must be compiled with the same flags (hence
:func:`xla_flags`); the comparisons with tolerances derive them from float rounding and
hold at either level.

``--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1``: XLA:CPU's
MLIR fusion emitters and its codegen split into parallel modules cost more compile time
than they save on these tiny programs: tests/test_gpt.py took 65 s of CPU with level 0
alone, 43 s with these too (the init program of ``python -m train`` is compiled without
the fusion emitters for the same reason, train/loop/build.py).
"""

# The collective abort timeout as ``python -m train`` sets it (train/parallel/xla_collectives.py):
# XLA's options are part of the compilation cache's key, so the suite's in-process runs and
# its ``python -m train`` subprocesses share compiled programs only with the same flags.
COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
    "--xla_cpu_parallel_codegen_split_count=1 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=86400"
)


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test's subprocess with ``devices`` host CPU devices."""
    return f"{COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"
