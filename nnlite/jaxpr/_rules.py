"""show_jaxpr's first-order primitive table: how each primitive prints as Python.

A rule gets the equation, its printed operands and the ambient abstract mesh (inside a
``shard_map`` body: the mesh with its manual axes, which a printed ``out_sharding=P(...)``
resolves against; ``None`` elsewhere) and returns an expression, or ``None`` when the
equation's parameters are not what the public function would produce; then the printer
falls back to ``prims.<name>_p.bind(*operands, **params)``, which reproduces the equation
exactly. Every rule is checked by the round trip: re-tracing the printed call must give
the same text. The table registers into the printer core when this module is imported,
as ``_nested.py`` and ``_parallel.py`` do.
"""

from __future__ import annotations

import re

import numpy as np

from ._exprs import Call, Rule, Tup, dtype_expr, flat, pystr, pyval, sharding_expr
from ._printer import register

__all__ = ["RULES"]

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
    else Call("lax.neg", args)  # complex and unsigned: NumPy's operator would run first
)
RULES["copy"] = _unary("jnp.copy")
RULES["copy_p"] = _unary("jnp.copy")
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
RULES["tile"] = _kw_rule("lax.tile", ("reps",))
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
    # a weakly typed result (jnp's own promotion of a Python scalar) has no public function:
    # printed strong, the next print would differ (the round trip's fixed point)
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
    if not _has(eqn, sharding=None) or args:
        return None
    if len(p["shape"]) == 1:
        return Call("lax.iota", [dtype_expr(p["dtype"]), pyval(p["shape"][0])])
    shape = pyval(tuple(p["shape"]))
    return Call("lax.broadcasted_iota", [dtype_expr(p["dtype"]), shape, pyval(p["dimension"])])


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


def _random_bits(eqn, args, _mesh):
    p = eqn.params
    dtype = dtype_expr(np.dtype(f"uint{p['bit_width']}"))
    return Call("jax.random.bits", [args[0], pyval(tuple(p["shape"]))], [("dtype", dtype)])


def _random_split(eqn, args, _mesh):
    return Call("jax.random.split", [args[0], pyval(tuple(eqn.params["shape"]))])


def _dynamic_slice(eqn, args, _mesh):
    # without allow_negative_indices=False, the function adds the wrap-around of negatives
    kw = [("slice_sizes", pyval(tuple(eqn.params["slice_sizes"])))]
    kw.append(("allow_negative_indices", "False"))
    return Call("lax.dynamic_slice", [args[0], "[" + ", ".join(map(flat, args[1:])) + "]"], kw)


def _dynamic_update_slice(eqn, args, _mesh):
    starts = "[" + ", ".join(map(flat, args[2:])) + "]"
    kw = [("allow_negative_indices", "False")]
    return Call("lax.dynamic_update_slice", [args[0], args[1], starts], kw)


RULES["random_bits"] = _random_bits
RULES["random_split"] = _random_split
RULES["random_fold_in"] = _unary("jax.random.fold_in")
RULES["dynamic_slice"] = _dynamic_slice
RULES["dynamic_update_slice"] = _dynamic_update_slice
RULES["random_wrap"] = _random_wrap
RULES["random_unwrap"] = _random_unwrap


# nnlite's own primitives: the fused CPU attention (nnlite/nn/_flash.py) and the MKL GEMM
# (nnlite/core/_gemm.py; nnlite.matmul binds it again where it applies, else XLA's dot)
for _name in ("fwd", "bwd"):
    RULES[f"nnlite_attention_{_name}"] = _kw_rule(
        f"nnlite.flash_attention_{_name}", ("scale", "causal", "offset", "window", "masked")
    )


def _nnlite_gemm(eqn, args, _mesh):
    # bfloat16 operands give a float32 product: nnlite.matmul says so by its
    # preferred_element_type (it would round to the operands' dtype otherwise)
    kw = [(k, pyval(eqn.params[k], k)) for k in ("transpose_a", "transpose_b")]
    out = eqn.outvars[0].aval.dtype
    if out != eqn.invars[0].aval.dtype:
        kw.append(("preferred_element_type", dtype_expr(out)))
    return Call("nnlite.matmul", args, kw)


RULES["nnlite_gemm"] = _nnlite_gemm

register(rules=RULES)
