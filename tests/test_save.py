"""nl.save / nl.load: safetensors files of params and optimizer state, and their errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import _inject
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy

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


def test_keys_are_paths_and_one_file_holds_several_named_trees(tmp_path):
    """What the trainer writes: ``{"params": ..., "opt_state": ...}`` in one file, keys
    ``params/<path>`` and ``opt_state<path>``; each part loads on its own."""
    p = ParamsDict(ffn=ParamsDict(W=jnp.ones((2, 3)), b=jnp.zeros(3)))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))  # [0] has no arrays
    state = opt.init(p)
    f = nl.save(tmp_path / "c.safetensors", {"params": p, "opt_state": state})
    assert sorted(safetensors.numpy.load_file(str(f))) == [
        "opt_state[1][0]/count", "opt_state[1][0]/mu/ffn/W", "opt_state[1][0]/mu/ffn/b",
        "opt_state[1][0]/nu/ffn/W", "opt_state[1][0]/nu/ffn/b", "params/ffn/W", "params/ffn/b",
    ]  # fmt: skip
    _equal(nl.load(f, like={"params": p, "opt_state": state}), {"params": p, "opt_state": state})
    # One part: without a template (a ParamsDict), into a template, or into shapes alone.
    assert [k for k, _ in nl.load(f, subtree="params").items()] == ["/ffn/W", "/ffn/b"]
    _equal(nl.load(f, like=p, subtree="params"), p)
    _equal(nl.load(f, like=state, subtree="/opt_state"), state)
    abstract = nl.load(f, like=jax.eval_shape(lambda: p), subtree="params")
    assert isinstance(abstract.ffn.W, jax.Array)
    _equal(abstract, p)
    # The whole file too (optax's [0] holds nothing: an empty ParamsDict in its place).
    whole = nl.load(f)
    assert whole.opt_state[0] == ParamsDict() and whole.opt_state[1][0].mu.ffn.W.shape == (2, 3)
    # Paths that make no ParamsDict (a key that is a ParamsDict method): what to pass instead.
    g = nl.save(tmp_path / "g.safetensors", {"params": p, "keys": jnp.ones(2)})
    with pytest.raises(nl.CheckpointError, match=r"do not make one ParamsDict .*pass like= .* or subtree= \(one of its parts: 'keys', 'params'\)"):  # fmt: skip
        nl.load(g)
    with pytest.raises(nl.CheckpointError, match=r"no subtree 'param'; its top-level parts are 'opt_state', 'params'"):  # fmt: skip
        nl.load(f, subtree="param")
    wider = ParamsDict(ffn=ParamsDict(W=p.ffn.W, b=p.ffn.b, c=p.ffn.b))
    with pytest.raises(nl.CheckpointError, match=r"the file's 'params' does not match the template \(like=\): 1 path\(s\) of the template missing, first 'params/ffn/c'"):  # fmt: skip
        nl.load(f, like=wider, subtree="params")


def _empty(x):
    return x is not None and jax.tree.structure(x).num_nodes == 1 and not jax.tree.leaves(x)


def _layout(tree) -> dict:
    """Each array by its path, and the paths of the empty containers."""
    items = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_empty)[0]
    return {nl.format_path(p): "empty" if _empty(v) else np.asarray(v) for p, v in items}


def _models():
    """Every kind of model the library builds: its layers (those without params first,
    between, and last in a Sequential), stacks, stateful ones, Hugging Face families."""
    import equinox as eqx

    from models.gpt import GPT
    from models.resnet import ResNet

    gaps = nl.Sequential(
        [nl.Activation("relu"), nl.Linear(3, 4), nl.Dropout(0.5), nl.Linear(4, 2), nl.Flatten()]
    )
    return {
        "Sequential with gaps": gaps,
        "Sequential of no params": nl.Sequential([nl.Activation("tanh"), nl.Flatten()]),
        "conv": nl.Sequential(
            [nl.Conv(1, 2, (3,)), nl.MaxPool((2,)), nl.GroupNorm(2, 2), nl.AdaptiveAvgPool((1,))]
        ),
        "BatchNorm (state)": nl.Sequential(
            [nl.Linear(3, 4), nl.BatchNorm(4), nl.Activation("relu")]
        ),
        "Stack": nl.Stack(nl.Sequential([nl.Linear(4, 4), nl.Activation("relu")]), 3),
        "Remat": nl.Remat(nl.FFN(3, (4,), 2)),
        "RotaryEmbedding (no params)": nl.RotaryEmbedding(4),
        "RNN": nl.RNN(nl.LSTMCell(3, 4)),
        "attention": nl.Sequential([nl.Embedding(10, 8), nl.TransformerBlock(8, 2, causal=True)]),
        "LoRA": nl.LoRA(nl.Linear(4, 4), rank=2),
        "gpt scanned": GPT(
            vocab_size=11, context=8, n_layer=2, n_head=2, n_embd=8, scan_layers=True
        ),
        "resnet": ResNet(in_shape=(16,), num_classes=3, channels=(2,)),
        "equinox": nl.from_equinox(eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))),
        "hf gpt2": nl.hf.GPT2LM(vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=8),
        "hf llama with LoRA": nl.hf.LlamaLM(
            vocab_size=11, context=8, n_layer=1, n_head=2, n_embd=8, hidden=16
        ).with_lora(["*/attn/q"], rank=2),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_every_part_of_a_checkpoint_loads_without_a_template(tmp_path, name):
    """nl.load(path, subtree=part) for each part the trainer writes (params, opt_state,
    state), for every kind of model: the arrays at their paths and the nodes without
    arrays (a layer without params anywhere in a Sequential, optax's EmptyState) in place."""
    model = _models()[name]
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def init():
        params = model.init(jax.random.key(0))
        tree = {"params": params, "opt_state": opt.init(params)}
        if callable(getattr(model, "init_state", None)):
            tree["state"] = model.init_state()
        return tree

    rng = np.random.default_rng(0)  # values from shapes: nothing compiled
    tree = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), jax.eval_shape(init))
    params = tree["params"]
    f = nl.save(tmp_path / "c.safetensors", tree)
    for part, want in tree.items():
        got = nl.load(f, subtree=part)
        got_layout, want_layout = _layout(got), _layout(want)
        assert list(got_layout) == list(want_layout), part
        for path, v in want_layout.items():
            np.testing.assert_array_equal(got_layout[path], v, err_msg=f"{part}{path}")
    # params come back as the very structure the model builds, so the model runs them
    assert jax.tree.structure(nl.load(f, subtree="params")) == jax.tree.structure(params)
    whole = nl.load(f)
    assert list(_layout(whole)) == list(_layout(tree))
    assert nl.load_metadata(f) == {"format": "nnlite.save", "format_version": "1"}


def test_a_sharded_checkpoint_keeps_its_layers_without_params(tmp_path):
    seq = _models()["Sequential with gaps"]
    params = jax.tree.map(
        lambda s: np.ones(s.shape, s.dtype), jax.eval_shape(seq.init, jax.random.key(0))
    )
    path = nl.save_sharded(tmp_path / "c.shards", {"params": params, "step": 3})
    back = nl.load(path, subtree="params")
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert [k for k, _ in back.items()] == [k for k, _ in params.items()]
    assert "empty_nodes" not in nl.load_metadata(path)


def test_metadata_round_trip_without_reading_tensors(tmp_path):
    meta = {"step": "12", "config": json.dumps({"lr": 0.1}), "note": "ü"}
    f = nl.save(tmp_path / "m.safetensors", _params(), metadata=meta)
    own = {"format": "nnlite.save", "format_version": "1"}
    assert nl.load_metadata(f) == {**own, **meta}
    assert nl.load_metadata(nl.save(tmp_path / "n.safetensors", jnp.ones(2))) == own
    with pytest.raises(nl.CheckpointError, match=r"metadata must map str to str, got 'step': 12"):
        nl.save(f, _params(), metadata={"step": 12})
    with pytest.raises(nl.CheckpointError, match=r"metadata key 'format_version' is nl.save's own"):
        nl.save(f, _params(), metadata={"format_version": "2"})
    assert nl.load_metadata(f) == {**own, **meta}  # refused writes leave the file alone
    with pytest.raises(nl.CheckpointError, match="no such file"):
        nl.load_metadata(tmp_path / "missing.safetensors")


def test_files_of_the_old_writers_still_load(tmp_path):
    """nl.save's keys began with '/' ('/layers[0]/W'); the trainer's files had no 'format'."""
    p = _params()
    flat = {k: np.asarray(v) for k, v in p.items() if k != "/act"}
    old = tmp_path / "old_nl.safetensors"
    own = {"format": "nnlite.save", "format_version": "1"}
    safetensors.numpy.save_file(flat, str(old), metadata=own)
    _equal(nl.load(old, like=p), p)
    assert [k for k, _ in nl.load(old).items()] == sorted(flat)
    trainer = tmp_path / "ckpt_00000004.safetensors"
    tensors = {"params" + k: v for k, v in flat.items()}
    tensors["opt_state[0]/count"] = np.array(4, np.int32)
    safetensors.numpy.save_file(tensors, str(trainer), metadata={"format_version": "1", "step": "4"})  # fmt: skip
    _equal(nl.load(trainer, like=p, subtree="params"), p)
    loaded = nl.load(trainer, like={"params": p, "opt_state": (ParamsDict(count=jnp.int32(0)),)})
    assert int(loaded["opt_state"][0].count) == 4
    assert nl.load(trainer).opt_state[0].count == 4  # its lists have no gaps: one ParamsDict
    assert nl.load_metadata(trainer) == {"format_version": "1", "step": "4"}
    # A format_version nnlite does not know is refused, not misread.
    safetensors.numpy.save_file(flat, str(old), metadata={**own, "format_version": "2"})
    with pytest.raises(nl.CheckpointError, match=r"format_version '2' of a newer nnlite; this one reads format_version '1'"):  # fmt: skip
        nl.load(old, like=p)


def test_mismatches_name_the_path(tmp_path):
    p = _params()
    f = nl.save(tmp_path / "p.safetensors", p)
    bigger = _params()
    bigger.layers[0].W = jnp.zeros((3, 5))
    with pytest.raises(nl.CheckpointError, match=r"'layers\[0\]/W' is float32\[3, 4\] in the file, the template \(like=\) expects float32\[3, 5\]"):  # fmt: skip
        nl.load(f, like=bigger)
    other_dtype = _params()
    other_dtype.layers[1].b = other_dtype.layers[1].b.astype(jnp.float32)
    with pytest.raises(nl.CheckpointError, match=r"'layers\[1\]/b' is int32\[2\] in the file, the template \(like=\) expects float32\[2\]"):  # fmt: skip
        nl.load(f, like=other_dtype)
    more = _params()
    more.layers[0].extra = jnp.ones(1)
    more.gain = jnp.ones(1)
    with pytest.raises(nl.CheckpointError, match=r"does not match the template \(like=\): 2 path\(s\) of the template missing, first 'gain'"):  # fmt: skip
        nl.load(f, like=more)
    fewer = _params()
    del fewer.layers[1].b
    with pytest.raises(nl.CheckpointError, match=r"1 unexpected path\(s\), first 'layers\[1\]/b' \(the file has 5 arrays, the template 4\)"):  # fmt: skip
        nl.load(f, like=fewer)


def _cut(keep):
    """A real file cut to ``keep(size)`` bytes, as a crash or a full disk leaves one."""

    def write(f):
        data = safetensors.numpy.save({"W": np.ones((4, 4), np.float32)})
        f.write_bytes(data[: keep(len(data))])

    return write


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"not a safetensors file: 0 bytes \(empty or truncated\)"),
        (b"hello world, plain text" * 3, r"file \(text: its first 8 bytes give a header of"),
        (b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", r"file \(its header is not JSON"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", r"file \(its header is not a JSON object\)"),
        (np.savez, r"not a safetensors file \(a zip archive"),
        (_cut(lambda n: n - 1), r"truncated: \d+ bytes, its header describes \d+ \(download"),
        (_cut(lambda n: 20), "truncated: 20 bytes, shorter than its"),
    ],
)
def test_not_a_safetensors_file(tmp_path, content, match):
    f = tmp_path / "x.safetensors"
    if content is np.savez:
        f = f.with_suffix(".npz")
        np.savez(f, a=np.ones(3))
    elif callable(content):
        content(f)
    else:
        f.write_bytes(content)
    before = f.read_bytes()
    for read in (lambda: nl.load(f, like=_params()), lambda: nl.load(f), lambda: nl.load_metadata(f)):  # fmt: skip
        with pytest.raises(nl.CheckpointError, match=f"^checkpoint {re.escape(str(f))}: .*{match}"):
            read()
    assert f.read_bytes() == before  # reading never writes
    with pytest.raises(nl.CheckpointError, match="no such file"):
        nl.load(tmp_path / "missing.safetensors", like=_params())
    with pytest.raises(nl.CheckpointError, match="a directory, not a checkpoint"):
        nl.load(tmp_path)


@pytest.mark.parametrize(("pause", "kill_after", "written"), [(60, 0, "half"), (2, 3, "all")])
def test_killed_mid_write_leaves_the_old_file(tmp_path, pause, kill_after, written):
    """SIGKILL while nl.save pauses inside the write (its temporary file half-written, or
    complete but not renamed): the target still holds the old file, whole."""
    f = nl.save(tmp_path / "p.safetensors", {"W": jnp.zeros((256, 256))}, metadata={"v": "old"})
    before = f.read_bytes()
    # the write pauses twice (tests/_inject.py): half-written, then complete but unrenamed
    code = "import sys, _inject, jax.numpy as jnp, nnlite as nl; _inject.pause_writes(float(sys.argv[2])); nl.save(sys.argv[1], {'W': jnp.ones((256, 256))})"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, str(f), str(pause)], env=_inject.env())
    try:
        t0 = time.monotonic()
        while not (tmps := list(tmp_path.glob("p.safetensors.*.tmp"))):
            assert time.monotonic() - t0 < 120 and proc.poll() is None
            time.sleep(0.01)
        time.sleep(kill_after)  # 3 s: inside the second 2 s pause, which starts at 2 s
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
    assert f.read_bytes() == before
    assert nl.load_metadata(f)["v"] == "old"
    if written == "all":  # the new file, whole, under its temporary name
        np.testing.assert_array_equal(nl.load(tmps[0])["W"], np.ones((256, 256)))
    else:
        with pytest.raises(nl.CheckpointError, match="truncated"):
            nl.load(tmps[0])
    # The leftover is no safetensors file a reader would take for the checkpoint.
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")] == ["p.safetensors"]


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
    with pytest.raises(nl.CheckpointError, match=r"'s' is a str of dtype <U1"):
        nl.save(tmp_path / "s.safetensors", {"s": "x"})
