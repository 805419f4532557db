"""show_jaxpr's primitive table: how each first-order primitive prints as Python.

A rule gets the equation, its printed operands and the ambient abstract mesh (inside a
``shard_map`` body: the mesh with its manual axes, which a printed ``out_sharding=P(...)``
resolves against; ``None`` elsewhere) and returns an expression, or ``None`` when the
equation's parameters are not what the public function would produce; then the
caller falls back to ``prims.<name>_p.bind(*operands, **params)`` (``prims`` is
``jax.extend.core.primitives``), which reproduces the equation exactly. Every rule is
checked by the round trip: re-tracing the printed call must give the same text.

Expressions are small trees (``Call``, ``Tup``) so that long statements can be wrapped
the way ``ruff format`` wraps them.
"""

from __future__ import annotations

import enum
import keyword
import math
import re
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
    "RULES",
    "Bare",
    "Call",
    "Tup",
    "target",
    "tuple_or_single",
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
    kind = _kind(dt)
    v = np.asarray(value, dt).item() if dt.kind != "V" else float(np.asarray(value, dt))
    if weak:
        if kind == "f":
            return _float_repr(float(v))
        if dt.kind in "iub":
            return repr(type(v)(v)) if dt.kind != "b" else repr(bool(v))
        if dt.kind == "c":
            return repr(complex(v))
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
        return f"np.{dt.name}({complex(typed)!r})"
    raise UnsupportedPrimitiveError(f"literal {value!r} of dtype {dt} has no Python spelling")


def _kind(dt: np.dtype) -> str:
    """NumPy's dtype kind, with ml_dtypes floats (bfloat16, float8s: kind "V") as "f"."""
    return "f" if jnp.issubdtype(dt, jnp.floating) else dt.kind


def _float_repr(x: float) -> str:
    if math.isfinite(x):
        return repr(x)
    return f'float("{x}")'


def array_expr(value) -> str:
    """``np.array([...], np.float32)`` with values that round-trip exactly."""
    a = np.asarray(value)
    dt = a.dtype
    if a.ndim == 0:
        return scalar_expr(a, dt, weak=False)
    if _kind(dt) == "f":
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
    if isinstance(v, (int, np.integer)):
        return repr(int(v))
    if isinstance(v, (float, np.floating)):
        return _float_repr(float(v))
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return dtype_expr(v)
    if isinstance(v, type) and isinstance(getattr(v, "dtype", None), np.dtype):
        return f"jnp.{v.__name__}" if getattr(jnp, v.__name__, None) is v else dtype_expr(v.dtype)
    if isinstance(v, enum.Enum):
        for mod, ns in _ENUM_HOMES:
            for attr in dir(ns):
                if getattr(ns, attr) is type(v):
                    return f"{mod}.{attr}.{v.name}"
        raise UnsupportedPrimitiveError(f"{what} {v!r}: enum {type(v).__name__} is not in jax.lax")
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        cls = getattr(lax, type(v).__name__, None)
        if cls is not type(v):
            raise UnsupportedPrimitiveError(f"{what} {v!r}: {type(v).__name__} is not in jax.lax")
        fields = [(f, pyval(getattr(v, f), what)) for f in v._fields]
        return Call(f"lax.{type(v).__name__}", [], fields)
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


_ENUM_HOMES = (("lax", lax), ("jax.memory", jax.memory), ("jax.sharding", jax.sharding))


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
    return ", ".join(f"{k}={v!r}" for k, v in params.items()) or "none"


# -- rules --------------------------------------------------------------------------------------
Rule = Callable[[Any, list, Any], "Call | str | None"]  # (eqn, operands, ambient mesh)
RULES: dict[str, Rule] = {}


def _has(eqn, **defaults) -> bool:
    """Whether every parameter not printed by the rule has the default value."""
    for k, v in defaults.items():
        if k not in eqn.params:
            continue
        p = eqn.params[k]
        if p is not v and not (type(p) is type(v) and p == v):
            return False
    return True


def _operands_plain(eqn, args) -> bool:
    """Operator syntax (``a + b``) is exact only for same-dtype, same-shape strong operands,
    at least one of them traced: on NumPy literals and constants it would run in NumPy."""
    if not _TRACED.fullmatch(flat(args[0])):  # Python would call NumPy's operator first
        return False
    avals = [v.aval for v in eqn.invars]
    if any(getattr(a, "weak_type", False) for a in avals):
        return False
    if len({a.dtype for a in avals}) != 1:
        return False
    shapes = {a.shape for a in avals}
    return len(shapes) == 1 or (len(shapes) == 2 and () in shapes and _literal_scalars(eqn))


def _literal_scalars(eqn) -> bool:
    from jax.extend.core import Literal

    return all(isinstance(v, Literal) for v in eqn.invars if v.aval.shape == ())


_TRACED = re.compile("[a-z]+")  # variable names; constants are C0, C1, ...
_BINOPS = {
    "add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
    "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^",
}  # fmt: skip
_FLOAT_ONLY = {"div": "/"}


def _binop(name: str, op: str | None, float_only: bool = False) -> Rule:
    def rule(eqn, args, _mesh):
        if not _has(eqn, out_dtype=None):
            return None
        dt = eqn.invars[0].aval.dtype
        plain = op and _operands_plain(eqn, args) and (not float_only or np.dtype(dt).kind == "f")
        if plain and np.dtype(dt) != np.dtype(bool) or (plain and op in "&|^"):
            return f"{_paren(args[0])} {op} {_paren(args[1])}"
        return Call(f"lax.{name}", args)

    return rule


def _paren(a) -> str:
    s = flat(a)
    return s if s.isidentifier() or (s[:1].isalpha() and "(" in s and s.endswith(")")) else f"({s})"


for _n, _op in _BINOPS.items():
    RULES[_n] = _binop(_n + ("_" if _n in ("and", "or") else ""), _op)
RULES["and"] = _binop("bitwise_and", "&")
RULES["or"] = _binop("bitwise_or", "|")
RULES["xor"] = _binop("bitwise_xor", "^")
RULES["div"] = _binop("div", "/", float_only=True)
for _n in ("max", "min", "rem", "pow", "atan2", "nextafter", "shift_left",
           "shift_right_logical", "shift_right_arithmetic", "complex"):  # fmt: skip
    RULES[_n] = _binop(_n, None)


def _unary(fn: str, **defaults) -> Rule:
    def rule(eqn, args, _mesh):
        if not _has(eqn, **defaults):
            return None
        return Call(fn, args)

    return rule


for _n in ("neg", "sign", "floor", "ceil", "is_finite", "abs", "imag", "real", "conj",
           "sqrt", "rsqrt", "cbrt", "integer_pow", "expm1", "log1p", "erf", "erfc",
           "erf_inv", "lgamma", "digamma", "square", "population_count", "clz",
           "stop_gradient"):  # fmt: skip
    RULES[_n] = _unary(f"lax.{_n}")
RULES["not"] = _unary("lax.bitwise_not")
RULES["neg"] = lambda eqn, args, _mesh: (
    f"-{_paren(args[0])}"
    if _operands_plain(eqn, args) and np.dtype(eqn.invars[0].aval.dtype).kind in "fi"
    else None
)
for _n in ("exp", "exp2", "log", "sin", "cos", "tan", "tanh", "logistic", "sinh", "cosh",
           "asin", "acos", "atan", "asinh", "acosh", "atanh"):  # fmt: skip
    RULES[_n] = _unary(f"lax.{_n}", accuracy=None)
RULES["abs"] = _unary("lax.abs")
RULES["sqrt"] = _unary("lax.sqrt", accuracy=None)
RULES["rsqrt"] = _unary("lax.rsqrt", accuracy=None)
RULES["cbrt"] = _unary("lax.cbrt", accuracy=None)


def _kw_rule(fn: str, printed: tuple[str, ...], sharding: str | None = None, **defaults) -> Rule:
    """``fn(*operands, p=...)`` for the ``printed`` params; the others must be defaults.

    ``sharding``: the param (if any) that prints as ``out_sharding=`` (see ``_out_sharding``).
    """

    def rule(eqn, args, mesh):
        if not _has(eqn, **defaults):
            return None
        kw = [(k, pyval(eqn.params[k], k)) for k in printed]
        out = _out_sharding(eqn, sharding, mesh) if sharding else []
        return None if out is None else Call(fn, args, kw + out)

    return rule


def _out_sharding(eqn, param: str, mesh) -> list | None:
    """``[("out_sharding", "P(...)")]``; ``[]`` when ``param`` is None; None if unprintable."""
    s = eqn.params.get(param)
    if s is None:
        return []
    expr = sharding_expr(s, mesh)
    return None if expr is None else [("out_sharding", expr)]


RULES["integer_pow"] = _kw_rule("lax.integer_pow", ("y",))
RULES["round"] = _kw_rule("lax.round", ("rounding_method",))
for _n in ("sum", "max", "min", "prod", "and", "or", "xor"):
    RULES[f"reduce_{_n}"] = _kw_rule(f"lax.reduce_{_n}", ("axes",), sharding="out_sharding")


def _argminmax(fn: str) -> Rule:
    def rule(eqn, args, _mesh):
        p = eqn.params
        if len(p["axes"]) != 1:
            return None
        return Call(
            fn, args, [("axis", pyval(p["axes"][0])), ("index_dtype", dtype_expr(p["index_dtype"]))]
        )

    return rule


RULES["argmax"] = _argminmax("lax.argmax")
RULES["argmin"] = _argminmax("lax.argmin")
RULES["squeeze"] = _kw_rule("lax.squeeze", ("dimensions",))
RULES["rev"] = _kw_rule("lax.rev", ("dimensions",))
RULES["transpose"] = _kw_rule("lax.transpose", ("permutation",))
RULES["cumsum"] = _kw_rule("lax.cumsum", ("axis", "reverse"))
RULES["cumprod"] = _kw_rule("lax.cumprod", ("axis", "reverse"))
RULES["cummax"] = _kw_rule("lax.cummax", ("axis", "reverse"))
RULES["cummin"] = _kw_rule("lax.cummin", ("axis", "reverse"))
RULES["cumlogsumexp"] = _kw_rule("lax.cumlogsumexp", ("axis", "reverse"))
RULES["bitcast_convert_type"] = _kw_rule("lax.bitcast_convert_type", ("new_dtype",))
RULES["select_n"] = _unary("lax.select_n")
RULES["clamp"] = _unary("lax.clamp")


def _convert(eqn, args, _mesh):
    if not _has(eqn, sharding=None) or eqn.params["weak_type"]:
        return None
    return Call(
        "lax.convert_element_type", args, [("new_dtype", dtype_expr(eqn.params["new_dtype"]))]
    )


RULES["convert_element_type"] = _convert


def _broadcast(eqn, args, mesh):
    p = eqn.params
    out = _out_sharding(eqn, "sharding", mesh)
    if out is None:
        return None
    return Call(
        "lax.broadcast_in_dim",
        args,
        [("shape", pyval(p["shape"])), ("broadcast_dimensions", pyval(p["broadcast_dimensions"]))]
        + out,
    )


RULES["broadcast_in_dim"] = _broadcast


def _reshape(eqn, args, mesh):
    p = eqn.params
    out = _out_sharding(eqn, "sharding", mesh)
    if not _has(eqn, dimensions=None) or out is None:
        return None
    return Call("lax.reshape", args, [("new_sizes", pyval(p["new_sizes"]))] + out)


RULES["reshape"] = _reshape


def _dot_general(eqn, args, mesh):
    p = eqn.params
    out = _out_sharding(eqn, "out_sharding", mesh)
    if out is None:
        return None
    kw = [("dimension_numbers", pyval(p["dimension_numbers"]))]
    if p["precision"] is not None:
        kw.append(("precision", pyval(p["precision"])))
    pet = p["preferred_element_type"]
    kw.append(("preferred_element_type", "None" if pet is None else dtype_expr(pet)))
    return Call("lax.dot_general", args, kw + out)


RULES["dot_general"] = _dot_general

_CONV_PARAMS = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers")


def _conv(eqn, args, mesh):
    """``lax.conv_general_dilated``; the public call, so that ``out_sharding`` (set inside
    ``shard_map``) prints as ``P(...)`` like ``dot_general``'s."""
    p = eqn.params
    out = _out_sharding(eqn, "out_sharding", mesh)
    if out is None:
        return None
    kw = [(k, pyval(p[k], k)) for k in _CONV_PARAMS]
    for k in ("feature_group_count", "batch_group_count"):
        if p[k] != 1:
            kw.append((k, pyval(p[k], k)))
    if p["precision"] is not None:
        kw.append(("precision", pyval(p["precision"], "precision")))
    pet = p["preferred_element_type"]
    if pet is not None:
        kw.append(("preferred_element_type", dtype_expr(pet)))
    return Call("lax.conv_general_dilated", args, kw + out)


RULES["conv_general_dilated"] = _conv


def _concatenate(eqn, args, _mesh):
    return Call(
        "lax.concatenate",
        [Tup(args) if len(args) != 1 else f"[{flat(args[0])}]"],
        [("dimension", pyval(eqn.params["dimension"]))],
    )


RULES["concatenate"] = _concatenate


def _pad(eqn, args, _mesh):
    return Call("lax.pad", args, [("padding_config", pyval(eqn.params["padding_config"]))])


RULES["pad"] = _pad


def _slice(eqn, args, _mesh):
    p = eqn.params
    kw = [
        ("start_indices", pyval(p["start_indices"])),
        ("limit_indices", pyval(p["limit_indices"])),
    ]
    if p["strides"] is not None:
        kw.append(("strides", pyval(p["strides"])))
    return Call("lax.slice", args, kw)


RULES["slice"] = _slice


def _stack(eqn, args, _mesh):
    return Call("lax.stack", [Tup(args)], [("axis", pyval(eqn.params["axis"]))])


RULES["stack"] = _stack


def _random_seed(eqn, args, _mesh):
    # jax.random.key binds random_seed on the seed as it is, whatever its integer dtype
    # (weak int32 from a Python int, uint32, int64): the legacy PRNGKey(seed) is this
    # followed by random_unwrap.
    if not np.issubdtype(eqn.invars[0].aval.dtype, np.integer):
        return None
    return Call("jax.random.key", args, [("impl", pystr(eqn.params["impl"].name))])


RULES["random_seed"] = _random_seed


def _gather(eqn, args, _mesh):
    p = eqn.params
    kw = [(k, pyval(p[k], k)) for k in ("dimension_numbers", "slice_sizes", "unique_indices",
                                       "indices_are_sorted", "mode", "fill_value")]  # fmt: skip
    return Call("lax.gather", args, kw)


RULES["gather"] = _gather


def _scatter(fn: str, combiner: str | None) -> Rule:
    def rule(eqn, args, _mesh):
        p = eqn.params
        uj = p.get("update_jaxpr")
        if combiner is None:
            if uj is not None:
                return None
        elif uj is None or [e.primitive.name for e in uj.eqns] != [combiner] or p["update_consts"]:
            return None
        kw = [(k, pyval(p[k], k)) for k in ("dimension_numbers", "indices_are_sorted",
                                           "unique_indices", "mode")]  # fmt: skip
        return Call(fn, args, kw)

    return rule


RULES["scatter"] = _scatter("lax.scatter", None)
RULES["scatter-add"] = _scatter("lax.scatter_add", "add")
RULES["scatter-mul"] = _scatter("lax.scatter_mul", "mul")
RULES["scatter-min"] = _scatter("lax.scatter_min", "min")
RULES["scatter-max"] = _scatter("lax.scatter_max", "max")


def _iota(eqn, args, _mesh):
    p = eqn.params
    if not _has(eqn, sharding=None) or len(p["shape"]) != 1 or args:
        return None
    return Call("lax.iota", [dtype_expr(p["dtype"]), pyval(p["shape"][0])])


RULES["iota"] = _iota


def _sort(eqn, args, _mesh):
    p = eqn.params
    kw = [("dimension", pyval(p["dimension"])), ("is_stable", pyval(p["is_stable"])),
          ("num_keys", pyval(p["num_keys"]))]  # fmt: skip
    return Call("lax.sort", [Tup(args)], kw)


RULES["sort"] = _sort


def _top_k(eqn, args, _mesh):
    p = eqn.params
    if p.get("axis", eqn.invars[0].aval.ndim - 1) != eqn.invars[0].aval.ndim - 1:
        return None
    return Call("lax.top_k", args, [("k", pyval(p["k"]))])


RULES["top_k"] = _top_k


def _random_wrap(eqn, args, _mesh):
    return Call("jax.random.wrap_key_data", args, [("impl", pystr(eqn.params["impl"].name))])


def _random_unwrap(eqn, args, _mesh):
    return Call("jax.random.key_data", args)


RULES["random_wrap"] = _random_wrap
RULES["random_unwrap"] = _random_unwrap


def is_identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)
