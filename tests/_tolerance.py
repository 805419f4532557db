"""Tolerances for equivalence tests, derived from float32 rounding, not tuned to one CPU.

Two programs that compute the same value in another order (a hand VJP and JAX's
autodiff, a batch summed on 4 devices and on one, XLA's AVX2 and AVX-512 kernels) agree
only to rounding. A float32 rounding moves a value by at most half a unit in the last
place, ``EPS32 / 2`` of it (``EPS32 = 2**-23``, about 1.2e-7); to first order the roundings
along a computation add up, each relative to the values it combines. So an evaluation with
``ops`` roundings on its longest path differs from a reordered one by at most about
``ops * EPS32 * scale``, ``scale`` being the size of the values involved: each leaf's
largest magnitude (a gradient's entries are sums of terms of about that size).

That bound is for one evaluation. Training compounds it, and Adam amplifies it: each
update is divided by the gradient's running RMS, so a rounding-level difference in a
gradient entry that is itself near zero becomes a difference of a sizeable fraction of the
learning rate in that step's update, and the two runs then take slightly different paths.
After 100 Adam steps two correct programs differ by up to a few % of the learning rate
(the CNN's manual and autodiff params by 8.4e-5 at lr 1e-2 on an AVX-512 EPYC, by 4.2e-7
on another CPU; the tiny GPT's by 0.029 lr): how much is chaos, not correctness. Hence
two checks, each for what it can prove:

- one step's gradients (or a loss, a layer's output): :func:`assert_close_f32` with an op
  count. Tight: it sees any error a hand rule or a reduction can make, including a wrong
  scale (a ``psum`` for a ``pmean``, a rule off by a constant factor), which Adam's
  per-entry normalisation hides from a trajectory almost entirely.
- a trajectory: :func:`assert_same_trajectory`, within one learning rate anywhere. A wrong
  rule moves params by about the learning rate per step in a wrong direction (an Adam
  step is ~lr whatever the gradient's size), so it breaks that bound within a few steps:
  relu's VJP without its mask moves the digits MLP 18 lr away in 10 steps, 100 lr in 100
  (``tests/test_manual_train.py::test_the_checks_catch_wrong_rules``).

A training run shows its first step's gradient (:func:`first_step_grads`): Adam's first
moment after one step is ``(1 - b1) * grad``, the gradient as the strategy under test
computes and reduces it, read through the public ``train()`` path. Under
:data:`SAME_PROGRAMS` (a constant rate, no clipping: it would normalise away a wrong scale;
one step per call) runs of 1 and of N steps compile the same programs, so the trajectory
after a gradient check costs no compile: the session's persistent compile cache has it.

Bit-identity (``np.testing.assert_array_equal``) stays where it is the promise: the same
program run twice, and a run resumed from its checkpoint in the same configuration.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: float32's spacing at 1.0

#: Overrides for runs whose first step's gradient and trajectory a test compares (see the
#: module docstring).
SAME_PROGRAMS = [
    "optimizer.schedule=constant",
    "optimizer.clip_norm=null",
    "train.steps_per_call=1",
]

#: Roundings per layer on a network's longest path, forward and backward (a contraction
#: and a few elementwise ops each way): ``ops`` for a gradient is this times the layers.
ROUNDINGS_PER_LAYER = 8


def first_step_grads(run):
    """The gradient of the one step that ``run`` (a ``train()`` result) took with Adam or
    AdamW: the first moment ``(1 - b1) * grad``, divided back out (float64 leaves)."""
    opt = run.cfg.optimizer
    if opt.name not in ("adam", "adamw") or run.step != 1:
        raise ValueError(f"one step of adam or adamw, not {run.step} of {opt.name}")
    mu = optax.tree_utils.tree_get(run.opt_state, "mu")
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / (1 - opt.b1), mu)


def _leaves(tree) -> list:
    return jax.tree_util.tree_leaves_with_path(tree)


def rounding_errors(got, want, eps: float = EPS32) -> dict[str, float]:
    """``{path: max |got - want| / (eps * scale)}`` per leaf, ``scale`` the leaf's largest
    magnitude in either tree: the difference in roundings (float32's by default) of the
    leaf's size."""
    a, b = _leaves(got), _leaves(want)
    if jax.tree.structure(got) != jax.tree.structure(want):
        raise AssertionError(
            f"different trees: {jax.tree.structure(got)} vs {jax.tree.structure(want)}"
        )
    out = {}
    for (path, g), (_, w) in zip(a, b):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            raise AssertionError(f"{jax.tree_util.keystr(path)}: shape {g.shape} != {w.shape}")
        scale = max(float(np.max(np.abs(g), initial=0)), float(np.max(np.abs(w), initial=0)))
        err = float(np.max(np.abs(g - w), initial=0))
        out[jax.tree_util.keystr(path)] = 0.0 if err == 0 else err / (eps * scale)
    return out


def assert_close_f32(got, want, *, ops: int, eps: float = EPS32, what: str = "") -> None:
    """Every leaf of ``got`` within ``ops * EPS32 * scale`` of ``want``'s (``scale``: the
    leaf's largest magnitude): two float32 evaluations of one value that differ in the
    order of at most ``ops`` roundings along any path. ``eps``: the precision's spacing
    at 1.0, for float64 ``np.finfo(np.float64).eps``.

    Example:
        >>> import numpy as np
        >>> x = np.float32([1.0, 2.0, 3.0]) / 3
        >>> assert_close_f32(x * 3 / 3, x, ops=4)  # a few roundings apart
        >>> assert_close_f32(x * (1 + 1e-4), x, ops=4)
        Traceback (most recent call last):
        ...
        AssertionError: [] differs by 8.4e+02 roundings of its scale, over the bound of 4
    """
    for path, n in rounding_errors(got, want, eps).items():
        if n > ops:
            raise AssertionError(
                f"{what}{path or '[]'} differs by {n:.2g} roundings of its scale, over the "
                f"bound of {ops}"
            )


def max_abs_diff(a, b) -> float:
    """Largest ``|a - b|`` over all leaves."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def assert_same_trajectory(got, want, *, lr: float, what: str = "") -> None:
    """Params of two training runs within one (peak) learning rate ``lr`` of each other
    everywhere: what two correct programs keep to after 100 Adam steps on any CPU (a few % of lr),
    and what a wrong rule or reduction breaks within a few steps (see the module docstring)."""
    diff = max_abs_diff(got, want)
    if not diff <= lr:
        raise AssertionError(
            f"{what}params differ by {diff:.3g} = {diff / lr:.3g} x the learning rate {lr:g}: "
            "more than rounding can explain"
        )


def check_rule(rule, *args, **static):
    """``nnlite.rules.check_rule`` of an ``@nl.hand_rule`` function's plain pair,
    hyperparameters bound."""
    import functools

    from nnlite import rules

    f = functools.partial(rule.f, **static)
    f_vjp = functools.partial(rule.f_vjp, **static)
    f.__name__, f_vjp.__name__ = rule.__name__, rule.f_vjp.__name__
    rules.check_rule(f, f_vjp, *args)
