"""train/split.py and the digits loader give exactly what scikit-learn gives, without it."""

import subprocess
import sys

import numpy as np
import pytest

from train.config import ConfigError, DataConfig
from train.data.builtin import load_dataset
from train.data.split import split_indices


def sk_split(*arrays, **kwargs):
    """scikit-learn's ``train_test_split``, imported when a test calls it (not at every
    worker's collection)."""
    return pytest.importorskip("sklearn.model_selection").train_test_split(*arrays, **kwargs)


def _labels(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "balanced":
        return np.arange(n) % 10
    if kind == "skewed":  # one big class, several small ones: ties in the remainders
        return np.minimum(rng.geometric(0.35, size=n) - 1, 6)
    if kind == "two":
        return (rng.random(n) < 0.2).astype(np.int64)
    if kind == "sparse":  # labels with gaps, unsorted, negative
        return rng.choice(np.array([-3, 5, 17, 400]), size=n, p=[0.1, 0.2, 0.3, 0.4])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "two", "sparse", None])
def test_split_equals_scikit_learn(kind):
    rng = np.random.default_rng(1)
    checked = 0
    for n in (40, 97, 300, 1797):
        for fraction in (0.1, 0.2, 0.25, 1 / 3, 0.5, 0.73):
            for seed in (0, 1, 7, 42, 2**31 - 1):
                y = None if kind is None else _labels(kind, n, rng)
                x = np.arange(n)
                try:
                    want = sk_split(x, test_size=fraction, random_state=seed, stratify=y)
                except ValueError:  # a class too small to stratify: we refuse it too
                    with pytest.raises(ValueError):
                        split_indices(n, fraction, seed, stratify=y)
                    continue
                train, test = split_indices(n, fraction, seed, stratify=y)
                np.testing.assert_array_equal(train, want[0])
                np.testing.assert_array_equal(test, want[1])
                checked += 1
    assert checked > 80  # most combinations are valid splits


def test_split_refuses_what_scikit_learn_refuses():
    with pytest.raises(ValueError, match="single member"):
        split_indices(10, 0.5, 0, stratify=np.array([0] * 9 + [1]))
    with pytest.raises(ValueError, match="at least one example of each"):
        split_indices(20, 0.9, 0, stratify=np.arange(20) % 10)
    with pytest.raises(ValueError, match="leave 0 for training"):
        split_indices(1, 0.2, 0)


def test_digits_equal_scikit_learn_and_skip_importing_it():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    for fraction, seed in ((0.2, 0), (0.35, 3)):
        got = load_dataset(DataConfig(name="digits", test_fraction=fraction, split_seed=seed))
        want = sk_split(x, y, test_size=fraction, random_state=seed, stratify=y)
        for a, b in zip((got.x, got.x_test, got.y, got.y_test), want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    code = (
        "import sys; from train.data.builtin import load_dataset; from train.config import DataConfig; "
        "load_dataset(DataConfig(name='digits')); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_npz_split_errors_are_config_errors(tmp_path):
    path = tmp_path / "one.npz"
    np.savez(path, x=np.zeros((1, 3), np.float32), y=np.zeros(1, np.float32))
    with pytest.raises(ConfigError, match=r"data.test_fraction=0.2: 1 examples"):
        load_dataset(DataConfig(name="npz", path=str(path)))
