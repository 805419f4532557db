"""Strict defaults for every test: 8 host CPU devices, rank promotion raises.

Tests compile hundreds of tiny programs and run each for a few steps, so compiling is most
of the suite's time. One persistent compilation cache for the session, shared by the
pytest-xdist workers and inherited by every subprocess through the environment, compiles a
program that several tests build (the same tiny config through ``train()`` or
``python -m train``, a 1-step and an N-step run of one config) once. Every test process
compiles with LLVM's optimisation level 0 (tests/_xla.py says why, and what that asks of
a test that starts a subprocess).
"""

import os
import shutil
import sys
import tempfile

from _xla import xla_flags

# Must happen before jax is imported anywhere.

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No Python traceback in every lowered op's location (HLO metadata for profilers): the
# tests read jaxprs' source lines, never HLO's, and building the locations is ~8% of a
# training test's CPU (tests/test_gpt.py: 37.6 -> 34.5 s).
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
# Bytecode on, whatever the environment says (PYTHONDONTWRITEBYTECODE=1 here and maybe in
# CI): the suite's hundreds of ``python -m train`` subprocesses would each compile the
# project's modules from source (~0.4 s of CPU a process), and each worker would rewrite
# every test module's asserts again. The .pyc files go to the gitignored __pycache__.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# The process that creates the cache (pytest's main process; under pytest-xdist the
# controller, which loads this file before it starts its workers) is the one that deletes
# it; the workers and every subprocess find it in the environment they inherit.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="nnlite-test-jax-cache-"
    )
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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


@pytest.fixture(params=["float32", "float64"])
def rand(request):
    """``rand(*shape)``: standard normal values in the test's dtype (float64 with x64 on
    for the test only); the rule checks run once per dtype."""
    dtype = request.param
    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng(0)
        # cast by numpy and placed with device_put: jnp.asarray of a numpy array compiles
        # a program (a convert, or a copy) for every new shape
        yield lambda *shape: jax.device_put(rng.standard_normal(shape).astype(dtype))


# The test files that take longest (seconds of compile and run on 2 cores, measured with
# --durations), longest first. pytest-xdist's --dist loadfile hands files to the workers
# in collection order, so a long file collected last leaves one worker idle while the
# other finishes it; handing out the longest first (LPT scheduling) evens the two out.
LONGEST_FIRST = [  # by each file's time in a whole-suite run (--durations=0), largest first
    "test_benchmarks.py",
    "test_docs.py",
    "test_hf.py",
    "test_distributed.py",
    "test_chat.py",
    "test_new_layers.py",
    "test_train.py",
    "test_your_model.py",
    "test_load_back.py",
    "test_gpt.py",
    "test_hf_adapter.py",
    "test_sharding.py",
    "test_jaxpr_sweep.py",
    "test_user_project.py",
    "test_grad_train.py",
    "test_faults.py",
    "test_deep.py",
    "test_manual_structural.py",
    "test_show_jaxpr.py",
    "test_manual_train.py",
    "test_batch_norm.py",
    "test_sharded_checkpoint.py",
    "test_params_features.py",
    "test_hand_vjp.py",
    "test_perf.py",
    "test_hf_generate.py",
    "test_grad_modes.py",
    "test_compose.py",
    "test_grad_contract.py",
    "test_cnn.py",
    "test_checkpoint_policies.py",
    "test_streamed.py",
    "test_lm_head.py",
    "test_attention.py",
    "test_vjp.py",
    "test_programs.py",
    "test_layers.py",
    "test_commands.py",
    "test_debug_runs.py",
    "test_save.py",
    "test_packaging.py",
    "test_data_source.py",
    "test_loggers.py",
    "test_grad_auto.py",
    "test_seed.py",
    "test_hf_export.py",
    "test_prepare.py",
    "test_grad_primitives.py",
    "test_edges.py",
    "test_faults_user.py",
    "test_config.py",
    "test_losses.py",
    "test_params.py",
    "test_clusters.py",
    "test_eject.py",
    "test_grad_policy.py",
    "test_conv.py",
    "test_equinox.py",
    "test_grad_auto_corpus.py",
    "test_plot.py",
    "test_text.py",
    "test_optimizers.py",
    "test_callbacks.py",
    "test_embedding.py",
    "test_checksum.py",
    "test_split.py",
    "test_normalisation.py",
    "test_flops.py",
    "test_newcomer.py",
    "test_hf_files.py",
    "test_parallel.py",
    "test_mnist1d.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sorted() is stable: tests keep their order within a file
    items[:] = sorted(items, key=lambda it: rank.get(it.path.name, len(rank)))
