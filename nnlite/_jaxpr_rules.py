"""show_jaxpr's primitive table: how each first-order primitive prints as Python.

A rule gets the equation and its printed operands and returns an expression, or ``None``
when the equation's parameters are not what the public function would produce; then the
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
from jax.extend.core import primitives as _prims

__all__ = [
    "RULES",
    "Bare",
    "Call",
    "Tup",
    "target",
    "tuple_or_single",
    "UnsupportedPrimitiveError",
    "dtype_expr",
    "pyval",
    "render",
]

WIDTH = 100  # ruff's line-length for nnlite


class UnsupportedPrimitiveError(NotImplementedError):
    """show_jaxpr met a primitive (or parameter) it cannot print as runnable Python."""


# -- expressions ------------------------------------------------------------------------------
class Call:
    """``fn(*args, **kwargs)`` with the arguments kept as trees for line wrapping."""

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
    return f"{e.fn}{e.open}{inner}{e.close}"


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
    head = f"{pad}{prefix}{e.fn}{e.open}"
    tail = f"{pad}{e.close}{suffix}"
    inner = ", ".join(flat(x) for x in e.items())
    if not (isinstance(e, Tup) and len(e.elts) == 1) and len(pad) + 4 + len(inner) <= WIDTH:
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


def pyval(v: Any, what: str = "parameter"):
    """Python source for a primitive parameter value (a string, or a tree for tuples)."""
    if v is None or isinstance(v, (bool, str)):
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
    raise UnsupportedPrimitiveError(
        f"{what} {v!r} of type {type(v).__name__} has no Python spelling"
    )


_ENUM_HOMES = (("lax", lax), ("jax.memory", jax.memory))

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
            "jax.extend.core.primitives or jax.lax; add a rule to nnlite/_jaxpr_rules.py"
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
Rule = Callable[[Any, list, list], "Call | str | None"]
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
    def rule(eqn, args, _kw):
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
    def rule(eqn, args, _kw):
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
RULES["neg"] = lambda eqn, args, _kw: (
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


def _kw_rule(fn: str, printed: tuple[str, ...], **defaults) -> Rule:
    """``fn(*operands, p=...)`` for the ``printed`` params; the others must be defaults."""

    def rule(eqn, args, _kw):
        if not _has(eqn, **defaults):
            return None
        return Call(fn, args, [(k, pyval(eqn.params[k], k)) for k in printed])

    return rule


RULES["integer_pow"] = _kw_rule("lax.integer_pow", ("y",))
RULES["round"] = _kw_rule("lax.round", ("rounding_method",))
RULES["reduce_sum"] = _kw_rule("lax.reduce_sum", ("axes",), out_sharding=None)
RULES["reduce_max"] = _kw_rule("lax.reduce_max", ("axes",), out_sharding=None)
RULES["reduce_min"] = _kw_rule("lax.reduce_min", ("axes",), out_sharding=None)
RULES["reduce_prod"] = _kw_rule("lax.reduce_prod", ("axes",), out_sharding=None)
RULES["reduce_and"] = _kw_rule("lax.reduce_and", ("axes",), out_sharding=None)
RULES["reduce_or"] = _kw_rule("lax.reduce_or", ("axes",), out_sharding=None)
RULES["reduce_xor"] = _kw_rule("lax.reduce_xor", ("axes",), out_sharding=None)


def _argminmax(fn: str) -> Rule:
    def rule(eqn, args, _kw):
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


def _convert(eqn, args, _kw):
    if not _has(eqn, sharding=None) or eqn.params["weak_type"]:
        return None
    return Call(
        "lax.convert_element_type", args, [("new_dtype", dtype_expr(eqn.params["new_dtype"]))]
    )


RULES["convert_element_type"] = _convert


def _broadcast(eqn, args, _kw):
    if not _has(eqn, sharding=None):
        return None
    p = eqn.params
    return Call(
        "lax.broadcast_in_dim",
        args,
        [("shape", pyval(p["shape"])), ("broadcast_dimensions", pyval(p["broadcast_dimensions"]))],
    )


RULES["broadcast_in_dim"] = _broadcast


def _reshape(eqn, args, _kw):
    p = eqn.params
    if not _has(eqn, dimensions=None, sharding=None):
        return None
    return Call("lax.reshape", args, [("new_sizes", pyval(p["new_sizes"]))])


RULES["reshape"] = _reshape


def _dot_general(eqn, args, _kw):
    p = eqn.params
    if not _has(eqn, out_sharding=None):
        return None
    kw = [("dimension_numbers", pyval(p["dimension_numbers"]))]
    if p["precision"] is not None:
        kw.append(("precision", pyval(p["precision"])))
    pet = p["preferred_element_type"]
    kw.append(("preferred_element_type", "None" if pet is None else dtype_expr(pet)))
    return Call("lax.dot_general", args, kw)


RULES["dot_general"] = _dot_general


def _concatenate(eqn, args, _kw):
    return Call(
        "lax.concatenate",
        [Tup(args) if len(args) != 1 else f"[{flat(args[0])}]"],
        [("dimension", pyval(eqn.params["dimension"]))],
    )


RULES["concatenate"] = _concatenate


def _pad(eqn, args, _kw):
    return Call("lax.pad", args, [("padding_config", pyval(eqn.params["padding_config"]))])


RULES["pad"] = _pad


def _slice(eqn, args, _kw):
    p = eqn.params
    kw = [
        ("start_indices", pyval(p["start_indices"])),
        ("limit_indices", pyval(p["limit_indices"])),
    ]
    if p["strides"] is not None:
        kw.append(("strides", pyval(p["strides"])))
    return Call("lax.slice", args, kw)


RULES["slice"] = _slice


def _stack(eqn, args, _kw):
    return Call("lax.stack", [Tup(args)], [("axis", pyval(eqn.params["axis"]))])


RULES["stack"] = _stack


def _random_seed(eqn, args, _kw):
    a = eqn.invars[0].aval
    if a.dtype != np.int32 or a.weak_type:
        return None
    return Call("jax.random.key", args, [("impl", repr(eqn.params["impl"].name))])


RULES["random_seed"] = _random_seed


def _gather(eqn, args, _kw):
    p = eqn.params
    kw = [(k, pyval(p[k], k)) for k in ("dimension_numbers", "slice_sizes", "unique_indices",
                                       "indices_are_sorted", "mode", "fill_value")]  # fmt: skip
    return Call("lax.gather", args, kw)


RULES["gather"] = _gather


def _scatter(fn: str, combiner: str | None) -> Rule:
    def rule(eqn, args, _kw):
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


def _iota(eqn, args, _kw):
    p = eqn.params
    if not _has(eqn, sharding=None) or len(p["shape"]) != 1 or args:
        return None
    return Call("lax.iota", [dtype_expr(p["dtype"]), pyval(p["shape"][0])])


RULES["iota"] = _iota


def _sort(eqn, args, _kw):
    p = eqn.params
    kw = [("dimension", pyval(p["dimension"])), ("is_stable", pyval(p["is_stable"])),
          ("num_keys", pyval(p["num_keys"]))]  # fmt: skip
    return Call("lax.sort", [Tup(args)], kw)


RULES["sort"] = _sort


def _top_k(eqn, args, _kw):
    p = eqn.params
    if p.get("axis", eqn.invars[0].aval.ndim - 1) != eqn.invars[0].aval.ndim - 1:
        return None
    return Call("lax.top_k", args, [("k", pyval(p["k"]))])


RULES["top_k"] = _top_k


def _random_wrap(eqn, args, _kw):
    return Call("jax.random.wrap_key_data", args, [("impl", repr(eqn.params["impl"].name))])


def _random_unwrap(eqn, args, _kw):
    return Call("jax.random.key_data", args)


RULES["random_wrap"] = _random_wrap
RULES["random_unwrap"] = _random_unwrap


def is_identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)
