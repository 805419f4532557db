"""``check_rules``: every hand rule a model's loss runs, checked against ``jax.vjp`` at the
inputs it really gets, one row per call -- the library half of a trainer's
``--check-grads`` (rules checked at the run's shapes and dtype before step 0).

The loss runs once, eagerly, in manual mode with show_grad's tape: each hand-rule call
(nnlite's layers and losses, a user's ``@nl.hand_rule``, ``nl.rules.custom_vjp`` plug-ins)
records its arguments. Each call's rule is then compared with ``jax.vjp`` of its plain
function on a random cotangent, and its error reported in units of float rounding: the
largest difference divided by the dtype's epsilon times the cotangent's magnitude.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._jax_private import of_current_trace
from ..core._mode import manual_scope
from ._check import _dret_args, host_random_like
from ._contract import cotangents, has_cotangent, is_hyperparameter

__all__ = ["RuleCheck", "check_rules"]


@dataclasses.dataclass(frozen=True)
class RuleCheck:
    """One hand-rule call of a loss: where (the params it reads, or its position), which
    rule, its error in roundings of its dtype, and whether that is within ``max_roundings``.

    ``argument``: the argument whose cotangent is farthest off (None: nothing compared);
    ``relative``: that error relative to ``jax.vjp``'s cotangent (its largest difference
    over the cotangent's largest magnitude: 1.0 for a rule off by a factor of two);
    ``fn``: the hand-rule function called (with ``.f`` and ``.f_vjp``).
    """

    layer: str
    rule: str
    dtype: str
    roundings: float
    ok: bool
    argument: int | None = None
    relative: float = 0.0
    fn: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        mark = "ok" if self.ok else "WRONG"
        return f"{self.layer:<28} {self.rule:<26} {self.dtype:<9} {self.roundings:>10.1f}  {mark}"


def _label(args, paths: dict[int, str], rule: str, counts: dict[str, int]) -> str:
    for a in args:
        path = paths.get(id(a))
        if path is not None:
            return path.rsplit(".", 1)[0] if "." in path else path
    counts[rule] = counts.get(rule, 0) + 1
    return f"{rule}#{counts[rule]}"


def check_rules(
    loss_fn: Callable,
    params: Any,
    *batch: Any,
    max_roundings: float = 1000.0,
    seed: int = 0,
    select: Callable[[Callable], bool] | None = None,
    **kwargs: Any,
) -> list[RuleCheck]:
    """Check every hand rule ``loss_fn(params, *batch, **kwargs)`` calls, at its inputs.

    Args:
        loss_fn, params, batch, kwargs: as for ``jax.grad(loss_fn)(params, *batch)``
            (concrete arrays: the rules are run on them).
        max_roundings: the largest error, in roundings of the call's dtype (its epsilon
            times the cotangent's largest magnitude), a rule may have.
        seed: for the random cotangents.
        select: which rules to check: ``select(rule)`` for each hand-rule function called
            (``rule.f``, ``rule.f_vjp``; e.g. one of ``nl.check_manual``'s); default all.
            The loss still runs whole; only the selected rules are compared.

    Returns:
        One ``RuleCheck`` per call, in call order (a backward policy's stop, scale or clip,
        whose VJP departs from its function on purpose, is left out); ``str()`` of each is
        a table row.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> net = nl.FFN(3, (4,), 2)
        >>> p = net.init(jax.random.key(0))
        >>> def loss(p, x):
        ...     return jnp.mean(net(p, x))
        >>> rows = nl.check_rules(loss, p, jnp.ones((5, 3)))
        >>> [(r.layer, r.rule, r.ok) for r in rows][:2]
        [('params.layers[0]', 'linear_vjp', True), ('relu#1', 'relu_vjp', True)]
    """
    rows: list = []  # (layer, rule, dtype, [(err, scale) per compared leaf]), at trace time

    def errors(params, batch, kwargs):
        # Traced once, as one program: the loss with manual mode's tape, then every call's
        # rule against jax.vjp (eagerly, each small op would compile a program of its
        # own: ~140 compiles for a 3-layer MLP). disable_jit while tracing inlines the jit,
        # scan and cond bodies the loss calls, so what the tape holds is of this trace.
        paths = {
            id(leaf): jax.tree_util.keystr(path, simple=True, separator=".")
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        paths = {k: _bracket(f"params.{v}".replace(".[", "[")) for k, v in paths.items()}
        tape: list = []
        with jax.disable_jit(), manual_scope(True, tape):
            loss_fn(params, *batch, **kwargs)
        counts: dict = {}
        out = []
        for i, (wrapped, args, static, _out) in enumerate(tape):  # grows: stacks' copies
            if hasattr(wrapped, "layer") and not hasattr(wrapped, "f"):  # an nl.Stack
                if of_current_trace(args):
                    tape.extend(_stack_copy(wrapped.layer, *args, paths))
                continue
            if select is not None and not select(wrapped):
                continue
            f, f_vjp = wrapped.f, wrapped.f_vjp
            if getattr(f, "_backward_policy", False):  # stop/scale/clip: not f's VJP, by design
                continue
            name = getattr(f_vjp, "__name__", "rule")
            if not of_current_trace((args, static)):
                # recorded inside another rule's function, traced apart from the loss (a
                # float32-backward policy's layer): checked through that outer rule
                continue
            pairs, dtype, which = _call_errors(f, f_vjp, name, args, static, [seed, i])
            layer = _label(args, paths, getattr(wrapped, "__name__", name), counts)
            rows.append((layer, name, dtype, which, wrapped))
            out.append(pairs)
        return out

    leaves, treedef = jax.tree.flatten((params, batch, kwargs))
    dyn = [i for i, a in enumerate(leaves) if hasattr(a, "shape") and hasattr(a, "dtype")]

    def traced(*xs):  # the arrays traced; Python scalars stay hyperparameters
        merged = list(leaves)
        for i, x in zip(dyn, xs, strict=True):
            merged[i] = x
        return errors(*jax.tree.unflatten(treedef, merged))

    measured = jax.device_get(jax.jit(traced)(*(leaves[i] for i in dyn)))
    return [_row(*row, pairs, max_roundings) for row, pairs in zip(rows, measured, strict=True)]


def _call_errors(f, f_vjp, name: str, args: tuple, static: dict, rng_seed: list) -> tuple:
    """One rule call compared with ``jax.vjp`` of its plain function on a random cotangent:
    ``(pairs, dtype, which)``, the ``(largest error, largest magnitude)`` of each compared
    float leaf, the first such leaf's dtype name, and each leaf's argument."""
    dyn = [k for k, a in enumerate(args) if not is_hyperparameter(a)]

    def plain(*xs):
        merged = list(args)
        for k, x in zip(dyn, xs, strict=True):
            merged[k] = x
        return f(*merged, **static)

    ref_out, pullback = jax.vjp(plain, *(args[k] for k in dyn))
    dret = host_random_like(np.random.default_rng(rng_seed), ref_out)
    want = pullback(dret)
    with manual_scope(False):
        got = cotangents(
            f_vjp(*args, *_dret_args(dret), **static), list(args), f"{name} (check_rules)"
        )
    pairs, dtype, which = [], None, []
    for k, w in zip(dyn, want, strict=True):
        if not has_cotangent(args[k]) or got[k] is None and w is None:
            continue
        g = got[k] if got[k] is not None else jax.tree.map(jnp.zeros_like, w)
        for wl, gl in zip(jax.tree.leaves(w), jax.tree.leaves(g), strict=True):
            if not jnp.issubdtype(wl.dtype, jnp.inexact) or wl.size == 0:
                continue
            dtype = dtype or jnp.dtype(wl.dtype).name
            w64, g64 = wl.astype(jnp.float32), jnp.asarray(gl).astype(jnp.float32)
            pairs.append((jnp.max(jnp.abs(g64 - w64)), jnp.max(jnp.abs(w64))))
            which.append(k)
    return pairs, dtype, which


def _row(layer, name, dtype, which, fn, pairs, max_roundings) -> RuleCheck:
    """A call's ``RuleCheck`` from its ``(largest error, largest magnitude)`` per compared
    leaf (``which``: each leaf's argument)."""
    eps = float(jnp.finfo(dtype).eps) if dtype else 0.0
    worst, argument, relative = 0.0, None, 0.0
    for k, (err, scale) in zip(which, pairs, strict=True):
        err, scale = float(err), float(scale)
        r = math.inf if math.isnan(err) else err / (eps * max(1.0, scale))
        if argument is None or r > worst:
            worst, argument = r, k
            relative = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    ok = worst <= max_roundings
    return RuleCheck(layer, name, dtype or "-", worst, ok, argument, relative, fn)


def _stack_copy(layer, params, x, keys, paths: dict) -> list:
    """The tape of an ``nl.Stack``'s first copy, run on the stack's input: its rules are
    checked at the inputs the first copy gets (the stack's own rule is the scan of
    theirs). The copy's params are labelled with the stacked params' paths."""
    copy = jax.tree.map(lambda a: a[0], params)
    for stacked, leaf in zip(jax.tree.leaves(params), jax.tree.leaves(copy), strict=True):
        if id(stacked) in paths:
            paths[id(leaf)] = paths[id(stacked)]
    tape: list = []
    with manual_scope(True, tape):
        layer(copy, x, key=None if keys is None else keys[0])
    return tape


def _bracket(path: str) -> str:
    """``params.layers.0.W`` -> ``params.layers[0].W``."""
    parts = path.split(".")
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out
