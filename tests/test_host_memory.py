"""nnlite.keep_host_memory: freed host memory kept for the next run of a CPU program (glibc),
so a program whose temporaries exceed malloc's mmap limits does not fault all its pages in
again at every run; NNLITE_CPU_MEMORY (auto: a script's call keeps, release: nothing
does), the late call and a bad value."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

import nnlite as nl
from nnlite.core import _host_memory

pytestmark = pytest.mark.skipif(
    _host_memory._glibc() is None, reason="tunes glibc's malloc: Linux with glibc only"
)

# A program with 64 MB of temporaries (a [4096, 4096] float32): more than glibc's largest
# mmap threshold (32 MB) and all a thread's own arena could hold.
SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import nnlite as nl
    kept = nl.keep_host_memory()
    import jax, jax.numpy as jnp
    x = jax.random.normal(jax.random.key(0), (4096, 64))
    f = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x)
    faults = []
    for _ in range(24):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": kept, "faults": faults[12:]}))
    """
)


def _faults(setting: str) -> dict:
    env = {**os.environ, _host_memory.ENV: setting}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _median(xs: list) -> int:
    return sorted(xs)[len(xs) // 2]


def test_kept_memory_is_not_faulted_in_again_at_each_run():
    kept, released = _faults("auto"), _faults("release")
    temp_pages = 4096 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")
    assert kept["kept"] and not released["kept"]
    # glibc's defaults: each run maps its temporaries afresh and touches every page again
    assert _median(released["faults"]) > temp_pages // 2, released
    # kept: once settled (the last 12 of 24 runs), the runs reuse the memory the first
    # ones had; before that the heap grows a few times (three under the suite's load),
    # where a run's temporaries are allocated before the last run's are freed
    assert _median(kept["faults"]) < temp_pages // 20, kept


def test_a_late_call_says_so_and_changes_nothing(monkeypatch):
    jax.devices()  # the backend has started (as in any process that computed something)
    monkeypatch.setattr(_host_memory, "_KEPT", False)
    monkeypatch.delenv(_host_memory.ENV, raising=False)
    with pytest.warns(UserWarning, match="backend has started already"):
        assert nl.keep_host_memory() is False
    assert not _host_memory.kept()


def test_a_bad_setting_names_the_value(monkeypatch):
    monkeypatch.setenv(_host_memory.ENV, "fast")
    with pytest.raises(ValueError, match=r"NNLITE_CPU_MEMORY='fast': expected one of auto"):
        nl.keep_host_memory()
