"""``nl.flops(fn, *args)``: the FLOPs a program runs, counted from its jaxpr.

XLA's cost analysis (``nl.cost_analysis``) counts a ``while`` loop's body once, so every
``lax.scan``, ``fori_loop`` and scanned layer stack was undercounted by its trip count (a
scanned 12-layer GPT by about 12x). This counter walks the jaxpr instead: every equation,
and every sub-jaxpr times the number of times it runs (a ``scan`` body ``length`` times).

How each equation counts:

* ``dot_general``: ``2 x`` output elements ``x`` contracted size, XLA's count;
  ``conv_general_dilated``: XLA's count exactly (2 per multiply-add at every kernel tap
  that lands on the input, padding and dilation holes left out); both also make up
  ``matmul_flops``.
* elementwise and reductions as XLA's cost analysis counts them: one FLOP per output
  element (a reduction: per input element it folds in), ``transcendentals`` apart (exp,
  log, tanh, sqrt, ...; :data:`_SPECIAL` holds XLA's per-element counts of those it
  expands); layout operations (reshape, transpose, slice, gather, broadcast, ...) none.
* higher-order primitives: ``jit``, calls, ``remat`` and custom_jvp/custom_vjp calls count
  their body once (under differentiation the traced program holds the rules' own
  equations, which count as any other); ``scan``: body ``x length``; ``cond``: the most
  expensive branch (XLA's choice too); ``while``: body ``x`` trip count where it is static
  (a literal bound and a counter stepped by 1, as ``fori_loop`` writes it), else the body
  once and ``lower_bound`` set; ``shard_map``: body ``x`` devices along its manual axes
  (the total over the devices, as a ``jit`` over sharded arrays counts the global program).
* equations whose results nothing uses are dropped first, as jit's lowering drops them.
* any other primitive counts zero and is named in ``unknown``, never a crash.

Reading JAX's primitives (their names and params: ``jaxpr``, ``length``, ``branches``) is
kept in this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var

__all__ = ["flops"]

# One FLOP per output element (XLA's HandleElementwiseOp): arithmetic, comparisons,
# selects, casts, bit operations.
_ELEMENTWISE = frozenset(
    "abs add add_any and bitcast_convert_type ceil clamp clz complex conj convert_element_type "
    "div eq floor imag is_finite max min mul mulhi ne neg not or population_count real "
    "reduce_precision rem round shift_left shift_right_arithmetic shift_right_logical sign "
    "square sub xor ge gt le lt eq_to le_to lt_to".split()
)
# (FLOPs, transcendentals) per output element: XLA's count of each primitive's lowering on
# a CPU (measured with nl.cost_analysis on float32, jax 0.10); what XLA keeps as one
# instruction is one transcendental, the special functions it expands count their parts.
_SPECIAL = {
    "exp": (0, 1), "log": (0, 1), "log1p": (0, 1), "expm1": (0, 1), "tanh": (0, 1),
    "sin": (0, 1), "cos": (0, 1), "tan": (0, 1), "sqrt": (0, 1), "rsqrt": (0, 1),
    "cbrt": (0, 1), "erf": (0, 1), "atan": (0, 1), "atan2": (0, 1), "pow": (0, 1),
    "exp2": (1, 1), "logistic": (3, 1), "acos": (3, 2), "acosh": (7, 4), "asin": (5, 2),
    "asinh": (11, 3), "atanh": (6, 2), "cosh": (3, 2), "sinh": (10, 3), "erf_inv": (37, 2),
    "erfc": (62, 1), "lgamma": (53, 4), "digamma": (73, 3), "bessel_i0e": (83, 1),
    "bessel_i1e": (83, 1), "igamma": (183, 6), "igammac": (183, 6), "nextafter": (24, 0),
    "polygamma": (260, 19), "zeta": (121, 11), "igamma_grad_a": (335, 14),
    "random_gamma_grad": (337, 13),
}  # fmt: skip
# Per input element folded into the result (XLA: input - output elements, times the
# reducer's FLOPs: 1, and 9 for argmax/argmin's comparator).
_REDUCTIONS = {
    "reduce_sum": 1, "reduce_max": 1, "reduce_min": 1, "reduce_prod": 1, "reduce_and": 1,
    "reduce_or": 1, "reduce_xor": 1, "argmax": 9, "argmin": 9,
}  # fmt: skip
# XLA's count of the threefry lowering, per 32-bit output word (bits), per key (split,
# fold_in).
_RANDOM = {"random_bits": 29, "threefry2x32": 29, "random_split": 28, "random_fold_in": 35}
# Moving data, not computing: no FLOPs (XLA counts none either); collectives and callbacks
# are communication and host work, no device FLOPs either.
_ZERO = frozenset(
    "broadcast_in_dim reshape squeeze expand_dims transpose slice dynamic_slice "
    "dynamic_update_slice concatenate pad iota rev copy copy_p device_put split "
    "sharding_constraint layout_constraint mesh_cast reshard pvary optimization_barrier "
    "stop_gradient top_k approx_top_k random_seed random_wrap random_unwrap random_clone "
    "random_key_data tie create_token after_all axis_index zeros_like scatter stack unstack "
    "tile psum pmax pmin ppermute all_gather all_to_all reduce_scatter psum_invariant "
    "all_gather_invariant ragged_all_to_all pbroadcast precv psend platform_index "
    "debug_callback debug_print pure_callback io_callback inspect_sharding name "
    "to_edtype from_edtype empty dce_sink".split()
)


# Layout operations that keep a broadcast literal a broadcast literal (see _no_op).
_SPLAT_KEEPING = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims"})


class _Count:
    """FLOPs, matmul FLOPs (inside ``flops``) and transcendentals of a piece of program."""

    __slots__ = ("flops", "matmul", "transcendentals")

    def __init__(self, flops: int = 0, matmul: int = 0, transcendentals: int = 0):
        self.flops, self.matmul, self.transcendentals = flops, matmul, transcendentals

    def add(self, other: _Count, times: int = 1) -> None:
        self.flops += times * other.flops
        self.matmul += times * other.matmul
        self.transcendentals += times * other.transcendentals

    def most(self, other: _Count) -> None:
        """Each field the larger of the two (XLA's rule for a conditional's branches)."""
        self.flops = max(self.flops, other.flops)
        self.matmul = max(self.matmul, other.matmul)
        self.transcendentals = max(self.transcendentals, other.transcendentals)


def flops(fn: Callable | Any, *args: Any, **kwargs: Any) -> dict:
    """The FLOPs of ``fn(*args, **kwargs)`` counted from its jaxpr, loops by trip count.

    Unlike XLA's cost analysis (``nl.cost_analysis``), which counts a loop's body once, a
    ``lax.scan`` body counts ``length`` times, so a scanned layer stack, a chunked LM head,
    gradient accumulation and several steps in one call are counted whole. Elementwise
    operations count as XLA counts them, so a program without loops gets XLA's figure (its
    matrix products exactly). Nothing runs or compiles: ``fn`` is traced once.

    Args:
        fn: a function, traced on ``args`` (arrays or ``jax.ShapeDtypeStruct``; keyword
            arguments are bound as they are, not traced); or, with no arguments, a traced
            program: a ``jax.jit(f).trace(...)`` result or a ``ClosedJaxpr``.

    Returns:
        ``{"flops", "matmul_flops", "transcendentals", "lower_bound", "unknown"}``:
        ``flops`` (ints) includes ``matmul_flops`` (``dot_general`` and convolutions), not
        the transcendentals; ``lower_bound`` is True where a ``while`` loop's trip count is
        not static (its body counted once); ``unknown`` names the primitives counted as
        zero because the counter does not know them (sorted).

    Example:
        >>> import jax, jax.numpy as jnp, nnlite as nl
        >>> scan = lambda x, ws: jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]
        >>> nl.flops(scan, jnp.ones((64, 64)), jnp.ones((10, 64, 64)))["matmul_flops"]
        5242880
    """
    closed = _closed_jaxpr(fn, args, kwargs)
    counter = _Counter()
    total = counter.jaxpr(closed.jaxpr)
    return {
        "flops": total.flops,
        "matmul_flops": total.matmul,
        "transcendentals": total.transcendentals,
        "lower_bound": counter.lower_bound,
        "unknown": tuple(sorted(counter.unknown)),
    }


def _closed_jaxpr(fn, args: tuple, kwargs: dict) -> ClosedJaxpr:
    if not args and not kwargs:
        if isinstance(fn, ClosedJaxpr):
            return fn
        if isinstance(getattr(fn, "jaxpr", None), ClosedJaxpr):  # jax.stages.Traced
            return fn.jaxpr
    if not callable(fn):
        raise TypeError(
            f"nl.flops: expected a function (with its arguments), a traced program or a "
            f"ClosedJaxpr, got {type(fn).__name__}"
        )
    return jax.make_jaxpr(functools.partial(fn, **kwargs) if kwargs else fn)(*args)


def _size(v) -> int:
    shape = getattr(getattr(v, "aval", None), "shape", ())
    return math.prod(shape)


def _literal(v, splats: dict | None = None) -> Any:
    """A scalar literal's value (or a broadcast one's, from ``splats``), else None."""
    if isinstance(v, Literal):
        return v.val if np.ndim(v.val) == 0 else None
    return None if splats is None else splats.get(v)


def _no_op(eqn, name: str, splats: dict) -> bool:
    """An operation the lowering folds away: ``x + 0``, ``x * 1``, ``x & True``, a cast to
    its own dtype (a weak type made strong)."""
    if name == "convert_element_type":
        return eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
    if len(eqn.invars) != 2:
        return False
    a, b = (_literal(v, splats) for v in eqn.invars)
    identity = {"add": 0, "add_any": 0, "or": False, "mul": 1, "and": True}.get(name)
    if identity is not None:
        return _is(a, identity) or _is(b, identity)
    return (name == "sub" and _is(b, 0)) or (name == "div" and _is(b, 1))


def _is(value, identity) -> bool:
    return value is not None and bool(value == identity)


def _out_size(eqn) -> int:
    return sum(_size(v) for v in eqn.outvars)


def _jaxpr_of(x) -> Jaxpr:
    if isinstance(x, ClosedJaxpr):
        return x.jaxpr
    if isinstance(x, Jaxpr):
        return x
    raise TypeError(f"expected a jaxpr, got {type(x).__name__}")


def _live(jaxpr: Jaxpr, outs_live: list[bool] | None) -> list[tuple[Any, list[bool]]]:
    """The equations some live output depends on (or with effects), each with which of its
    outputs are live: dead code dropped, as jit's lowering drops it before XLA sees it."""
    if outs_live is None:
        outs_live = [True] * len(jaxpr.outvars)
    live = {v for v, keep in zip(jaxpr.outvars, outs_live, strict=True) if keep and _is_var(v)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        mask = [not isinstance(o, DropVar) and o in live for o in eqn.outvars]
        if any(mask) or eqn.effects:
            kept.append((eqn, mask))
            live.update(v for v in eqn.invars if _is_var(v))
    return kept[::-1]


def _is_var(v) -> bool:
    return isinstance(v, Var) and not isinstance(v, DropVar | Literal)


def _live_inputs(jaxpr: Jaxpr, outs_live: list[bool]) -> list[bool]:
    used = {v for eqn, _ in _live(jaxpr, outs_live) for v in eqn.invars if _is_var(v)}
    used |= {v for v, keep in zip(jaxpr.outvars, outs_live, strict=True) if keep and _is_var(v)}
    return [v in used for v in jaxpr.invars]


class _Counter:
    """One walk over a jaxpr; collects what it cannot count."""

    def __init__(self):
        self.unknown: set[str] = set()
        self.lower_bound = False
        self.splats: dict = {}  # vars that hold a literal broadcast: the value

    def jaxpr(self, jaxpr: Jaxpr, outs_live: list[bool] | None = None) -> _Count:
        total = _Count()
        for eqn, mask in _live(jaxpr, outs_live):
            total.add(self.eqn(eqn, mask))
        return total

    def eqn(self, eqn, mask: list[bool]) -> _Count:
        name = eqn.primitive.name
        rule = _HIGHER_ORDER.get(name)
        if rule is not None:
            try:
                return rule(self, eqn, mask)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                self.unknown.add(f"{name} (params not understood: {type(e).__name__}: {e})")
                return _Count()
        return self.first_order(eqn, name)

    def first_order(self, eqn, name: str) -> _Count:
        if name in _ZERO:
            if name in _SPLAT_KEEPING:
                self.splat(eqn.outvars[0], _literal(eqn.invars[0], self.splats))
            return _Count()
        if name in _ELEMENTWISE:
            return _Count(0 if _no_op(eqn, name, self.splats) else _out_size(eqn))
        if name in _SPECIAL:
            f, t = _SPECIAL[name]
            n = _out_size(eqn)
            return _Count(f * n, 0, t * n)
        rule = _FIRST_ORDER.get(name)
        if rule is None:
            self.unknown.add(name)
            return _Count()
        try:
            return rule(eqn)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            self.unknown.add(f"{name} (params not understood: {type(e).__name__}: {e})")
            return _Count()

    # -- higher-order primitives -----------------------------------------------------------
    def call(self, eqn, mask, key: str = "jaxpr") -> _Count:
        body = _jaxpr_of(eqn.params[key])
        for inner, outer in zip(body.invars, eqn.invars, strict=True):
            self.splat(inner, _literal(outer, self.splats))  # the lowering folds through calls
        return self.jaxpr(body, mask)

    def splat(self, var, value) -> None:
        """Note that ``var`` holds a broadcast literal ``value`` (None: it does not; a jit's
        body is one object for every call of it, with or without literals)."""
        if value is None:
            self.splats.pop(var, None)
        else:
            self.splats[var] = value

    def scan(self, eqn, mask) -> _Count:
        p = eqn.params
        body = _jaxpr_of(p["jaxpr"])
        outs = _scan_live_outputs(body, p["num_consts"], p["num_carry"], mask)
        total = _Count()
        total.add(self.jaxpr(body, outs), int(p["length"]))
        return total

    def cond(self, eqn, mask) -> _Count:
        total = _Count()
        for branch in eqn.params["branches"]:
            total.most(self.jaxpr(_jaxpr_of(branch), mask))
        return total

    def while_(self, eqn, mask) -> _Count:
        p = eqn.params
        cond, body = _jaxpr_of(p["cond_jaxpr"]), _jaxpr_of(p["body_jaxpr"])
        trips = _trip_count(eqn)
        if trips is None:
            self.lower_bound = True
        total = _Count()
        total.add(self.jaxpr(cond), 1 if trips is None else trips + 1)
        total.add(self.jaxpr(body), 1 if trips is None else trips)
        return total

    def shard_map(self, eqn, mask) -> _Count:
        p = eqn.params
        axes, shape = p["newly_manual_axes"], dict(p["mesh"].shape)
        total = _Count()
        total.add(self.jaxpr(_jaxpr_of(p["jaxpr"]), mask), math.prod(shape[a] for a in axes))
        return total

    def reduce(self, eqn, mask) -> _Count:
        # lax.reduce: the reducer's FLOPs per input element folded in (XLA's count)
        folds = max(0, _size(eqn.invars[0]) - _size(eqn.outvars[0]))
        total = _Count()
        total.add(self.jaxpr(_jaxpr_of(eqn.params["jaxpr"])), folds)
        return total

    def reduce_window(self, eqn, mask) -> _Count:
        window = math.prod(eqn.params["window_dimensions"])
        total = _Count()
        total.add(self.jaxpr(_jaxpr_of(eqn.params["jaxpr"])), _out_size(eqn) * max(0, window - 1))
        return total


def _scan_live_outputs(body: Jaxpr, n_consts: int, n_carry: int, mask: list[bool]) -> list:
    """Which of a scan body's outputs are live: the scan's live outputs, and each carry
    another live output's computation reads (a fixed point, as JAX's dce rule for scan)."""
    carry, ys = list(mask[:n_carry]), list(mask[n_carry:])
    while True:
        ins = _live_inputs(body, carry + ys)
        needed = [c or i for c, i in zip(carry, ins[n_consts : n_consts + n_carry], strict=True)]
        if needed == carry:
            return carry + ys
        carry = needed


def _trip_count(eqn) -> int | None:
    """The trip count of a ``while`` written as ``fori_loop`` writes it: ``i < n`` on a
    counter that starts at a literal and steps by 1, ``n`` a literal or a carried literal
    the body leaves unchanged; None for any other loop."""
    p = eqn.params
    cond, body = _jaxpr_of(p["cond_jaxpr"]), _jaxpr_of(p["body_jaxpr"])
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    init = eqn.invars[cn + bn :]
    carry_c, carry_b = cond.invars[cn:], body.invars[bn:]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    if cond.eqns[0].outvars[0] is not cond.outvars[0]:
        return None
    i, n = cond.eqns[0].invars

    def slot(v) -> int | None:
        return next((k for k, c in enumerate(carry_c) if c is v), None)

    def literal(v) -> int | None:
        val = _literal(v)
        return None if val is None else int(val)

    ki = slot(i)
    if ki is None or literal(init[ki]) is None:
        return None
    kn = slot(n)
    if kn is None:
        bound = literal(n)
    elif body.outvars[kn] is carry_b[kn]:
        bound = literal(init[kn])
    else:
        return None
    step = next((e for e in body.eqns if body.outvars[ki] in e.outvars), None)
    if bound is None or step is None or step.primitive.name != "add":
        return None
    a, b = step.invars
    if not ((a is carry_b[ki] and literal(b) == 1) or (b is carry_b[ki] and literal(a) == 1)):
        return None
    return max(0, bound - literal(init[ki]))


_HIGHER_ORDER: dict[str, Callable] = {
    "jit": _Counter.call,
    "remat2": _Counter.call,
    "closed_call": functools.partial(_Counter.call, key="call_jaxpr"),
    "custom_jvp_call": functools.partial(_Counter.call, key="call_jaxpr"),
    "custom_vjp_call": functools.partial(_Counter.call, key="call_jaxpr"),
    "scan": _Counter.scan,
    "cond": _Counter.cond,
    "while": _Counter.while_,
    "shard_map": _Counter.shard_map,
    "reduce": _Counter.reduce,
    "reduce_window": _Counter.reduce_window,
}


# -- first-order primitives with their own rule ---------------------------------------------
def _dot(eqn) -> _Count:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    n = 2 * _out_size(eqn) * math.prod(lhs[d] for d in contract)
    return _Count(n, n)


def _attention(eqn, products: int, elementwise: int) -> _Count:
    """nnlite's fused CPU attention (``nnlite_attention_fwd``/``_bwd``): ``products``
    ``[T, D] x [D, S]``-sized products over the (query, key) pairs each query sees, 2 FLOPs
    per multiply-add, and per pair ``elementwise`` FLOPs and one exp."""
    b, t, h, d = eqn.invars[0].aval.shape
    s = eqn.invars[1].aval.shape[1]
    p = eqn.params
    rows = np.arange(t)
    hi = np.minimum(s, rows + p["offset"] + 1) if p["causal"] else np.full(t, s)
    lo = np.maximum(0, rows + p["offset"] - p["window"] + 1) if p["window"] > 0 else 0
    pairs = b * h * int(np.maximum(hi - lo, 0).sum())
    matmul = products * 2 * pairs * d
    return _Count(matmul + elementwise * pairs, matmul, pairs)


def _gemm(eqn) -> _Count:
    """nnlite's MKL product (``nnlite_gemm``): ``2 m k n`` per batch element."""
    a = eqn.invars[0].aval.shape
    n = 2 * _out_size(eqn) * (a[-2] if eqn.params["transpose_a"] else a[-1])
    return _Count(n, n)


def _ragged_dot(eqn) -> _Count:
    # each row of lhs [m, k] meets one group's [k, n]: a dense [m, k] x [k, n] product
    lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    n = 2 * math.prod(out) * lhs[-1]
    return _Count(n, n)


def _conv(eqn) -> _Count:
    """XLA's ``HloCostAnalysis::GetConvolutionFlops``: 2 per multiply-add, at each kernel
    tap that lands on an input element (not on padding or a dilation hole)."""
    p = eqn.params
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = p["dimension_numbers"]
    if dn is None:
        spec = tuple(range(len(lhs)))
        dn = (spec, spec, spec)
    lhs_spec, rhs_spec, out_spec = dn
    positions = 1
    for d in range(len(lhs_spec) - 2):
        positions *= _valid_positions(
            lhs[lhs_spec[2 + d]],
            rhs[rhs_spec[2 + d]],
            out[out_spec[2 + d]],
            p["window_strides"][d],
            p["padding"][d][0],
            p["lhs_dilation"][d],
            p["rhs_dilation"][d],
        )
    fma = (
        lhs[lhs_spec[1]] // p["feature_group_count"]
        * out[out_spec[1]]
        * (lhs[lhs_spec[0]] // p["batch_group_count"])
        * positions
    )  # fmt: skip
    return _Count(2 * fma, 2 * fma)


def _valid_positions(size, kernel, out, stride, pad_low, base_dil, window_dil) -> int:
    """(output, kernel tap) pairs of one spatial dimension whose input index is real."""
    o = np.arange(out, dtype=np.int64) * stride - pad_low
    count = 0
    for k in range(kernel):
        idx = o + k * window_dil
        ok = idx % base_dil == 0 if base_dil > 1 else np.ones(out, bool)
        idx = idx // base_dil
        count += int(np.count_nonzero(ok & (idx >= 0) & (idx < size)))
    return count


def _reduction(eqn) -> _Count:
    per = _REDUCTIONS[eqn.primitive.name]
    return _Count(per * max(0, _size(eqn.invars[0]) - _size(eqn.outvars[0])))


def _integer_pow(eqn) -> _Count:
    # lax's lowering: square-and-multiply, then a division for a negative power
    y = abs(int(eqn.params["y"]))
    muls = 0 if y == 0 else (y.bit_length() - 1) + (bin(y).count("1") - 1)
    return _Count(_out_size(eqn) * (muls + (eqn.params["y"] < 0)))


def _select_n(eqn) -> _Count:
    return _Count(_out_size(eqn) * max(1, len(eqn.invars) - 2))  # n cases: n-1 selects


def _sort(eqn) -> _Count:
    dim = eqn.invars[0].aval.shape[eqn.params["dimension"]]
    return _Count(_size(eqn.invars[0]) * (math.ceil(math.log2(dim)) if dim > 1 else 0))


def _per_output(eqn) -> _Count:
    # cumulative reductions: one FLOP per output element (the work of a scan; XLA's
    # reduce-window lowering on a CPU counts n per element, a quadratic artefact)
    return _Count(_out_size(eqn))


def _window(eqn) -> _Count:
    window = math.prod(eqn.params["window_dimensions"])
    return _Count(_out_size(eqn) * max(0, window - 1))


def _select_and_scatter(eqn) -> _Count:
    # max-pool's gradient: each source element selects within its window, then adds once
    window = math.prod(eqn.params["window_dimensions"])
    return _Count(_size(eqn.invars[0]) * window)


def _gather(eqn) -> _Count:
    # out of bounds filled: a bounds check per index (3) and a select per output element
    if "FILL_OR_DROP" not in str(eqn.params.get("mode")):
        return _Count()
    return _Count(_out_size(eqn) + 3 * math.prod(eqn.invars[1].aval.shape[:-1]))


def _scatter_update(eqn) -> _Count:
    return _Count(_size(eqn.invars[2]))  # one combine per update element


def _random(eqn) -> _Count:
    per = _RANDOM[eqn.primitive.name]
    n = _size(eqn.outvars[0])
    if eqn.primitive.name == "random_bits":
        n *= max(1, eqn.params["bit_width"] // 32)
    return _Count(per * n)


_FIRST_ORDER: dict[str, Callable] = {
    "dot_general": _dot,
    # forward: q k^T and p v; backward: q k^T again, do v^T, p^T do, ds^T q and ds k
    "nnlite_attention_fwd": functools.partial(_attention, products=2, elementwise=4),
    "nnlite_attention_bwd": functools.partial(_attention, products=5, elementwise=4),
    "nnlite_gemm": _gemm,
    "ragged_dot_general": _ragged_dot,
    "conv_general_dilated": _conv,
    "integer_pow": _integer_pow,
    "select_n": _select_n,
    "gather": _gather,
    "sort": _sort,
    "reduce_window_sum": _window,
    "reduce_window_max": _window,
    "reduce_window_min": _window,
    "select_and_scatter_add": _select_and_scatter,
    "select_and_gather_add": _select_and_scatter,
    "scatter-add": _scatter_update,
    "scatter-mul": _scatter_update,
    "scatter-min": _scatter_update,
    "scatter-max": _scatter_update,
    "scatter-sub": _scatter_update,
    **{name: _reduction for name in _REDUCTIONS},
    **{name: _per_output for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    **{name: _random for name in _RANDOM},
}
