"""XLA:CPU's own abort of a collective that waits too long, moved past nnlite's watchdog.

XLA:CPU aborts the whole process (``Termination timeout for all reduce ... of 40 seconds
exceeded``: a C++ ``LOG(FATAL)``, status 134, no Python line) when the devices of one
process have not all reached a collective within 40 s. On a loaded machine that can be
a slow step, not a deadlock, and it always pre-empts the training loop's watchdog
(``train.step_timeout``, automatic: 300 s for the first calls, then at least 30 s), whose
exit 5 says what happened, keeps the checkpoints and tells how to resume. So the command
sets XLA's limit to a day, unless ``XLA_FLAGS`` sets it already: the watchdog decides
when a call is stuck. It must happen before JAX starts its backend (``nnlite-train``
does it first thing; the ``--processes`` launcher's children inherit it).
"""

from __future__ import annotations

import os

TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
TERMINATE_S = 24 * 3600


def with_collective_timeout(xla_flags: str, seconds: int = TERMINATE_S) -> str:
    """``xla_flags`` with XLA:CPU's collective termination timeout set to ``seconds``,
    unless it sets one already (the user's choice wins)."""
    if TERMINATE_FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {TERMINATE_FLAG}={seconds}".strip()


def apply() -> None:
    """Set it in this process's ``XLA_FLAGS`` (before JAX's backend starts)."""
    os.environ["XLA_FLAGS"] = with_collective_timeout(os.environ.get("XLA_FLAGS", ""))
