"""Sharded checkpoints: written shard by shard by every process (nothing gathered), atomic,
read back whole (``nl.load``, ``train.load_run``) or placed onto another mesh."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _inject
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from _common import NPZ_MLP
from _sharded_strategy import ShardedParams, use_sharded_strategy
from _sharded_writer import STEP, full_state
from _xla import xla_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
import train
from train.checkpoint import store as ckpt
from train.config import load_config
from train.loop.trainer import train as train_run
from train.parallel.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/digits_mlp.yaml"
# Resumes that change train.steps follow one schedule only if it is constant.
COMMON = [
    *NPZ_MLP,
    "train.batch_size=32",
    "train.log_every=5",
    "train.eval_every=100",
    "checkpoint.every=5",
    "checkpoint.keep=3",
    "optimizer.schedule=constant",
    "log.progress=false",
    "log.plot=false",
]


def run(tmp_path, *overrides, resume="auto"):
    cfg = load_config(ROOT / CONFIG, [*COMMON, f"log.dir={tmp_path}", *overrides])
    return train_run(cfg, resume=resume, echo=lambda *_: None)


def shard_tables(ckpt_path: Path) -> dict[str, dict]:
    """``{file name: {shard key: [leaf key, bounds]}}`` of a sharded checkpoint."""
    tables = {}
    for f in sorted(ckpt_path.glob("shards_*.safetensors")):
        with safetensors.safe_open(str(f), "np") as st:
            tables[f.name] = json.loads(st.metadata()["shards"])
    return tables


def script_env() -> dict:
    """The environment of a test script run as ``python tests/<script>.py`` (its own
    directory comes first on its path, so the repository is added)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def mesh_of(n: int, axes=("x",), shape=None):
    return jax.make_mesh(shape or (n,), axes, devices=jax.devices()[:n])


def test_sharded_write_reads_back_whole_and_onto_other_meshes(tmp_path, monkeypatch):
    m8, m42 = mesh_of(8), mesh_of(8, ("a", "b"), (4, 2))
    full = {
        "W": np.arange(16 * 6, dtype=np.float32).reshape(16, 6),
        "V": np.arange(8 * 6, dtype=np.float32).reshape(8, 6) - 20,
        "b": np.linspace(-1, 1, 6).astype(jnp.bfloat16),
        "count": np.int32(3),
    }
    shardings = {
        "W": NamedSharding(m8, P("x")),
        "V": NamedSharding(m42, P("a", "b")),  # a 2-D mesh: 8 blocks
        "b": NamedSharding(m8, P()),  # replicated on 8 devices: stored once
        "count": NamedSharding(m8, P()),
    }
    state = {k: jax.device_put(v, shardings[k]) for k, v in full.items()}
    path = nl.save_sharded(tmp_path / "c.shards", state, metadata={"step": "3"})
    assert sorted(p.name for p in path.iterdir()) == [
        "index.safetensors",
        "shards_00000.safetensors",
    ]
    assert not list(tmp_path.glob("*.tmp"))
    # Each stored piece is one device's replica-0 shard: W and V in 8 pieces, b and count once.
    (table,) = shard_tables(path).values()
    pieces = {}
    for leaf, bounds in table.values():
        pieces.setdefault(leaf, []).append(bounds)
    assert {k: len(v) for k, v in pieces.items()} == {"W": 8, "V": 8, "b": 1, "count": 1}
    assert sorted(pieces["W"]) == [[[2 * i, 2 * i + 2], [0, 6]] for i in range(8)]
    assert nl.load_metadata(path) | {"step": "3"} == nl.load_metadata(path)
    assert nl.load_metadata(path)["format"] == "nnlite.sharded"

    # Whole, in this process (any device count): the same bytes.
    whole = nl.load(path, like=full)
    for k in full:
        np.testing.assert_array_equal(np.asarray(whole[k]), full[k], err_msg=k)
    assert nl.load(path)["V"].shape == (8, 6)  # no template: a ParamsDict

    # Onto 4 devices and onto one: placed as asked; a split leaf is read part by part.
    from nnlite.core._sharded import ShardedFile

    regions = []
    read = ShardedFile.read
    monkeypatch.setattr(
        ShardedFile,
        "read",
        lambda self, key, region=None: regions.append((key, region)) or read(self, key, region),
    )
    m4 = mesh_of(4)
    for target in (
        {
            k: NamedSharding(m4, P("x") if np.ndim(v) and len(v) % 4 == 0 else P())
            for k, v in full.items()
        },
        {k: jax.sharding.SingleDeviceSharding(jax.devices()[5]) for k in full},
    ):
        like = {
            k: jax.ShapeDtypeStruct(np.shape(v), np.result_type(v), sharding=target[k])
            for k, v in full.items()
        }
        regions.clear()
        back = nl.load(path, like=like)
        for k in full:
            assert back[k].sharding == target[k], k
            np.testing.assert_array_equal(np.asarray(back[k]), full[k], err_msg=k)
        if isinstance(target["W"], NamedSharding):  # never the whole of a leaf split over the mesh
            whole_reads = [
                k
                for k, r in regions
                if k in ("W", "V") and np.asarray(full[k])[r].size == full[k].size
            ]
            assert whole_reads == [], whole_reads
            assert len([k for k, _ in regions if k == "W"]) == 4

    # Bad checkpoints say what is wrong, and name the file.
    monkeypatch.undo()
    with pytest.raises(nl.CheckpointError, match=r"'W' is float32\[16, 6\] in the file.*\[8, 6\]"):
        nl.load(path, like={**full, "W": full["V"]})
    (path / "shards_00000.safetensors").rename(tmp_path / "moved")
    with pytest.raises(nl.CheckpointError, match="shards_00000.safetensors is missing"):
        nl.load(path)
    (path / "index.safetensors").unlink()
    with pytest.raises(
        nl.CheckpointError,
        match="not a safetensors file nor a complete sharded checkpoint .it has no index",
    ):
        nl.load_metadata(path)


def test_trainer_writes_sharded_checkpoints_that_resume_on_4_devices_then_one(
    tmp_path, monkeypatch, npz
):
    """Written on 8 devices (sharded), resumed sharded on 4, then on one device (strategy
    none): the same params as an uninterrupted run, to float rounding; nothing gathered."""
    use_sharded_strategy(monkeypatch)
    gathers_in_checkpoints = []
    get_state = ShardedParams.get_state

    def spy(self, leaves):
        import traceback

        frames = traceback.extract_stack()
        gathers_in_checkpoints.extend(
            f.name for f in frames if f.name in ("checkpoint", "checkpoint_sharded", "save_sharded")
        )
        return get_state(self, leaves)

    monkeypatch.setattr(ShardedParams, "get_state", spy)
    sharded = ["parallel.strategy=shard_map", npz]
    first = run(tmp_path, *sharded, "train.steps=10", resume="fresh")
    assert isinstance(first.strategy, ShardedParams)
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(ckpts)] == [
        "ckpt_00000005.shards",
        "ckpt_00000010.shards",
    ]
    # One process, 8 devices: 8 pieces of the first layer's W, each 1/8 of it.
    (table,) = shard_tables(ckpts / "ckpt_00000010.shards").values()
    w_pieces = [b for leaf, b in table.values() if leaf == "params/ffn/layers[0]/W"]
    assert len(w_pieces) == 8 and all(b[0][1] - b[0][0] == 1 for b in w_pieces)

    # train.load_run reads the sharded checkpoint back whole, for inference.
    loaded = train.load_run(tmp_path / "run")
    assert loaded.step == 10
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(first.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)

    second = run(tmp_path, *sharded, "parallel.devices=4", "train.steps=15")
    assert len(second.strategy.devices) == 4
    (table,) = shard_tables(ckpts / "ckpt_00000015.shards").values()
    assert len([b for leaf, b in table.values() if leaf == "params/ffn/layers[0]/W"]) == 4
    third = run(tmp_path, "parallel.strategy=none", npz, "train.steps=20")
    # keep-N counts both kinds; a file now, on one device
    assert [p.name for p in ckpt.list_checkpoints(ckpts)] == [
        "ckpt_00000010.shards",
        "ckpt_00000015.shards",
        "ckpt_00000020.safetensors",
    ]
    # evaluations gathered (both sharded runs), checkpoints never did
    assert ShardedParams.gathered >= 2 and gathers_in_checkpoints == []

    ref = run(tmp_path, "parallel.strategy=none", npz, "train.steps=20", "name=ref")
    lr = ref.cfg.optimizer.learning_rate
    for path, a, b in zip(
        *zip(*jax.tree_util.tree_flatten_with_path(third.params)[0]),
        jax.tree.leaves(ref.params),
        strict=True,
    ):
        # 8- and 4-way sums of the batch's gradient round otherwise: far within one lr
        assert np.max(np.abs(a - b)) < 1e-3 * lr, path


def test_sigkill_during_a_sharded_write_keeps_the_previous_and_resumes_bit_identically(
    tmp_path, monkeypatch, npz
):
    over = ["parallel.strategy=shard_map", npz, "train.steps=20"]
    args = [sys.executable, "tests/_sharded_strategy.py", "--config", CONFIG]
    for o in (*COMMON, f"log.dir={tmp_path}", *over):
        args += ["--set", o]
    # each file's write pauses twice, the directory once more (tests/_inject.py)
    env = _inject.env(script_env(), pause=0.3)
    env["XLA_FLAGS"] = xla_flags(8)
    ckpts = tmp_path / "run" / "checkpoints"
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ckpts / "ckpt_00000010.shards.tmp").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no second checkpoint write began"
            time.sleep(0.005)
        # anywhere in the write: the shard file half-written, complete, the index, the rename
        time.sleep(random.Random(0).uniform(0, 1.0))  # of 1.5 s
        proc.kill()
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (ckpts / "ckpt_00000010.shards").exists()  # it did not look complete
    assert [p.name for p in ckpt.list_checkpoints(ckpts)] == ["ckpt_00000005.shards"]

    use_sharded_strategy(monkeypatch)
    resumed = run(tmp_path, *over)
    assert not list(ckpts.glob("*.tmp"))  # the interrupted write's leftovers are gone
    ref = run(tmp_path, *over, "name=ref", resume="fresh")
    for a, b in zip(
        jax.tree.leaves((resumed.params, resumed.opt_state)),
        jax.tree.leaves((ref.params, ref.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_two_processes_write_their_own_shards_resume_on_another_mesh_and_one_reads(tmp_path):
    port = free_port()
    env = script_env()
    env["XLA_FLAGS"] = xla_flags(4)
    ckpts = tmp_path / "checkpoints"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "tests/_sharded_writer.py",
                f"127.0.0.1:{port}",
                "2",
                str(i),
                str(ckpts),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    path = ckpts / f"ckpt_{STEP:08d}.shards"
    for out in outs:
        assert "nl.save: 'opt_state/mu' is spread over several processes" in out, out
    assert not (tmp_path / "whole.safetensors").exists()
    # Resumed onto the reversed mesh: process 0's devices hold the rows process 1 wrote.
    for p, rows in (
        (0, "(8, 10), (10, 12), (12, 14), (14, 16)"),
        (1, "(0, 2), (2, 4), (4, 6), (6, 8)"),
    ):
        line = f"resumed at step {STEP} from {path.name}: W rows [{rows}]"
        assert line in outs[p], outs[p]
    # The next checkpoint, which process 1 never joined: process 0's wait was bounded, and
    # it left no checkpoint that looks complete.
    waited = re.search(r"after ([\d.]+) s: barrier 'ckpt_00000008.shards:begin': not every "
                       r"process arrived within 1 s", outs[0])  # fmt: skip
    assert waited and float(waited.group(1)) < 10, outs[0]
    assert [p.name for p in ckpt.list_checkpoints(ckpts)] == [path.name]
    # Each process's file holds its own devices' parts only: process 0 rows 0-7 of W (its
    # 4 devices come first in the mesh), process 1 rows 8-15; replicated leaves once.
    tables = shard_tables(path)
    assert sorted(tables) == ["shards_00000.safetensors", "shards_00001.safetensors"]
    for p, table in enumerate(tables.values()):
        rows = sorted(b[0] for leaf, b in table.values() if leaf == "params/W")
        assert rows == [[8 * p + 2 * i, 8 * p + 2 * i + 2] for i in range(4)]
        replicated = {leaf for leaf, _ in table.values()} & {"params/b", "opt_state/count"}
        assert replicated == ({"params/b", "opt_state/count"} if p == 0 else set())

    meta = ckpt.read_metadata(path)
    assert meta["step"] == str(STEP) and meta["written_by"] == "test" and meta["processes"] == "2"
    want = full_state()
    whole = nl.load(path, like=want)  # one process, whole
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    # ... or placed on this process's 8 devices, as a resume would
    m8 = mesh_of(8)
    like = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(
            v.shape,
            v.dtype,
            sharding=NamedSharding(m8, P("x") if v.ndim and v.shape[0] % 8 == 0 else P()),
        ),
        want,
    )
    params, opt_state, _, _ = ckpt.restore(path, like["params"], like["opt_state"])
    assert params["W"].sharding.spec == P("x")
    want = (want["params"], want["opt_state"])
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
