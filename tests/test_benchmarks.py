"""The train-step benchmark's implementations compute the same training (correctness only)."""

import jax
import pytest

pytest.importorskip("equinox")
pytest.importorskip("flax")

from benchmarks._impls import TINY, Spec, build_all, losses_after  # noqa: E402


# The peers are written as their users write them (``x @ W + b``), with rank promotion.
@jax.numpy_rank_promotion("allow")
def test_implementations_agree_on_loss():
    impls = build_all(TINY, n_batches=3, steps_per_call=2)
    assert [i.name for i in impls] == ["raw JAX", "Equinox", "Flax NNX", "nnlite", "nnlite K=2"]
    losses = losses_after(impls, 5)  # 5 steps: nnlite K=2 also takes a shorter last call
    ref = losses["raw JAX"]
    for name, value in losses.items():
        assert value == pytest.approx(ref, rel=1e-5), name
    # Training moved: the loss differs from the untrained loss.
    assert losses_after(impls[:1], 1)["raw JAX"] != pytest.approx(ref, rel=1e-3)


def test_matmul_flops_counts_what_autodiff_computes():
    spec = Spec("t", 4, (8,), 2, 3)
    fwd = 2 * 3 * (4 * 8 + 8 * 2)
    # Weight gradients for both layers, the input gradient only for the second.
    assert spec.matmul_flops() == 2 * fwd + 2 * 3 * 8 * 2
