"""nl.save / nl.load: safetensors files of params and optimizer state, and their errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import nnlite as nl
from nnlite import ParamsDict


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ParamsDict(
        act="relu",
        scale=0.5,
        layers=[
            ParamsDict(W=jax.random.normal(k1, (3, 4)), b=jnp.zeros(4)),
            ParamsDict(W=jax.random.normal(k2, (4, 2)).astype(jnp.bfloat16), b=jnp.arange(2)),
        ],
    )


def _equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert type(x) is type(y) or isinstance(x, jax.Array) and isinstance(y, jax.Array)
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_round_trip_params_and_optimizer_state(tmp_path):
    p = _params()
    trainable = ParamsDict(W=p.layers[0].W, b=p.layers[0].b)
    opt = optax.adam(1e-2)
    state = opt.update(jax.tree.map(jnp.ones_like, trainable), opt.init(trainable), trainable)[1]
    assert nl.save(tmp_path / "p.safetensors", p) == tmp_path / "p.safetensors"
    nl.save(tmp_path / "s.safetensors", (trainable, state))
    q = nl.load(tmp_path / "p.safetensors", like=p)
    _equal(q, p)
    assert q.act == "relu" and isinstance(q.scale, float) and q.layers[1].W.dtype == jnp.bfloat16
    _equal(nl.load(tmp_path / "s.safetensors", like=(trainable, state)), (trainable, state))
    # The keys are nnlite's paths, so the file reads back as a ParamsDict without a template.
    flat = nl.load(tmp_path / "p.safetensors")
    assert [k for k, _ in flat.items()] == ["/layers[0]/W", "/layers[0]/b", "/layers[1]/W",
                                            "/layers[1]/b", "/scale"]  # fmt: skip
    np.testing.assert_array_equal(flat.layers[0].W, p.layers[0].W)
    # a single array
    nl.save(tmp_path / "a.safetensors", jnp.arange(3.0))
    np.testing.assert_array_equal(nl.load(tmp_path / "a.safetensors"), [0.0, 1.0, 2.0])


def test_mismatches_name_the_path(tmp_path):
    p = _params()
    f = nl.save(tmp_path / "p.safetensors", p)
    bigger = _params()
    bigger.layers[0].W = jnp.zeros((3, 5))
    with pytest.raises(nl.CheckpointError, match=r"/layers\[0\]/W is float32\[3, 4\] in the file, `like` has float32\[3, 5\]"):  # fmt: skip
        nl.load(f, like=bigger)
    other_dtype = _params()
    other_dtype.layers[1].b = other_dtype.layers[1].b.astype(jnp.float32)
    with pytest.raises(nl.CheckpointError, match=r"/layers\[1\]/b is int32\[2\] in the file, `like` has float32\[2\]"):  # fmt: skip
        nl.load(f, like=other_dtype)
    more = _params()
    more.layers[0].extra = jnp.ones(1)
    more.gain = jnp.ones(1)
    with pytest.raises(nl.CheckpointError, match=r"2 path\(s\) of `like` missing from the file, first /gain"):  # fmt: skip
        nl.load(f, like=more)
    fewer = _params()
    del fewer.layers[1].b
    with pytest.raises(nl.CheckpointError, match=r"1 unexpected path\(s\) in the file, first /layers\[1\]/b"):  # fmt: skip
        nl.load(f, like=fewer)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"is not a safetensors file \(0 bytes\)"),
        (b"hello world, plain text" * 3, "first 8 bytes do not give a header length"),
        (b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", "bad header"),
        (np.savez, "is not a safetensors file"),
    ],
)
def test_not_a_safetensors_file(tmp_path, content, match):
    f = tmp_path / "x.safetensors"
    if callable(content):
        content(f.with_suffix(".npz"), a=np.ones(3))
        f = f.with_suffix(".npz")
    else:
        f.write_bytes(content)
    with pytest.raises(nl.CheckpointError, match=match):
        nl.load(f, like=_params())
    with pytest.raises(nl.CheckpointError, match="no such file"):
        nl.load(tmp_path / "missing.safetensors", like=_params())


def test_save_is_atomic_and_refuses_bad_targets(tmp_path, monkeypatch):
    p = _params()
    f = nl.save(tmp_path / "p.safetensors", p)
    before = f.read_bytes()

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        nl.save(f, jax.tree.map(lambda a: a + 1 if hasattr(a, "shape") else a, p))
    monkeypatch.undo()
    assert f.read_bytes() == before  # the old file is untouched
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.safetensors"]  # no temporary left
    with pytest.raises(nl.CheckpointError, match="does not exist"):
        nl.save(tmp_path / "no" / "p.safetensors", p)
    with pytest.raises(nl.CheckpointError, match="is a directory"):
        nl.save(tmp_path, p)
    with pytest.raises(nl.CheckpointError, match=r"/s is a str of dtype <U1"):
        nl.save(tmp_path / "s.safetensors", {"s": "x"})
