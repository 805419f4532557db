"""show_jaxpr's expressions: how values, parameters and calls print as Python.

Expressions are small trees (``Call``, ``Tup``) so that long statements can be wrapped
the way ``ruff format`` wraps them; parameters (dtypes, shardings, meshes, enums) print
as the public constructors that rebuild them (``pyval``), and an equation no rule prints
falls back to ``prims.<name>_p.bind(*operands, **params)`` (``bind_expr``; ``prims`` is
``jax.extend.core.primitives``), which reproduces it exactly. The printer core and every
rule module build on this one; it imports none of them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive as _Primitive
from jax.extend.core import primitives as _prims
from jax.sharding import PartitionSpec as P

__all__ = [
    "Bare",
    "Call",
    "Tup",
    "target",
    "tuple_or_single",
    "Rule",
    "UnsupportedPrimitiveError",
    "dtype_expr",
    "mesh_expr",
    "named_sharding_expr",
    "pystr",
    "pyval",
    "render",
    "sharding_expr",
    "spec_expr",
]

WIDTH = 100  # ruff's line-length for nnlite


class UnsupportedPrimitiveError(NotImplementedError):
    """show_jaxpr met a primitive (or parameter) it cannot print as runnable Python."""


UnsupportedPrimitiveError.__module__ = "nnlite"  # its public home, shown in tracebacks


# -- expressions ------------------------------------------------------------------------------
class Call:
    """``fn(*args, **kwargs)`` with the arguments kept as trees for line wrapping.

    ``fn`` is a name, or a ``Call`` for ``make(...)(*args)`` (e.g. ``jax.shard_map``).
    """

    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn: str, args=(), kwargs=()):
        self.fn, self.args, self.kwargs = fn, list(args), list(kwargs)

    def items(self) -> list:
        return [*self.args, *((k + "=", v) for k, v in self.kwargs)]

    open, close = "(", ")"


class Tup:
    """A tuple display; ``Tup([x])`` prints ``(x,)``."""

    __slots__ = ("elts",)

    def __init__(self, elts):
        self.elts = list(elts)

    def items(self) -> list:
        return self.elts

    fn, open, close = "", "(", ")"


def flat(e) -> str:
    if isinstance(e, str):
        return e
    if isinstance(e, tuple):  # keyword argument
        return e[0] + flat(e[1])
    inner = ", ".join(flat(x) for x in e.items())
    if isinstance(e, Tup) and len(e.elts) == 1:
        inner += ","
    return f"{flat(e.fn)}{e.open}{inner}{e.close}"


def render(e, indent: int, prefix: str = "", suffix: str = "") -> list[str]:
    """Lines for ``prefix + e + suffix`` at ``indent``, wrapped as ruff format would."""
    pad = " " * indent
    one = f"{pad}{prefix}{flat(e)}{suffix}"
    if len(one) <= WIDTH or isinstance(e, str):
        return [one]
    if isinstance(e, tuple):
        return render(e[1], indent, prefix + e[0], suffix)
    if not e.items():
        return [one]
    if isinstance(e.fn, Call) and len(f"{pad}{prefix}{flat(e.fn)}(") > WIDTH:
        # f(...)(args): split f's call, then the arguments go on its closing line
        lines = render(e.fn, indent, prefix)
        return lines[:-1] + render(Call(lines[-1].strip(), e.args, e.kwargs), indent, "", suffix)
    if isinstance(e, Bare):  # a long ``return a, b`` gets parentheses
        return render(Tup(e.elts), indent, prefix, suffix)
    head = f"{pad}{prefix}{flat(e.fn)}{e.open}"
    tail = f"{pad}{e.close}{suffix}"
    inner = ", ".join(flat(x) for x in e.items())
    # call arguments stay on one line if they fit; a split tuple display has one per line
    if not isinstance(e, Tup) and len(pad) + 4 + len(inner) <= WIDTH:
        return [head, f"{pad}    {inner}", tail]
    lines = [head]
    for x in e.items():
        lines += render(x, indent + 4, suffix=",")
    return [*lines, tail]


def target(names: list[str]) -> str:
    return f"({names[0]},)" if len(names) == 1 else ", ".join(names)


def tuple_or_single(outs: list[str]):
    if len(outs) == 1:
        return outs[0]
    return Tup(outs) if not outs else Bare(outs)


class Bare(Tup):
    """``a, b`` without parentheses in a return statement (ruff keeps it that way)."""

    open = close = ""


# -- Python values of parameters --------------------------------------------------------------
_DTYPE_NAMES = {"bool": "jnp.bool_"}


def dtype_expr(dtype) -> str:
    """``jnp.float32`` for float32, ``jnp.bfloat16``, ``jnp.bool_``; keys raise."""
    name = str(np.dtype(dtype))
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    if not name.isidentifier():
        raise UnsupportedPrimitiveError(f"dtype {name} has no Python spelling")
    return f"jnp.{name}"


def scalar_expr(value, dtype, weak: bool) -> str:
    """A Python expression for a scalar literal that traces back to the same literal.

    Weak-typed literals print as Python scalars (``2.0``); strongly typed ones with their
    dtype (``np.float32(2.0)``), using the shortest repr that round-trips in that dtype.
    """
    dt = np.dtype(dtype)
    if dt == jax.dtypes.float0:
        # a symbolic-zero tangent (e.g. of an integer output): NumPy's float0 zeros
        return "np.zeros((), jax.dtypes.float0)"
    kind = _kind(dt)
    v = np.asarray(value, dt).item() if dt.kind != "V" else float(np.asarray(value, dt))
    if weak:
        if kind == "f":
            return _float_repr(float(v))
        if dt.kind in "iub":
            return repr(type(v)(v)) if dt.kind != "b" else repr(bool(v))
        if dt.kind == "c":
            return _complex_repr(complex(v))
    typed = np.asarray(value).astype(dt)[()]
    if dt.kind == "b":
        return f"np.bool_({bool(typed)})"
    if kind == "f":
        text = str(typed)
        if not np.isfinite(typed):
            text = f'"{text}"'  # ruff format's quotes
        elif "e" not in text and "." not in text:
            text += ".0"
        mod = "np" if dt.name in ("float16", "float32", "float64") else "jnp"
        return f"{mod}.{dt.name}({text})"
    if dt.kind in "iu":
        return f"np.{dt.name}({int(typed)})"
    if dt.kind == "c":
        return f"np.{dt.name}({_complex_repr(complex(typed))})"
    raise UnsupportedPrimitiveError(f"literal {value!r} of dtype {dt} has no Python spelling")


def _kind(dt: np.dtype) -> str:
    """NumPy's dtype kind, with ml_dtypes floats (bfloat16, float8s: kind "V") as "f"."""
    return "f" if jnp.issubdtype(dt, jnp.floating) else dt.kind


def _complex_repr(z: complex) -> str:
    """``(1+2j)``, or ``complex(float("nan"), 0.0)`` when a part is not finite (the repr
    ``(nan+nanj)`` is no Python expression)."""
    if math.isfinite(z.real) and math.isfinite(z.imag):
        return repr(z)
    return f"complex({_float_repr(z.real)}, {_float_repr(z.imag)})"


def _float_repr(x: float) -> str:
    if math.isfinite(x):
        return repr(x)
    return f'float("{x}")'


def array_expr(value) -> str:
    """``np.array([...], np.float32)`` with values that round-trip exactly."""
    a = np.asarray(value)
    dt = a.dtype
    if dt == jax.dtypes.float0:
        return f"np.zeros({a.shape!r}, jax.dtypes.float0)"
    if a.ndim == 0:
        return scalar_expr(a, dt, weak=False)
    if dt.kind == "c":
        data = np.vectorize(lambda x: _complex_repr(complex(x)), otypes=[object])(a).tolist()
        body = repr(data).replace("'", "")
    elif _kind(dt) == "f":
        # repr of the float64 value is exact for every float32/16/bf16 value
        data = np.vectorize(lambda x: _float_repr(float(x)), otypes=[object])(a).tolist()
        body = repr(data).replace("'", "")
    else:
        body = repr(a.tolist())
    np_name = dt.name if dt.name in ("bool", *np.sctypeDict) and dt.kind in "biufc" else None
    mod_dt = f"np.{np_name}" if np_name and dt.name != "bool" else dtype_expr(dt)
    return f"np.array({body}, {mod_dt.replace('jnp.bool_', 'np.bool_')})"


def pystr(s: str) -> str:
    """A string literal as ``ruff format`` writes it: double quotes unless that needs escapes."""
    r = repr(s)
    return f'"{r[1:-1]}"' if r.startswith("'") and '"' not in s else r


def spec_expr(spec) -> str:
    """``P("batch", None)`` for a ``PartitionSpec``."""
    if spec.unreduced or spec.reduced:
        raise UnsupportedPrimitiveError(
            f"PartitionSpec {spec} with unreduced/reduced axes has no Python spelling in nnlite"
        )
    parts = []
    for x in spec:
        if x is None or isinstance(x, str):
            parts.append("None" if x is None else pystr(x))
        elif isinstance(x, tuple) and all(isinstance(n, str) for n in x):
            parts.append(flat(Tup([pystr(n) for n in x])))
        elif x is P.UNCONSTRAINED:
            parts.append("P.UNCONSTRAINED")
        else:
            raise UnsupportedPrimitiveError(f"PartitionSpec {spec}: entry {x!r} is not printable")
    return f"P({', '.join(parts)})"


def mesh_expr(mesh: jax.sharding.Mesh) -> Call:
    """``jax.make_mesh(...)`` (or ``jax.sharding.Mesh(...)``) rebuilding ``mesh``.

    Devices are named by their position in ``jax.devices()``. ``jax.make_mesh`` prints
    when it gives the same device order (it may reorder devices for the hardware topology);
    otherwise the device array is spelled out.
    """
    everything = jax.devices()
    position = {d: i for i, d in enumerate(everything)}
    missing = [d for d in mesh.devices.flat if d not in position]
    if missing:
        raise UnsupportedPrimitiveError(
            f"mesh {mesh}: devices {missing} are not in jax.devices(), so the source cannot "
            "name them"
        )
    index = [position[d] for d in mesh.devices.flat]
    shape = tuple(mesh.devices.shape)
    names, types = tuple(mesh.axis_names), tuple(mesh.axis_types)
    shape_s = Tup([repr(n) for n in shape])
    names_s = Tup([pystr(n) for n in names])
    types_s = Tup([f"jax.sharding.AxisType.{t.name}" for t in types])
    n = len(index)
    if index == list(range(n)):
        kw = [("axis_types", types_s)]
        if n < len(everything):
            kw.append(("devices", f"jax.devices()[:{n}]"))
        remade = jax.make_mesh(shape, names, types, devices=everything[:n])
        if np.array_equal(remade.devices, mesh.devices):
            return Call("jax.make_mesh", [shape_s, names_s], kw)
    devices = f"np.array([jax.devices()[i] for i in {tuple(index)!r}]).reshape({flat(shape_s)})"
    return Call("jax.sharding.Mesh", [devices, names_s], [("axis_types", types_s)])


def named_sharding_expr(sharding) -> Call | None:
    """``jax.sharding.NamedSharding(mesh, P(...))`` over a concrete mesh, or None when the
    sharding is of another kind or names a memory other than the device's."""
    if (
        not isinstance(sharding, jax.sharding.NamedSharding)
        or not isinstance(sharding.mesh, jax.sharding.Mesh)
        or sharding.memory_kind not in (None, "device")
    ):
        return None
    return Call("jax.sharding.NamedSharding", [mesh_expr(sharding.mesh), spec_expr(sharding.spec)])


def sharding_expr(sharding, mesh) -> str | None:
    """``P(...)`` for an ``out_sharding`` that is a spec over the ambient mesh, else None.

    Inside ``shard_map`` JAX's transpose rules give some equations (``broadcast_in_dim``,
    ...) a ``NamedSharding`` over the manual abstract mesh; a public function given
    ``out_sharding=P(...)`` there resolves the spec against the same mesh.
    """
    if (
        mesh is None
        or not isinstance(sharding, jax.sharding.NamedSharding)
        or sharding.mesh != mesh
        or sharding.memory_kind is not None
    ):
        return None
    return spec_expr(sharding.spec)


def pyval(v: Any, what: str = "parameter"):
    """Python source for a primitive parameter value (a string, or a tree for tuples)."""
    if isinstance(v, str):
        return pystr(v)
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, enum.Enum):  # before int: lax.FftType is an IntEnum
        for mod, ns in _ENUM_HOMES:
            for attr in dir(ns):
                if getattr(ns, attr) is type(v):
                    return f"{mod}.{attr}.{v.name}"
        raise UnsupportedPrimitiveError(f"{what} {v!r}: enum {type(v).__name__} is not in jax.lax")
    if isinstance(v, (int, np.integer)):
        return repr(int(v))
    if isinstance(v, (float, np.floating)):
        return _float_repr(float(v))
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return dtype_expr(v)
    if isinstance(v, type) and isinstance(getattr(v, "dtype", None), np.dtype):
        return f"jnp.{v.__name__}" if getattr(jnp, v.__name__, None) is v else dtype_expr(v.dtype)
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        cls = getattr(lax, type(v).__name__, None)
        if cls is not type(v):
            raise UnsupportedPrimitiveError(f"{what} {v!r}: {type(v).__name__} is not in jax.lax")
        fields = [(f, pyval(getattr(v, f), what)) for f in v._fields]
        return Call(f"lax.{type(v).__name__}", [], fields)
    if isinstance(v, slice):  # a static index (e.g. a rule's subarray of a stacked output)
        return f"slice({v.start!r}, {v.stop!r}, {v.step!r})"
    if v is Ellipsis:
        return "..."
    if isinstance(v, tuple):
        return Tup([pyval(x, what) for x in v])
    if isinstance(v, list):
        return "[" + ", ".join(flat(pyval(x, what)) for x in v) + "]"
    if isinstance(v, np.ndarray):
        return array_expr(v)
    if isinstance(v, _Primitive) and id(v) in _PRIMS_BY_ID:
        return _PRIMS_BY_ID[id(v)]  # e.g. max pooling's gradient: select_prim=prims.ge_p
    if (
        isinstance(v, jax.sharding.NamedSharding)
        and isinstance(v.mesh, jax.sharding.AbstractMesh)
        and v.memory_kind is None
    ):
        # e.g. convert_element_type[sharding=...] that jax.jacfwd/jax.hessian make: a spec
        # over an abstract mesh (no devices), so it prints without one.
        return Call("jax.sharding.NamedSharding", [abstract_mesh_expr(v.mesh), spec_expr(v.spec)])
    raise UnsupportedPrimitiveError(
        f"{what} {v!r} of type {type(v).__name__} has no Python spelling"
    )


_ENUM_HOMES = (
    ("lax", lax),
    ("lax.linalg", lax.linalg),
    ("jax.memory", jax.memory),
    ("jax.sharding", jax.sharding),
)


def abstract_mesh_expr(mesh: jax.sharding.AbstractMesh) -> Call:
    """``jax.sharding.AbstractMesh(sizes, names, axis_types=...)``."""
    return Call(
        "jax.sharding.AbstractMesh",
        [Tup([repr(int(n)) for n in mesh.axis_sizes]), Tup([pystr(a) for a in mesh.axis_names])],
        [("axis_types", Tup([pyval(t, "axis type") for t in mesh.axis_types]))],
    )


# -- the fallback ------------------------------------------------------------------------------
_PRIMS_BY_ID = {id(p): f"lax.{n}" for n, p in vars(lax).items() if n.endswith("_p")}
_PRIMS_BY_ID.update({id(p): f"prims.{n}" for n, p in vars(_prims).items() if n.endswith("_p")})


def bind_expr(eqn, args: list) -> Call:
    """``prims.<name>_p.bind(*args, **params)``: reproduces any first-order equation.

    ``prims`` is ``jax.extend.core.primitives``; primitives only ``jax.lax`` exports (e.g.
    ``split_p``) bind as ``lax.<name>_p.bind``.
    """
    attr = _PRIMS_BY_ID.get(id(eqn.primitive))
    if attr is None:
        raise UnsupportedPrimitiveError(
            f"show_jaxpr cannot print primitive {eqn.primitive.name!r} (params: "
            f"{_params_str(eqn.params)}): it has no rule in nnlite and is not exported by "
            "jax.extend.core.primitives or jax.lax; add a rule to nnlite/jaxpr/_rules.py"
        )
    try:
        kwargs = [(k, pyval(v, f"parameter {k}={v!r}:")) for k, v in eqn.params.items()]
    except UnsupportedPrimitiveError as e:
        raise UnsupportedPrimitiveError(
            f"show_jaxpr cannot print primitive {eqn.primitive.name!r} (params: "
            f"{_params_str(eqn.params)}): {e}"
        ) from None
    return Call(f"{attr}.bind", args, kwargs)


def _params_str(params: dict) -> str:
    def short(v) -> str:
        r = " ".join(repr(v).split())
        return r if len(r) <= 80 else r[:77] + "..."

    return ", ".join(f"{k}={short(v)}" for k, v in params.items()) or "none"


Rule = Callable[[Any, list, Any], "Call | str | None"]  # (eqn, operands, ambient mesh)
