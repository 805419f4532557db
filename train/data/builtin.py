"""Data sets and the seeded data order.

A small data set lives on the device and each step the host sends only the indices of
the batch; a big one (``data.placement``: host, or auto above a size, see
``train/data/streamed.py``) stays on disk or in host memory and each call's batches are read
on the host and sent ahead (``train/data/feed.py``). For example data sets the order is a function of (seed, epoch); for
text the batch of step ``s`` is ``batch_size`` random window starts drawn from
``default_rng([seed, s])``. Either way a checkpoint's step number is its data position.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from ..errors import ConfigError, relative_to, users_error
from ..report.units import format_bytes, host_memory_bytes
from . import streamed
from .dataset import Dataset, labels_are_ids
from .registry import DATA_SETS, arguments, factory, is_factory, is_given
from .section import DataConfig
from .source import DataError
from .split import split_indices
from .text import corpus as text_corpus
from .user import to_dataset

DEFAULT_CONTEXT = 64  # text windows when neither data.context nor model.context is set


def text_context(cfg) -> int:
    """The text window length of a config: ``data.context``, else the model's
    ``context`` when the config sets it, else :data:`DEFAULT_CONTEXT`."""
    return cfg.data.context or cfg.model.get("context") or DEFAULT_CONTEXT


def data_section(cfg) -> DataConfig:
    """The config's ``data`` section with what the model determines filled in:
    ``data.tokenizer`` (unset) is the directory of a ``model.name: "hf:DIR"``."""
    name = cfg.model.name if isinstance(cfg.model.name, str) else ""
    if cfg.data.tokenizer or not name.startswith("hf:"):
        return cfg.data
    return dataclasses.replace(cfg.data, tokenizer=name[3:])


def load_dataset(cfg: DataConfig, context: int | None = None, search=()) -> Dataset:
    """Build the data set named by ``cfg.name``: a built-in one (``DATA_SETS``; text data
    sets need the model's ``context``, the window length), or a user's factory
    ``module:function`` called with ``cfg.options`` that returns a source
    (train/data/source.py). ``search``: directories to import a user's module from first."""
    if is_given(cfg.name):
        raise ConfigError(
            f"data.name={cfg.name} names a source that was given to train.fit(data=...); a "
            "config builds one from a factory: data.name: 'module:function'"
        )
    where = f"data.name={cfg.name}"
    fn = (
        factory(cfg.name, cfg.options, search)
        if is_factory(cfg.name)
        else DATA_SETS.get(cfg.name, where)
    )
    kwargs = arguments(fn, cfg, context, where)
    if not is_factory(cfg.name):
        return streamed.place(fn(**kwargs), cfg)
    try:
        made = fn(**kwargs)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's code: one line, named
        err = users_error("data source", e, where)
        if err is not None:
            raise err from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{where}: calling it raised {type(e).__name__}: {first}") from None
    if isinstance(made, Dataset):  # a built data set, as the built-ins return
        return streamed.place(made, cfg)
    return to_dataset(made, cfg, name=cfg.name)


def _split(x: np.ndarray, y: np.ndarray, cfg: DataConfig, stratify: bool):
    """``x, x_test, y, y_test``: scikit-learn's ``train_test_split`` (see train/data/split.py)."""
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


# What digits does to load_digits' pixels (0..16 -> [0, 1]); a run records it, so that
# predicting on raw pixels applies it (Dataset.preprocess, train.load_run(...).predict).
DIGITS_PREPROCESS = {"scale": 1 / 16}


def _digits(cfg: DataConfig) -> Dataset:
    data, target = load_digits_arrays()
    x = apply_preprocess(data, DIGITS_PREPROCESS)
    y = target.astype(np.int32)
    x, x_test, y, y_test = _split(x, y, cfg, stratify=True)
    return Dataset("digits", x, y, x_test, y_test, 10, preprocess=DIGITS_PREPROCESS)


def recorded_preprocess(name: str) -> dict | None:
    """What data set ``name`` did to its inputs, for a run whose checkpoint predates
    recording it (only digits scaled its pixels)."""
    return DIGITS_PREPROCESS if name == "digits" else None


def apply_preprocess(x: np.ndarray, preprocess: dict | None) -> np.ndarray:
    """Raw inputs as a run's model saw them (``preprocess``: ``{"scale": s}``, or None)."""
    if not preprocess:
        return x
    return (np.asarray(x, np.float64) * preprocess["scale"]).astype(np.float32)


# mnist1d generates float64 signals of this length (before its 40-sample crop), a few
# arrays of them at once: bytes per example, a lower bound of what generation holds.
_MNIST1D_BYTES_PER_EXAMPLE = 72 * 8 * 3


def _mnist1d(cfg: DataConfig) -> Dataset:
    """The ``mnist1d`` package's data set (its default recipe, ``num_samples`` examples,
    seed ``split_seed + 42``), cached as an npz: importing the package (matplotlib, scipy,
    requests) and generating 5000 examples cost ~3 s of CPU, reading the cache ~10 ms."""
    need, have = cfg.num_samples * _MNIST1D_BYTES_PER_EXAMPLE, host_memory_bytes()
    if need > have:
        raise ConfigError(
            f"data.num_samples={cfg.num_samples}: generating MNIST-1D needs at least "
            f"{format_bytes(need)} but this machine has {format_bytes(have)}"
        )
    seed = cfg.split_seed + 42  # the package's published default is 42
    path = text_corpus.cache_dir() / f"mnist1d_n{cfg.num_samples}_seed{seed}.npz"
    d = _read_cached(path, _MNIST1D_KEYS)
    if d is None:
        d = _generate_mnist1d(cfg.num_samples, seed)
        _write_cached(path, d)
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
        raise ConfigError(f"{where}: file not found{relative_to(path)}")
    _check_npz_magic(path, where)
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
        distinct = len(np.unique(labels))
        if labels_are_ids(num_classes, distinct):
            raise ConfigError(
                f"{where}: labels must be class indices 0..K-1, but the largest is "
                f"{num_classes - 1} and only {distinct} distinct labels occur (a "
                f"{num_classes}-way output layer); map them to 0..{distinct - 1}"
            )
        unused = num_classes - distinct
        note = ""
        if unused:
            missing = sorted(set(range(num_classes)) - set(np.unique(labels).tolist()))
            shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            note = (
                f"labels run 0..{num_classes - 1} but {unused} of those classes never occur "
                f"({shown}): the model gets a {num_classes}-way output; if the labels are not "
                f"class indices, map them to 0..{distinct - 1}"
            )
        return Dataset(
            "npz", x, y.astype(np.int32), x_test, y_test.astype(np.int32), num_classes, note=note
        )
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
    counts = np.unique(y, return_counts=True)[1]  # not bincount: a label of 10^9 is 8 GB
    return counts.min() >= 2 and len(y) * cfg.test_fraction >= len(counts)


# Labels are class indices: a gap this much larger than the labels in use is a mistake
# (ids, not indices), not classes that happen to be missing from the data.

_NPZ_MAGIC = b"PK\x03\x04"  # an .npz is a zip archive
_NPY_MAGIC = b"\x93NUMPY"


def _check_npz_magic(path: Path, where: str) -> None:
    """Say what a file that is not an .npz archive is, instead of numpy's guess that it
    "contains pickled data"."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(_NPZ_MAGIC):
        return
    expected = "expected an .npz archive written by np.savez(path, x=..., y=...)"
    if head.startswith(_NPY_MAGIC):
        raise ConfigError(f"{where}: is a .npy file (a single array); {expected}")
    if not head:
        raise ConfigError(f"{where}: the file is empty; {expected}")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        first = text.splitlines()[0][:60] if text.strip() else ""
        raise ConfigError(
            f"{where}: is a text file (first line {first!r}), not an .npz; {expected}"
        )
    raise ConfigError(f"{where}: not an .npz archive (it starts with {head[:8]!r}); {expected}")


_MNIST1D_KEYS = ("x", "y", "x_test", "y_test")


def _generate_mnist1d(num_samples: int, seed: int) -> dict:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    state = np.random.get_state()  # the generator reseeds numpy's global RNG; put it back
    try:
        d = make_dataset(args)
    except (ValueError, IndexError) as e:
        raise ConfigError(f"data.num_samples={num_samples}: mnist1d cannot make it ({e})") from None
    finally:
        np.random.set_state(state)
    return {k: np.asarray(d[k]) for k in _MNIST1D_KEYS}


def _read_cached(path: Path, keys: tuple) -> dict | None:
    """The arrays of a cache file, or None when it is missing or unreadable (then rebuilt)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in keys}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None


def _write_cached(path: Path, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` atomically; a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # read-only home or full disk: the run goes on, the next one generates again


# The built-in data sets, as train/data/registry.py's DATA_SETS names them, called as a
# user's data-set function is (data=the section, context=the window length)
def digits(data: DataConfig) -> Dataset:
    """scikit-learn's 8x8 digits, 64 features in [0, 1], a stratified test split."""
    return _digits(data)


def mnist1d(data: DataConfig) -> Dataset:
    """MNIST-1D: 40-sample signals of 10 classes, generated locally."""
    return _mnist1d(data)


def linreg(data: DataConfig) -> Dataset:
    """The JAX tutorial's linear regression, y = 2x - 1 + noise."""
    return _linreg(data)


def npz(data: DataConfig) -> Dataset:
    """Arrays x, y (and x_test, y_test) of an .npz file, ``data.path``."""
    return _npz(data)


def _text(cfg: DataConfig, context: int) -> Dataset:
    return text_dataset("text", text_corpus.read_text(cfg.path, "data.path"), cfg, context)


def _shakespeare(cfg: DataConfig, context: int) -> Dataset:
    path = text_corpus.build_corpus(text_corpus.SHAKESPEARE)
    return text_dataset(
        "shakespeare_char", text_corpus.read_text(path, "cached corpus"), cfg, context
    )


def text(data: DataConfig, context: int) -> Dataset:
    """A UTF-8 file (``data.path``) as characters, windows of ``context``."""
    return _text(data, context)


def shakespeare_char(data: DataConfig, context: int) -> Dataset:
    """Tiny Shakespeare as characters (built and cached locally), windows of ``context``."""
    return _shakespeare(data, context)


def text_dataset(name: str, corpus: str, cfg: DataConfig, context: int) -> Dataset:
    """A character-level language-modelling data set of ``corpus`` with windows of
    ``context`` characters (see train/data/text/corpus.py for the split and the vocabulary)."""
    where = f"data.name={name}" + (f" ({cfg.path})" if cfg.path else "")
    enc = text_corpus.encode_corpus(corpus, cfg.val_fraction)
    need = context + 1  # a window of inputs plus the next character of its last one
    for split, ids in (("training", enc.train), ("validation", enc.val)):
        if len(ids) < need:
            raise ConfigError(
                f"{where}: the {split} split has {len(ids)} characters but a window of "
                f"model.context={context} needs {need}; use a longer text or a shorter context"
            )
    n_val = len(enc.val) - context  # window starts with a full target window
    m = min(cfg.eval_windows_for(context), n_val)
    starts = np.unique(np.linspace(0, n_val - 1, m).round().astype(np.int64))
    pos = starts[:, None] + np.arange(context)
    note = ""
    if enc.dropped_count:
        note = (
            f"dropped {enc.dropped_count} validation characters absent from the training "
            f"split ({enc.dropped!r})"
        )
    return Dataset(
        name,
        enc.train[:-1],
        enc.train[1:],
        enc.val[pos],
        enc.val[pos + 1],
        len(enc.vocab),
        window=context,
        vocab=enc.vocab,
        note=note,
    )
