"""nnlite's native CPU kernels: C++ sources compiled at first use into a cached library.

Two kernels ship as source (the fused attention, ``nnlite/nn/_flash.cc``; the call of
MKL's GEMM, ``nnlite/core/_gemm.cc``). Each is compiled once with the system's C++ compiler
(``$CXX``, ``c++`` or ``g++``) into ``$NNLITE_CACHE`` (else ``~/.cache/nnlite``), keyed by
its source, the headers it includes from this folder, jaxlib's version and the CPU (the
code is built with ``-march=native``). ``_pool.h`` is the one parallel loop both run on
XLA's own thread pool. A missing compiler or a failed build is an error the caller turns
into "not available" (each kernel's ``*_info()`` says why) and XLA's ops run instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

__all__ = [
    "BF16_FLAGS",
    "BUILD_ERRORS",
    "SETTINGS",
    "cache_dir",
    "check_settings",
    "cpu_flags",
    "cpuinfo_text",
    "held_off",
    "info",
    "keep",
    "load",
    "off",
    "parse_cpu_flags",
    "setting",
]

HEADERS = (Path(__file__).with_name("_pool.h"),)
COMPILE_TIMEOUT_S = 300
# What a failed build or load raises: the callers fall back to XLA's ops on these.
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError, AttributeError)
_LOADED: list = []  # a library must outlive every compiled program that calls it
# Each kernel's environment switch and the values it takes, the default first
# (NNLITE_CPU_ATTENTION, NNLITE_CPU_GEMM): registered by the kernels' modules.
SETTINGS: dict[str, tuple[str, ...]] = {}


def setting(env: str) -> str:
    """``$env`` (a registered switch), or its default; a ValueError naming the value and
    the accepted ones where it is none of them."""
    choices = SETTINGS[env]
    value = os.environ.get(env, choices[0])
    if value not in choices:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(choices)}")
    return value


_OFF: list[str] = []  # the switches ``off`` holds off (process-wide, while it is held)


@contextlib.contextmanager
def off(env: str):
    """Programs traced inside run without the kernel switched by ``env`` (XLA's ops
    instead), whatever ``$env`` says: the benchmarks' and tests' in-process A/B. A function
    that ``jax.jit`` traced before keeps the program it traced then (jit's cache is keyed by
    the function): wrap it in a fresh one."""
    if env not in SETTINGS:
        raise ValueError(
            f"no native kernel is switched by {env!r}: expected one of {list(SETTINGS)}"
        )
    _OFF.append(env)
    try:
        yield
    finally:
        _OFF.remove(env)


def held_off(env: str) -> bool:
    """Whether an enclosing :func:`off` holds the kernel switched by ``env`` off."""
    return env in _OFF


def check_settings() -> None:
    """Every kernel switch checked at once (the trainer does at start-up, so a bad value is
    an error even in a run whose model never reaches that kernel)."""
    for env in SETTINGS:
        setting(env)


def cache_dir() -> Path:
    """``$NNLITE_CACHE``, else ``~/.cache/nnlite`` (the trainer's cache folder too:
    ``train/data/text/corpus.py``)."""
    root = os.environ.get("NNLITE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "nnlite").expanduser()


#: The /proc/cpuinfo flags that give a CPU bfloat16 dot products in hardware.
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def parse_cpu_flags(cpuinfo: str) -> frozenset[str] | None:
    """The first processor's ``flags`` in a /proc/cpuinfo text; None when it has none
    (not an x86 Linux text)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return None


@functools.cache
def cpuinfo_text() -> str:
    """/proc/cpuinfo's text, read once; '' where there is none (macOS, Windows)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo has none)."""
    return parse_cpu_flags(cpuinfo_text()) or frozenset()


def _cpu_key() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags."""
    text = cpuinfo_text()
    if not text:
        return platform.processor()
    lines = [x for x in text.splitlines() if x.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(stem: str, source: Path) -> Path:
    """``source``'s shared library, compiled once per source, headers, jaxlib and CPU."""
    import jaxlib

    text = source.read_bytes()
    key = hashlib.sha256(
        text
        + b"".join(h.read_bytes() for h in HEADERS)
        + f"|{jaxlib.__version__}|{sys.platform}|{platform.machine()}|".encode()
        + _cpu_key().encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++) on the PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
    includes = ["-I", jax.ffi.include_dir(), "-I", str(HEADERS[0].parent)]
    try:
        done = subprocess.run(
            [*cmd, *includes, "-x", "c++", "-", "-o", tmp],
            input=text,
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            lines = done.stderr.decode(errors="replace").strip().splitlines() or ["?"]
            first = next((x for x in lines if "error" in x), lines[0])
            raise RuntimeError(f"{compiler} failed on {source.name}: {first}")
        os.replace(tmp, target)  # atomic: a process compiling beside this one is unharmed
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def info(name: str, library) -> str:
    """``"<name>: what"`` where ``library()`` (a kernel's ``(loaded, what or why)``) loaded on
    this process's CPU backend, else ``"XLA: why"``: the kernels' ``*_info()``."""
    if jax.default_backend() != "cpu":
        return f"XLA: {jax.default_backend()} backend"
    ok, what = library()
    return f"{name}: {what}" if ok else f"XLA: {what}"


def keep(lib) -> None:
    """Keep ``lib`` (a library a kernel calls into) loaded for the process's lifetime."""
    _LOADED.append(lib)


def load(stem: str, source: Path, handlers: dict[str, str]) -> tuple[ctypes.CDLL, Path]:
    """Build (once) and load ``source``, and register each ``{target: symbol}`` handler as
    an XLA FFI target on the CPU. Raises one of ``BUILD_ERRORS`` where it cannot."""
    path = _build(stem, source)
    lib = ctypes.CDLL(str(path))
    for target, symbol in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    _LOADED.append(lib)
    return lib, path
