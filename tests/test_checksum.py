"""Checksummed checkpoints: damaged tensor bytes are refused naming the file, old files
without checksums still load, and resuming falls back to the newest intact checkpoint."""

import json
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnlite as nl
from train.config import load_config
from train.loop.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return nl.ParamsDict(
        ffn=nl.ParamsDict(W=jax.random.normal(k1, (4, 3)), b=jax.random.normal(k2, (3,)))
    )


def damage(path: Path, key: str | None = None) -> str:
    """Overwrite one float32 tensor's bytes with other finite values; the header (and so
    the file's structure) stays as it was. Returns the damaged key."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    key = key or next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    start, end = header[key]["data_offsets"]
    garbage = np.full((end - start) // 4, 0.25, np.float32).tobytes()
    assert garbage != raw[8 + n + start : 8 + n + end]
    path.write_bytes(raw[: 8 + n + start] + garbage + raw[8 + n + end :])
    return key


def test_damaged_tensor_is_refused_naming_the_file_and_tensor(tmp_path):
    p = _params()
    f = nl.save(tmp_path / "c.safetensors", {"params": p, "step": 3})
    nl.verify(f)
    damage(f, "params/ffn/W")
    for load in (
        lambda: nl.load(f, like={"params": p, "step": 0}),
        lambda: nl.load(f, subtree="params"),
        lambda: nl.verify(f),
    ):
        with pytest.raises(nl.CheckpointCorruptError, match=rf"{f}: 'params/ffn/W' does not match its checksum"):  # fmt: skip
            load()
    # the parts that are intact still read, and the metadata (no tensors) too
    assert nl.load(f, like=0, subtree="step") == 3
    assert nl.load_metadata(f)["format"] == "nnlite.save"
    assert issubclass(nl.CheckpointCorruptError, nl.CheckpointError)


def test_truncated_file_is_corrupt_too(tmp_path):
    f = nl.save(tmp_path / "c.safetensors", _params())
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(nl.CheckpointCorruptError, match="truncated"):
        nl.verify(f)


def test_a_file_without_checksums_still_loads(tmp_path):
    p = _params()
    old = tmp_path / "old.safetensors"
    tensors = {k.removeprefix("/"): np.asarray(v) for k, v in p.items()}
    safetensors.numpy.save_file(tensors, str(old), metadata={"format": "nnlite.save", "format_version": "1"})  # fmt: skip
    nl.verify(old)  # nothing to check against: not an error
    got = nl.load(old, like=p)
    np.testing.assert_array_equal(got.ffn.W, p.ffn.W)


def test_a_damaged_shard_is_refused_naming_the_shard_file(tmp_path):
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    W = jax.device_put(jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3), NamedSharding(mesh, P("x")))  # fmt: skip
    d = nl.save_sharded(tmp_path / "ckpt.shards", {"W": W, "n": np.float32(2.0)})
    nl.verify(d)
    shard = d / "shards_00000.safetensors"
    header_meta = json.loads(shard.read_bytes()[8:].split(b"}}", 1)[0] + b"}}").get("__metadata__")
    assert "checksums" in header_meta  # each shard file carries its tensors' checksums
    damage(shard)
    with pytest.raises(nl.CheckpointCorruptError, match=rf"{shard}: '\d+:\w+' does not match its checksum"):  # fmt: skip
        nl.load(d)
    with pytest.raises(nl.CheckpointCorruptError, match="shards_00000"):
        nl.verify(d)
    # placed part by part onto the mesh: the damaged shard is read, and refused
    placed = jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    with pytest.raises(nl.CheckpointCorruptError):
        nl.load(d, like={"W": placed, "n": np.float32(0)})


def _run(tmp_path, *overrides, resume="fresh"):
    cfg = load_config(
        ROOT / "configs/digits_mlp.yaml",
        [
            f"log.dir={tmp_path}",
            "log.progress=false",
            "log.plot=false",
            "train.batch_size=32",
            "train.eval_every=10",
            "checkpoint.every=10",
            "checkpoint.keep=10",
            *overrides,
        ],
    )
    return train(cfg, resume=resume, echo=lambda *_: None)


def test_resume_skips_a_damaged_checkpoint_with_one_line(tmp_path, capsys):
    full = _run(tmp_path, "train.steps=30", "name=full")
    part = tmp_path / "part"
    shutil.copytree(full.run_dir, part)
    ckpts = part / "checkpoints"
    (ckpts / "ckpt_00000030.safetensors").unlink()  # a crash after step 20 ...
    damage(ckpts / "ckpt_00000020.safetensors")  # ... whose checkpoint a bad disk damaged
    capsys.readouterr()
    resumed = _run(tmp_path, "train.steps=30", "name=part", resume="auto")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "damaged" in line]
    assert len(lines) == 1, err
    assert "ckpt_00000020.safetensors" in lines[0] and "ckpt_00000010.safetensors" in lines[0]
    assert resumed.step == 30
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)  # resumed from step 10: still bit-identical


def test_resume_refuses_when_no_checkpoint_is_intact(tmp_path):
    from train.errors import ConfigError

    full = _run(tmp_path, "train.steps=10", "name=one")
    damage(full.run_dir / "checkpoints" / "ckpt_00000010.safetensors")
    with pytest.raises(ConfigError, match=r"ckpt_00000010.safetensors: .* checksum.*no older checkpoint is intact.*--fresh"):  # fmt: skip
        _run(tmp_path, "train.steps=20", "name=one", resume="auto")
