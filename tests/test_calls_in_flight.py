"""One process driving several CPU devices bounds its calls in flight (the stall of
docs/distributed.md), and XLA's own collective abort is moved past the watchdog."""

import jax

from train.loop.trainer import max_in_flight
from train.parallel import xla_collectives


def test_several_cpu_devices_in_one_process_bound_the_calls_in_flight():
    assert jax.devices()[0].platform == "cpu" and len(jax.devices()) == 8
    assert max_in_flight(False, 8) == 0  # one process, 8 host devices
    assert max_in_flight(False, 2) == 0
    assert max_in_flight(True, 1) == 0  # several processes, as before
    assert max_in_flight(False, 1) is None  # one device: full async dispatch


def test_xla_collective_abort_is_moved_past_the_watchdog(monkeypatch):
    flag = xla_collectives.TERMINATE_FLAG
    got = xla_collectives.with_collective_timeout("--xla_force_host_platform_device_count=8")
    assert got == f"--xla_force_host_platform_device_count=8 {flag}=86400"
    mine = f"{flag}=90"
    assert xla_collectives.with_collective_timeout(mine) == mine  # the user's value wins
    monkeypatch.setenv("XLA_FLAGS", "")
    xla_collectives.apply()
    import os

    assert os.environ["XLA_FLAGS"] == f"{flag}=86400"
