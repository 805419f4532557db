"""Strict defaults for every test: 8 host CPU devices, rank promotion raises."""

import os

# Must happen before jax is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture(scope="session")
def npz(tmp_path_factory) -> str:
    """``data.path=...`` of a small npz data set for subprocess training runs: four classes
    from the signs of two of eight features, with a fixed test split (quicker to load
    than scikit-learn)."""
    rng = np.random.default_rng(0)
    x, x_test = rng.normal(size=(512, 8)), rng.normal(size=(128, 8))

    def label(x):
        return ((x[:, 0] > 0) + 2 * (x[:, 1] > 0)).astype(np.int32)

    path = tmp_path_factory.mktemp("data") / "small.npz"
    np.savez(
        path,
        x=x.astype(np.float32),
        y=label(x),
        x_test=x_test.astype(np.float32),
        y_test=label(x_test),
    )
    return f"data.path={path}"
