"""show_jaxpr's primitives that take functions: each function becomes a nested definition.

``custom_linear_solve`` -> ``lax.custom_linear_solve(matvec, b, solve, transpose_solve,
symmetric=...)``; generic ``reduce`` -> ``lax.reduce(operands, inits, fn, dimensions)``;
generic ``reduce_window`` -> ``lax.reduce_window(operands, inits, fn, ...)``; a ``scatter``
that applies a function (``x.at[i].apply(f)``) -> ``lax.scatter_apply``; ``composite`` ->
``lax.composite(fn, name=..., version=...)(...)``. Callbacks (``jax.pure_callback``,
``io_callback``, ``jax.debug.callback`` / ``print``) call Python functions that have no
source form: they are refused at print time. Registered into the printer core on import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var

from ._exprs import Call, Tup, UnsupportedPrimitiveError, pystr, pyval
from ._printer import register, single_ret

if TYPE_CHECKING:
    from ._printer import Printer as _Printer

__all__ = ["CALL_HANDLERS"]


def _tree(atoms: list):
    """One operand bare, several as a tuple (the tree the printed functions take)."""
    return atoms[0] if len(atoms) == 1 else Tup(atoms)


def _sig(n: int, name: str) -> list:
    return [None] if n == 1 else [(name, n)]


def _custom_linear_solve(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    lengths, jaxprs = p["const_lengths"], p["jaxprs"]
    nb = len(args) - sum(lengths)
    if len(eqn.outvars) != nb:
        raise UnsupportedPrimitiveError(
            "show_jaxpr cannot print primitive 'custom_linear_solve' with has_aux=True"
        )
    consts, b = [], args[sum(lengths) :]
    k = 0
    for n in lengths:
        consts.append(args[k : k + n])
        k += n
    origin = pr.origin(eqn, "custom_linear_solve")
    names = {}
    for i, role in enumerate(("matvec", "vecmat", "solve", "transpose_solve")):
        closed = jaxprs[i]
        if closed is None or role == "vecmat":  # vecmat: JAX transposes matvec again
            continue
        fname = pr.unique(role, ("linear_solve", role, str(closed.jaxpr)))
        sig = _sig(nb, "xs") if role == "matvec" else [("_mv", 0), *_sig(nb, "xs")]
        pr.define(fname, closed, sig, env, consts[i], single_ret, scope, indent, origin)
        names[role] = fname
    kw = []
    if jaxprs.transpose_solve is not None and jaxprs.vecmat is jaxprs.matvec:
        kw.append(("symmetric", "True"))
    call_args = [names["matvec"], _tree(b), names["solve"]]
    if "transpose_solve" in names:
        call_args.append(names["transpose_solve"])
    pr.assign(eqn, env, Call("lax.custom_linear_solve", call_args, kw), indent, origin, True)


def _reducer(pr: _Printer, eqn, closed: ClosedJaxpr, n: int, env, scope, indent, origin) -> str:
    """The reduction function ``fn(acc, x)`` of ``n`` operands (tuples when ``n > 1``)."""
    fname = pr.unique("reducer", ("reducer", str(closed.jaxpr)))
    sig = [None, None] if n == 1 else [("carry", n), ("xs", n)]
    pr.define(fname, closed, sig, {}, [], single_ret, scope, indent, origin)
    return fname


def _reduce(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    n = len(args) // 2
    origin = pr.origin(eqn, "reduce")
    closed = p["jaxpr"]
    if not isinstance(closed, ClosedJaxpr):
        closed = ClosedJaxpr(closed, [])
    fname = _reducer(pr, eqn, closed, n, env, scope, indent, origin)
    call = Call("lax.reduce", [_tree(args[:n]), _tree(args[n:]), fname, pyval(p["dimensions"])])
    pr.assign(eqn, env, call, indent, origin, structured=True)


def _reduce_window(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    n = len(args) // 2
    origin = pr.origin(eqn, "reduce_window")
    closed = ClosedJaxpr(p["jaxpr"], list(p["consts"]))
    fname = _reducer(pr, eqn, closed, n, env, scope, indent, origin)
    window = [pyval(p[k], k) for k in ("window_dimensions", "window_strides", "padding",
                                       "base_dilation", "window_dilation")]  # fmt: skip
    call = Call("lax.reduce_window", [_tree(args[:n]), _tree(args[n:]), fname, *window])
    pr.assign(eqn, env, call, indent, origin, structured=True)


def _scatter(pr: _Printer, eqn, args, env, scope, indent):
    """A ``scatter`` carrying a function: ``lax.scatter_apply`` (``x.at[i].apply(f)``),
    whose placeholder updates (zeros, folded by ``fold_apply_placeholders``) it makes
    itself. Any other scatter is a first-order rule's."""
    from ._printer import RULES

    p = eqn.params
    uj = p.get("update_jaxpr")
    if uj is None or not _is_apply(uj) or ("apply", eqn.invars[2]) not in env:
        rule = RULES["scatter"]
        expr = rule(eqn, args, pr.mesh)
        if expr is None:
            raise UnsupportedPrimitiveError(
                "show_jaxpr cannot print primitive 'scatter' with a combining function "
                "that is neither an update nor a function of the old value alone"
            )
        pr.assign(eqn, env, expr, indent)
        return
    origin = pr.origin(eqn, "scatter_apply function")
    closed = ClosedJaxpr(uj.replace(invars=uj.invars[:1]), list(p["update_consts"]))
    fname = pr.unique("apply_fn", ("apply", str(closed.jaxpr)))
    pr.define(fname, closed, [None], env, [], single_ret, scope, indent, origin)
    kw = [("dimension_numbers", pyval(p["dimension_numbers"]))]
    shape = tuple(eqn.invars[2].aval.shape)
    if shape:
        kw.append(("update_shape", pyval(shape)))
    kw += [(k, pyval(p[k], k)) for k in ("indices_are_sorted", "unique_indices", "mode")]
    call = Call("lax.scatter_apply", [args[0], args[1], fname], kw)
    pr.assign(eqn, env, call, indent, origin)


def _is_apply(uj) -> bool:
    used = {v for e in uj.eqns for v in e.invars if isinstance(v, Var)} | {
        v for v in uj.outvars if isinstance(v, Var)
    }
    return len(uj.invars) == 2 and uj.invars[1] not in used


def fold_apply_placeholders(jaxpr, env: dict) -> set[int]:
    """Skip the zeros ``lax.scatter_apply`` makes as placeholder updates: printing the call
    makes them again. Only a ``broadcast_in_dim`` of a literal zero used by nothing else."""
    uses: dict = {}
    for e in jaxpr.eqns:
        for i, v in enumerate(e.invars):
            if isinstance(v, Var):
                uses.setdefault(v, []).append((e, i))
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            uses.setdefault(v, []).append((None, -1))
    skip = set()
    for e in jaxpr.eqns:
        if e.primitive.name != "broadcast_in_dim" or not isinstance(e.invars[0], Literal):
            continue
        if e.params.get("sharding") is not None:
            continue
        out = e.outvars[0]
        us = uses.get(out, [])
        if len(us) == 1 and us[0][0] is not None and us[0][1] == 2:
            user = us[0][0]
            if (
                user.primitive.name == "scatter"
                and user.params.get("update_jaxpr") is not None
                and np.all(np.asarray(e.invars[0].val) == 0)
            ):
                if _is_apply(user.params["update_jaxpr"]):
                    skip.add(id(e))
                    env[("apply", out)] = True
    return skip


def _composite(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    closed = p["jaxpr"]
    kw = [("name", pystr(p["name"]))]
    if p["version"]:
        kw.append(("version", repr(p["version"])))
    attrs = []
    for k, leaves, treedef in p["attributes"]:
        if treedef.num_leaves != 1 or treedef.num_nodes != 1:
            raise UnsupportedPrimitiveError(
                f"show_jaxpr cannot print primitive 'composite' {p['name']!r}: attribute {k} "
                "is not a single value"
            )
        attrs.append((k, pyval(leaves[0], f"attribute {k}")))
    origin = pr.origin(eqn, f"composite {p['name']}")
    base = getattr(closed.jaxpr.debug_info, "func_name", None) or "decomposition"
    fname = pr.unique(base, ("composite", str(closed.jaxpr)))
    # the decomposition's constants lead its operands: the printed one takes them as
    # arguments (so it has no constants, and prints the same again). lax.composite calls it
    # with the attributes as keyword arguments, whose values its body already holds.
    sig = [None] * len(args) + ([("**attributes", 0)] if attrs else [])
    pr.define(fname, closed, sig, {}, [], single_ret, scope, indent, origin)
    call = Call(Call("lax.composite", [fname], kw), args, attrs)
    pr.assign(eqn, env, call, indent, origin, structured=True)


def _callback(pr: _Printer, eqn, args, env, scope, indent):
    fn = eqn.params.get("callback")
    inner = getattr(fn, "callback_func", None) or getattr(fn, "func", None) or fn
    what = getattr(inner, "__qualname__", None) or repr(inner)
    raise UnsupportedPrimitiveError(
        f"show_jaxpr cannot print primitive {eqn.primitive.name!r}: it calls the Python "
        f"function {what}, which has no source form (callbacks are not printable)"
    )


CALL_HANDLERS = {
    "custom_linear_solve": _custom_linear_solve,
    "reduce": _reduce,
    "reduce_window": _reduce_window,
    "scatter": _scatter,
    "composite": _composite,
    "pure_callback": _callback,
    "io_callback": _callback,
    "debug_callback": _callback,
    "debug_print": _callback,
}

register(higher_order=CALL_HANDLERS, body_pass=fold_apply_placeholders)
