"""Test helper: one of several processes (``jax.distributed``) that write one sharded
checkpoint together through the trainer's writer, each only the shards of its own devices.

``python tests/_sharded_writer.py COORDINATOR NUM_PROCESSES PROCESS_ID CKPT_DIR``; the
state is :func:`state` sharded over every process's devices (a 1-D mesh of all of them).
Then both resume from it as the trainer does (``train.resume.agree_on_start``) onto
another mesh, the same devices in reverse order, so each process reads the rows the other
process wrote, and print what they hold. Then process 0 starts the next checkpoint
alone, with barriers of 1 s: it prints the barrier's error and how long it waited, while
process 1 stays alive without joining.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

STEP = 7


def full_state() -> dict:
    """The whole values (every process knows them; the test compares with them)."""
    return {
        "params": {
            "W": np.arange(16 * 3, dtype=np.float32).reshape(16, 3),
            "b": np.linspace(-1, 1, 3, dtype=np.float32),  # replicated
        },
        "opt_state": {"mu": np.arange(32, dtype=np.float32) / 7, "count": np.int32(STEP)},
    }


def state(mesh):
    """:func:`full_state` placed: first dimensions split over the mesh where they divide;
    each process builds only its own devices' parts (``make_array_from_callback``)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size

    def place(v):
        spec = P("x") if v.ndim and v.shape[0] % n == 0 else P()
        return jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i: v[i])

    return jax.tree.map(place, full_state())


def main(coordinator: str, num: int, pid: int, ckpt_dir: Path) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num, pid, initialization_timeout=60)
    import nnlite as nl
    from train.checkpoint import store as ckpt
    from train.parallel import distributed as dist

    mesh = jax.make_mesh((len(jax.devices()),), ("x",), devices=dist.global_devices(4))
    s = state(mesh)
    # np.asarray of an array spread over processes raises: gathering cannot happen quietly.
    assert not s["params"]["W"].is_fully_addressable
    from _sharded_strategy import ShardedParams

    from train.checkpoint.resume import agree_on_start
    from train.config import load_config, to_dict

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs/digits_mlp.yaml", ["train.steps=10"])
    meta = {"written_by": "test", "config": to_dict(cfg)}
    ckpt.save_sharded(ckpt_dir, STEP, s["params"], s["opt_state"], meta, 2, dist.barrier)

    try:  # the whole-file writer refuses what no process holds whole
        nl.save(ckpt_dir.parent / "whole.safetensors", s)
    except nl.CheckpointError as e:
        print(e)

    reversed_mesh = ShardedParams(dist.global_devices(4)[::-1])
    want = full_state()
    start = agree_on_start(cfg, "auto", ckpt_dir, want["params"], want["opt_state"], reversed_mesh)
    W = start.p_leaves[0]  # params/W, placed by the strategy
    rows = sorted({s.index[0].indices(16)[:2] for s in W.addressable_shards})
    for leaf, whole in zip(
        start.p_leaves + start.o_leaves,
        jax.tree.leaves((want["params"], want["opt_state"])),
        strict=True,
    ):
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])
    print(f"resumed at step {start.step} from {start.checkpoint.name}: W rows {rows}")
    t0 = time.monotonic()
    if pid == 0:
        try:
            ckpt.save_sharded(
                ckpt_dir, STEP + 1, s["params"], s["opt_state"], {}, 2,
                lambda name: dist.barrier(name, timeout_s=1),
            )  # fmt: skip
        except dist.BarrierTimeout as e:
            print(f"after {time.monotonic() - t0:.1f} s: {e}")
    else:
        time.sleep(2)  # alive, never at the barrier
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
