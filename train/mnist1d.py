"""MNIST-1D generated with numpy alone, equal to the ``mnist1d`` package's ``make_dataset``.

The package (Greydanus, 2020; ``pip install mnist1d``) builds each example from one of
ten 12-point templates: pad with zeros, stretch (linear interpolation), scale, shift,
fill the padding with smoothed noise, add white noise, shear, subsample to 40 points.
Importing it loads matplotlib, requests and scipy (about 1.7 s of CPU), and it builds a
scipy ``interp1d`` per interpolation (2.8 s for 5000 examples). This module draws the same
random numbers in the same order from a ``np.random.RandomState(seed)`` (the package
reseeds numpy's global generator with ``seed``; this leaves it alone) and does the same
arithmetic: ``np.interp`` is what ``interp1d(kind="linear")`` calls for 1-D float data, and
:func:`gaussian_filter` repeats ``scipy.ndimage.gaussian_filter``'s sums term by term.
``tests/test_mnist1d.py`` checks the arrays equal the package's, bit for bit.
"""

from __future__ import annotations

import numpy as np

# The package's defaults (mnist1d.data.get_dataset_args).
TEMPLATE_LEN = 12
PADDING = (36, 60)
SCALE_COEFF = 0.4
MAX_TRANSLATION = 48
CORR_NOISE_SCALE = 0.25
IID_NOISE_SCALE = 2e-2
SHEAR_SCALE = 0.75
FINAL_SEQ_LENGTH = 40
TRAIN_SPLIT = 0.8

# The ten digit templates (mnist1d.data.get_templates), before whitening.
_TEMPLATES = (
    (5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5),
    (5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5),
    (5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5),
    (5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5),
    (5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5),
    (5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5),
    (5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5),
    (5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5),
    (5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5),
    (5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5),
)


def templates() -> np.ndarray:
    """``[10, 12]`` float64: the templates whitened, starting at 0, divided by 6."""
    x = np.stack([np.asarray(t) for t in _TEMPLATES])
    x -= x.mean(1, keepdims=True)
    x /= x.std(1, keepdims=True)
    x -= x[:, :1]
    return x / 6.0


def gaussian_filter(x: np.ndarray, sigma: float = 2.0, truncate: float = 4.0) -> np.ndarray:
    """``scipy.ndimage.gaussian_filter1d(x, sigma, axis=-1)`` (mode "reflect"), with the
    same floating-point sums: ``x[i] w[0] + sum_j (x[i-j] + x[i+j]) w[j]``, j from the
    outermost tap in."""
    r = int(truncate * sigma + 0.5)
    k = np.arange(-r, r + 1)
    phi = np.exp(-0.5 / (sigma * sigma) * k**2)
    w = phi / phi.sum()
    n = x.shape[-1]
    xp = np.concatenate([x[..., :r][..., ::-1], x, x[..., n - r :][..., ::-1]], axis=-1)
    out = xp[..., r : r + n] * w[r]
    for j in range(r, 0, -1):
        out = out + (xp[..., r - j : r - j + n] + xp[..., r + j : r + j + n]) * w[r - j]
    return out


def _interpolate(x: np.ndarray, n: int) -> np.ndarray:
    return np.interp(np.linspace(0, 1, n), np.linspace(0, 1, len(x)), x)


def _examples(labels: np.ndarray, rng: np.random.RandomState, eps: float = 1e-8) -> np.ndarray:
    """``[len(labels), 40]``: the package's ``transform`` of each label's template.

    The random numbers are drawn example by example in the package's order (pad length,
    scale, shift, correlated noise, white noise, shear); the arithmetic then runs on all
    examples at once, element by element as the package does it one example at a time
    (so the results are the same floats). The stretched padded template depends only on
    (label, pad length): 10 x 25 of them, computed once.
    """
    low, high = PADDING
    n, length = len(labels), TEMPLATE_LEN + PADDING[-1]
    pads, scales, shifts, shears = (np.empty(n, int), np.empty(n), np.empty(n, int), np.empty(n))
    corr, iid = np.empty((n, length)), np.empty((n, length))
    for i in range(n):
        pads[i] = low + int(rng.rand() * (high - low + 1))
        scales[i] = rng.rand()
        shifts[i] = rng.choice(MAX_TRANSLATION)
        corr[i] = rng.randn(length)
        iid[i] = rng.randn(length)
        shears[i] = rng.rand()
    tmpl = templates()
    stretched = {
        (c, p): _interpolate(np.concatenate([tmpl[c] + eps, np.zeros(p)]), length)
        for c, p in set(zip(labels.tolist(), pads.tolist()))
    }
    x = np.stack([stretched[c, p] for c, p in zip(labels.tolist(), pads.tolist())])
    x *= (1 + SCALE_COEFF * (scales - 0.5))[:, None]
    x = x[np.arange(n)[:, None], (np.arange(length) - shifts[:, None]) % length]  # shift right
    mask = x != 0
    x = mask * x + (1 - mask) * gaussian_filter(CORR_NOISE_SCALE * corr)
    x = x + IID_NOISE_SCALE * iid
    x = x - (SHEAR_SCALE * (shears - 0.5))[:, None] * np.linspace(-0.5, 0.5, length)
    grid, final = np.linspace(0, 1, length), np.linspace(0, 1, FINAL_SEQ_LENGTH)
    return np.stack([np.interp(final, grid, row) for row in x])


def make_dataset(num_samples: int = 5000, seed: int = 42) -> dict[str, np.ndarray]:
    """``{"x", "y", "x_test", "y_test"}`` as ``mnist1d.data.make_dataset`` returns them for
    ``num_samples`` and ``seed`` (its other arguments at their defaults): float64
    ``[n, 40]`` signals, centred and scaled to unit deviation, int64 labels; the first
    80% train.

    Example:
      >>> d = make_dataset(100, seed=1)
      >>> d["x"].shape, d["x_test"].shape, sorted(set(d["y"].tolist()))[:3]
      ((80, 40), (20, 40), [0, 1, 2])
    """
    if num_samples < len(_TEMPLATES):
        raise ValueError(
            f"num_samples must be at least {len(_TEMPLATES)} (one per class), got {num_samples}"
        )
    rng = np.random.RandomState(seed)
    labels = np.repeat(np.arange(len(_TEMPLATES)), num_samples // len(_TEMPLATES))
    xs = _examples(labels, rng)
    shuffle = rng.permutation(len(labels))
    xs, ys = xs[shuffle], labels[shuffle]
    xs = (xs - xs.mean()) / xs.std()
    split = int(len(ys) * TRAIN_SPLIT)
    return {"x": xs[:split], "x_test": xs[split:], "y": ys[:split], "y_test": ys[split:]}
