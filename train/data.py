"""Data sets and the seeded data order.

Every data set is small enough to live on the device; each step the host sends only the
indices of the batch. The order is a function of (seed, epoch), so a checkpoint's step
number is its data position.
"""

from __future__ import annotations

import gzip
import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ConfigError, DataConfig
from .split import split_indices


@dataclass(frozen=True)
class Dataset:
    name: str
    x: np.ndarray  # [n, features] float32
    y: np.ndarray  # [n] int32 labels, or [n, outputs] float32 targets
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int | None  # None for regression

    @property
    def task(self) -> str:
        return "regression" if self.num_classes is None else "classification"

    @property
    def in_features(self) -> int:
        return self.x.shape[1]

    @property
    def out_features(self) -> int:
        return self.num_classes if self.num_classes is not None else self.y.shape[1]


def load_dataset(cfg: DataConfig) -> Dataset:
    """Build the data set named by ``cfg.name``."""
    return _LOADERS[cfg.name](cfg)


def _split(x: np.ndarray, y: np.ndarray, cfg: DataConfig, stratify: bool):
    """``x, x_test, y, y_test``: scikit-learn's ``train_test_split`` (see train/split.py)."""
    try:
        train, test = split_indices(
            len(x), cfg.test_fraction, cfg.split_seed, stratify=y if stratify else None
        )
    except ValueError as e:
        raise ConfigError(f"data.test_fraction={cfg.test_fraction}: {e}") from None
    return x[train], x[test], y[train], y[test]


def digits_csv() -> Path:
    """scikit-learn's bundled digits (``sklearn/datasets/data/digits.csv.gz``), found without
    importing scikit-learn (1.5 s of start-up): ``find_spec`` of a top-level package reads
    only its location."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise ConfigError(
        "data.name=digits reads the digits bundled with scikit-learn, which is not installed "
        "(or has no datasets/data/digits.csv.gz); pip install scikit-learn"
    )


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(data, target)`` as ``sklearn.datasets.load_digits`` returns them: ``[1797, 64]``
    float64 pixel values 0..16 and ``[1797]`` integer labels."""
    with gzip.open(digits_csv(), "rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def _digits(cfg: DataConfig) -> Dataset:
    data, target = load_digits_arrays()
    x = (data / 16.0).astype(np.float32)  # pixel values 0..16 -> [0, 1]
    y = target.astype(np.int32)
    x, x_test, y, y_test = _split(x, y, cfg, stratify=True)
    return Dataset("digits", x, y, x_test, y_test, 10)


def _mnist1d(cfg: DataConfig) -> Dataset:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = cfg.num_samples
    args.seed = cfg.split_seed + 42  # 42 is the package's published default
    state = np.random.get_state()  # the generator reseeds numpy's global RNG; put it back
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(state)
    return Dataset(
        "mnist1d",
        d["x"].astype(np.float32),
        d["y"].astype(np.int32),
        d["x_test"].astype(np.float32),
        d["y_test"].astype(np.int32),
        10,
    )


def _linreg(cfg: DataConfig) -> Dataset:
    """The JAX tutorial's data: y = 2x - 1 + 0.5 * noise, 128 training points."""
    rng = np.random.default_rng(cfg.split_seed)

    def make(n):
        x = rng.normal(size=(n, 1)).astype(np.float32)
        noise = rng.normal(size=(n, 1)).astype(np.float32)
        return x, (2 * x - 1 + 0.5 * noise).astype(np.float32)

    x, y = make(128)
    x_test, y_test = make(128)
    return Dataset("linreg", x, y, x_test, y_test, None)


def _npz(cfg: DataConfig) -> Dataset:
    path = Path(cfg.path)
    where = f"data.path {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where}: file not found")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{where}: not a readable .npz file without pickles ({e})") from None
    for k in ("x", "y"):
        if k not in arrays:
            raise ConfigError(
                f"{where}: missing array {k!r}; found {sorted(arrays) or 'none'}; expected x, y and optionally x_test, y_test"
            )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ConfigError(f"{where}: x_test and y_test must be given together")
    x, y = _check_xy(arrays["x"], arrays["y"], where, "x", "y")
    classification = np.issubdtype(y.dtype, np.integer)
    if "x_test" in arrays:
        x_test, y_test = _check_xy(arrays["x_test"], arrays["y_test"], where, "x_test", "y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise ConfigError(
                f"{where}: x_test has feature shape {x_test.shape[1:]}, x has {x.shape[1:]}"
            )
        if (
            np.issubdtype(y_test.dtype, np.integer) != classification
            or y_test.shape[1:] != y.shape[1:]
        ):
            raise ConfigError(
                f"{where}: y_test (dtype {y_test.dtype}, shape {y_test.shape}) does not match y (dtype {y.dtype}, shape {y.shape})"
            )
    else:
        x, x_test, y, y_test = _split(x, y, cfg, stratify=classification and _can_stratify(y, cfg))
    if classification:
        labels = np.concatenate([y, y_test])
        if labels.min() < 0:
            raise ConfigError(f"{where}: labels must be >= 0, found {labels.min()}")
        num_classes = int(labels.max()) + 1
        return Dataset("npz", x, y.astype(np.int32), x_test, y_test.astype(np.int32), num_classes)
    y = y.reshape(len(y), -1).astype(np.float32)
    y_test = y_test.reshape(len(y_test), -1).astype(np.float32)
    return Dataset("npz", x, y, x_test, y_test, None)


def _check_xy(x: np.ndarray, y: np.ndarray, where: str, xn: str, yn: str):
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ConfigError(f"{where}: {xn} must be numeric, got dtype {x.dtype}")
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2:
        raise ConfigError(f"{where}: {xn} must have shape [n, features], got {x.shape}")
    if not (np.issubdtype(y.dtype, np.floating) or np.issubdtype(y.dtype, np.integer)):
        raise ConfigError(
            f"{where}: {yn} must be integer labels or float targets, got dtype {y.dtype}"
        )
    if y.ndim == 0 or len(y) != len(x):
        raise ConfigError(f"{where}: {yn} has shape {y.shape} but {xn} has {len(x)} rows")
    if np.issubdtype(y.dtype, np.integer) and y.ndim != 1:
        raise ConfigError(f"{where}: integer labels {yn} must have shape [n], got {y.shape}")
    if len(x) == 0:
        raise ConfigError(f"{where}: {xn} is empty")
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"{where}: {xn} has {int(np.sum(~np.isfinite(x)))} non-finite values")
    if np.issubdtype(y.dtype, np.floating) and not np.all(np.isfinite(y)):
        raise ConfigError(f"{where}: {yn} has {int(np.sum(~np.isfinite(y)))} non-finite values")
    return x.astype(np.float32), y


def _can_stratify(y: np.ndarray, cfg: DataConfig) -> bool:
    counts = np.bincount(y - y.min())
    return counts[counts > 0].min() >= 2 and len(y) * cfg.test_fraction >= np.count_nonzero(counts)


_LOADERS = {"digits": _digits, "mnist1d": _mnist1d, "linreg": _linreg, "npz": _npz}


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(n // batch_size, 1)


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation of the training set used in ``epoch`` (a pure function of both)."""
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int32)


class BatchIndices:
    """Host-side sampler: the indices of global batches ``step, step+1, ...``.

    Batches are consecutive slices of each epoch's permutation (the tail that does not
    fill a batch is dropped); a data set smaller than the batch is sampled with wraparound.
    """

    def __init__(self, seed: int, n: int, batch_size: int):
        self.seed, self.n, self.batch_size = seed, n, batch_size
        self.per_epoch = steps_per_epoch(n, batch_size)
        self._cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            order = epoch_order(self.seed, epoch, self.n)
            if self.n < self.batch_size:
                order = np.resize(order, self.batch_size)
            self._cache = (epoch, order)
        return self._cache[1]

    def batch(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.per_epoch)
        b = self.batch_size
        return self._order(epoch)[i * b : (i + 1) * b]

    def batches(self, step: int, count: int) -> np.ndarray:
        """``[count, batch_size]`` indices for steps ``step .. step+count-1``."""
        return np.stack([self.batch(s) for s in range(step, step + count)])

    def position(self, step: int) -> dict:
        epoch, i = divmod(step, self.per_epoch)
        return {"epoch": epoch, "batch_in_epoch": i, "steps_per_epoch": self.per_epoch}
