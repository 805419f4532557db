"""show_grad's view of a traced loss: each value named, each call a node.

``_Walk`` turns the jaxpr of a loss traced in manual mode (and its twin traced at twice the
batch) into ``_Node`` calls: a hand rule's call (from the tape, matched to its equation by
its result), a primitive's library rule (the plain ``jnp`` between layers), or, on data
only, show_jaxpr's spelling of an equation. Values that depend on neither params nor
batch are computed and printed as literals. ``_Printer`` spells Python values, writing a
size that follows the batch as an expression in ``B``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ..core._jax_private import bind_equation, tracer_var
from ..core._mode import manual_scope
from ._contract import is_constant, is_hyperparameter
from ._interpret import HAND, NESTED, Refusal, _layer, classify, inner, refusal_message
from ._manual import ManualGradError
from ._prim_layout import stop_gradient as _stop_gradient
from ._structural import rule_for

_LITERAL_LIMIT = 4096  # elements: larger constants are refused


def _path_expr(root: str, path) -> str:
    out = root
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            out += f"[{k.idx}]"
        else:
            name = getattr(k, "key", getattr(k, "name", None))
            out += f".{name}" if isinstance(name, str) and name.isidentifier() else f"[{name!r}]"
    return out


def _ident(expr: str) -> str:
    s = re.sub(r"[^0-9a-zA-Z]+", "_", expr).strip("_")
    return s or "v"


def _is_float_dtype(dtype) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


class _NotPortable(Exception):
    """The trace at the doubled batch does not line up with the first one."""


# --- values and calls -----------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Val:
    """A value of the traced loss: an input, a constant, or a call's result."""

    aval: Any
    b_aval: Any = None  # the same value's type in the doubled-batch trace
    expr: str | None = None  # its name in the printed code, once it has one
    tainted: bool = False  # computed from the params (a float): has a cotangent
    const: bool = False  # depends on neither params nor batch: printable as a literal
    node: _Node | None = None  # the call computing it
    compute: Callable | None = None  # its concrete value (constants only)
    _value: Any = None

    def value(self):
        if self._value is None:
            self._value = self.compute()
        return self._value


@dataclasses.dataclass(eq=False)
class _Node:
    """One printed call: ``outs = name(*args, **kwargs)``; ``f_vjp`` when it has a backward."""

    name: str
    fn: Callable | None  # what to import (None: an expression printed by show_jaxpr's rules)
    f_vjp: Callable | None
    args: list  # _Val or ("py", value_a, value_b)
    kwargs: list  # (key, value_a, value_b)
    outs: list
    label: str | None = None
    expr: str | None = None  # the printed right-hand side of an expression node
    stack: _StackBody | None = None  # a Stack printed as two scans over this body
    primitive: bool = False  # a primitive's library rule: one cotangent per operand


@dataclasses.dataclass(eq=False)
class _StackBody:
    """One copy of a Stack's layer, walked on its own: the body of the printed scans."""

    walk: _Walk
    p_name: str  # the copy's params in the body
    paths: list  # the params' leaf paths
    p_vals: list  # the body's param leaves
    h: _Val  # the body's input (the carry)
    y: _Val  # its output
    key: _Val | None = None  # the copy's random key, when the stack has keys


class _Printer:
    def __init__(self, p_name: str, batch_dim: tuple[int, int] | None, batch_expr: str | None):
        self.p_name = p_name
        self.batch_dim = batch_dim  # (B traced, B doubled)
        self.batch_expr = batch_expr
        self.uses_b = False
        self.portable = True
        self.used: set[str] = set()  # module aliases the code needs
        self.names: set[str] = set()
        self.counts: dict[str, int] = {}
        self.fn_names: dict[int, str] = {}  # id(rule function) -> its name in the code

    def fresh(self, base: str) -> str:
        base = _ident(base)
        name, i = base, 1
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    # -- Python values, sizes that follow the batch written in B ---------------------------
    def size(self, a: int, b: int | None) -> str:
        if b is None or a == b or self.batch_dim is None:
            return repr(int(a))
        ba, bb = self.batch_dim
        k, rem = divmod(int(b) - int(a), bb - ba)
        c = int(a) - k * ba
        if rem or k == 0:
            self.portable = False
            return repr(int(a))
        self.uses_b = True
        term = "B" if k == 1 else f"B * {k}"
        return term if c == 0 else f"{term} + {c}" if c > 0 else f"{term} - {-c}"

    def pyval(self, a: Any, b: Any = None) -> str:
        from ..jaxpr._exprs import flat, pyval

        if isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_)):
            return self.size(a, b if isinstance(b, (int, np.integer)) else None)
        if isinstance(a, (tuple, list)) and not hasattr(a, "_fields"):
            bs = b if isinstance(b, (tuple, list)) and len(b) == len(a) else [None] * len(a)
            items = [self.pyval(x, y) for x, y in zip(a, bs, strict=True)]
            inner_ = ", ".join(items) + ("," if len(items) == 1 else "")
            return f"({inner_})" if isinstance(a, tuple) else f"[{inner_}]"
        if b is not None and not _same(a, b):
            self.portable = False
        text = flat(pyval(a))
        self.note(text)
        return text

    def note(self, text: str) -> None:
        for mod in ("jnp", "np", "lax", "prims", "jax"):
            if re.search(rf"(?<![\w.]){mod}\.", text):
                self.used.add(mod)


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- arrays and odd params: compare by identity
        return a is b


# --- literals -------------------------------------------------------------------------------


def _literal(pr: _Printer, a, b_shape) -> str:
    """Source for a constant: a lower-triangular (causal) mask, an ``arange`` or a literal,
    broadcast to ``a``'s shape when it repeats along its leading axes."""
    arr = np.asarray(a)
    core = arr
    while core.ndim > 1 and all(np.array_equal(core[0], c) for c in core[1:]):
        core = core[0]
    lead = arr.ndim - core.ndim
    if arr.size > 1 and arr.dtype != np.bool_ and np.all(arr == arr.flat[0]):
        # one value throughout (zeros, a fill): its shape may follow the batch
        shape = pr.pyval(tuple(arr.shape), None if b_shape is None else tuple(b_shape))
        v = arr.flat[0].item()
        text = repr(v) if not isinstance(v, float) or np.isfinite(v) else f'float("{v}")'
        return f"jnp.full({shape}, {text}, jnp.{arr.dtype})"
    if b_shape is not None and tuple(b_shape[lead:]) != core.shape:
        pr.portable = False  # the constant itself changes with the batch
    shape = pr.pyval(tuple(arr.shape), None if b_shape is None else tuple(b_shape))
    if core.ndim == 2 and core.dtype == np.bool_ and core.shape[0] == core.shape[1]:
        if np.array_equal(core, np.tril(np.ones(core.shape, bool))):
            return _bcast(f"jnp.tril(jnp.ones({core.shape}, bool))", core, arr, shape)
    if core.size > _LITERAL_LIMIT:
        raise ValueError(
            f"show_grad: a constant of shape {arr.shape} is too large to print; call show_grad "
            "on a smaller batch"
        )
    if core.ndim == 1 and core.size and np.array_equal(core, np.arange(core.size)):
        src = f"np.arange({core.size}, dtype=np.{core.dtype})"
    else:
        src = f"np.array({core.tolist()}, np.{core.dtype})"
    return _bcast(src, core, arr, shape)


def _bcast(src: str, core, arr, shape: str) -> str:
    if core.shape == arr.shape and shape == repr(tuple(arr.shape)):
        return src
    return f"jnp.broadcast_to({src}, {shape})"


# --- tracing ----------------------------------------------------------------------------------


def _trace(loss_fn, params, batch, kwargs, leaves_spec):
    """``(closed jaxpr of the loss, {out var: tape entry})`` in manual mode, jit inlined."""
    treedef = jax.tree.structure((params, batch))

    def flat(*xs):
        p, b = jax.tree.unflatten(treedef, xs)
        out = loss_fn(p, *b, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    tape: list = []
    with jax.disable_jit(), manual_scope(True, tape):
        closed = jax.make_jaxpr(flat)(*leaves_spec)
    by_out = {}
    for entry in tape:
        out = entry[3]
        first = out[0] if isinstance(out, (tuple, list)) else out
        var = tracer_var(first)
        if var is not None:
            by_out[var] = entry
    return closed, by_out


# --- the walk ---------------------------------------------------------------------------------


class _Walk:
    """Turns the traced jaxpr (and its doubled-batch twin) into ``_Node`` calls."""

    def __init__(self, pr: _Printer, tape_a: dict, tape_b: dict | None):
        self.pr = pr
        self.tape_a, self.tape_b = tape_a, tape_b
        self.nodes: list[_Node] = []

    def body(self, ja, jb, ins: list[_Val], consts_a: list, consts_b: list | None):
        env: dict = {}
        for i, v in enumerate(ja.constvars):
            c = consts_a[i]
            bv = None if jb is None else jb.constvars[i].aval
            env[v] = _Val(v.aval, bv, const=True, compute=lambda c=c: c)
        env.update(zip(ja.invars, ins, strict=True))
        if jb is not None and len(jb.eqns) != len(ja.eqns):
            raise _NotPortable
        for k, ea in enumerate(ja.eqns):
            eb = None if jb is None else jb.eqns[k]
            if eb is not None and (
                eb.primitive is not ea.primitive or len(eb.outvars) != len(ea.outvars)
            ):
                raise _NotPortable
            ins = [self.read(env, v) for v in ea.invars]
            if eb is not None:
                for i, (va, vb) in enumerate(zip(ea.invars, eb.invars, strict=True)):
                    if isinstance(va, Literal) != isinstance(vb, Literal):
                        raise _NotPortable
                    if isinstance(va, Literal) and not _same(va.val, vb.val):
                        ins[i] = self.batch_literal(va, vb)
            outs = self.eqn(ea, eb, ins)
            env.update(zip(ea.outvars, outs, strict=True))
        return [self.read(env, v) for v in ja.outvars], env

    def batch_literal(self, va: Literal, vb: Literal) -> _Val:
        """A scalar that follows the batch size (``jnp.mean``'s count): ``np.float32(B)``."""
        a, b = np.asarray(va.val), np.asarray(vb.val)
        expr = None
        if a.ndim == 0 and float(a).is_integer() and float(b).is_integer():
            size = self.pr.size(int(a), int(b))
            if self.pr.portable:
                expr = f"np.{a.dtype}({size})"
        if expr is None:
            self.pr.portable = False
            return _Val(va.aval, vb.aval, const=True, compute=lambda: va.val, expr=_scalar(va))
        return _Val(va.aval, vb.aval, expr=expr)

    @staticmethod
    def read(env, v) -> _Val:
        if isinstance(v, Literal):
            return _Val(v.aval, v.aval, const=True, compute=lambda: v.val, expr=_scalar(v))
        return env[v]

    def eqn(self, ea, eb, ins: list[_Val]) -> list[_Val]:
        name = ea.primitive.name
        t_in = [x.tainted for x in ins]
        b_avals = [None] * len(ea.outvars) if eb is None else [v.aval for v in eb.outvars]
        kind = classify(ea, t_in)
        if name in NESTED and name not in ("scan", "cond", "while") and kind != "rule":
            ba, bconsts = (None, None) if eb is None else inner(eb)
            body_a, consts_a = inner(ea)
            return self.body(body_a, ba, ins, consts_a, bconsts)[0]
        if name in HAND and ea.outvars[0] in self.tape_a:
            return self.hand(ea, eb, ins, b_avals)
        if kind == "refuse" or (kind == "hand"):
            what = refusal_message(Refusal(ea, _layer(ea, ""), tuple(t_in)), who="show_grad")
            if kind == "hand":
                what = (
                    "show_grad: a jax.custom_vjp function not declared with nl.hand_rule computes "
                    "on the params; show_grad prints the rules it can import: declare it with "
                    "@nl.hand_rule(f_vjp)"
                )
            raise ManualGradError(what)
        if name in ("scan", "cond", "while") and not all(x.const for x in ins):
            raise ValueError(
                f"show_grad: cannot print a `{name}` here (it runs under jax.disable_jit, so "
                "scans unroll; a cond or while on traced values has no printed form); "
                "differentiate with nl.manual_grads instead"
            )
        outs = [
            _Val(v.aval, b, tainted=kind == "rule" and _is_float_dtype(v.aval.dtype))
            for v, b in zip(ea.outvars, b_avals, strict=True)
        ]
        if all(x.const for x in ins):  # a constant: computed now, printed as a literal
            results: dict = {}

            def compute(i, ea=ea, ins=ins):
                if "v" not in results:
                    results["v"] = bind_equation(ea, [x.value() for x in ins])
                return results["v"][i]

            for i, o in enumerate(outs):
                o.const, o.compute = True, functools.partial(compute, i)
            return outs
        if name in HAND or name == "custom_jvp_call":  # a foreign rule on data: its forward
            body_a = ea.params["call_jaxpr"]
            body_b = None if eb is None else eb.params["call_jaxpr"]
            n_c = ea.params.get("num_consts", 0)
            return self.body(
                body_a.jaxpr,
                None if body_b is None else body_b.jaxpr,
                ins[n_c:] if len(body_a.jaxpr.invars) < len(ins) else ins,
                list(body_a.consts),
                None if body_b is None else list(body_b.consts),
            )[0]
        rule = rule_for(ea)
        if name == "stop_gradient":
            fn, f_vjp, params_a, params_b = _stop_gradient, None, {}, {}
        elif rule is not None:
            fn, f_vjp = rule.f, (rule.f_vjp if kind == "rule" else None)
            params_a = rule.params(ea.params)
            params_b = None if eb is None else rule.params(eb.params)
        else:
            return self.expression(ea, eb, ins, outs)
        defaults = {
            k: p.default
            for k, p in inspect.signature(fn).parameters.items()
            if p.default is not p.empty
        }
        kwargs = [
            (k, v, None if params_b is None else params_b.get(k))
            for k, v in params_a.items()
            if not (k in defaults and _same(defaults[k], v))
        ]
        node = _Node(fn.__name__, fn, f_vjp, list(ins), kwargs, outs, primitive=True)
        return self.add(node)

    def hand(self, ea, eb, ins, b_avals) -> list[_Val]:
        """A hand rule's call. Its equation's operands are, after the rule's closed-over
        constants, the array arguments in order, then the array hyperparameters in the
        order of ``jax.tree.flatten`` (see ``hand_rule``)."""
        wrapped, args, static, out = self.tape_a[ea.outvars[0]]
        entry_b = None if eb is None or self.tape_b is None else self.tape_b.get(eb.outvars[0])
        if eb is not None and entry_b is None:
            raise _NotPortable
        if getattr(wrapped, "layer", None) is not None:
            return self.stack(wrapped.layer, ea, entry_b, ins, b_avals)
        operands = iter(ins[ea.params.get("num_consts", 0) :])
        b_args = [None] * len(args) if entry_b is None else list(entry_b[1])
        node_args = []
        for a, b in zip(args, b_args, strict=True):
            if is_hyperparameter(a):
                node_args.append(("py", a, b))
            elif is_constant(a):  # closed over by the rule's call: a printed constant
                aval = jax.core.ShapedArray(a.shape, a.dtype)
                node_args.append(_Val(aval, aval, const=True, compute=lambda a=a: a))
            elif _arrayish(a):
                node_args.append(next(operands))
            else:
                raise ValueError(
                    f"show_grad: {wrapped.__name__} takes a {type(a).__name__}; show_grad "
                    "prints hand rules whose arguments are arrays and Python scalars"
                )
        s_leaves, s_tree = jax.tree.flatten(static)
        s_leaves = [next(operands) if _arrayish(x) else x for x in s_leaves]
        b_static = {} if entry_b is None else entry_b[2]
        kwargs = [
            (k, v, None if isinstance(v, _Val) else b_static.get(k))
            for k, v in jax.tree.unflatten(s_tree, s_leaves).items()
        ]
        tainted = any(x.tainted for x in ins)
        outs = [
            _Val(v.aval, b, tainted=tainted and _is_float_dtype(v.aval.dtype))
            for v, b in zip(ea.outvars, b_avals, strict=True)
        ]
        node = _Node(wrapped.__name__, wrapped, wrapped.f_vjp, node_args, kwargs, outs)
        node.label = self.label(node_args)
        return self.add(node)

    def stack(self, layer, ea, entry_b, ins, b_avals) -> list[_Val]:
        """A ``Stack``: one node whose body, one copy of ``layer`` on the params (and key)
        of one copy, is walked apart (traced again, at both batch sizes) and printed once
        inside a forward and a reverse ``lax.scan``."""
        ins = ins[ea.params.get("num_consts", 0) :]
        params, _, keys = self.tape_a[ea.outvars[0]][1]
        p_tree = jax.tree.structure(params)
        n_p = p_tree.num_leaves
        p_vals, x, k_vals = ins[:n_p], ins[n_p], ins[n_p + 1 :]
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

        def spec(aval, drop: int):
            return jax.ShapeDtypeStruct(tuple(aval.shape[drop:]), aval.dtype)

        def copy(p, h, *k):
            return layer(p, h, key=k[0] if k else None)

        def trace(avals, h_aval):
            one = jax.tree.unflatten(p_tree, [spec(a, 1) for a in avals])
            h = spec(h_aval, 0)
            k = [spec(v.aval, 1) for v in k_vals]
            return _trace(copy, one, (h, *k), {}, [*jax.tree.leaves(one), h, *k])

        closed_a, tape_a = trace([v.aval for v in p_vals], x.aval)
        closed_b, tape_b = None, None
        if entry_b is not None:
            closed_b, tape_b = trace([v.b_aval for v in p_vals], x.b_aval)
        saved = self.pr.p_name
        self.pr.p_name = p_name = self.pr.fresh("p_copy")
        try:
            sub = _Walk(self.pr, tape_a, tape_b)
            # one copy's params: the body's own input types, not the stacked ones
            b_in = [None] * n_p if closed_b is None else [v.aval for v in closed_b.jaxpr.invars]
            sub_ins = [
                _Val(
                    closed_a.jaxpr.invars[i].aval,
                    b_in[i],
                    tainted=v.tainted,
                    expr=_path_expr(p_name, path),
                )
                for i, (v, path) in enumerate(zip(p_vals, paths, strict=True))
            ]
            # the carry has a cotangent whenever the copies' params do: the previous copy's
            tainted = x.tainted or any(v.tainted for v in p_vals)
            h = _Val(x.aval, x.b_aval, tainted=tainted, expr=self.pr.fresh("h"))
            k = [_Val(v.aval, v.aval, expr=self.pr.fresh("k")) for v in k_vals]
            jb = None if closed_b is None else closed_b.jaxpr
            (y,), _ = sub.body(
                closed_a.jaxpr,
                jb,
                [*sub_ins, h, *k],
                list(closed_a.consts),
                None if closed_b is None else list(closed_b.consts),
            )
        finally:
            self.pr.p_name = saved
        tainted = any(v.tainted for v in ins)
        outs = [
            _Val(v.aval, b, tainted=tainted and _is_float_dtype(v.aval.dtype))
            for v, b in zip(ea.outvars, b_avals, strict=True)
        ]
        node = _Node("stack", None, None, [*p_vals, x, *k_vals], [], outs)
        node.stack = _StackBody(sub, p_name, paths, sub_ins, h, y, k[0] if k else None)
        node.label = self.label(p_vals)
        return self.add(node)

    def label(self, args: list) -> str | None:
        """``_blocks_0_ln1`` for a call on ``params.blocks[0].ln1.scale``: the path of the
        layer owning the first param leaf among the arguments."""
        p = self.pr.p_name
        for a in args:
            expr = a.expr if isinstance(a, _Val) else None
            if expr and expr[len(p) : len(p) + 1] in (".", "[") and expr.startswith(p):
                rest = expr[len(p) :]
                return _ident(rest.rsplit(".", 1)[0] if "." in rest else rest)
        return None

    def expression(self, ea, eb, ins, outs) -> list[_Val]:
        """An equation on data without a library rule (a comparison, ``argmax``): printed
        with show_jaxpr's rule for its primitive."""
        if eb is not None and not all(_same(ea.params[k], eb.params.get(k)) for k in ea.params):
            self.pr.portable = False
        node = _Node(ea.primitive.name, None, None, list(ins), [], outs)
        node.expr = ea  # printed later, when the operands have names
        return self.add(node)

    def add(self, node: _Node) -> list[_Val]:
        for o in node.outs:
            o.node = node
        self.nodes.append(node)
        return node.outs


def _arrayish(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def _scalar(v: Literal) -> str:
    from ..jaxpr._exprs import scalar_expr

    return scalar_expr(v.val, v.aval.dtype, getattr(v.aval, "weak_type", False))
