"""MNIST-1D comes from the mnist1d package, generated once and then read from the cache."""

import numpy as np
import pytest

from train.config import ConfigError, DataConfig
from train.data import builtin as data_mod
from train.data.builtin import load_dataset


def _mnist1d_data():
    """The mnist1d package's data module, imported when a test needs it (it imports
    matplotlib and scipy: ~1 s of every worker's collection at module level)."""
    return pytest.importorskip("mnist1d.data")


def _reference(num_samples: int, seed: int) -> dict:
    mnist1d_data = _mnist1d_data()
    args = mnist1d_data.get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    state = np.random.get_state()
    try:
        return mnist1d_data.make_dataset(args)
    finally:
        np.random.set_state(state)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NNLITE_CACHE", str(tmp_path))
    return tmp_path


def test_the_package_arrays_then_the_cache(cache, monkeypatch):
    cfg = DataConfig(name="mnist1d", num_samples=200, split_seed=3)
    want = _reference(200, 45)
    state = np.random.get_state()[1].copy()
    first = load_dataset(cfg)
    assert np.array_equal(np.random.get_state()[1], state)  # the global RNG is left alone
    assert [p.name for p in cache.iterdir()] == ["mnist1d_n200_seed45.npz"]

    def no_generation(*_):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr(data_mod, "_generate_mnist1d", no_generation)
    second = load_dataset(cfg)
    for got in (first, second):
        np.testing.assert_array_equal(got.x, want["x"].astype(np.float32))
        np.testing.assert_array_equal(got.y, want["y"])
        np.testing.assert_array_equal(got.x_test, want["x_test"].astype(np.float32))
        np.testing.assert_array_equal(got.y_test, want["y_test"])


def test_a_damaged_cache_is_rebuilt_and_an_unwritable_one_skipped(cache, tmp_path, monkeypatch):
    cfg = DataConfig(name="mnist1d", num_samples=100)
    path = cache / "mnist1d_n100_seed42.npz"
    path.write_bytes(b"torn")  # a half-written file from an older, killed writer
    got = load_dataset(cfg)
    np.testing.assert_array_equal(got.y, _reference(100, 42)["y"])
    assert np.load(path)["y"].shape == got.y.shape  # rewritten whole
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("NNLITE_CACHE", str(blocker))
    assert load_dataset(cfg).x.shape == got.x.shape  # trains all the same


def test_absurd_sample_counts_are_refused_before_generating(cache):
    with pytest.raises(ConfigError, match=r"data.num_samples=100000000000: .*needs at least"):
        load_dataset(DataConfig(name="mnist1d", num_samples=10**11))
