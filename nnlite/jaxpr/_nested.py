"""show_jaxpr's higher-order primitives: jaxprs inside equations become nested functions.

``jit`` -> ``jax.jit(fn)(...)``; ``cond`` -> ``lax.cond`` / ``lax.switch``; ``while`` ->
``lax.while_loop``; ``scan`` -> ``lax.scan``; ``custom_jvp_call`` -> a ``jax.custom_jvp``
function with its JVP rule; ``custom_vjp_call`` -> a ``jax.custom_vjp`` function with its
forward and backward rules (rebuilt from the rules JAX recorded, so the decompiled function
differentiates exactly like the original, not by autodiff of the primal); ``shard_map`` ->
``jax.shard_map(fn, ...)(...)`` (in ``_parallel.py``). Registered into the printer
core (``_printer.py``) on import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from ..core import _jax_private
from ._exprs import (
    Bare,
    Call,
    Tup,
    UnsupportedPrimitiveError,
    flat,
    named_sharding_expr,
    pystr,
    pyval,
)
from ._printer import JITTED, JITTED_BODIES, register, single_ret

if TYPE_CHECKING:
    from ._printer import Printer as _Printer

__all__ = ["HIGHER_ORDER", "fold_index_eqns"]


def _jit(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    closed: ClosedJaxpr = p["jaxpr"]
    if _wrapped_public(pr, eqn, closed, args, env, indent):
        return
    if pr.inline_jit or (pr.simplify and len(closed.jaxpr.eqns) <= 1):
        inner = dict(env)
        for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
            inner[v] = pr.closed_over(c, env)
        inner.update(zip(closed.jaxpr.invars, args, strict=True))
        pr.body(closed.jaxpr, inner, scope, indent)
        for o, v in zip(eqn.outvars, closed.jaxpr.outvars, strict=True):
            env[o] = pr.atom(v, inner)
        return
    _check_jit_params(eqn, pr.mesh)
    key = _jaxpr_key(closed)
    fname = pr.unique(pr.function_name(eqn), key)
    origin = pr.origin(eqn, f"jit of {p['name']}")
    if not scope.lookup(fname, key):
        pr.define(fname, closed, [None] * len(args), {}, [], single_ret, scope, indent, origin)
        scope.defs[fname] = key
    kw = _jit_shardings(p)
    if any(p["donated_invars"]):
        kw.append(
            ("donate_argnums", repr(tuple(i for i, d in enumerate(p["donated_invars"]) if d)))
        )
    if p["keep_unused"]:
        kw.append(("keep_unused", "True"))
    if p["inline"]:
        kw.append(("inline", "True"))
    call = Call(Call("jax.jit", [fname], kw), args)
    pr.assign(eqn, env, call, indent, origin, structured=True)


def _wrapped_public(pr: _Printer, eqn, closed: ClosedJaxpr, args, env, indent) -> bool:
    """Print ``jit(fft)`` of one ``fft`` equation as ``lax.fft(...)``, which makes both, and
    a jit whose body a public function makes as it is (``jnp.linalg.cholesky``) as a call."""
    if _public_body(pr, eqn, closed, args, env, indent):
        return True
    (inner,) = closed.jaxpr.eqns if len(closed.jaxpr.eqns) == 1 else (None,)
    if inner is None or closed.consts:
        return False
    jitted = JITTED.get(inner.primitive.name)
    if jitted is None or jitted[0] != eqn.params["name"] or any(eqn.params["donated_invars"]):
        return False
    if list(inner.invars) != list(closed.jaxpr.invars):
        return False
    if list(inner.outvars) != list(closed.jaxpr.outvars):
        return False
    expr = jitted[1](inner, args, pr.mesh)
    if expr is None:
        return False
    pr.assign(eqn, env, expr, indent, structured=not inner.primitive.multiple_results)
    return True


def _public_body(pr: _Printer, eqn, closed: ClosedJaxpr, args, env, indent) -> bool:
    candidates = JITTED_BODIES.get(eqn.params["name"])
    if not candidates or closed.consts or any(eqn.params["donated_invars"]):
        return False
    avals = [v.aval for v in closed.jaxpr.invars]
    want = str(closed.jaxpr)
    for call, fn in candidates:
        try:
            traced = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals))
        except Exception:  # not this function's operands
            continue
        (jit,) = traced.jaxpr.eqns if len(traced.jaxpr.eqns) == 1 else (None,)
        if jit is None or jit.primitive.name != "jit" or jit.params["name"] != eqn.params["name"]:
            continue
        if str(jit.params["jaxpr"].jaxpr) == want and not jit.params["jaxpr"].consts:
            pr.assign(eqn, env, call.format(*map(flat, args)), indent, structured=True)
            return True
    return False


def _jaxpr_key(closed: ClosedJaxpr):
    """Equal keys: the same computation (a definition can be reused for both). Constants
    count by value: a rule traced again (a JVP rule calling its own function) makes new
    arrays of the same values."""
    return str(closed.jaxpr), tuple(_fingerprint(c) for c in closed.consts)


def _fingerprint(c):
    try:
        a = np.asarray(c)
    except Exception:  # a key array, ...: by identity
        return id(c)
    return a.shape, str(a.dtype), hash(a.tobytes())


def _check_jit_params(eqn, ambient_mesh):
    """Raise unless ``jax.jit(fn, donate_argnums=...)`` traced here gives these params.

    Inside a ``shard_map`` body, ``ctx_mesh`` is the body's manual abstract mesh, which
    re-tracing the printed ``shard_map`` sets again.
    """
    p = eqn.params
    bad = {}
    for k in ("in_shardings", "out_shardings"):
        if any(not _unspecified(s) and named_sharding_expr(s) is None for s in p[k]):
            bad[k] = p[k]
    for k in ("in_layouts", "out_layouts"):
        if any(x is not None for x in p[k]):
            bad[k] = p[k]
    if p.get("compiler_options_kvs"):
        bad["compiler_options_kvs"] = p["compiler_options_kvs"]
    mesh = p.get("ctx_mesh")
    if mesh is not None and getattr(mesh, "axis_names", ()) != () and mesh != ambient_mesh:
        bad["ctx_mesh"] = mesh
    if bad:
        raise UnsupportedPrimitiveError(
            f"show_jaxpr cannot print primitive 'jit' with params {bad}: only jit without "
            "layouts, meshes or compiler options, and with shardings (if any) that are "
            "NamedShardings over a concrete mesh, is supported"
        )


def _unspecified(s) -> bool:
    return type(s).__name__ == "UnspecifiedValue"


def _jit_shardings(p) -> list:
    """``in_shardings=(...)`` / ``out_shardings=...`` keywords, when the jit had them.

    The printed function takes one argument per input and returns a bare value for one
    output, so ``in_shardings`` is a tuple (``None``: unspecified) and ``out_shardings``
    a tuple, or the bare sharding for one output.
    """
    kw = []
    for k in ("in_shardings", "out_shardings"):
        specs = p[k]
        if all(_unspecified(s) for s in specs):
            continue
        exprs = ["None" if _unspecified(s) else named_sharding_expr(s) for s in specs]
        kw.append((k, exprs[0] if k == "out_shardings" and len(exprs) == 1 else Tup(exprs)))
    return kw


def _cond(pr: _Printer, eqn, args, env, scope, indent):
    branches = eqn.params["branches"]
    ops = args[1:]
    origin = pr.origin(eqn, "cond branch")
    names = []
    for i, br in enumerate(branches):
        two = len(branches) == 2 and "branches_platforms" not in eqn.params
        fname = ("false_fn", "true_fn")[i] if two else f"branch_{i}"
        pr.define(fname, br, [None] * len(ops), env, [], single_ret, scope, indent, origin)
        names.append(fname)
    index = eqn.invars[0]
    if isinstance(index, Literal):  # lax.cond(True, ...): a Python bool predicate
        if len(branches) != 2:
            raise UnsupportedPrimitiveError(
                f"show_jaxpr cannot print primitive 'cond' of {len(branches)} branches with a "
                "constant index (lax.switch would clamp it)"
            )
        kind, x = "cond", repr(bool(int(index.val)))
    else:
        kind, x = env.get(("index", index), ("switch", index))
    if kind == "platform":
        kw = []
        for name, platforms in zip(names, eqn.params["branches_platforms"], strict=True):
            kw += [(pl, name) for pl in platforms] if platforms is not None else []
            if platforms is None:
                kw.append(("default", name))
        call = Call("lax.platform_dependent", ops, kw)
    elif kind == "cond":
        pred = x if isinstance(x, str) else pr.atom(x, env)
        call = Call("lax.cond", [pred, "true_fn", "false_fn", *ops])
    else:
        call = Call("lax.switch", [pr.atom(x, env), Tup(names), *ops])
    pr.assign(eqn, env, call, indent, origin, structured=True)


def fold_index_eqns(jaxpr: Jaxpr, env: dict) -> set[int]:
    """Fold the equations ``lax.cond`` / ``lax.switch`` make for the index of a ``cond``.

    ``lax.cond(p, ...)`` makes ``i = convert_element_type(p: bool, int32)`` and
    ``lax.switch(j, ...)`` makes ``i = clamp(0, j, n - 1)``; when every use of ``i`` is
    as such a ``cond`` index, printing ``lax.cond(p, ...)`` / ``lax.switch(j, ...)``
    makes them again. Any other int32 index prints as ``lax.switch(i, ...)``: the clamp
    that adds is a no-op for the in-range indices JAX itself computes, and folds away on
    the next decompile.
    """
    uses: dict[Var, list] = {}
    for e in jaxpr.eqns:
        for i, v in enumerate(e.invars):
            if isinstance(v, Var):
                uses.setdefault(v, []).append((e, i))
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            uses.setdefault(v, []).append((None, -1))
    skip = set()
    for e in jaxpr.eqns:
        if e.primitive.name == "platform_index":
            # lax.platform_dependent makes it for the cond it chooses a branch with
            us = uses.get(e.outvars[0], [])
            platforms = e.params["platforms"]
            if us and all(
                u is not None and u.primitive.name == "cond" and i == 0
                and u.params.get("branches_platforms") == platforms
                for u, i in us
            ):  # fmt: skip
                skip.add(id(e))
                env[("index", e.outvars[0])] = ("platform", None)
            continue
        if len(e.outvars) != 1 or e.primitive.name not in ("convert_element_type", "clamp"):
            continue
        out = e.outvars[0]
        us = uses.get(out, [])
        conds = [u for u, i in us if u is not None and u.primitive.name == "cond" and i == 0]
        if not us or len(conds) != len(us):
            continue
        nbr = {len(u.params["branches"]) for u in conds}
        if e.primitive.name == "convert_element_type" and _is_pred_convert(e) and nbr == {2}:
            skip.add(id(e))
            env[("index", out)] = ("cond", e.invars[0])
        elif e.primitive.name == "clamp" and _is_switch_clamp(e, nbr):
            skip.add(id(e))
            env[("index", out)] = ("switch", e.invars[1])
    return skip


def _is_pred_convert(e) -> bool:
    return (
        e.invars[0].aval.dtype == np.bool_
        and e.params["new_dtype"] == np.int32
        and not e.params["weak_type"]
        and e.params.get("sharding") is None
    )


def _is_switch_clamp(e, nbr: set) -> bool:
    lo, x, hi = e.invars
    if len(nbr) != 1 or not (isinstance(lo, Literal) and isinstance(hi, Literal)):
        return False
    strong = not (lo.aval.weak_type or hi.aval.weak_type or x.aval.weak_type)
    n = next(iter(nbr))
    return strong and x.aval.dtype == np.int32 and int(lo.val) == 0 and int(hi.val) == n - 1


def _while(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]
    origin = pr.origin(eqn, "while loop")
    sig = [("carry", len(init))]
    pred_aval = p["cond_jaxpr"].out_avals[0]
    if pred_aval.shape:  # vmap with a batched predicate: see _batched_while
        _batched_while(pr, p, cconsts, bconsts, env, scope, indent, origin)
    else:
        pr.define(
            "cond_fn", p["cond_jaxpr"], sig, env, cconsts, lambda o, _: o[0], scope, indent, origin
        )
        pr.define(
            "body_fn", p["body_jaxpr"], sig, env, bconsts, lambda o, _: Tup(o), scope, indent,
            origin,
        )  # fmt: skip
    pr.assign(eqn, env, Call("lax.while_loop", ["cond_fn", "body_fn", Tup(init)]), indent, origin)


def _batched_while(pr: _Printer, p, cconsts, bconsts, env, scope, indent, origin):
    """A while loop whose predicate is an array (``vmap`` of a loop whose condition
    depends on the mapped values): XLA runs it while any element's predicate holds, and
    the body keeps the carry of the elements whose predicate is false. ``lax.while_loop``
    takes a scalar predicate, so the printed loop says both: ``cond_fn`` reduces the
    predicate with ``lax.reduce_or``, ``body_fn`` selects between the new and the old
    carry by the predicate of the old one. Printed again, that loop is the same text."""
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    rank = len(cj.out_avals[0].shape)
    axes = tuple(range(rank))
    sig = [("carry", len(bj.jaxpr.invars) - len(bconsts))]
    inner = indent + 4

    def cond_ret(outs, _args):
        name = pr.fresh()
        pr.emit_expr(Call("lax.reduce_or", [outs[0]], [("axes", pyval(axes))]), inner, f"{name} = ")
        return name

    def body_ret(new, old):
        cenv = dict(env)
        for v, c in zip(cj.jaxpr.constvars, cj.consts, strict=True):
            cenv[v] = pr.closed_over(c, env)
        cenv.update(zip(cj.jaxpr.invars, [*cconsts, *old], strict=True))
        pr.body(cj.jaxpr, cenv, scope, inner)
        pred = pr.atom(cj.jaxpr.outvars[0], cenv)
        outs = []
        for n, o, aval in zip(new, old, bj.out_avals, strict=True):
            which = pred
            if len(aval.shape) != rank:
                which = pr.fresh()
                bcast = Call(
                    "lax.broadcast_in_dim",
                    [pred],
                    [("shape", pyval(tuple(aval.shape))), ("broadcast_dimensions", pyval(axes))],
                )
                pr.emit_expr(bcast, inner, f"{which} = ")
            out = pr.fresh()
            pr.emit_expr(Call("lax.select_n", [which, o, n]), inner, f"{out} = ")
            outs.append(out)
        return Tup(outs)

    pr.define("cond_fn", cj, sig, env, cconsts, cond_ret, scope, indent, origin)
    pr.define("body_fn", bj, sig, env, bconsts, body_ret, scope, indent, origin)


def _scan(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:nc], args[nc : nc + ncar], args[nc + ncar :]
    origin = pr.origin(eqn, "scan")

    def ret(outs, _args):
        return Bare([Tup(outs[:ncar]), Tup(outs[ncar:])])

    sig = [("carry", ncar), ("xs", len(xs))]
    pr.define("scan_fn", p["jaxpr"], sig, env, consts, ret, scope, indent, origin)
    kw = [("length", repr(p["length"]))]
    if p["reverse"]:
        kw.append(("reverse", "True"))
    if p["unroll"] != 1:
        kw.append(("unroll", repr(p["unroll"])))
    if p.get("_split_transpose"):
        kw.append(("_split_transpose", "True"))
    call = Call("lax.scan", ["scan_fn", Tup(init), Tup(xs)], kw)
    outs = pr.bind_outs(eqn, env)
    target = f"{_tuple_target(outs[:ncar])}, {_tuple_target(outs[ncar:])}"
    pr.emit_expr(call, indent, f"{target} = ", origin)


def _tuple_target(names: list[str]) -> str:
    if not names:
        return "()"
    return f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"


def _custom_jvp(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    if p["symbolic_zeros"]:
        raise UnsupportedPrimitiveError(
            "show_jaxpr cannot print primitive 'custom_jvp_call' with symbolic_zeros=True"
        )
    nc = p["num_consts"]
    consts, xs = args[:nc], args[nc:]
    key = ("custom_jvp", _jaxpr_key(p["call_jaxpr"]), tuple(flat(c) for c in consts))
    base = pr.function_name(eqn)
    n, nout = len(xs), len(eqn.outvars)
    known = pr.fn_names.get((pr.base_name(base), key))
    if known is not None and scope.lookup(known, key):
        # e.g. the JVP rule calling its own primal function
        origin = pr.origin(eqn, f"custom_jvp function {known}")
        pr.assign(eqn, env, Call(known, xs), indent, origin, structured=True)
        return
    if pr.jvp_depth >= MAX_JVP_DEPTH:
        # A custom_jvp function inside a JVP rule (JAX's special functions recurse: sinc's
        # rule calls a custom_jvp of the next order, expn's calls expn(n - 1)) prints as
        # the jit of its function: its own rule, a derivative of higher order, is autodiff.
        _jit_cut(pr, eqn, p["call_jaxpr"], args, env, scope, indent, base)
        return
    fname = pr.unique(base, key)
    origin = pr.origin(eqn, f"custom_jvp function {fname}")
    try:
        jvp, out_zeros = _jax_private.custom_jvp_rule(eqn)
        if any(
            isinstance(c, jax.core.Tracer) and _jax_private.tracer_var(c) not in env
            for c in (*jvp.consts, *p["call_jaxpr"].consts)
        ):
            raise TypeError("the rule closes over a tracer of a finished trace")
    except Exception as e:
        # the rule closes over a value of a finished trace, or fails at these shapes
        raise UnsupportedPrimitiveError(
            f"show_jaxpr cannot print primitive 'custom_jvp_call': the JVP rule of "
            f"{fname!r} does not trace on its own at these shapes (a rule that closes over "
            "a traced value needs it as an argument, or jax.closure_convert); tracing it "
            f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ) from None
    deco = ("@jax.custom_jvp",)
    pr.define(
        fname, p["call_jaxpr"], [None] * n, env, consts, single_ret, scope, indent, origin, deco
    )
    scope.defs[fname] = key
    if any(out_zeros):
        raise UnsupportedPrimitiveError(
            f"show_jaxpr cannot print the JVP rule of custom_jvp function {fname!r}: it returns "
            "symbolic zero tangents"
        )

    def ret(outs, _args):
        return Bare([_group(outs[:nout]), _group(outs[nout:])])

    sig = [("primals", n), ("tangents", n)]
    doc = f"JVP rule of {fname}"
    pr.jvp_depth += 1
    try:
        pr.define(f"{fname}_jvp", jvp, sig, env, [], ret, scope, indent, doc, (f"@{fname}.defjvp",))
    finally:
        pr.jvp_depth -= 1
    pr.assign(eqn, env, Call(fname, xs), indent, origin, structured=True)


def _group(outs: list):
    """One output bare, several as a parenthesised tuple (an element of a returned pair)."""
    return outs[0] if len(outs) == 1 else Tup(outs)


#: custom_jvp rules printed inside one another before a function is printed as a jit
MAX_JVP_DEPTH = 1


def _jit_cut(pr: _Printer, eqn, closed, args, env, scope, indent, fname):
    """``jax.jit(fname)(*args)`` computing ``closed`` (its constants passed as arguments):
    exactly what printing that jit again gives."""
    key = _jaxpr_key(closed)
    name = pr.unique(fname, key)
    origin = pr.origin(eqn, f"jit of {name}")
    if not scope.lookup(name, key):
        pr.define(name, closed, [None] * len(args), {}, [], single_ret, scope, indent, origin)
        scope.defs[name] = key
    call = Call(Call("jax.jit", [name]), args)
    pr.assign(eqn, env, call, indent, origin, structured=True)


def _custom_vjp(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    if p["symbolic_zeros"] or p["num_consts"]:
        raise UnsupportedPrimitiveError(
            "show_jaxpr cannot print primitive 'custom_vjp_call' with symbolic_zeros=True or "
            "closed-over traced values (use jax.closure_convert)"
        )
    key = ("custom_vjp", _jaxpr_key(p["call_jaxpr"]))
    fname = pr.unique(pr.function_name(eqn), key)
    origin = pr.origin(eqn, f"custom_vjp function {fname}")
    n, nout = len(args), len(eqn.outvars)
    if scope.lookup(fname, key):  # e.g. the forward rule calling its own primal function
        pr.assign(eqn, env, Call(fname, args), indent, origin, structured=True)
        return
    deco = ("@jax.custom_vjp",)
    pr.define(fname, p["call_jaxpr"], [None] * n, env, [], single_ret, scope, indent, origin, deco)
    scope.defs[fname] = key
    fwd, res_fwds, bwd = _jax_private.custom_vjp_rules(eqn)
    # The forward jaxpr returns (*residuals that are not inputs, *outputs); the rule we
    # print returns (outputs, residuals) with the forwarded inputs put back in place.
    nres_out = len(fwd.jaxpr.outvars) - nout
    res_outs = iter(fwd.jaxpr.outvars[:nres_out])
    in_avals = [v.aval for v in eqn.invars]
    res_src = [("out", next(res_outs)) if f is None else ("in", f) for f in res_fwds]
    res_avals = [x.aval if kind == "out" else in_avals[x] for kind, x in res_src]

    def fwd_ret(outs, fwd_args):
        res, produced = [], iter(outs[:nres_out])
        for kind, x in res_src:
            res.append(next(produced) if kind == "out" else fwd_args[x])
        prim = outs[nres_out:]
        return Bare([prim[0] if len(prim) == 1 else Tup(prim), Tup(res)])

    doc = f"forward rule of {fname}"
    pr.define(f"{fname}_fwd", fwd, [None] * n, env, [], fwd_ret, scope, indent, doc)
    ct_avals = [v.aval.to_tangent_aval() for v in eqn.outvars]
    bwd_closed, none_mask = _trace_bwd(bwd, res_avals, ct_avals)

    def bwd_ret(outs, _args):
        it = iter(outs)
        return Tup(["None" if z else next(it) for z in none_mask])

    sig = [("res", len(res_avals)), ("ct", nout) if nout != 1 else None]
    doc = f"backward rule of {fname}"
    pr.define(f"{fname}_bwd", bwd_closed, sig, env, [], bwd_ret, scope, indent, doc)
    pr.emit(f"{fname}.defvjp({fname}_fwd, {fname}_bwd)", indent)
    pr.assign(eqn, env, Call(fname, args), indent, origin, structured=True)


def _remat(pr: _Printer, eqn, args, env, scope, indent):
    """``jax.checkpoint(fn, prevent_cse=..., policy=...)(*args)``.

    ``differentiated=True`` (JAX sets it on the rematerialised forward pass inside a
    gradient) has no public spelling and is not printed: the rebuilt call computes the
    same values; it only tells XLA lowering that the recomputation was differentiated.
    """
    p = eqn.params
    closed = ClosedJaxpr(p["jaxpr"], [])
    key = ("remat", _jaxpr_key(closed))
    fname = pr.unique(pr.function_name(eqn), key)
    origin = pr.origin(eqn, f"checkpoint of {fname}")
    if not scope.lookup(fname, key):
        pr.define(fname, closed, [None] * len(args), {}, [], single_ret, scope, indent, origin)
        scope.defs[fname] = key
    kw = []
    if not p["prevent_cse"]:
        kw.append(("prevent_cse", "False"))
    if p["policy"] is not None:
        kw.append(("policy", _policy_expr(p["policy"])))
    call = Call(Call("jax.checkpoint", [fname], kw), args)
    pr.assign(eqn, env, call, indent, origin, structured=True)


_NAME_POLICIES = {  # policy class -> (factory in jax.checkpoint_policies, its names field)
    "SaveOnlyTheseNames": ("save_only_these_names", "saveable_names"),
    "SaveAnyNamesButThese": ("save_any_names_but_these", "names"),
}


def _policy_expr(policy) -> str:
    cp = jax.checkpoint_policies
    for attr in dir(cp):
        if not attr.startswith("_") and getattr(cp, attr) is policy:
            return f"jax.checkpoint_policies.{attr}"
    factory = _NAME_POLICIES.get(type(policy).__name__)
    if factory is not None:
        names = sorted(getattr(policy, factory[1]))
        return flat(Call(f"jax.checkpoint_policies.{factory[0]}", [pystr(n) for n in names]))
    raise UnsupportedPrimitiveError(
        f"show_jaxpr cannot print jax.checkpoint policy {policy!r}: only the policies of "
        "jax.checkpoint_policies (ready-made, save_only_these_names, save_any_names_but_these) "
        "have a Python spelling here"
    )


def _trace_bwd(bwd, res_avals, ct_avals):
    """Trace a custom_vjp backward rule; ``mask[i]``: it returns None for input ``i``."""
    mask: list[bool] = []

    def fn(*xs):
        cts = bwd(*xs)
        mask[:] = [c is None for c in cts]
        return [c for c in cts if c is not None]

    structs = [_jax_private.shape_dtype_struct(a) for a in (*res_avals, *ct_avals)]
    return jax.make_jaxpr(fn)(*structs), mask


HIGHER_ORDER = {
    "jit": _jit,
    "pjit": _jit,
    "cond": _cond,
    "while": _while,
    "scan": _scan,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "remat2": _remat,
}


def _func_name(param: str, default: str):
    def name(eqn) -> str:
        j = eqn.params[param]
        dbg = getattr(j, "jaxpr", j).debug_info
        return getattr(dbg, "func_name", None) or default

    return name


def _jit_name(eqn) -> str:
    return eqn.params.get("name", "fn")


register(
    higher_order=HIGHER_ORDER,
    body_pass=fold_index_eqns,
    function_names={
        "jit": _jit_name,
        "pjit": _jit_name,
        "closed_call": _jit_name,
        "custom_jvp_call": _func_name("call_jaxpr", "custom_fn"),
        "custom_vjp_call": _func_name("call_jaxpr", "custom_fn"),
        "remat2": _func_name("jaxpr", "checkpointed"),
    },
)
