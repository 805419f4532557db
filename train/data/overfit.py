"""``train.overfit_batches: N``: train on the same N batches again and again, and
evaluate on them.

A debugging run: a model that can learn drives the loss on a few batches to ~0; one that
cannot (a bug in the model, the loss or the data) shows it in a few hundred steps. The N
batches are the first N of the run's data order (steps 0 .. N-1), and step ``s`` trains
on batch ``s mod N``: a pure function of (seed, step) like every data order here, so a
resumed run continues exactly. The held-out split is replaced by those N batches' rows
(or text windows), so the evaluation's loss is the loss on what the model trains on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ConfigError
from .dataset import Dataset, Sampler, host_batch, make_sampler


class OverfitSampler:
    """The batches of ``inner`` for steps ``0 .. n-1``, repeated: step ``s`` gets
    ``inner``'s batch of step ``s % n``."""

    def __init__(self, inner: Sampler, n: int):
        self.inner, self.n = inner, n
        self.batch_size = getattr(inner, "batch_size", None)

    def batch(self, step: int) -> np.ndarray:
        return self.inner.batch(step % self.n)

    def batches(self, step: int, count: int) -> np.ndarray:
        return np.stack([self.batch(s) for s in range(step, step + count)])

    def position(self, step: int) -> dict:
        return {"overfit_batches": self.n, **self.inner.position(step % self.n)}

    def restore(self, start: int, meta: dict | None) -> None:
        pass


def run_sampler(cfg, data: Dataset) -> Sampler:
    """The run's sampler: the data order, or its first ``train.overfit_batches`` batches
    repeated."""
    sampler = make_sampler(cfg.seed, data, cfg.train.batch_size)
    n = cfg.train.overfit_batches
    return OverfitSampler(sampler, n) if n else sampler


def eval_on_batches(cfg, data: Dataset) -> Dataset:
    """``data`` with its held-out split replaced by the rows of the batches that
    ``train.overfit_batches`` repeats (unchanged when it is 0)."""
    n = cfg.train.overfit_batches
    if not n:
        return data
    if data.stream is not None:
        raise ConfigError(
            f"train.overfit_batches={n} repeats batches by their position in the data order, "
            "but this data source is an iterable (read in order, once); use a map-style "
            "source (__len__ and __getitem__) or an array data set"
        )
    idx = make_sampler(cfg.seed, data, cfg.train.batch_size).batches(0, n).reshape(-1)
    x, y = host_batch(data, idx)
    what = "windows" if data.window is not None else "examples"
    note = (
        f"train.overfit_batches={n}: training on the same {n} batch{'es' if n > 1 else ''} "
        f"({len(idx)} {what}) every step; the {data.eval_split} metrics are on them"
    )
    return dataclasses.replace(
        data,
        x_test=x,
        y_test=y,
        note=f"{data.note}; {note}" if data.note else note,
        chars_per_token=None,  # counted on the held-out targets, which these are not
    )
