"""Surviving faults: exit statuses, preemption (SIGTERM/SIGINT) and the non-finite guard.

Exit statuses of ``python -m train`` (also listed in docs/distributed.md):

====  ==================================================================================
0     finished
1     unexpected failure, including a lost peer in a multi-process run
2     bad input: config, command line, data, or a checkpoint that does not fit
3     preempted: stopped on SIGTERM/SIGINT after writing a checkpoint; rerun to resume
4     stopped on a non-finite loss/gradient/param (``train.nonfinite: stop``); the last
      good checkpoint is untouched
====  ==================================================================================
"""

from __future__ import annotations

import os
import signal
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 3
EXIT_NONFINITE = 4


class Preempted(Exception):
    """Training stopped on a signal after saving ``checkpoint`` at ``step``."""

    def __init__(self, step: int, checkpoint, signal_name: str):
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name
        super().__init__(f"{signal_name}: stopped at step {step}, checkpoint {checkpoint}")


class NonFinite(Exception):
    """A step produced a non-finite loss, gradient or param; the message says which."""


class PreemptionWatch:
    """Turns SIGTERM/SIGINT into "stop after this call, checkpoint, exit 3".

    One process: a Python handler sets a flag that the loop reads after each compiled
    call. Several processes: the processes must stop at the *same* step, so we use JAX's
    preemption sync point: ``jax.distributed.initialize`` installs a SIGTERM notifier that
    tells the coordinator; every process reports its call counter and all of them stop at
    the fastest one's next call. ``reached_preemption_sync_point`` is a local, lock-only
    check, so calling it after every compiled call costs nothing. SIGINT (Ctrl-C) is
    forwarded as SIGTERM to reach the same notifier. A second signal quits at once
    (exit 128 + signal number); the checkpoints on disk are crash-safe.

    Use as a context manager around the loop; the previous handlers come back on exit.
    """

    def __init__(self, multiprocess: bool):
        self.multiprocess = multiprocess
        self.signal_name: str | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self):
        # Several processes: leave SIGTERM to JAX's notifier (a Python handler would replace it).
        sigs = (signal.SIGINT,) if self.multiprocess else (signal.SIGINT, signal.SIGTERM)
        for s in sigs:
            self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved.clear()

    def _handle(self, signum, _frame):
        if self.signal_name is not None:
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        if self.multiprocess:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, call_index: int) -> bool:
        """True at the call where this (and every other) process must save and stop.

        ``call_index`` counts compiled calls since the loop started: 1, 2, 3, ... on every
        process alike.
        """
        if not self.multiprocess:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(call_index):
            self.signal_name = self.signal_name or "SIGTERM"
            return True
        return False


def first_nonfinite(loss_fn, optimizer, params, opt_state, x, y) -> str | None:
    """Name the first non-finite value of one step: ``loss``, ``grads/<path>``, ``params/<path>``.

    Runs the step once more on one device on the host's copy of the state before the bad
    step; None if everything comes out finite there.
    """
    # Imported here: ``python -m train`` imports this module before it knows it will train
    # (--print-config and config errors answer without loading JAX).
    import jax
    import numpy as np
    import optax

    import nnlite as nl

    @jax.jit
    def step(params, opt_state, x, y):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, _ = optimizer.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates)

    loss, grads, new_params = jax.device_get(step(params, opt_state, x, y))
    if not np.isfinite(loss):
        return "loss"
    for prefix, tree in (("grads", grads), ("params", new_params)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not np.all(np.isfinite(leaf)):
                return prefix + nl.format_path(path)
    return None
