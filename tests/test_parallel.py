"""The parallel strategies: one class per strategy, asked by the stepper and the loop."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from train import parallel
from train.config import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]


def test_registry_is_the_configs_choice_and_names_its_classes():
    assert STRATEGIES == parallel.NAMES
    for name in parallel.NAMES:
        assert parallel.strategy_class(name).name == name
    with pytest.raises(ValueError, match="unknown parallel strategy 'zero'.*'none'"):
        parallel.strategy_class("zero")


def test_no_strategy_name_is_compared_outside_the_registry():
    # The stepper, loop, memory estimate and checkpoints ask the strategy object.
    names = "|".join(re.escape(n) for n in parallel.NAMES)
    literal = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in (ROOT / "train").rglob("*.py")
        if "parallel" not in path.parts
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line) or "parallel.strategy ==" in line
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("name", parallel.NAMES)
def test_state_round_trips_through_placement(name):
    devices = jax.devices()[:1] if name == "none" else jax.devices()[:4]
    strategy = parallel.get(name, devices)
    leaves = [np.arange(12, dtype=np.float32).reshape(3, 4), np.float32(2.5)]
    placed = strategy.put_state(leaves)
    back = strategy.get_state(placed)
    for a, b in zip(leaves, back, strict=True):
        np.testing.assert_array_equal(np.asarray(b), a)
    # replicated strategies: every device holds the whole tree
    avals = [jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for v in leaves]
    assert strategy.bytes_per_device(avals) == sum(np.asarray(v).nbytes for v in leaves)


def test_data_parallel_device_selection_names_the_batch_that_splits():
    from train.config import ConfigError, ParallelConfig

    cls = parallel.strategy_class("shard_map")
    assert len(cls.select_devices(ParallelConfig("shard_map", 4), 8)) == 4
    with pytest.raises(ConfigError, match="batch_size=10 does not split across 4 devices.*8 or 12"):
        cls.select_devices(ParallelConfig("shard_map", 4), 10)
    with pytest.raises(ConfigError, match="parallel.devices=9 but only 8"):
        cls.select_devices(ParallelConfig("pmap", 9), 18)
