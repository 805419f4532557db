"""Streamed data (data.placement: host): prepared tokens and .npy arrays read per batch on
the host, placed a call ahead, each device only its slice; equal to the on-device path."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import train
from train import parallel
from train.__main__ import main
from train.config import config_from_dict
from train.data import streamed
from train.data.builtin import load_dataset
from train.loop.trainer import train as train_run
from train.prepare import main as prepare
from train.sample import main as sample

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/shakespeare_gpt.yaml"


WORDS = ["the", "king", "shall", "love", "night", "o", "day!", "thee", "\n"]
TINY_GPT = {"name": "gpt", "context": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A generated text and its char and bpe preparations (``char/``, ``bpe/``)."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (d / "c.txt").write_text(" ".join(rng.choice(WORDS, 12000)) + "\n")
    assert prepare(["--input", str(d / "c.txt"), "--out", str(d / "char")]) == 0
    bpe = ["--tokenizer", "bpe", "--vocab-size", "300"]
    assert prepare(["--input", str(d / "c.txt"), "--out", str(d / "bpe"), *bpe]) == 0
    return d


def cfg_of(tmp_path, name, data, model=None, **train_keys):
    t = {"batch_size": 8, "steps": 6, "eval_every": 6, "log_every": 1, "steps_per_call": 2}
    raw = {
        "name": name,
        "model": model or TINY_GPT,
        "data": data | ({"eval_windows": 64} if data["name"] in ("text", "tokens") else {}),
        "loss": {"grad": "autodiff"},  # compiles faster than the hand rules auto would pick
        "train": t | train_keys,
        "log": {"dir": str(tmp_path), "progress": False, "plot": False},
    }
    strategy = raw["train"].pop("strategy", "none")
    raw["parallel"] = {"strategy": strategy}
    return config_from_dict(raw)


def run(tmp_path, name, data, model=None, **train_keys):
    return train_run(cfg_of(tmp_path, name, data, model, **train_keys), resume="fresh", echo=print)


def losses(r, split="train"):
    recs = [json.loads(x) for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in recs if x["split"] == split]


def leaves(tree):
    return [np.asarray(v) for v in jax.tree.leaves(tree)]


def test_prepared_chars_stream_exactly_as_the_in_memory_text(tmp_path, corpus, monkeypatch):
    """The same config through data.name=text (on the device) and through prepared char
    tokens (streamed from the memory map): the same vocabulary, windows and losses."""
    text = run(tmp_path, "text", {"name": "text", "path": str(corpus / "c.txt")})
    tok = run(
        tmp_path, "tok", {"name": "tokens", "path": str(corpus / "char"), "placement": "host"}
    )
    assert not text.data.streamed and tok.data.streamed
    assert text.data.vocab == tok.data.vocab
    assert losses(tok) == losses(text)  # every step's train loss, bit for bit
    for a, b in zip(leaves(tok.params), leaves(text.params), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(losses(tok, "val"), losses(text, "val"), rtol=1e-6)
    # auto: a small corpus lives on the device, read whole from the memory map; a big one
    # (here: a threshold of 0 bytes) streams
    cfg = cfg_of(tmp_path, "auto", {"name": "tokens", "path": str(corpus / "char")})
    auto = load_dataset(cfg.data, context=16)
    assert not auto.streamed and auto.x.dtype == np.int32
    np.testing.assert_array_equal(auto.x, text.data.x)
    monkeypatch.setattr(streamed, "AUTO_DEVICE_MAX_BYTES", 0)
    assert load_dataset(cfg.data, context=16).streamed


@pytest.mark.parametrize("strategy", ["shard_map", "pmap", "fsdp"])
def test_streamed_batches_equal_the_on_device_gather_on_8_devices(tmp_path, arrays, strategy):
    data = {"name": "arrays", "path": str(arrays)}
    mlp = {"name": "mlp", "hidden_sizes": [16]}
    keys = {"strategy": strategy, "batch_size": 64}
    on_dev = run(tmp_path, "d", data | {"placement": "device"}, mlp, **keys)
    host = run(tmp_path, "h", data | {"placement": "host"}, mlp, **keys)
    assert len(host.devices) == 8 and host.data.streamed and not on_dev.data.streamed
    np.testing.assert_allclose(losses(host), losses(on_dev), rtol=1e-6)
    for a, b in zip(leaves(host.params), leaves(on_dev.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["none", "shard_map", "pmap"])
def test_each_device_receives_only_its_slice(strategy):
    s = parallel.get(strategy, jax.local_devices()[: 1 if strategy == "none" else 8])
    x = np.arange(3 * 16 * 5, dtype=np.int32).reshape(3, 16, 5)  # [K, B, T]
    placed = s.put_batch((x, x + 1))
    n = len(s.devices)
    for arr, want in zip(placed, (x, x + 1), strict=True):
        shards = sorted(arr.addressable_shards, key=lambda sh: sh.device.id)
        assert [sh.device for sh in shards] == s.devices
        for i, sh in enumerate(shards):
            block = want[:, i * 16 // n : (i + 1) * 16 // n]
            got = np.asarray(sh.data)
            if strategy == "pmap":  # [devices, K, B / devices, T]: one device's row
                assert got.shape == (1, *block.shape)
                got = got[0]
            np.testing.assert_array_equal(got, block)


@pytest.fixture(scope="module")
def arrays(tmp_path_factory) -> Path:
    """A directory of x.npy (uint8 rows, read as float32), y.npy and a test split, and the
    same arrays as an .npz beside it (``<dir>.npz``)."""
    d = tmp_path_factory.mktemp("arrays")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, size=(300, 12)).astype(np.uint8)
    y = (x[:, 0] > x[:, 1]).astype(np.int64) + 2 * (x[:, 2] > 127)
    x_test = rng.integers(0, 255, size=(50, 12)).astype(np.uint8)
    y_test = (x_test[:, 0] > x_test[:, 1]).astype(np.int64) + 2 * (x_test[:, 2] > 127)
    for k, v in {"x": x, "y": y, "x_test": x_test, "y_test": y_test}.items():
        np.save(d / f"{k}.npy", v)
    np.savez(d.parent / f"{d.name}.npz", x=x, y=y, x_test=x_test, y_test=y_test)
    return d


def test_arrays_directory_streams_like_the_same_npz_on_the_device(tmp_path, arrays):
    d = arrays
    mlp = {"name": "mlp", "hidden_sizes": [16]}
    host = run(tmp_path, "a", {"name": "arrays", "path": str(d), "placement": "host"}, mlp, steps=6)
    npz = run(tmp_path, "n", {"name": "npz", "path": f"{d}.npz"}, mlp, steps=6)
    assert isinstance(host.data.x, np.memmap) and host.data.num_classes == 4
    assert losses(host) == losses(npz)
    np.testing.assert_allclose(losses(host, "test"), losses(npz, "test"), rtol=1e-6)
    for a, b in zip(leaves(host.params), leaves(npz.params), strict=True):
        np.testing.assert_array_equal(a, b)
    # float targets are a regression set; without x_test.npy the last rows are held out
    reg = tmp_path / "reg"
    reg.mkdir()
    np.save(reg / "x.npy", np.ones((10, 3), np.float32))
    np.save(reg / "y.npy", np.arange(10, dtype=np.float64))
    cfg = cfg_of(tmp_path, "r", {"name": "arrays", "path": str(reg), "test_fraction": 0.2}, mlp)
    data = load_dataset(cfg.data)
    assert data.task == "regression" and data.y.shape == (8, 1) and data.y_test.shape == (2, 1)
    assert data.y_test[:, 0].tolist() == [8.0, 9.0] and "last 2 rows" in data.note


# A streamed run SIGKILLed (and SIGTERMed) at every phase and resumed, bit-identical to an
# uninterrupted one, the prefetcher reading ahead each time: test_faults' interrupted run
# streams its data (data.placement=host).
# Two processes, each reading only its share of every batch, train like one process:
# test_clusters' runs (2 processes x 2 devices against one with 4) stream their data.


def test_bad_streamed_data_is_one_line_exit_2(tmp_path, corpus, capsys):
    base = ["--config", str(ROOT / CONFIG), "--set", f"log.dir={tmp_path}"]

    def cli(*sets, plot=False):
        # The curve plotter's helper (log.plot) starts before the data loads and is
        # stopped on the error, a wait of up to 1 s each: on for the first case only.
        sets = sets if plot else (*sets, "log.plot=false")
        code = main([*base, *(a for s in sets for a in ("--set", s))])
        err = capsys.readouterr().err
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    nope = tmp_path / "nope"
    assert "no such directory" in cli("data.name=tokens", f"data.path={nope}", plot=True)
    assert "no meta.json" in cli("data.name=tokens", f"data.path={tmp_path}")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (corpus / "char").iterdir():
        if f.name != "train.bin":
            (broken / f.name).write_bytes(f.read_bytes())
    assert "train.bin" in cli("data.name=tokens", f"data.path={broken}")
    err = cli("data.name=tokens", f"data.path={corpus / 'char'}", "model.vocab_size=5")
    assert "model.vocab_size=5 does not fit the data" in err
    assert "data.path is required" in cli("data.name=tokens")
    assert "no x.npy" in cli("data.name=arrays", f"data.path={tmp_path}", "model={name: mlp}")
    assert "not one of auto, device, host" in cli("data.placement=disk")
    assert not (tmp_path / "shakespeare_gpt").exists()  # nothing written for bad input


def test_bpe_prepare_train_sample_end_to_end(tmp_path, corpus, capsys):
    r = run(tmp_path, "bpe", {"name": "tokens", "path": str(corpus / "bpe")}, steps=2)
    capsys.readouterr()
    code = sample(["--run", str(r.run_dir), "--prompt", "the king", "--tokens", "12"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("the king") and len(out) > len("the king\n")
    loaded = train.load_run(r.run_dir)
    tok = loaded.tokenizer
    assert tok.kind == "bpe" and loaded.vocab is None and tok.vocab_size == r.data.num_classes
    assert loaded.encode("the king") == tok.encode("the king").tolist()
    assert len(loaded.encode("the king")) < len("the king")  # merges, not characters
    assert loaded.decode(loaded.encode("the king!\n")) == "the king!\n"
    long = "the king " * 10
    assert sample(["--run", str(r.run_dir), "--prompt", long, "--tokens", "2"]) == 2
    assert "tokens, longer than the model's context of 16" in capsys.readouterr().err


def test_reader_preads_exactly_what_indexing_the_memory_map_gives(tmp_path):
    from train.data.reader import _file_offset, read_range, read_rows

    a = np.arange(600, dtype="<u2").reshape(200, 3)
    np.save(tmp_path / "a.npy", a)
    m = np.load(tmp_path / "a.npy", mmap_mode="r")
    rows = np.array([0, 7, 199, 7, 50])
    for view, want in ((m, a), (m[:-20], a[:-20]), (m[20:], a[20:])):
        assert _file_offset(view) is not None  # read from the file, not the mapping
        np.testing.assert_array_equal(read_rows(view, rows % len(view)), want[rows % len(want)])
        np.testing.assert_array_equal(read_range(view, 3, 9), want[3:9])
    flat = np.memmap(tmp_path / "a.npy", "<u2", mode="r", offset=128, shape=(600,))
    windows = np.lib.stride_tricks.sliding_window_view(flat[1:], 16)  # overlapping rows
    np.testing.assert_array_equal(
        read_rows(windows, [0, 5, 583]),
        a.reshape(-1)[1:][np.array([0, 5, 583])[:, None] + np.arange(16)],
    )
    np.testing.assert_array_equal(read_rows(m[:, 1], [4, 2]), a[[4, 2], 1])  # 1 value a row
    assert _file_offset(m[:, ::2]) is None  # gaps inside a row: indexed instead
    np.testing.assert_array_equal(read_rows(m[:, ::2], [4, 2]), a[[4, 2], ::2])
    with pytest.raises(IndexError, match="out of bounds"):
        read_rows(m, [200])
