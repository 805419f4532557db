"""``show_grad``: a loss's backward pass as runnable Python, at the level of layers.

The loss is traced once in manual-gradient mode with a tape (every hand-rule call --
``linear``, ``relu``, ``conv``, ``layer_norm``, a user's ``@nl.hand_rule`` -- records its
arguments and result) and with ``jax.disable_jit`` (a jitted helper is inlined, a
``lax.scan`` unrolled). The jaxpr is then printed as a function: the forward calls, each
result named after the layer path of the params it uses; the plain ``jnp`` between layers
as calls of the primitive's library rule (``add``, ``reduce_sum``, ``reshape``, ...); then
the hand VJPs in reverse order, summing cotangents where a value feeds several calls, and
finally the ParamsDict of gradients. Values that depend on neither params nor batch
(causal masks, position indices, dropout keys) print as literals.

The printed code runs anywhere: each rule is imported from the module that defines it
(``nnlite.rules`` for the library's, the user's own module for theirs), and it works at
any batch size: the loss is traced a second time with the batch doubled, and every size
that changed with it prints as an expression in ``B = <first batch array>.shape[0]``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ..core._jax_private import bind_equation, tracer_var
from ..core._mode import manual_scope
from ._interpret import HAND, NESTED, Refusal, _layer, classify, inner, refusal_message
from ._manual import ManualGradError
from ._structural import PRIMITIVE_RULES
from ._structural import stop_gradient as _stop_gradient

__all__ = ["show_grad"]

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
            outs = self.eqn(ea, eb, [self.read(env, v) for v in ea.invars])
            env.update(zip(ea.outvars, outs, strict=True))
        return [self.read(env, v) for v in ja.outvars], env

    @staticmethod
    def read(env, v) -> _Val:
        if isinstance(v, Literal):
            return _Val(v.aval, v.aval, const=True, compute=lambda: v.val, expr=_scalar(v))
        return env[v]

    def eqn(self, ea, eb, ins: list[_Val]) -> list[_Val]:
        name = ea.primitive.name
        t_in = [x.tainted for x in ins]
        b_avals = [None] * len(ea.outvars) if eb is None else [v.aval for v in eb.outvars]
        if name in NESTED and name not in ("scan", "cond"):
            ba, bconsts = (None, None) if eb is None else inner(eb)
            body_a, consts_a = inner(ea)
            return self.body(body_a, ba, ins, consts_a, bconsts)[0]
        kind = classify(ea, t_in)
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
        rule = PRIMITIVE_RULES.get(name)
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
        node = _Node(fn.__name__, fn, f_vjp, list(ins), kwargs, outs)
        return self.add(node)

    def hand(self, ea, eb, ins, b_avals) -> list[_Val]:
        wrapped, args, static, out = self.tape_a[ea.outvars[0]]
        entry_b = None if eb is None or self.tape_b is None else self.tape_b.get(eb.outvars[0])
        if eb is not None and entry_b is None:
            raise _NotPortable
        env = {v: x for v, x in zip(ea.invars, ins, strict=True)}
        b_args = [None] * len(args) if entry_b is None else list(entry_b[1])
        node_args = [self.hand_arg(env, a, b) for a, b in zip(args, b_args, strict=True)]
        b_static = {} if entry_b is None else entry_b[2]
        kwargs = []
        for k, v in static.items():
            if _arrayish(v):
                kwargs.append((k, self.hand_arg(env, v, None), None))
            else:
                kwargs.append((k, v, b_static.get(k)))
        outs = [
            _Val(v.aval, b, tainted=_is_float_dtype(v.aval.dtype) and any(x.tainted for x in ins))
            for v, b in zip(ea.outvars, b_avals, strict=True)
        ]
        node = _Node(wrapped.__name__, wrapped, wrapped.f_vjp, node_args, kwargs, outs)
        node.label = self.label(node_args)
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

    def hand_arg(self, env, a, b):
        if a is None or isinstance(a, (bool, int, float, str)):
            return ("py", a, b)
        var = tracer_var(a)
        if var is not None:
            if var not in env:
                raise ValueError(
                    "show_grad: a hand rule's argument was computed where show_grad cannot "
                    "see it (inside another rule or transformation)"
                )
            return env[var]
        if _arrayish(a):  # a concrete array the loss closed over: a constant
            return _Val(jax.typeof(a), jax.typeof(a), const=True, compute=lambda a=a: a)
        raise ValueError(
            f"show_grad: cannot print a hand rule argument of type {type(a).__name__} (arrays "
            "and Python scalars only)"
        )

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


# --- imports of the rules ---------------------------------------------------------------------


def _home(fn: Callable) -> str | None:
    """The module to import ``fn`` from: ``nnlite.rules`` for the library's rules, else the
    module defining it, if it is importable there under its name."""
    from .. import rules

    name = fn.__name__
    public = getattr(rules, name, None)
    if public is fn or getattr(public, "f", None) is fn:
        return "nnlite.rules"
    mod = getattr(fn, "__module__", None)
    if mod and mod != "__main__" and fn.__qualname__ == name:
        module = sys.modules.get(mod)
        if module is not None and getattr(module, name, None) is fn:
            return mod
    return None


def _inline_source(fn: Callable) -> str:
    """The source of a rule that cannot be imported (defined in ``__main__`` or in a
    function), to define it in the printed code."""
    plain = inspect.unwrap(fn)
    if plain.__code__.co_freevars:
        raise ValueError(
            f"show_grad: the rule {fn.__name__} is defined inside a function and uses its local "
            f"variables ({', '.join(plain.__code__.co_freevars)}); define it at module level so "
            "that the printed code can import it"
        )
    try:
        return textwrap.dedent(inspect.getsource(plain))
    except (OSError, TypeError):
        raise ValueError(
            f"show_grad: the rule {fn.__name__} is defined where neither an import nor its "
            "source can reach it (exec'd code, the interactive prompt); define it in a module"
        ) from None


# --- show_grad --------------------------------------------------------------------------------


def show_grad(loss_fn: Callable, params: Any, *batch: Any, **kwargs: Any) -> str:
    """Python source of the backward pass of ``loss_fn(params, *batch)`` by hand VJPs.

    Executing the source defines ``grad(params, <batch names>)`` returning the gradient
    ParamsDict, equal to ``jax.grad(loss_fn)(params, *batch)`` (for a loss returning
    ``(loss, aux)``, of the loss), at this batch size or another. Every layer and loss
    inside must carry hand rules (nnlite's, or a user's ``@nl.hand_rule``); the plain ``jnp``
    between them prints as calls of the library's rules for their primitives, as
    ``nl.manual_grads`` runs them. Rules are imported from the modules that define them.

    Args:
        loss_fn: ``loss_fn(params, *batch, **kwargs) -> scalar`` (or ``(scalar, aux)``).
        params: the params (a ParamsDict); batch: the other arguments, concrete arrays
            with the batch as their leading axis.
        kwargs: passed to ``loss_fn`` as they are (e.g. ``key=``): constants of the code.

    Returns:
        Source text; ``exec`` it and call ``grad``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import nnlite as nl
        >>> net = nl.FFN(3, (4,), 2)
        >>> p = net.init(jax.random.key(0))
        >>> def loss(params, x, y):
        ...     return nl.softmax_cross_entropy(net(params, x), y, reduction="mean")
        >>> x, y = jnp.ones((5, 3)), jnp.zeros(5, jnp.int32)
        >>> src = nl.show_grad(loss, p, x, y)
        >>> print(src.splitlines()[9])
            linear_layers_0 = linear(x, params.layers[0].W, params.layers[0].b)
        >>> ns = {}
        >>> exec(src, ns)
        >>> g = ns["grad"](p, jnp.ones((7, 3)), jnp.zeros(7, jnp.int32))  # another batch
        >>> bool(jnp.allclose(g.layers[0].W, jax.grad(loss)(p, jnp.ones((7, 3)),
        ...     jnp.zeros(7, jnp.int32)).layers[0].W, atol=1e-6))
        True
    """
    try:
        arg_names = list(inspect.signature(loss_fn).parameters)[: 1 + len(batch)]
    except (TypeError, ValueError):
        arg_names = []
    if len(arg_names) < 1 + len(batch) or not all(n.isidentifier() for n in arg_names):
        arg_names = ["params", *(f"arg{i}" for i in range(len(batch)))]
    p_name, *b_names = arg_names

    p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    b_leaves = [
        (_path_expr(n, path), leaf)
        for n, b in zip(b_names, batch, strict=True)
        for path, leaf in jax.tree_util.tree_flatten_with_path(b)[0]
    ]
    leaves = [leaf for _, leaf in p_leaves] + [leaf for _, leaf in b_leaves]
    closed_a, tape_a = _trace(loss_fn, params, batch, kwargs, leaves)

    # The same loss at twice the batch, abstractly: which sizes follow the batch.
    batched = [(e, leaf) for e, leaf in b_leaves if np.ndim(leaf) >= 1]
    trace_b = None
    if batched:
        first_expr, first = batched[0]
        b0 = int(np.shape(first)[0])
        spec = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]
        for i in range(len(p_leaves), len(leaves)):
            shape = np.shape(leaves[i])
            if len(shape) >= 1 and shape[0] == b0:
                spec[i] = jax.ShapeDtypeStruct((2 * b0, *shape[1:]), jnp.result_type(leaves[i]))
        try:
            trace_b = _trace(loss_fn, params, batch, kwargs, spec)
        except Exception:  # noqa: BLE001 -- a loss tied to its batch size: sizes stay literal
            trace_b = None

    for b_enabled in (True, False):
        pr = _Printer(
            p_name,
            (b0, 2 * b0) if batched and trace_b is not None and b_enabled else None,
            f"{first_expr}.shape[0]" if batched else None,
        )
        pr.names.update(arg_names)
        try:
            src = _print(
                pr,
                loss_fn,
                closed_a,
                tape_a,
                trace_b if pr.batch_dim else None,
                p_leaves,
                b_leaves,
                arg_names,
            )
            break
        except _NotPortable:
            continue
    return src


def _print(pr, loss_fn, closed_a, tape_a, trace_b, p_leaves, b_leaves, arg_names) -> str:
    closed_b, tape_b = trace_b if trace_b is not None else (None, None)
    walk = _Walk(pr, tape_a, tape_b)
    ins = []
    jb = None if closed_b is None else closed_b.jaxpr
    for k, v in enumerate(closed_a.jaxpr.invars):
        b_aval = None if jb is None else jb.invars[k].aval
        if k < len(p_leaves):
            expr = _path_expr(pr.p_name, p_leaves[k][0])
            ins.append(_Val(v.aval, b_aval, expr=expr, tainted=_is_float_dtype(v.aval.dtype)))
        else:
            ins.append(_Val(v.aval, b_aval, expr=b_leaves[k - len(p_leaves)][0]))
    (loss,), _ = walk.body(
        closed_a.jaxpr,
        jb,
        ins,
        list(closed_a.consts),
        None if closed_b is None else list(closed_b.consts),
    )
    if not loss.tainted or loss.node is None or loss.node.f_vjp is None:
        raise ValueError(
            "show_grad: the loss must be computed from the params by hand rules (nnlite's "
            "layers and losses, @nl.hand_rule functions) and the plain jnp between them, so "
            "that its backward pass starts there"
        )

    # Only the calls the loss needs, in order.
    needed: set = set()
    stack = [loss.node]
    while stack:
        node = stack.pop()
        if id(node) in needed:
            continue
        needed.add(id(node))
        for a in node.args + [v for _, v, _ in node.kwargs]:
            if isinstance(a, _Val) and a.node is not None:
                stack.append(a.node)
    nodes = [n for n in walk.nodes if id(n) in needed]

    functions = {n.fn for n in nodes if n.fn is not None}
    functions |= {n.f_vjp for n in nodes if n.f_vjp is not None}
    pr.names.update(f.__name__ for f in functions)  # never shadow a rule

    consts: list[str] = []
    literals: dict[str, str] = {}  # source -> name

    def name_of(v: _Val) -> str:
        if v.expr is None:
            if v.const:
                value = v.value()
                if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                    data = np.asarray(jax.random.key_data(value))
                    impl = str(jax.random.key_impl(value))
                    v.expr = pr.fresh("key")
                    consts.append(
                        f"{v.expr} = jax.random.wrap_key_data(jnp.array({data.tolist()}, "
                        f"jnp.{data.dtype}), impl={impl!r})"
                    )
                else:
                    src = _literal(pr, value, None if v.b_aval is None else v.b_aval.shape)
                    if src not in literals:  # the same mask for every block: printed once
                        literals[src] = pr.fresh("mask" if value.dtype == np.bool_ else "const")
                        consts.append(f"{literals[src]} = {src}")
                    v.expr = literals[src]
            else:
                raise AssertionError("show_grad: a value without a name")  # pragma: no cover
        return v.expr

    def arg_src(a) -> str:
        if isinstance(a, tuple) and a[0] == "py":
            return pr.pyval(a[1], a[2]) if not isinstance(a[1], str) else repr(a[1])
        return name_of(a)

    fwd: list[str] = []
    for node in nodes:
        args = [arg_src(a) for a in node.args]
        kw = "".join(
            f", {k}={name_of(va) if isinstance(va, _Val) else pr.pyval(va, vb)}"
            for k, va, vb in node.kwargs
        )
        node.call_args, node.call_kw = args, kw  # type: ignore[attr-defined]
        if node.fn is None:
            rhs = _expression(pr, node.expr, args)
        else:
            rhs = f"{node.name}({', '.join(args)}{kw})"
        if node.label is None and node.f_vjp is not None:
            node.label = walk.label(node.args)
        if node.label:
            base = f"{node.name}_{node.label}"
        else:
            pr.counts[node.name] = pr.counts.get(node.name, 0) + 1
            base = f"{node.name}_out{pr.counts[node.name]}"
        if len(node.outs) == 1:
            node.outs[0].expr = pr.fresh(base)
            fwd.append(f"    {node.outs[0].expr} = {rhs}")
        else:
            for i, o in enumerate(node.outs):
                o.expr = pr.fresh(f"{base}_{i}")
            fwd.append(f"    {', '.join(o.expr for o in node.outs)} = {rhs}")

    # Backward: the hand VJPs in reverse, cotangents summed where a value fed several calls.
    bwd: list[str] = []
    have: set = set()
    bwd.append(f"    d_{loss.expr} = jnp.ones_like({loss.expr})")
    have.add(id(loss))
    for node in reversed(nodes):
        if node.f_vjp is None or not any(id(o) in have for o in node.outs):
            continue
        d_outs = [
            f"d_{o.expr}" if id(o) in have else f"jnp.zeros_like({o.expr})" for o in node.outs
        ]
        targets, adds = [], []
        for i, a in enumerate(node.args):
            if not (isinstance(a, _Val) and a.tainted):
                targets.append("_")
                continue
            d = f"d_{_ident(a.expr)}"
            if id(a) not in have:
                targets.append(d)
                have.add(id(a))
            else:
                tmp = f"d{i}_{node.outs[0].expr}"
                targets.append(tmp)
                adds.append(f"    {d} = {d} + {tmp}")
        call = f"{node.f_vjp.__name__}({', '.join(node.call_args + d_outs)}{node.call_kw})"  # type: ignore[attr-defined]
        bwd.append(f"    {', '.join(targets)} = {call}")
        bwd.extend(adds)

    grads = [
        f"d_{_ident(v.expr)}" if id(v) in have else f"jnp.zeros_like({v.expr})"
        for v in ins[: len(p_leaves)]
    ]

    # Imports: each rule from its home; rules without one are defined in the code.
    by_module: dict[str, list[str]] = {}
    inline: list[Callable] = []
    for f in sorted(functions, key=lambda f: f.__name__):
        home = _home(f)
        if home is None:
            inline.append(f)
        else:
            by_module.setdefault(home, []).append(f.__name__)
    header = ["import jax", "import jax.numpy as jnp", "import numpy as np"]
    body_text = "\n".join(consts + fwd + bwd)
    pr.note(body_text)
    if "lax" in pr.used:
        header.append("from jax import lax")
    if "prims" in pr.used:
        header.append("from jax.extend.core import primitives as prims")
    if inline:
        header.append("import nnlite as nl")
    header.append("")
    for mod in sorted(by_module, key=lambda m: (m != "nnlite.rules", m)):
        header.append(f"from {mod} import {', '.join(sorted(set(by_module[mod])))}")
    defs = []
    # a rule's VJP before the function whose decorator names it
    for f in sorted(inline, key=lambda f: f not in {n.f_vjp for n in nodes}):
        defs += ["", _inline_source(f).rstrip()]
    lines = header + defs + ["", "", f"def grad({', '.join(arg_names)}):"]
    if not pr.portable:
        lines.append("    # sizes below are those of the traced batch: trace again for another")
    elif pr.uses_b:
        lines.append(f"    B = {pr.batch_expr}  # the batch size: the code works for any")
    lines += [f"    {c}" for c in consts]
    lines += ["    # forward: each layer's call, its result kept"] + fwd
    lines += ["    # backward: the hand VJPs in reverse"] + bwd
    leaves_src = ",\n        ".join(grads)
    lines.append(
        f"    return jax.tree.unflatten(\n        jax.tree.structure({pr.p_name}),\n"
        f"        [\n        {leaves_src},\n        ],\n    )"
    )
    return "\n".join(lines) + "\n"


def _expression(pr: _Printer, eqn, args: list[str]) -> str:
    """An equation printed by show_jaxpr's table (``lax.ne(x, 0)``, ...)."""
    from ..jaxpr import _show_jaxpr  # noqa: F401 -- registers every rule into the printer
    from ..jaxpr._exprs import bind_expr, flat
    from ..jaxpr._printer import RULES

    rule = RULES.get(eqn.primitive.name)
    expr = rule(eqn, args, None) if rule is not None else None
    text = flat(expr if expr is not None else bind_expr(eqn, args))
    pr.note(text)
    return text
