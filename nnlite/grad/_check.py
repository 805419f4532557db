"""``check_rule``: a rule against ``jax.vjp`` (also ``check_vjp``), and the seed's tree helpers.

The plug-in that hands a checked rule to JAX is ``_custom_vjp.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "VJPCheckError",
    "allclose",
    "check",
    "check_rule",
    "check_vjp",
    "default_tolerances",
    "ensure_tuple",
    "randlike",
    "tree_all",
    "tree_allclose",
    "tree_close",
]


from ._contract import VJPCheckError, cotangents, is_hyperparameter

# (rtol, atol) per dtype. atol is relative to the largest reference magnitude of each
# cotangent (at least 1), so a rule is judged the same way whatever the scale of its data.
_TOLERANCES = {
    "float64": (1e-9, 1e-11),
    "float32": (1e-4, 1e-5),
    "bfloat16": (2e-2, 2e-3),
    "float16": (1e-2, 1e-3),
}


def default_tolerances(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` used by ``check_rule`` for cotangents of ``dtype``.

    Example:
        >>> default_tolerances("float32")
        (0.0001, 1e-05)
    """
    return _TOLERANCES.get(jnp.dtype(dtype).name, _TOLERANCES["float32"])


def _is_int_like(x: Any) -> bool:
    """True when every leaf of ``x`` has an integer/bool dtype (labels, indices)."""
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(
        jnp.issubdtype(jnp.result_type(leaf), jnp.integer) or jnp.result_type(leaf) == jnp.bool_
        for leaf in leaves
    )


def _is_zero_cotangent(ct: Any) -> bool:
    """``None`` or float0 leaves: what a rule may return for an integer argument."""
    return all(
        leaf is None or getattr(leaf, "dtype", None) == jax.dtypes.float0
        for leaf in jax.tree.leaves(ct, is_leaf=_is_none)
    )


def _is_none(x: Any) -> bool:
    return x is None


def _is_static(x: Any) -> bool:
    """Python scalars, strings, slices, None...: hyperparameters, closed over, no cotangent
    (the rule contract, ``_contract.py``)."""
    return is_hyperparameter(x)


def _name(f: Callable) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


def ensure_tuple(val: Any) -> tuple:
    """``val`` if it is a tuple, else ``(val,)`` (the seed's helper).

    Example:
        >>> ensure_tuple(1), ensure_tuple((1, 2))
        ((1,), (1, 2))
    """
    return val if isinstance(val, tuple) else (val,)


def allclose(ref: Any, test: Any, rtol: float = 1e-5, atol: float = 1e-8, verbose: bool = False):
    """``jnp.allclose(test, ref)`` as a Python bool; ``verbose`` prints both when they differ.

    Example:
        >>> allclose(1.0, 1.0 + 1e-7)
        True
    """
    if bool(jnp.allclose(test, ref, rtol=rtol, atol=atol)):
        return True
    if verbose:
        print(f"allclose: reference {ref!r}\n          test      {test!r}")
    return False


def tree_close(tref: Any, ttest: Any, rtol: float = 1e-5, atol: float = 1e-8, verbose=True):
    """A tree of bools: ``allclose`` leaf by leaf (the trees must have the same structure).

    Example:
        >>> tree_close({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.5}, verbose=False)
        {'a': True, 'b': False}
    """
    return jax.tree.map(lambda a, b: allclose(a, b, rtol, atol, verbose), tref, ttest)


def tree_all(t: Any) -> bool:
    """True when every leaf of ``t`` is true."""
    return all(jax.tree.leaves(t))


def tree_allclose(tref: Any, ttest: Any, rtol: float = 1e-5, atol: float = 1e-8, verbose=True):
    """``tree_close`` reduced to one bool.

    Example:
        >>> tree_allclose((1.0, [2.0]), (1.0, [2.0]))
        True
    """
    return tree_all(tree_close(tref, ttest, rtol, atol, verbose))


def randlike(x: Any, rng: np.random.Generator | None = None) -> np.ndarray:
    """A standard-normal numpy array with ``x``'s shape (the seed's random cotangent).

    Uses numpy's global generator, as the seed does, unless ``rng`` is given.

    Example:
        >>> randlike(np.zeros((2, 3))).shape
        (2, 3)
    """
    shape = np.shape(x)
    return np.random.randn(*shape) if rng is None else rng.standard_normal(shape)


def _dret_args(dret: Any) -> tuple:
    """How a rule receives the cotangent: a tuple result's cotangents one by one (the seed's
    ``dup_vjp(x, *dret)``), anything else as one argument."""
    return ensure_tuple(dret)


def _random_like(key: jax.Array, tree: Any) -> Any:
    """Standard-normal arrays shaped like ``tree``'s float leaves (float0 for the others).

    Drawn on the host with numpy, seeded from ``key``: no random kernel to compile for
    every shape checked.
    """
    seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return host_random_like(np.random.default_rng(seed), tree)


def host_random_like(rng: np.random.Generator, tree: Any) -> Any:
    """Standard-normal numpy arrays from ``rng`` shaped like ``tree``'s float leaves
    (float0 for the others)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            out.append(rng.standard_normal(leaf.shape).astype(leaf.dtype))
        else:
            out.append(np.zeros(leaf.shape, jax.dtypes.float0))
    return jax.tree.unflatten(jax.tree.structure(tree), out)


def check_rule(
    f: Callable,
    f_vjp: Callable,
    *args: Any,
    rtol: float | None = None,
    atol: float | None = None,
    key: jax.Array | None = None,
    jit: bool = True,
    verbose: bool = False,
) -> None:
    """Check the rule ``f_vjp(*args, dret)`` against ``jax.vjp(f, *args)`` on a random
    cotangent (``check_vjp`` and the seed's ``check`` are this function).

    Compares, argument by argument, the tree structure, shapes and values of the
    cotangents. Integer arrays must get ``None`` (or a float0 array); Python scalars
    (an int index, a float rate) are hyperparameters, passed through, and what the rule
    returns for them is ignored (the rule contract: ``docs/gradients.md``).
    When ``f`` returns a tuple, the rule gets one cotangent per output, as the seed's
    ``dup_vjp(x, *dret)`` does. The rule may return cotangents for the differentiable
    arguments only (the seed's ``index_vjp(x, i, dret) -> dx``).

    Args:
        f: the forward function.
        f_vjp: its hand rule, ``f_vjp(*args, dret) -> dargs``.
        *args: arguments at which to check (arrays or pytrees of arrays).
        rtol, atol: tolerances; default from ``default_tolerances`` for each cotangent's
            dtype, with ``atol`` scaled by the largest reference magnitude (at least 1).
        key: PRNG key for the random cotangent (default ``jax.random.key(0)``).
        jit: trace ``f`` and ``f_vjp`` into one compiled computation (fast: one compile
            instead of one per op); ``False`` runs them eagerly, e.g. to debug with print.
        verbose: print, per argument, the largest difference from ``jax.vjp``.

    Raises:
        VJPCheckError: naming the argument index and path, the largest error and where.

    Example:
        >>> import jax.numpy as jnp
        >>> check_rule(jnp.sin, lambda x, dret: dret * jnp.cos(x), jnp.arange(3.0))
        >>> check_rule(jnp.sin, lambda x, dret: dret * jnp.sin(x), jnp.arange(3.0))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        nnlite.rules.VJPCheckError: check_rule(sin, <lambda>): cotangent of argument 0 differs ...
    """
    who = f"check_rule({_name(f)}, {_name(f_vjp)})"
    key = jax.random.key(0) if key is None else key
    static = [_is_static(a) for a in args]

    def merge(dyn):
        # Static arguments (Python ints: an index) are closed over; jax.vjp differentiates
        # the rest, and their cotangents are what the rule is compared against.
        it = iter(dyn)
        return [a if s else next(it) for a, s in zip(args, static, strict=True)]

    def f_dyn(*dyn):
        return f(*merge(dyn))

    def both(dyn, dret):
        _, pullback = jax.vjp(f_dyn, *dyn)
        want = [None if _is_int_like(a) else w for a, w in zip(dyn, pullback(dret), strict=True)]
        full = merge(dyn)
        return want, cotangents(f_vjp(*full, *_dret_args(dret)), full, who)

    dyn = [a for a, s in zip(args, static, strict=True) if not s]
    dret = _random_like(key, jax.eval_shape(f_dyn, *dyn))
    want, got = (jax.jit(both) if jit else both)(dyn, dret)
    want = iter(want)
    for i, (arg, g) in enumerate(zip(args, got, strict=True)):
        if static[i]:
            continue  # not traced: no cotangent to compare
        w = next(want)
        if _is_int_like(arg):
            if not _is_zero_cotangent(g):
                raise VJPCheckError(
                    f"{who}: argument {i} is an integer array, not differentiable; the rule must "
                    f"return None for it, got {jax.tree.map(jnp.shape, g)}"
                )
            continue
        _compare(who, i, w, g, rtol, atol, verbose)


#: ``check_rule``'s other names: ``check_vjp`` (nnlite's first), ``check`` (the seed's).
check_vjp = check = check_rule


def _compare(who: str, i: int, want: Any, got: Any, rtol, atol, verbose=False) -> None:
    w_leaves, w_def = jax.tree_util.tree_flatten_with_path(want)
    g_leaves, g_def = jax.tree_util.tree_flatten_with_path(got)
    if w_def != g_def:
        w_paths = [jax.tree_util.keystr(p) for p, _ in w_leaves]
        g_paths = [jax.tree_util.keystr(p) for p, _ in g_leaves]
        pairs = zip(w_paths, g_paths, strict=False)
        diffs = (f"{a or '<root>'} vs {b or '<root>'}" for a, b in pairs if a != b)
        first = next(diffs, f"{len(w_paths)} leaves vs {len(g_paths)}")
        raise VJPCheckError(
            f"{who}: cotangent of argument {i} has tree structure {g_def}, jax.vjp gives "
            f"{w_def} (first difference: {first})"
        )
    for (path, w), (_, g) in zip(w_leaves, g_leaves, strict=True):
        where = f"argument {i}{jax.tree_util.keystr(path)}"
        w = np.asarray(w)
        if g is None or np.shape(g) != w.shape:
            raise VJPCheckError(
                f"{who}: cotangent of {where} has shape {None if g is None else np.shape(g)}, "
                f"expected {w.shape}"
            )
        g = np.asarray(g)
        d_rtol, d_atol = default_tolerances(w.dtype)
        r = d_rtol if rtol is None else rtol
        a = d_atol * max(1.0, float(np.max(np.abs(w), initial=0.0))) if atol is None else atol
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        err = np.abs(g64 - w64)
        bad = ~(err <= a + r * np.abs(w64))  # also catches NaN
        if verbose:
            print(f"{who}: {where}: max abs error {np.max(err, initial=0.0):.3g}")
        if bad.any():
            score = np.where(np.isnan(err), np.inf, err - r * np.abs(w64))
            at = np.unravel_index(int(np.argmax(score)), w.shape)
            raise VJPCheckError(
                f"{who}: cotangent of {where} differs from jax.vjp: max abs error "
                f"{float(np.nanmax(err, initial=0) if not np.isnan(err).all() else np.nan):.4g} "
                f"at index {tuple(int(k) for k in at)} (rule {float(g64[at]):.4g}, jax.vjp "
                f"{float(w64[at]):.4g}); rtol={r:.4g}, atol={a:.4g} "
                f"({int(bad.sum())} of {bad.size} elements outside tolerance)"
            )
