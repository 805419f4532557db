"""Faults injected into the tests' training processes through public seams, never through
the code under test: ``python -m _inject ARGS`` (tests/ on the path: :func:`env`) is
``python -m train ARGS`` with the faults its environment names applied first, in every
process a launcher (``--processes N``) starts too.

- :data:`PAUSE_ENV` = seconds: every checkpoint file nl.save and nl.save_sharded write
  pauses twice, half-written and then written but not renamed, and a sharded checkpoint's
  directory once more before its rename (``os.fdopen`` and ``os.replace`` wrapped for a
  checkpoint's temporary names), so that a test can kill the process there.
- :data:`STUCK_ENV` = ``STEP`` or ``STEP:PROCESS``: the first compiled call that runs step
  STEP or a later one (on process PROCESS only) is followed by one that never finishes,
  handed to the watchdog (``train.faults.Watchdog.watch`` wrapped) and waited for: a stuck
  call on that process and, for its peers, a collective that never completes. With
  :data:`STUCK_MARK_ENV` = a path, that process creates the file once it is stuck, so a
  test can act after the step is stuck, not before.
- :data:`PREPARE_PAUSE_ENV` = seconds: ``nnlite-train prepare`` sleeps after each chunk of
  its input (the readers ``train.prepare`` calls wrapped) and before it commits ``--out``,
  so that a test can signal or kill it half-way.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

PAUSE_ENV = "NNLITE_INJECT_CHECKPOINT_PAUSE_S"
STUCK_ENV = "NNLITE_INJECT_STUCK_AT_STEP"
STUCK_MARK_ENV = "NNLITE_INJECT_STUCK_MARK"
PREPARE_PAUSE_ENV = "NNLITE_INJECT_PREPARE_PAUSE_S"
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def env(
    base: dict | None = None,
    *,
    pause: float | None = None,
    stuck: str | None = None,
    stuck_mark: Path | None = None,
    prepare_pause: float | None = None,
) -> dict:
    """``base`` (default: this process's environment) with the repository and tests/ on
    PYTHONPATH (for ``python -m _inject``) and the faults asked for."""
    out = dict(os.environ if base is None else base)
    paths = [str(ROOT), str(TESTS), out.get("PYTHONPATH")]
    out["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if pause is not None:
        out[PAUSE_ENV] = str(pause)
    if stuck is not None:
        out[STUCK_ENV] = stuck
    if stuck_mark is not None:
        out[STUCK_MARK_ENV] = str(stuck_mark)
    if prepare_pause is not None:
        out[PREPARE_PAUSE_ENV] = str(prepare_pause)
    return out


def _is_checkpoint_tmp(name: str) -> bool:
    """A temporary name of nl.save (``X.safetensors.<hex>.tmp``) or nl.save_sharded's
    directory (``ckpt_<step>.shards.tmp``)."""
    return name.endswith(".tmp") and (".safetensors." in name or name.endswith(".shards.tmp"))


class _PausedFile:
    """A file whose one ``write`` stops halfway for ``seconds`` (flushed: on disk)."""

    def __init__(self, f, seconds: float):
        self._f, self._seconds = f, seconds

    def write(self, data):
        half = len(data) // 2
        self._f.write(data[:half])
        self._f.flush()
        time.sleep(self._seconds)
        return half + self._f.write(data[half:])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)


def pause_writes(seconds: float) -> None:
    """Every checkpoint write of this process pauses (module docstring, :data:`PAUSE_ENV`)."""
    fdopen, replace = os.fdopen, os.replace

    def paused_fdopen(fd, *args, **kwargs):
        f = fdopen(fd, *args, **kwargs)
        if isinstance(fd, int) and _is_checkpoint_tmp(os.readlink(f"/proc/self/fd/{fd}")):
            return _PausedFile(f, seconds)
        return f

    def paused_replace(src, dst, *args, **kwargs):
        if _is_checkpoint_tmp(os.fspath(src)):
            time.sleep(seconds)
        return replace(src, dst, *args, **kwargs)

    os.fdopen, os.replace = paused_fdopen, paused_replace


class StuckCall:
    """A compiled call that does not finish until ``release`` is set (never, by default):
    its host callback waits. The CPU runtime runs a call with a host callback in the
    dispatching thread, so it is dispatched from a thread of its own; ``block_until_ready``
    waits for it as for any output (and holds up the device's later calls meanwhile)."""

    def __init__(self, release: threading.Event | None = None):
        self.release = release or threading.Event()
        self._thread = threading.Thread(target=self._run, name="stuck-call", daemon=True)
        self._thread.start()

    def _run(self):
        import jax
        import numpy as np

        def wait(x):
            self.release.wait()
            return x

        spec = jax.ShapeDtypeStruct((), np.float32)
        jax.block_until_ready(jax.jit(lambda x: jax.pure_callback(wait, spec, x))(np.float32(0)))

    def block_until_ready(self):
        self._thread.join()
        return self


def stick_at(step: int, process: int | None = None) -> None:
    """The loop of this process gets stuck at ``step`` (module docstring, :data:`STUCK_ENV`)."""
    import jax

    from train import faults

    watch = faults.Watchdog.watch
    stuck: list[StuckCall] = []

    def stuck_watch(self, first, output):
        watch(self, first, output)  # the call for steps first + 1 ... was dispatched
        if stuck or first + 1 < step or process not in (None, jax.process_index()):
            return
        stuck.append(StuckCall())
        watch(self, first, stuck[0])
        if os.environ.get(STUCK_MARK_ENV):
            Path(os.environ[STUCK_MARK_ENV]).touch()
        stuck[0].block_until_ready()  # as at any sync point: never returns

    faults.Watchdog.watch = stuck_watch


def pause_prepare(seconds: float) -> None:
    """``train.prepare`` sleeps after each chunk of its input that it encodes or trains a
    BPE tokenizer on (its readers wrapped: they sleep once the token writer exists or
    while the tokenizer trains), and before it commits its staging directory to ``--out``."""
    from train import prepare

    busy = {"writing": False, "training": 0}

    def paused(read):
        def chunks(*args, **kwargs):
            for chunk in read(*args, **kwargs):
                yield chunk
                if busy["writing"] or busy["training"]:
                    time.sleep(seconds)

        return chunks

    for name in ("read_text", "read_blocks", "bpe_pieces"):
        setattr(prepare, name, paused(getattr(prepare, name)))

    class Writer(prepare.TokenWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            busy["writing"] = True

    prepare.TokenWriter = Writer
    train_bpe = prepare.train_bpe

    def training(*args, **kwargs):
        busy["training"] += 1
        try:
            return train_bpe(*args, **kwargs)
        finally:
            busy["training"] -= 1

    prepare.train_bpe = training
    commit = prepare.staging.commit

    def late_commit(*args, **kwargs):
        time.sleep(seconds)
        return commit(*args, **kwargs)

    prepare.staging.commit = late_commit


def from_env() -> None:
    """Apply the faults the environment names, and have a launcher start its processes
    through this module so that they get them too."""
    from train.parallel import launch

    launch.TRAINER = "_inject"
    if os.environ.get(PAUSE_ENV):
        pause_writes(float(os.environ[PAUSE_ENV]))
    if os.environ.get(PREPARE_PAUSE_ENV):
        pause_prepare(float(os.environ[PREPARE_PAUSE_ENV]))
    if os.environ.get(STUCK_ENV):
        at, _, proc = os.environ[STUCK_ENV].partition(":")
        stick_at(int(at), int(proc) if proc else None)


if __name__ == "__main__":
    from train.__main__ import main

    from_env()
    sys.exit(main(sys.argv[1:], compile_cache=True, standalone=True))
