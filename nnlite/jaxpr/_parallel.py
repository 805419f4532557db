"""show_jaxpr's parallel primitives: ``shard_map`` (so also ``pmap``) and the collectives.

``shard_map`` -> a nested function called through ``jax.shard_map(fn, mesh=..., in_specs=...,
out_specs=...)``. ``jax.pmap`` traces to a ``jit`` of a ``shard_map`` (JAX 0.10) and prints
as that. Collectives print as their ``jax.lax`` functions: ``psum`` and ``psum_invariant``
-> ``lax.psum`` (which of the two it binds follows ``check_vma``, and the printed
``shard_map`` keeps that), ``pmax``, ``pmin``, ``all_gather`` (and ``all_gather_invariant``),
``all_to_all``, ``ppermute``, ``pbroadcast``, ``axis_index``, ``pvary`` ->
``lax.pcast(..., to="varying")``. ``lax.pmean`` is a ``psum`` then a ``div``.

Meshes print over ``jax.devices()``: the source assumes it runs where ``jax.devices()``
lists the same devices in the same order as where it was decompiled (same platform and
device count, e.g. the same ``--xla_force_host_platform_device_count``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal
from jax.sharding import AxisType

from ..core import _jax_private
from ._exprs import (
    Call,
    Rule,
    Tup,
    UnsupportedPrimitiveError,
    flat,
    mesh_expr,
    named_sharding_expr,
    pystr,
    pyval,
    spec_expr,
    tuple_or_single,
)
from ._printer import register

if TYPE_CHECKING:
    from ._printer import Printer as _Printer

__all__ = ["COLLECTIVE_RULES", "shard_map"]


# -- shard_map --------------------------------------------------------------------------------
def shard_map(pr: _Printer, eqn, args, env, scope, indent):
    p = eqn.params
    mesh = p["mesh"]
    if not isinstance(mesh, jax.sharding.Mesh):
        raise UnsupportedPrimitiveError(
            f"show_jaxpr cannot print primitive 'shard_map' over {mesh!r}: only a concrete "
            "jax.sharding.Mesh is supported"
        )
    closed = ClosedJaxpr(p["jaxpr"], [])  # JAX made its constants leading inputs
    key = ("shard_map", str(closed.jaxpr))
    fname = pr.unique(pr.function_name(eqn), key)
    origin = pr.origin(eqn, f"shard_map of {fname}")
    kw = [
        ("mesh", mesh_expr(mesh)),
        ("in_specs", Tup([spec_expr(s) for s in p["in_specs"]])),
        ("out_specs", _out_specs(p["out_specs"])),
    ]
    manual = p["newly_manual_axes"]
    if set(manual) != set(mesh.axis_names) - set(mesh.manual_axes):
        kw.append(("axis_names", "{" + ", ".join(pystr(a) for a in _ordered(mesh, manual)) + "}"))
    if not p["check_vma"]:
        kw.append(("check_vma", "False"))
    if not scope.lookup(fname, key):
        outer_mesh, pr.mesh = pr.mesh, _manual_mesh(mesh, manual)
        try:
            with _jax_private.shard_map_body(mesh, manual, p["check_vma"]):
                pr.define(fname, closed, [None] * len(args), {}, [], _ret, scope, indent, origin)
        finally:
            pr.mesh = outer_mesh
        scope.defs[fname] = key
    call = Call(Call("jax.shard_map", [fname], kw), args)
    pr.assign(eqn, env, call, indent, origin, structured=True)


def _ret(outs, _args):
    return tuple_or_single(outs)


def _out_specs(specs):
    """One spec for one output (the printed function returns a bare array), else a tuple."""
    return spec_expr(specs[0]) if len(specs) == 1 else Tup([spec_expr(s) for s in specs])


def _ordered(mesh, names) -> list[str]:
    return [a for a in mesh.axis_names if a in names]


def _manual_mesh(mesh, manual):
    """The abstract mesh JAX traces a shard_map body under: ``manual`` axes made Manual."""
    return mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in manual})


# -- collectives ------------------------------------------------------------------------------
def _names(v) -> str:
    """An axis-name parameter: ``"batch"`` for a string or a 1-tuple, else a tuple."""
    if isinstance(v, tuple) and len(v) == 1:
        v = v[0]
    if isinstance(v, str):
        return pystr(v)
    if isinstance(v, tuple) and all(isinstance(n, str) for n in v):
        return flat(Tup([pystr(n) for n in v]))
    raise UnsupportedPrimitiveError(f"axis name {v!r} is not a mesh axis name")


def _exact_names(v) -> str:
    """For functions that bind the axis name as given (no tuple normalization)."""
    return pystr(v) if isinstance(v, str) else flat(Tup([pystr(n) for n in v]))


def _named(v) -> bool:
    names = v if isinstance(v, tuple) else (v,)
    return all(isinstance(n, str) for n in names)


def _psum(eqn, args, _mesh):
    p = eqn.params
    x = eqn.invars[0]
    # lax.psum binds one operand at a time, and folds a constant operand itself
    if len(eqn.invars) != 1 or isinstance(x, Literal):
        return None
    if p.get("axis_index_groups") is not None or not _named(p["axes"]):
        return None
    if x.aval.dtype == np.bool_:  # lax.psum sums booleans as int32
        return None
    varying = _jax_private.varying_axes(x.aval)
    if eqn.primitive.name == "psum_invariant":
        if not set(p["axes"]) <= varying:  # lax.psum would add a pvary first
            return None
    elif varying:  # psum_p on varying values: lax.psum would bind psum_invariant
        return None
    return Call("lax.psum", [args[0], _names(p["axes"])])


def _pminmax(fn: str) -> Rule:
    def rule(eqn, args, _mesh):
        p = eqn.params
        if p.get("axis_index_groups") is not None or not _named(p["axes"]):
            return None
        return Call(fn, [args[0], _names(p["axes"])])

    return rule


def _all_gather(eqn, args, _mesh):
    p = eqn.params
    if p.get("axis_index_groups") is not None:
        return None
    kw = [("axis", repr(p["all_gather_dimension"])), ("tiled", repr(p["tiled"]))]
    if eqn.primitive.name == "all_gather_invariant":
        kw.append(("to", '"invarying"'))
    return Call("lax.all_gather", [args[0], _names(p["axis_name"])], kw)


def _all_to_all(eqn, args, _mesh):
    p = eqn.params
    split, concat, tiled = p["split_axis"], p["concat_axis"], p["tiled"]
    # untiled with split != concat, lax.all_to_all adds an expand_dims and a squeeze
    if p["axis_index_groups"] is not None or not (tiled or split == concat):
        return None
    names = _exact_names(p["axis_name"])
    kw = [("tiled", "True")] if tiled else []
    return Call("lax.all_to_all", [args[0], names, repr(split), repr(concat)], kw)


def _ppermute(eqn, args, _mesh):
    p = eqn.params
    perm = "[" + ", ".join(repr(tuple(pair)) for pair in p["perm"]) + "]"
    return Call("lax.ppermute", [args[0], _names(p["axis_name"])], [("perm", perm)])


def _pbroadcast(eqn, args, _mesh):
    p = eqn.params
    return Call(
        "lax.pbroadcast", [args[0], _exact_names(p["axis_name"])], [("source", repr(p["source"]))]
    )


def _axis_index(eqn, args, _mesh):
    name = eqn.params["axis_name"]
    return Call("lax.axis_index", [pystr(name)]) if isinstance(name, str) else None


def _pvary(eqn, args, _mesh):
    axes = eqn.params["axes"]
    if not _named(axes):
        return None
    return Call("lax.pcast", [args[0], _names(axes)], [("to", '"varying"')])


def _sharding_constraint(eqn, args, _mesh):
    """``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(...)))`` over a concrete
    mesh (what ``jax.jit`` programs such as the fsdp step place on their arrays)."""
    p = eqn.params
    sharding = named_sharding_expr(p["sharding"])
    if sharding is None or p.get("layout") is not None:
        return None
    return Call("jax.lax.with_sharding_constraint", [args[0], sharding])


def _reshard(eqn, args, _mesh):
    """``jax.sharding.reshard(x, NamedSharding(...))``: e.g. the ones that ``jax.grad``
    seeds its backward pass with, placed like the loss, inside a ``jax.jit`` over a mesh."""
    p = eqn.params
    if p.get("concrete_mesh") is not None:
        return None
    dst = p["dst_sharding"]
    sharding = named_sharding_expr(dst)
    if sharding is None:
        sharding = pyval(dst, "dst_sharding")  # over an abstract mesh
    return Call("jax.sharding.reshard", [args[0], sharding])


COLLECTIVE_RULES: dict[str, Rule] = {
    "psum": _psum,
    "psum_invariant": _psum,
    "pmax": _pminmax("lax.pmax"),
    "pmin": _pminmax("lax.pmin"),
    "all_gather": _all_gather,
    "all_gather_invariant": _all_gather,
    "all_to_all": _all_to_all,
    "ppermute": _ppermute,
    "pbroadcast": _pbroadcast,
    "axis_index": _axis_index,
    "pvary": _pvary,
    "sharding_constraint": _sharding_constraint,
    "reshard": _reshard,
}


def _shard_map_name(eqn) -> str:
    return getattr(eqn.params["jaxpr"].debug_info, "func_name", None) or "shard_fn"


register(
    rules=COLLECTIVE_RULES,
    higher_order={"shard_map": shard_map},
    function_names={"shard_map": _shard_map_name},
)
