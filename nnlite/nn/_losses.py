"""Losses: per-example values, with an explicit ``reduction``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..grad._manual import hand_rule
from ..grad._small_rules import mean, reduce_sum, softmax_cross_entropy_values

__all__ = ["REDUCTIONS", "accuracy", "mse", "nll", "reduce", "softmax_cross_entropy"]

REDUCTIONS = ("none", "mean", "sum")


def reduce(values: jax.Array, reduction: str) -> jax.Array:
    """Apply ``reduction`` ("none" keeps per-example values, "mean", "sum")."""
    if reduction == "none":
        return values
    # Both carry their rules (mean_vjp, reduce_sum_vjp).
    if reduction == "mean":
        return mean(values)
    if reduction == "sum":
        return reduce_sum(values)
    raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(REDUCTIONS)}")


def _check_labels(fn: str, scores: jax.Array, labels: jax.Array) -> None:
    if scores.ndim < 1:
        raise ValueError(f"{fn}: expected scores with a class axis, got shape {scores.shape}")
    if labels.shape != scores.shape[:-1]:
        raise ValueError(
            f"{fn}: expected labels of shape {scores.shape[:-1]} (scores shape {scores.shape} "
            f"minus the class axis), got {labels.shape}"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{fn}: labels must be integers (class indices), got dtype {labels.dtype}")


def _class_ids(scores: jax.Array, dtype) -> jax.Array:
    """``0 .. num_classes-1`` along the class axis, with size-1 axes before it (so it
    broadcasts against ``scores`` without rank promotion)."""
    ids = jnp.arange(scores.shape[-1], dtype=dtype)
    return ids.reshape((1,) * (scores.ndim - 1) + ids.shape)


def nll(log_probs: jax.Array, labels: jax.Array, *, reduction: str = "none") -> jax.Array:
    """Negative log-likelihood ``-log_probs[..., labels]``.

    Args:
        log_probs: ``[..., num_classes]`` log-probabilities.
        labels: ``[...]`` integer class indices.
        reduction: "none" (per example, default), "mean" or "sum".

    Example:
        >>> import jax.numpy as jnp
        >>> nll(jnp.log(jnp.array([[0.25, 0.75]])), jnp.array([1]))
        Array([0.2876821], dtype=float32)
    """
    log_probs, labels = jnp.asarray(log_probs), jnp.asarray(labels)
    _check_labels("nll", log_probs, labels)
    return reduce(nll_values(log_probs, labels), reduction)


def nll_values_vjp(log_probs, labels, dret):
    hit = labels[..., None] == _class_ids(log_probs, labels.dtype)
    return jnp.where(hit, -dret[..., None], 0).astype(log_probs.dtype), None


@hand_rule(nll_values_vjp)
def nll_values(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example ``-log_probs[..., labels]`` (no checks, no reduction)."""
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


def softmax_cross_entropy(
    logits: jax.Array, labels: jax.Array, *, reduction: str = "none"
) -> jax.Array:
    """Cross-entropy of ``softmax(logits)`` against integer ``labels``.

    Computed as ``logsumexp(logits) - logits[label]`` with the max subtracted first, so
    logits of magnitude 1e4 give exact, finite values.

    Args:
        logits: ``[..., num_classes]`` unnormalised scores.
        labels: ``[...]`` integer class indices.
        reduction: "none" (per example, default), "mean" or "sum".

    Example:
        >>> import jax.numpy as jnp
        >>> softmax_cross_entropy(jnp.array([[0.0, 0.0]]), jnp.array([0]))
        Array([0.6931472], dtype=float32)
    """
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    _check_labels("softmax_cross_entropy", logits, labels)
    return reduce(softmax_cross_entropy_values(logits, labels), reduction)


def accuracy(scores: jax.Array, labels: jax.Array, *, reduction: str = "none") -> jax.Array:
    """1.0 where ``argmax(scores) == labels``, else 0.0 (per example, float32).

    Exactly ``jnp.argmax(scores, axis=-1) == labels`` (the first index of the maximum wins
    a tie) for finite scores; a row with a NaN counts as wrong. Computed as a max and a
    min-reduction over the class axis, which XLA fuses, instead of argmax's
    (value, index) pair reduction.

    Args:
        scores: ``[..., num_classes]`` logits or probabilities.
        labels: ``[...]`` integer class indices.
        reduction: "none" (per example, default), "mean" (the accuracy) or "sum".

    Example:
        >>> import jax.numpy as jnp
        >>> accuracy(jnp.array([[0.1, 0.9], [2.0, 2.0], [3.0, -1.0]]), jnp.array([1, 1, 1]))
        Array([1., 0., 0.], dtype=float32)
    """
    scores, labels = jnp.asarray(scores), jnp.asarray(labels)
    _check_labels("accuracy", scores, labels)
    scores = jax.lax.stop_gradient(scores)
    num_classes = scores.shape[-1]
    top = jnp.max(scores, axis=-1, keepdims=True)
    classes = jnp.broadcast_to(_class_ids(scores, labels.dtype), scores.shape)
    first_top = jnp.min(jnp.where(scores == top, classes, num_classes), axis=-1)
    return reduce((first_top == labels).astype(jnp.float32), reduction)


def mse(predictions: jax.Array, targets: jax.Array, *, reduction: str = "none") -> jax.Array:
    """Mean squared error per example: the mean over all but the leading axis.

    Args:
        predictions, targets: arrays of the same shape ``[batch, ...]`` (or ``[batch]``).
        reduction: "none" (per example, default), "mean" or "sum".

    Example:
        >>> import jax.numpy as jnp
        >>> mse(jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0]))
        Array([1., 4.], dtype=float32)
    """
    predictions, targets = jnp.asarray(predictions), jnp.asarray(targets)
    if predictions.shape != targets.shape:
        raise ValueError(
            f"mse: predictions shape {predictions.shape} != targets shape {targets.shape}"
        )
    return reduce(squared_error_values(predictions, targets), reduction)


def squared_error_values_vjp(predictions, targets, dret):
    per_row = predictions[0].size if predictions.ndim > 1 else 1
    g = dret.reshape(dret.shape + (1,) * (predictions.ndim - 1)) * (2 / per_row)
    d = (predictions - targets) * g
    return d, -d


@hand_rule(squared_error_values_vjp)
def squared_error_values(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-example mean squared error over all but the leading axis (no checks)."""
    sq = jnp.square(predictions - targets)
    return sq.reshape(sq.shape[0], -1).mean(axis=1) if sq.ndim > 1 else sq
