"""The fixed train/test split, with numpy alone.

:func:`split_indices` returns the same indices as scikit-learn's
``train_test_split(..., test_size=f, random_state=seed, stratify=y or None)`` (its
``ShuffleSplit`` / ``StratifiedShuffleSplit`` draws from ``np.random.RandomState(seed)``,
repeated here draw for draw; ``tests/test_data.py`` checks equality against scikit-learn
over many seeds, fractions and label distributions). Importing scikit-learn costs about a
second and a half of start-up, for a few lines of index arithmetic.
"""

from __future__ import annotations

import math

import numpy as np


def split_sizes(n: int, test_fraction: float) -> tuple[int, int]:
    """``(n_train, n_test)`` for ``n`` examples: the test share rounded up, as scikit-learn
    rounds it. Raises ValueError when either part would be empty."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test fraction must be in (0, 1), got {test_fraction}")
    n_test = math.ceil(test_fraction * n)
    n_train = n - n_test
    if n_train < 1 or n_test < 1:
        raise ValueError(
            f"{n} examples with test fraction {test_fraction} leave {n_train} for training "
            f"and {n_test} for testing; both need at least one"
        )
    return n_train, n_test


def split_indices(
    n: int, test_fraction: float, seed: int, stratify: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, test)`` of a shuffled split of ``n`` examples.

    Args:
      n: number of examples.
      test_fraction: share held out for testing, in (0, 1); ``ceil(test_fraction * n)``
        examples.
      seed: seed of the ``np.random.RandomState`` that draws the split.
      stratify: ``[n]`` class labels whose proportions both parts keep (each class needs
        at least two members, and each part at least one example per class), or None.

    Returns:
      Two int64 index arrays, in scikit-learn's order.

    Example:
      >>> train, test = split_indices(10, 0.2, seed=0)
      >>> sorted(train.tolist() + test.tolist()) == list(range(10)), len(test)
      (True, 2)
    """
    n_train, n_test = split_sizes(n, test_fraction)
    rng = np.random.RandomState(seed)
    if stratify is None:
        order = rng.permutation(n)
        return order[n_test : n_test + n_train], order[:n_test]
    y = np.asarray(stratify)
    if y.shape != (n,):
        raise ValueError(f"stratify labels must have shape ({n},), got {y.shape}")
    classes, y_idx, counts = np.unique(y, return_inverse=True, return_counts=True)
    if counts.min() < 2:
        raise ValueError(
            f"classes {classes[counts < 2].tolist()} have a single member; stratifying "
            "needs at least two per class"
        )
    if n_train < len(classes) or n_test < len(classes):
        raise ValueError(
            f"a stratified split of {len(classes)} classes needs at least one example of each "
            f"per part, but the parts hold {n_train} (train) and {n_test} (test)"
        )
    members = np.split(np.argsort(y_idx, kind="stable"), np.cumsum(counts)[:-1])
    train_counts = _apportion(counts, n_train, rng)
    test_counts = _apportion(counts - train_counts, n_test, rng)
    train, test = [], []
    for idx, a, b in zip(members, train_counts, test_counts):
        shuffled = idx[rng.permutation(len(idx))]
        train.append(shuffled[:a])
        test.append(shuffled[a : a + b])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _apportion(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Split ``draws`` over classes in proportion to ``counts``: each class gets the floor of
    its share, and the rest go to the largest remainders, ties broken at random (the
    random draws must match scikit-learn's ``_approximate_mode`` one for one)."""
    exact = counts / counts.sum() * draws
    out = np.floor(exact)
    missing = int(draws - out.sum())
    if missing > 0:
        remainder = exact - out
        for value in np.unique(remainder)[::-1]:
            (tied,) = np.nonzero(remainder == value)
            take = min(len(tied), missing)
            out[rng.choice(tied, size=take, replace=False)] += 1
            missing -= take
            if missing == 0:
                break
    return out.astype(int)
