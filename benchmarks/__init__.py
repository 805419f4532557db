"""Benchmarks of nnlite against raw JAX, Equinox and Flax NNX (run as ``python -m benchmarks.NAME``)."""
