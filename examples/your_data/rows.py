"""A data source of your own: rows made on demand (see docs/data.md#your-data-sources).

``data.name: rows:make`` in a config calls :func:`make` with ``data.options`` as keyword
arguments; the trainer then asks the source for the rows of each batch.
"""

import numpy as np


class Rings:
    """Points on three noisy rings, labelled by ring: row ``i`` is a pure function of
    ``(seed, i)``, so any batch of indices can be read in any order, by any process."""

    num_classes = 3  # declared: otherwise the trainer scans the labels once

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        y = (np.asarray(indices) % 3).astype(np.int32)
        noise = np.stack([np.random.default_rng([self.seed, i]).normal(size=3) for i in indices])
        angle = noise[:, 0] * np.pi
        radius = 1.0 + y + 0.1 * noise[:, 1]
        x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
        return x.astype(np.float32), y


def make(n: int = 3000, seed: int = 0) -> Rings:
    return Rings(n, seed)
