"""show_jaxpr over a sweep of JAX's public API (tests/_jaxpr_sweep.py builds the cases).

Every case must round-trip: the printed code runs and traces to the same program as the
original (outputs and gradients equal bit for bit; where the programs differ, both run and
their outputs and gradients are compared), and printing it again gives the same text. A
case may instead be refused at print time, with ``UnsupportedPrimitiveError`` naming the
primitive and the source line, only for a primitive that docs/show_jaxpr.md lists as not
supported, and for at most 2% of the cases.

The suite runs a fixed, systematic share of the cases of each module (every k-th, so each
module, dtype and shape family is in it) to stay within its time budget;
``NNLITE_SWEEP=full`` runs them all (``python tests/_jaxpr_sweep.py`` prints the counts).
"""

import collections
import functools
import os
import re

import _jaxpr_sweep as sweep
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = os.environ.get("NNLITE_SWEEP") == "full"
#: of a module with more cases than this, the suite runs every k-th, about this many
PER_MODULE = 12

#: the modules the cases cover (test_sweep_is_broad checks that these are the cases' own).
#: Named here so that collecting this file builds no case: building all of them costs ~2.5 s
#: of CPU, which every xdist worker would pay at collection, the one that runs none too.
MODULES = ("jax.lax", "jax.nn", "jax.numpy", "jax.numpy.fft", "jax.numpy.linalg",
           "jax.random", "jax.scipy", "jax.scipy.linalg", "jax.scipy.signal",
           "jax.scipy.special", "jax.scipy.stats", "transforms")  # fmt: skip


@functools.cache
def cases() -> list:
    return sweep.all_cases()


@functools.cache
def by_module() -> dict[str, list]:
    out = collections.defaultdict(list)
    for c in cases():
        out[c.module].append(c)
    return out


def _sample(cases):
    if FULL or len(cases) <= PER_MODULE:
        return cases
    k = -(-len(cases) // PER_MODULE)
    return cases[::k]


def _documented_refusals() -> set[str]:
    """The primitives docs/show_jaxpr.md lists under "Not supported"."""
    with open(os.path.join(ROOT, "docs/show_jaxpr.md")) as f:
        text = f.read()
    section = text.split("### Not supported", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w-]+)` \|", section, re.M))


REFUSALS: collections.Counter = collections.Counter()


@pytest.mark.parametrize("module", MODULES)
def test_sweep_module_round_trips(module):
    documented = _documented_refusals()
    bad = []
    # the module's first valid case is also run and its outputs and gradients compared
    # numerically; the others run wherever their programs differ (equal programs compute
    # equal outputs, bit for bit)
    numeric = True
    for case in _sample(by_module()[module]):
        outcome, detail = sweep.check(case, numeric=numeric)
        numeric = numeric and outcome in ("invalid", "refused")  # nothing was run
        REFUSALS["cases"] += outcome != "invalid"
        if outcome == "refused":
            REFUSALS["refused"] += 1
            prim = re.search(r"primitive '([\w-]+)'", detail).group(1)
            if prim not in documented:
                bad.append(f"{case.name}: refused {prim!r}, not listed in docs: {detail}")
        elif outcome not in ("ok", "invalid"):
            bad.append(f"{case.name}: {outcome}: {detail}")
    assert not bad, "\n".join(bad)


def test_sweep_is_broad():
    assert len(cases()) >= 1000
    assert set(by_module()) == set(MODULES)
    assert set(MODULES) >= {"jax.numpy", "jax.numpy.fft", "jax.numpy.linalg", "jax.nn",
                              "jax.lax", "jax.random", "jax.scipy.special",
                              "jax.scipy.linalg", "jax.scipy.signal", "jax.scipy.stats",
                              "transforms"}  # fmt: skip
    shapes = {tuple(a.shape) for c in cases() for a in c.args if hasattr(a, "shape")}
    assert () in shapes and any(0 in s for s in shapes)  # scalars and zero-size arrays


def test_sweep_refusals_are_at_most_two_percent():
    # runs after the module tests (pytest keeps file order); alone it checks a sample
    if not REFUSALS["cases"]:
        for module in MODULES:
            for case in _sample(by_module()[module])[::4]:
                outcome, _ = sweep.check(case)
                REFUSALS["cases"] += outcome != "invalid"
                REFUSALS["refused"] += outcome == "refused"
    assert REFUSALS["refused"] <= 0.02 * REFUSALS["cases"], REFUSALS
