"""train/mnist1d.py generates exactly the mnist1d package's data set, without importing it."""

import subprocess
import sys

import numpy as np
import pytest

from train.config import ConfigError, DataConfig
from train.data import load_dataset
from train.mnist1d import gaussian_filter, make_dataset

mnist1d_data = pytest.importorskip("mnist1d.data")


def _reference(num_samples: int, seed: int) -> dict:
    args = mnist1d_data.get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    state = np.random.get_state()
    try:
        return mnist1d_data.make_dataset(args)
    finally:
        np.random.set_state(state)


@pytest.mark.parametrize(("num_samples", "seed"), [(5000, 42), (737, 9), (10, 3)])
def test_same_arrays_as_the_package(num_samples, seed):
    got, want = make_dataset(num_samples, seed), _reference(num_samples, seed)
    for k in ("x", "y", "x_test", "y_test"):
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_gaussian_filter_equals_scipy_bit_for_bit():
    ndimage = pytest.importorskip("scipy.ndimage")
    x = np.random.default_rng(0).standard_normal((300, 72)) * np.logspace(-3, 3, 300)[:, None]
    want = np.stack([ndimage.gaussian_filter(row, 2) for row in x])
    np.testing.assert_array_equal(gaussian_filter(x), want)
    np.testing.assert_array_equal(
        gaussian_filter(x[:, :20], 1.5),
        np.stack([ndimage.gaussian_filter1d(r, 1.5) for r in x[:, :20]]),
    )


def test_loader_leaves_global_rng_and_imports_alone():
    state = np.random.get_state()
    d = load_dataset(DataConfig(name="mnist1d", num_samples=200, split_seed=1))
    assert d.x.shape == (160, 40) and d.x.dtype == np.float32 and d.y.dtype == np.int32
    assert np.array_equal(np.random.get_state()[1], state[1])
    code = (
        "import sys; from train.data import load_dataset; from train.config import DataConfig; "
        "load_dataset(DataConfig(name='mnist1d', num_samples=100)); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mnist1d', 'scipy', 'matplotlib'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    with pytest.raises(ConfigError, match="data.num_samples=5: num_samples must be at least 10"):
        load_dataset(DataConfig(name="mnist1d", num_samples=5))
