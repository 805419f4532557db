"""Flatten + unflatten cost of a ParamsDict against a plain nested dict/list.

Run from the repository root as ``python benchmarks/pytree.py`` or
``python -m benchmarks.pytree``. Both trees hold the same 200 leaves (100 Linear layers,
``W`` and ``b`` each); the variants are timed interleaved in one process and the medians
of many repeats are compared. Target: ParamsDict / dict <= 2.5x.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make ``nnlite`` importable from the root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from nnlite import ParamsDict

TARGET = 2.5
N_LAYERS = 100


def make_trees(n_layers: int = N_LAYERS) -> dict[str, object]:
    """The four trees under test, all with the same 2 * n_layers numpy leaves."""
    rng = np.random.default_rng(0)
    layers = [
        (rng.standard_normal((8, 8), dtype=np.float32), np.zeros(8, np.float32))
        for _ in range(n_layers)
    ]
    named = {f"l{i}": (w, b) for i, (w, b) in enumerate(layers)}
    return {
        "ParamsDict(layers=[...])": ParamsDict(layers=[ParamsDict(W=w, b=b) for w, b in layers]),
        "dict(layers=[...])": {"layers": [{"W": w, "b": b} for w, b in layers]},
        "ParamsDict(l0..l99)": ParamsDict({k: ParamsDict(W=w, b=b) for k, (w, b) in named.items()}),
        "dict(l0..l99)": {k: {"W": w, "b": b} for k, (w, b) in named.items()},
    }


def _touch(tree: object) -> None:
    """Read every node's fields (an unflattened ParamsDict builds its dict on first use)."""
    nodes = tree["layers"] if "layers" in tree else list(tree.values())
    for node in nodes:
        len(node)


def _round_trip_seconds(tree: object, inner: int, touch: bool) -> float:
    flatten, unflatten = jax.tree_util.tree_flatten, jax.tree_util.tree_unflatten
    t0 = time.perf_counter()
    if touch:
        for _ in range(inner):
            leaves, treedef = flatten(tree)
            _touch(unflatten(treedef, leaves))
    else:
        for _ in range(inner):
            leaves, treedef = flatten(tree)
            unflatten(treedef, leaves)
    return (time.perf_counter() - t0) / inner


def run(repeats: int = 200, inner: int = 20, touch: bool = False) -> dict[str, float]:
    """Median seconds per flatten+unflatten round trip for each tree, timed interleaved."""
    trees = make_trees()
    for tree in trees.values():  # warm caches (treedef aux, registry lookups)
        _round_trip_seconds(tree, inner, touch)
    samples: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(repeats):
        for name, tree in trees.items():
            samples[name].append(_round_trip_seconds(tree, inner, touch))
    return {name: statistics.median(s) for name, s in samples.items()}


PAIRS = [
    ("ParamsDict(layers=[...])", "dict(layers=[...])"),
    ("ParamsDict(l0..l99)", "dict(l0..l99)"),
]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.pytree", description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="few repeats: a smoke run")
    args = ap.parse_args(argv)
    repeats = 5 if args.tiny else 200
    medians = run(repeats=repeats)
    for name, sec in medians.items():
        print(f"{name:<26} {sec * 1e6:8.1f} us  (median flatten+unflatten, 200 leaves)")
    worst = 0.0
    for pd_name, dict_name in PAIRS:
        ratio = medians[pd_name] / medians[dict_name]
        worst = max(worst, ratio)
        print(f"ratio {pd_name} / {dict_name}: {ratio:.2f}x (target <= {TARGET}x)")
    print(f"worst ratio: {worst:.2f}x -> {'OK' if worst <= TARGET else 'ABOVE TARGET'}")
    # For information: the same round trip when the result's fields are then read, which
    # also counts the lazily built dicts of the unflattened ParamsDicts.
    touched = run(repeats=min(50, repeats), touch=True)
    for pd_name, dict_name in PAIRS:
        ratio = touched[pd_name] / touched[dict_name]
        print(f"  + reading every node: {pd_name} / {dict_name}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
