"""``show_grad``: a loss's backward pass as runnable Python, at the level of layers.

The loss is traced once in manual-gradient mode with a tape (every hand-rule call --
``linear``, ``relu``, ``conv``, ``layer_norm``, a user's ``@nl.hand_rule`` -- records its
arguments and result) and with ``jax.disable_jit`` (a jitted helper is inlined, a
``lax.scan`` unrolled). An ``nl.Stack`` records one call: one copy of its layer is traced
and walked apart and printed once, as the body of a forward ``lax.scan`` that keeps what
the copy's VJPs read and of a reverse scan of those VJPs. The jaxpr is then printed as a function: the forward calls, each
result named after the layer path of the params it uses; the plain ``jnp`` between layers
as calls of the primitive's library rule (``add``, ``reduce_sum``, ``reshape``, ...); then
the hand rules in reverse order, summing cotangents where a value feeds several calls, and
finally the ParamsDict of gradients. Values that depend on neither params nor batch
(causal masks, position indices, dropout keys) print as literals.

The printed code runs anywhere: each rule is imported from the module that defines it
(``nnlite.rules`` for the library's, the user's own module for theirs), and it works at
any batch size: the loss is traced a second time with the batch doubled, and every size
that changed with it prints as an expression in ``B = <first batch array>.shape[0]``.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._contract import RuleContractError, cotangents, rule_layout
from ._rule_table import public_name, same_function
from ._show_grad_walk import (
    _ident,
    _is_float_dtype,
    _literal,
    _NotPortable,
    _path_expr,
    _Printer,
    _StackBody,
    _trace,
    _Val,
    _Walk,
)

__all__ = ["show_forward", "show_grad", "show_value_and_grad"]

# --- imports of the rules ---------------------------------------------------------------------

#: Where the printed code imports nnlite's rules from: the one home, generated from the table.
RULES_HOME = "nnlite.rules"


def _home(fn: Callable) -> str | None:
    """The module to import ``fn`` from: ``nnlite.rules`` for a rule of the table, nnlite's
    public namespaces for its other functions, else the module defining it if it is
    importable there under its name; None: define it in the printed code (``__main__``, a
    function's local)."""
    name = fn.__name__
    if public_name(fn) == name:
        return RULES_HOME
    mod = getattr(fn, "__module__", None) or ""
    if mod.split(".")[0] == "nnlite":
        # a tool of nnlite's (a checker, match_primal): nnlite is imported, show_grad is in it
        for modname in (RULES_HOME, "nnlite"):
            if same_function(getattr(sys.modules.get(modname), name, None), fn):
                return modname
        raise ValueError(
            f"show_grad: the rule function {name} ({mod}) has no public import path "
            f"({RULES_HOME}, nnlite), so printed code could not import it"
        )
    if mod and mod != "__main__" and getattr(fn, "__qualname__", name) == name:
        module = sys.modules.get(mod)
        if module is not None and same_function(getattr(module, name, None), fn):
            return mod
    return None


def _def_source(plain: Callable) -> str:
    """A function's source without its decorators (the printed code calls it plainly)."""
    src = textwrap.dedent(inspect.getsource(plain))
    tree = ast.parse(src)
    node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    lines = src.splitlines()
    return "\n".join(lines[node.lineno - 1 : node.end_lineno])


def _free_globals(src: str) -> list[str]:
    """Names a function's source reads that it does not bind (globals and builtins)."""
    tree = ast.parse(src)
    fn = tree.body[0]
    bound = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    bound |= {
        n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    bound |= {
        n.name
        for n in ast.walk(fn)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n is not fn
    }
    seen = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound:
            if n.id not in seen:
                seen.append(n.id)
    return seen


def _inline(fn: Callable, imports: list[str], defs: dict[str, str]) -> None:
    """Define ``fn`` in the printed code: its source (decorators left out, the printed code
    calls it plainly) and what it reads from its module, imported or defined too."""
    plain = inspect.unwrap(fn)
    name = fn.__name__
    if name in defs:
        return
    code = getattr(plain, "__code__", None)
    if code is None:
        raise ValueError(f"show_grad: cannot print the rule {name}: it is not a Python function")
    if code.co_freevars:
        raise ValueError(
            f"show_grad: the rule {name} is defined inside a function and uses its local "
            f"variables ({', '.join(code.co_freevars)}); define it at module level so "
            "that the printed code can import it"
        )
    try:
        src = _def_source(plain)
    except (OSError, TypeError, StopIteration, SyntaxError):
        raise ValueError(
            f"show_grad: the rule {name} is defined where neither an import nor its "
            "source can reach it (exec'd code, the interactive prompt); define it in a module"
        ) from None
    defs[name] = src
    g = plain.__globals__
    for ref in _free_globals(src):
        if ref not in g:
            if ref in vars(builtins):
                continue
            raise ValueError(f"show_grad: the rule {name} reads {ref}, which is not defined")
        val = g[ref]
        if isinstance(val, types.ModuleType):
            mod = val.__name__
            imports.append(f"import {mod}" if mod == ref else f"import {mod} as {ref}")
        elif callable(val) and hasattr(val, "__name__"):
            try:
                home = _home(val)
            except ValueError:
                home = None
            if home is None:
                modname = getattr(val, "__module__", None)
                m = sys.modules.get(modname or "")
                if (
                    m is not None
                    and modname != "__main__"
                    and getattr(m, val.__name__, None) is val
                ):
                    home = modname
            if home is not None:
                alias = "" if val.__name__ == ref else f" as {ref}"
                imports.append(f"from {home} import {val.__name__}{alias}")
            elif val.__name__ == ref:
                _inline(val, imports, defs)
            else:
                raise ValueError(
                    f"show_grad: the rule {name} reads {ref} ({val.__name__}), which printed "
                    "code can neither import nor define; define the rule in a module"
                )
        elif isinstance(val, (bool, int, float, complex, str, type(None))) or (
            isinstance(val, tuple) and all(isinstance(v, (bool, int, float, str)) for v in val)
        ):
            defs.setdefault(ref, f"{ref} = {val!r}")
        else:
            raise ValueError(
                f"show_grad: the rule {name} reads the global {ref} (a {type(val).__name__}), "
                "which printed code cannot rebuild; define the rule in a module"
            )


# --- show_grad --------------------------------------------------------------------------------


def show_grad(loss_fn: Callable, params: Any, *batch: Any, **kwargs: Any) -> str:
    """Python source of the backward pass of ``loss_fn(params, *batch)`` by rules.

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
        >>> p = jax.jit(net.init)(jax.random.key(0))
        >>> def loss(params, x, y):
        ...     return nl.softmax_cross_entropy(net(params, x), y, reduction="mean")
        >>> x, y = jnp.ones((5, 3)), jnp.zeros(5, jnp.int32)
        >>> src = nl.show_grad(loss, p, x, y)
        >>> print(src.splitlines()[9])
            linear_layers_0 = linear(x, params.layers[0].W, params.layers[0].b)
        >>> ns = {}
        >>> exec(src, ns)
        >>> x7, y7 = jnp.ones((7, 3)), jnp.zeros(7, jnp.int32)  # another batch size
        >>> g = jax.jit(ns["grad"])(p, x7, y7)
        >>> g_ad = jax.jit(jax.grad(loss))(p, x7, y7)  # autodiff's gradient
        >>> bool(jnp.allclose(g.layers[0].W, g_ad.layers[0].W, atol=1e-6))
        True
    """
    return _show(loss_fn, params, batch, kwargs, "grad")


def show_value_and_grad(loss_fn: Callable, params: Any, *batch: Any, **kwargs: Any) -> str:
    """:func:`show_grad`, with the loss returned too: the source defines
    ``value_and_grad(params, <batch names>) -> (loss, grads)``, as ``jax.value_and_grad``
    of the loss (what a train step needs; ``nnlite-train --eject`` writes it)."""
    return _show(loss_fn, params, batch, kwargs, "value_and_grad")


def show_forward(loss_fn: Callable, params: Any, *batch: Any, **kwargs: Any) -> str:
    """The forward half of :func:`show_grad`: the source defines ``loss(params, <batch
    names>) -> loss``, each layer's (and the plain ``jnp``'s) forward function called by
    name, for ``jax.grad`` to differentiate by autodiff (the functions are plain array code
    outside ``nl.manual_grads``)."""
    return _show(loss_fn, params, batch, kwargs, "loss")


def _show(loss_fn: Callable, params: Any, batch: tuple, kwargs: dict, form: str) -> str:
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
                form,
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


def _print(pr, form, loss_fn, closed_a, tape_a, trace_b, p_leaves, b_leaves, arg_names) -> str:
    walk, ins, loss = _walk_loss(pr, closed_a, tape_a, trace_b, p_leaves, b_leaves)
    nodes = _needed(walk, loss)
    imports, inline = _name_rules(pr, nodes)
    out = _Lines(pr)
    fwd = out.forward(nodes, walk)
    have: set = {id(loss)}
    if form == "loss":  # the forward alone, for jax.grad to differentiate
        bwd = []
    else:
        bwd = [f"    d_{loss.expr} = jnp.ones_like({loss.expr})"] + out.backward(nodes, have)
    grads = [
        f"d_{_ident(v.expr)}" if id(v) in have else f"jnp.zeros_like({v.expr})"
        for v in ins[: len(p_leaves)]
    ]

    header = ["import jax", "import jax.numpy as jnp", "import numpy as np"]
    body_text = "\n".join(out.consts + fwd + bwd)
    pr.note(body_text)
    if "lax" in pr.used:
        header.append("from jax import lax")
    if "prims" in pr.used:
        header.append("from jax.extend.core import primitives as prims")
    if form == "loss":  # the forward calls only: the rules they do not call are not imported
        for mod in list(imports):
            imports[mod] = [
                n
                for n in imports[mod]
                if re.search(rf"\b{re.escape(n.split(' as ')[-1])}\(", body_text)
            ]
            if not imports[mod]:
                del imports[mod]
        inline = [f for f in inline if re.search(rf"\b{re.escape(f.__name__)}\(", body_text)]
    extra: list[str] = []
    inline_defs: dict[str, str] = {}
    for f in inline:
        _inline(f, extra, inline_defs)
    header += [i for i in dict.fromkeys(extra) if i not in header]
    header.append("")
    for mod in sorted(imports, key=lambda m: (m != "nnlite.rules", m)):
        header.append(f"from {mod} import {', '.join(sorted(set(imports[mod])))}")
    defs = []
    for src in inline_defs.values():
        defs += ["", src.rstrip()]
    if pr.batch_dim is not None and not pr.portable:
        raise _NotPortable  # some size does not follow the batch: print the traced sizes
    lines = header + defs + ["", "", f"def {form}({', '.join(arg_names)}):"]  # the name
    if not pr.portable:
        lines.append("    # sizes below are those of the traced batch: trace again for another")
    elif pr.uses_b:
        lines.append(f"    B = {pr.batch_expr}  # the batch size: the code works for any")
    lines += [f"    {c}" for c in out.consts]
    lines += ["    # forward: each layer's call, its result kept"] + fwd
    if form == "loss":
        lines.append(f"    return {loss.expr}")
        return "\n".join(lines) + "\n"
    lines += ["    # backward: the rules in reverse"] + bwd
    leaves_src = ",\n        ".join(grads)
    value = f"{loss.expr}, " if form == "value_and_grad" else ""
    lines.append(
        f"    return {value}jax.tree.unflatten(\n        jax.tree.structure({pr.p_name}),\n"
        f"        [\n        {leaves_src},\n        ],\n    )"
    )
    return "\n".join(lines) + "\n"


def _walk_loss(pr: _Printer, closed_a, tape_a, trace_b, p_leaves, b_leaves):
    """``(walk, inputs, loss)``: the traced loss walked, its inputs (params then batch) and
    its result, which must come out of a rule."""
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
    return walk, ins, loss


def _name_rules(pr: _Printer, nodes: list) -> tuple[dict[str, list[str]], list[Callable]]:
    """``(imports, inline)``: each rule function once, under the name the printed code gives
    it (``pr.fn_names``): imported from its public home (aliased where two homes share a
    name), or defined in the code."""
    functions: dict[int, Callable] = {}
    for n in _all_nodes(nodes):
        for f in (n.fn, n.f_vjp):
            if f is not None:
                functions.setdefault(id(f), f)
    imports: dict[str, list[str]] = {}
    inline: list[Callable] = []
    taken: dict[str, Any] = {}
    for f in sorted(functions.values(), key=lambda f: f.__name__):
        home = _home(f)
        key = (home, f.__name__) if home is not None else ("", id(inspect.unwrap(f)))
        name = f.__name__
        k = 1
        while name in taken and taken[name] != key:
            if home is None:
                raise ValueError(
                    f"show_grad: two different rule functions are named {f.__name__}; "
                    "rename one, or define them in modules"
                )
            k += 1
            name = f"{f.__name__}_{k}"
        if name not in taken:
            taken[name] = key
            if home is None:
                inline.append(f)
            else:
                alias = "" if name == f.__name__ else f" as {name}"
                imports.setdefault(home, []).append(f"{f.__name__}{alias}")
        pr.fn_names[id(f)] = name
    pr.names.update(taken)  # never shadow a rule

    return imports, inline


class _Lines:
    """The printed function's lines: each node's forward call and, in reverse, its rule's
    call, the constants they read (``consts``), a ``Stack``'s scans."""

    def __init__(self, pr: _Printer):
        self.pr = pr
        self.consts: list[str] = []
        self.literals: dict[str, str] = {}  # source -> name

    def name_of(self, v: _Val) -> str:
        """The printed name of a value (a constant is defined on first use)."""
        if v.expr is None:
            if v.const:
                value = v.value()
                if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                    data = np.asarray(jax.random.key_data(value))
                    impl = str(jax.random.key_impl(value))
                    v.expr = self.pr.fresh("key")
                    self.consts.append(
                        f"{v.expr} = jax.random.wrap_key_data(jnp.array({data.tolist()}, "
                        f"jnp.{data.dtype}), impl={impl!r})"
                    )
                else:
                    src = _literal(self.pr, value, None if v.b_aval is None else v.b_aval.shape)
                    if src not in self.literals:  # the same mask for every block: printed once
                        self.literals[src] = self.pr.fresh(
                            "mask" if value.dtype == np.bool_ else "const"
                        )
                        self.consts.append(f"{self.literals[src]} = {src}")
                    v.expr = self.literals[src]
            else:
                raise AssertionError("show_grad: a value without a name")  # pragma: no cover
        return v.expr

    def arg_src(self, a) -> str:
        if isinstance(a, tuple) and a[0] == "py":
            return self.pr.pyval(a[1], a[2]) if not isinstance(a[1], str) else repr(a[1])
        return self.name_of(a)

    def forward(self, nodes: list, walk: _Walk) -> list[str]:
        """Each node's call, its result named."""
        fwd: list[str] = []
        for node in nodes:
            args = [self.arg_src(a) for a in node.args]
            kw = "".join(
                f", {k}={self.name_of(va) if isinstance(va, _Val) else self.pr.pyval(va, vb)}"
                for k, va, vb in node.kwargs
            )
            node.call_args, node.call_kw = args, kw  # type: ignore[attr-defined]
            if node.stack is not None:
                fwd += self.stack_forward(node, args)
                continue
            if node.fn is None:
                rhs = _expression(self.pr, node.expr, args)
            else:
                rhs = f"{self.pr.fn_names[id(node.fn)]}({', '.join(args)}{kw})"
            if node.label is None and node.f_vjp is not None:
                node.label = walk.label(node.args)
            if node.label:
                base = f"{node.name}_{node.label}"
            else:
                self.pr.counts[node.name] = self.pr.counts.get(node.name, 0) + 1
                base = f"{node.name}_out{self.pr.counts[node.name]}"
            if len(node.outs) == 1:
                node.outs[0].expr = self.pr.fresh(base)
                fwd.append(f"    {node.outs[0].expr} = {rhs}")
            else:
                for i, o in enumerate(node.outs):
                    o.expr = self.pr.fresh(f"{base}_{i}")
                fwd.append(f"    {', '.join(o.expr for o in node.outs)} = {rhs}")
        return fwd

    def backward(self, nodes: list, have: set) -> list[str]:
        """The rules in reverse, cotangents summed where a value fed several calls."""
        bwd: list[str] = []
        for node in reversed(nodes):
            has_bwd = node.f_vjp is not None or node.stack is not None
            if not has_bwd or not any(id(o) in have for o in node.outs):
                continue
            d_outs = [
                f"d_{o.expr}" if id(o) in have else f"jnp.zeros_like({o.expr})" for o in node.outs
            ]
            if node.stack is not None:
                returned = list(enumerate(node.args))
                bare = False
            else:
                bare, returned = _layout(node)
            targets, adds = [], []
            for i, a in returned:
                if i is None or not (isinstance(a, _Val) and a.tainted):
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
            if node.stack is not None:
                bwd += self.stack_backward(node, d_outs[0], targets)
            elif any(t != "_" for t in targets):
                vjp_name = self.pr.fn_names[id(node.f_vjp)]
                call = f"{vjp_name}({', '.join(node.call_args + d_outs)}{node.call_kw})"  # type: ignore[attr-defined]
                if bare:
                    lhs = targets[0]
                elif len(targets) == 1:
                    lhs = f"({targets[0]},)"
                else:
                    lhs = ", ".join(targets)
                bwd.append(f"    {lhs} = {call}")
            bwd.extend(adds)
        return bwd

    def stack_forward(self, node, args: list[str]) -> list[str]:
        """A Stack: the body (one copy's calls) printed once, in a forward scan that keeps
        what the copy's backward needs (its reverse scan is written now, printed later)."""
        body: _StackBody = node.stack
        saved, self.pr.p_name = self.pr.p_name, body.p_name
        try:
            sub_nodes = _needed(body.walk, body.y)
            sub_fwd = self.forward(sub_nodes, body.walk)
            have: set = {id(body.y)}
            d_y = f"d_{body.y.expr}"
            sub_bwd = self.backward(sub_nodes, have)
        finally:
            self.pr.p_name = saved
        # the body's values the backward pass reads: kept, one per copy
        keyed = body.key is not None
        defined = [body.h.expr] + ([body.key.expr] if keyed else [])
        defined += [o.expr for n in sub_nodes for o in n.outs]
        text = "\n".join(sub_bwd)
        kept = [e for e in dict.fromkeys(defined) if re.search(rf"\b{re.escape(e)}\b", text)]
        n_p = len(body.paths)
        p_src, carry_src = _stacked_params(self.pr, body, args[:n_p]), args[n_p]
        base = _ident(p_src[len(self.pr.p_name) :]) if p_src.startswith(self.pr.p_name) else ""
        base = base if base and base != "v" else "stack"
        f_fwd, f_bwd = self.pr.fresh(f"{base}_forward"), self.pr.fresh(f"{base}_backward")
        kept_name = self.pr.fresh(f"{base}_kept")
        (out,) = node.outs
        out.expr = self.pr.fresh(f"{base}_out")
        kept_tuple = f"({', '.join(kept)}{',' if len(kept) == 1 else ''})"
        d_p = [
            f"d_{_ident(v.expr)}" if id(v) in have else f"jnp.zeros_like({v.expr})"
            for v in body.p_vals
        ]
        d_h = f"d_{_ident(body.h.expr)}" if id(body.h) in have else f"jnp.zeros_like({body.h.expr})"
        # the reverse scan's body, written now that its names are known
        node.stack_backward_def = (  # type: ignore[attr-defined]
            [
                f"    def {f_bwd}({d_y}, xs):",
                f"        {body.p_name}, {kept_tuple} = xs",
            ]
            + [f"    {line}" for line in sub_bwd]
            + [
                f"        return {d_h}, jax.tree.unflatten(",
                f"            jax.tree.structure({body.p_name}),",
                "            [",
                *(f"            {d}," for d in d_p),
                "            ],",
                "        )",
            ]
        )
        node.stack_names = (f_bwd, kept_name, p_src)  # type: ignore[attr-defined]
        if keyed:  # the scan runs over the params and the copies' keys
            head = [
                f"    def {f_fwd}({body.h.expr}, xs):",
                f"        {body.p_name}, {body.key.expr} = xs",
            ]
            xs_src = f"({p_src}, {args[n_p + 1]})"
        else:
            head, xs_src = [f"    def {f_fwd}({body.h.expr}, {body.p_name}):"], p_src
        return (
            head
            + [f"    {line}" for line in sub_fwd]
            + [f"        return {body.y.expr}, {kept_tuple}"]
            + [f"    {out.expr}, {kept_name} = lax.scan({f_fwd}, {carry_src}, {xs_src})"]
        )

    def stack_backward(self, node, d_out: str, targets: list[str]) -> list[str]:
        """A Stack's reverse scan of the copy's rules."""
        body: _StackBody = node.stack
        f_bwd, kept_name, p_src = node.stack_names  # type: ignore[attr-defined]
        d_stacked = self.pr.fresh(f"d_{f_bwd.removesuffix('_backward')}_params")
        lines = list(node.stack_backward_def)  # type: ignore[attr-defined]
        n_p = len(body.paths)
        lines.append(
            f"    {targets[n_p]}, {d_stacked} = lax.scan("
            f"{f_bwd}, {d_out}, ({p_src}, {kept_name}), reverse=True)"
        )
        for t, path in zip(targets[:n_p], body.paths, strict=True):
            if t != "_":
                lines.append(f"    {t} = {_path_expr(d_stacked, path)}")
        return lines


_LAYOUTS: dict = {}  # (rule, argument types) -> its result's layout


def _layout(node) -> tuple[bool, list]:
    """How the printed call of ``node``'s rule unpacks: ``(bare, [(argument index, or None
    where the rule returns None, argument), ...])``, one entry per returned value.

    A primitive's library rule returns one cotangent per operand. A hand rule's form
    (``dx``, ``(dx,)``, one per argument, one per argument with a cotangent, ``None``
    entries) is read from the rule itself, called on the traced shapes -- the contract's
    reading (``_contract.rule_layout``), as ``manual_grads`` and ``check_rule`` read it.
    """
    if node.primitive:
        n = len(node.args)
        return n == 1, list(enumerate(node.args))
    specs = [
        jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype) if isinstance(a, _Val) else a[1]
        for a in node.args
    ]
    kw = {
        k: jax.ShapeDtypeStruct(va.aval.shape, va.aval.dtype) if isinstance(va, _Val) else va
        for k, va, _ in node.kwargs
    }
    drets = [jax.ShapeDtypeStruct(o.aval.shape, o.aval.dtype) for o in node.outs]
    dyn = [i for i, a in enumerate(specs) if isinstance(a, jax.ShapeDtypeStruct)]
    kw_dyn = [k for k, v in kw.items() if isinstance(v, jax.ShapeDtypeStruct)]
    vjp_name = getattr(node.f_vjp, "__name__", "rule")
    who = f"{vjp_name} (the rule of {node.name})"
    try:
        key = (id(node.f_vjp), repr(specs), repr(sorted(kw.items())), repr(drets))
    except Exception:  # noqa: BLE001 -- an odd hyperparameter: no caching
        key = None
    if key is None or key not in _LAYOUTS:

        def call(xs, kxs, ds):
            args = list(specs)
            for i, x in zip(dyn, xs, strict=True):
                args[i] = x
            kwargs = dict(kw, **dict(zip(kw_dyn, kxs, strict=True)))
            return node.f_vjp(*args, *ds, **kwargs)

        try:
            result = jax.eval_shape(call, [specs[i] for i in dyn], [kw[k] for k in kw_dyn], drets)
        except RuleContractError:
            raise
        except Exception as e:  # noqa: BLE001 -- one clear line instead of wrong code
            raise ValueError(
                f"show_grad: cannot print {who}: calling it at the traced shapes failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        cotangents(result, specs, who)  # the contract, checked as every tool checks it
        bare, positions = rule_layout(result, specs, who)
        got = (result,) if bare else tuple(result)
        layout = (bare, [p if g is not None else None for p, g in zip(positions, got, strict=True)])
        if key is None:
            return bare, [(p, None if p is None else node.args[p]) for p in layout[1]]
        _LAYOUTS[key] = layout
    bare, positions = _LAYOUTS[key]
    return bare, [(p, None if p is None else node.args[p]) for p in positions]


def _needed(walk: _Walk, out: _Val) -> list:
    """The calls ``out`` needs, in order."""
    needed: set = set()
    todo = [out.node] if out.node is not None else []
    while todo:
        node = todo.pop()
        if id(node) in needed:
            continue
        needed.add(id(node))
        for a in node.args + [v for _, v, _ in node.kwargs]:
            if isinstance(a, _Val) and a.node is not None:
                todo.append(a.node)
    return [n for n in walk.nodes if id(n) in needed]


def _all_nodes(nodes: list) -> list:
    """``nodes`` and, for each Stack among them, the calls of its body."""
    out = []
    for n in nodes:
        out.append(n)
        if n.stack is not None:
            out += _all_nodes(_needed(n.stack.walk, n.stack.y))
    return out


def _stacked_params(pr: _Printer, body: _StackBody, args: list[str]) -> str:
    """The stacked params as the scan's ``xs``: their common ParamsDict when the leaves
    are one subtree's (``params.stack``), else the leaves rebuilt into the tree."""
    prefixes = set()
    for a, path in zip(args, body.paths, strict=True):
        suffix = _path_expr("", path)
        prefixes.add(a[: len(a) - len(suffix)] if suffix and a.endswith(suffix) else None)
    if len(prefixes) == 1 and None not in prefixes and "" not in prefixes:
        return prefixes.pop()
    raise ValueError("show_grad: a Stack's params must be one subtree of the params")


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
