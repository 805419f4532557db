"""show_jaxpr: decompile a traced function into runnable Python, and the round trip.

``show_jaxpr(f, *args)`` traces ``f`` with ``jax.make_jaxpr`` and prints one Python
statement per equation, using ``jax.lax`` / ``jax.numpy`` calls (the primitive table is
``_jaxpr_rules.py``). Nested jaxprs become nested functions called through the construct
that made them: ``jax.jit``, ``jax.custom_jvp`` (with its JVP rule), ``jax.custom_vjp``
(with its forward and backward rules), ``lax.cond`` / ``lax.switch``, ``lax.while_loop``,
``lax.scan``, ``jax.shard_map`` (so also ``jax.pmap``, which traces to jit of shard_map;
collectives are in ``_jaxpr_parallel.py``). The printed source is self-contained: executing it defines a function that
computes the same thing, and printing that function again gives the same text.
"""

from __future__ import annotations

import builtins
import itertools
import keyword
import linecache
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from . import _jax_private
from ._jaxpr_nested import HIGHER_ORDER, fold_index_eqns, single_ret
from ._jaxpr_parallel import COLLECTIVE_RULES
from ._jaxpr_rules import (
    RULES,
    Call,
    UnsupportedPrimitiveError,
    array_expr,
    bind_expr,
    flat,
    pystr,
    render,
    scalar_expr,
    target,
)

__all__ = ["UnsupportedPrimitiveError", "roundtrip", "show_jaxpr"]

_IMPORTS = {
    "jax": "import jax",
    "jnp": "import jax.numpy as jnp",
    "np": "import numpy as np",
    "lax": "from jax import lax",
    "prims": "from jax.extend.core import primitives as prims",
    "P": "from jax.sharding import PartitionSpec as P",
}
_RESERVED = set(keyword.kwlist) | set(dir(builtins)) | set(_IMPORTS) | {"carry", "xs", "res", "ct"}
_CONSTS_DICT = "LARGE_CONSTS"
_RULES = {**RULES, **COLLECTIVE_RULES}


def show_jaxpr(
    f: Callable,
    *args: Any,
    name: str | None = None,
    simplify: bool = False,
    inline_jit: bool = False,
    max_const_size: int = 1000,
    **make_jaxpr_kwargs: Any,
) -> str:
    """Decompile ``f`` traced at ``args`` into Python source that runs.

    Executing the returned source defines ``name(...)`` taking one argument per
    flattened input of ``f`` (each annotated with its type, e.g. ``# f32[11,7]``) and
    returning the flattened outputs. ``roundtrip`` executes it for you.

    Args:
        f: the function to trace; ``args`` are its example arguments (arrays, pytrees,
            or ``jax.ShapeDtypeStruct``).
        name: name of the printed function (default: ``f.__name__``).
        simplify: inline ``jit`` calls of at most one equation and drop identity
            equations (same-type conversions, no-op reshapes/broadcasts/transposes).
        inline_jit: inline every ``jit`` call into its caller.
        max_const_size: captured constants with more elements than this are not printed;
            the source reads them from a module-level ``LARGE_CONSTS`` dict that
            ``roundtrip`` supplies.
        **make_jaxpr_kwargs: passed to ``jax.make_jaxpr`` (e.g. ``static_argnums``).

    Returns:
        The source text, formatted as ``ruff format`` would leave it.

    Raises:
        UnsupportedPrimitiveError: a primitive (named, with its parameters) has no Python
            spelling.

    Example:
        >>> import jax.numpy as jnp
        >>> print(show_jaxpr(lambda x, y: jnp.sin(x) * y, jnp.ones(3), 2.0, name="f"))
        import jax.numpy as jnp
        from jax import lax
        <BLANKLINE>
        <BLANKLINE>
        def f(
            a,  # f32[3]
            b,  # f32[] (weak)
        ):
            c = lax.sin(a)
            d = lax.convert_element_type(b, new_dtype=jnp.float32)
            e = lax.mul(c, d)
            return e
        <BLANKLINE>
    """
    return _decompile(f, args, name, simplify, inline_jit, max_const_size, make_jaxpr_kwargs)[0]


def roundtrip(f: Callable, *args: Any, **kwargs: Any) -> Callable:
    """Decompile ``f`` with ``show_jaxpr`` and execute the source; return the new function.

    The returned function takes the flattened inputs of ``f`` (``jax.tree.leaves(args)``)
    and returns its flattened outputs (a single array when there is one).
    Keyword arguments are those of ``show_jaxpr``.

    Example:
        >>> import jax.numpy as jnp
        >>> g = roundtrip(lambda x: jnp.cumsum(x) ** 2, jnp.arange(3.0))
        >>> g(jnp.arange(3.0))
        Array([0., 1., 9.], dtype=float32)
    """
    opts = {
        k: kwargs.pop(k)
        for k in ("name", "simplify", "inline_jit", "max_const_size")
        if k in kwargs
    }
    src, origins, large, fname = _decompile(
        f,
        args,
        opts.get("name"),
        opts.get("simplify", False),
        opts.get("inline_jit", False),
        opts.get("max_const_size", 1000),
        kwargs,
    )
    filename = f"<nnlite.show_jaxpr:{fname}:{next(_COUNTER)}>"
    # Register the text so tracebacks show it, and where each nested construct came from so
    # that decompiling the rebuilt function names the original source lines (a fixed point).
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    _ORIGINS[filename] = origins
    namespace: dict[str, Any] = {"__name__": "nnlite_show_jaxpr_generated", _CONSTS_DICT: large}
    exec(compile(src, filename, "exec"), namespace)
    return namespace[fname]


_COUNTER = itertools.count()
_ORIGINS: dict[str, list[tuple[int, int, str]]] = {}


def _decompile(f, args, name, simplify, inline_jit, max_const_size, make_jaxpr_kwargs):
    closed = jax.make_jaxpr(f, **make_jaxpr_kwargs)(*args)
    fname = name or getattr(f, "__name__", "fn")
    fname = _sanitize(fname)
    p = _Printer(simplify=simplify, inline_jit=inline_jit, max_const_size=max_const_size)
    return (*p.module(closed, fname), fname)


def _sanitize(name: str) -> str:
    s = re.sub(r"\W", "_", name) or "fn"
    if s[0].isdigit():
        s = "f_" + s
    return s + "_" if keyword.iskeyword(s) or s in _IMPORTS else s


def _names() -> Any:
    for n in itertools.count(1):
        for t in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=n):
            yield "".join(t)


class _Scope:
    """Which nested-function definitions a function body can reuse (by jaxpr identity)."""

    def __init__(self, parent: _Scope | None = None):
        self.parent = parent
        self.defs: dict[str, Any] = {}  # function name -> key of the jaxpr it computes

    def lookup(self, name: str, key: Any) -> bool:
        s: _Scope | None = self
        while s is not None:
            if name in s.defs:
                return s.defs[name] == key
            s = s.parent
        return False


class _Printer:
    def __init__(self, *, simplify: bool, inline_jit: bool, max_const_size: int):
        self.simplify = simplify
        self.inline_jit = inline_jit
        self.max_const_size = max_const_size
        self.taken = set(_RESERVED)
        self.names = (n for n in _names() if n not in self.taken)
        self.used: set[str] = set()  # import aliases used
        self.const_lines: list[str] = []
        self.const_names: dict[int, str] = {}
        self.const_keep: list[Any] = []  # keeps ids stable while printing
        self.large: dict[str, Any] = {}
        self.lines: list[tuple[str, str | None]] = []  # (text, origin of the statement)
        self.keep: list[Any] = []
        self.mesh = None  # the ambient abstract mesh: set while printing a shard_map body

    # -- naming ---------------------------------------------------------------------------------
    def fresh(self) -> str:
        n = next(self.names)
        self.taken.add(n)
        return n

    def reserve_function_names(self, jaxpr: Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            fn = self.function_name(eqn)
            if fn:
                self.taken.add(fn)
            for sub in _subjaxprs(eqn):
                self.reserve_function_names(sub)

    def function_name(self, eqn) -> str | None:
        pname = eqn.primitive.name
        if pname in ("jit", "pjit", "closed_call"):
            return _sanitize(eqn.params.get("name", "fn"))
        if pname == "shard_map":
            dbg = eqn.params["jaxpr"].debug_info
            return _sanitize(getattr(dbg, "func_name", None) or "shard_fn")
        if pname in ("custom_jvp_call", "custom_vjp_call"):
            dbg = eqn.params["call_jaxpr"].jaxpr.debug_info
            return _sanitize(getattr(dbg, "func_name", None) or "custom_fn")
        return None

    # -- atoms ------------------------------------------------------------------------------------
    def atom(self, x, env) -> str:
        if isinstance(x, Literal):
            a = x.aval
            s = scalar_expr(x.val, a.dtype, getattr(a, "weak_type", False))
            self.used.add(s.split(".")[0] if s[:3] in ("np.", "jnp") else "")
            return s
        return env[x]

    def const(self, value) -> str:
        key = id(value)
        if key in self.const_names:
            return self.const_names[key]
        self.const_keep.append(value)
        cname = f"C{len(self.const_names)}"
        self.taken.add(cname)
        self.const_names[key] = cname
        aval = jax.typeof(value) if not isinstance(value, np.ndarray) else None
        dt = getattr(value, "dtype", None)
        is_key = dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
        if is_key:
            data = np.asarray(jax.random.key_data(value))
            impl = str(jax.random.key_impl(value))
            shape = f"key<{impl}>{list(value.shape)}".replace(" ", "")
        else:
            data = np.asarray(value)
            shape = _type_str(aval) if aval is not None else str(data.dtype) + str(list(data.shape))
        if data.size > self.max_const_size:
            self.large[cname] = value
            expr = f"{_CONSTS_DICT}[{cname!r}]"
            note = f"{shape}, too large to print: supplied by roundtrip()"
        else:
            expr = array_expr(data)
            self.used.add("np")
            if is_key:
                expr = f"jax.random.wrap_key_data({expr}, impl={pystr(impl)})"
                self.used.add("jax")
            note = shape
        self.const_lines += [f"# {note}", f"{cname} = {expr}  # fmt: skip"]
        self._note(expr)
        return cname

    # -- module -----------------------------------------------------------------------------------
    def module(self, closed: ClosedJaxpr, fname: str):
        self.taken.add(fname)
        self.reserve_function_names(closed.jaxpr)
        env: dict[Var, str] = {}
        for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
            env[v] = self.const(c)
        argnames = [self.fresh() for _ in closed.jaxpr.invars]
        env.update(zip(closed.jaxpr.invars, argnames, strict=True))
        if argnames:
            self.emit(f"def {fname}(", 0)
            for a, v in zip(argnames, closed.jaxpr.invars, strict=True):
                self.emit(f"{a},  # {_type_str(v.aval)}", 4)
            self.emit("):", 0)
        else:
            self.emit(f"def {fname}():", 0)
        self.body(closed.jaxpr, env, _Scope(), 4)
        self.ret(closed.jaxpr, env, 4, single_ret)
        head = [_IMPORTS[k] for k in _IMPORTS if k in self.used]
        text = []
        if head:
            text += head + ["", ""]
        if self.const_lines:
            text += self.const_lines + ["", ""]
        if self.large:
            text = [f"# Needs {_CONSTS_DICT}, a dict of the constants too large to print."] + text
        offset = len(text)
        text += [t for t, _ in self.lines]
        origins = [(offset + i + 1, o) for i, (_, o) in enumerate(self.lines) if o]
        src = "\n".join(text) + "\n"
        return src, _ranges(origins), self.large

    def emit(self, text: str, indent: int, origin: str | None = None) -> None:
        self.lines.append((" " * indent + text if text else "", origin))
        self._note(text)

    def emit_expr(self, expr, indent: int, prefix: str = "", origin: str | None = None) -> None:
        for line in render(expr, indent, prefix):
            self.lines.append((line, origin))
        self._note(expr)

    def _note(self, expr) -> None:
        s = flat(expr)
        for mod in ("jnp", "np", "lax", "prims", "jax"):
            if re.search(rf"(?<![\w.]){mod}\.", s):
                self.used.add(mod)
        if re.search(r"(?<![\w.])P\(", s):
            self.used.add("P")

    def ret(self, jaxpr: Jaxpr, env, indent: int, fmt: Callable, args=()) -> None:
        outs = [self.atom(v, env) for v in jaxpr.outvars]
        self.emit_expr(fmt(outs, list(args)), indent, "return ")

    # -- bodies -----------------------------------------------------------------------------------
    def body(self, jaxpr: Jaxpr, env: dict, scope: _Scope, indent: int) -> None:
        skip = fold_index_eqns(jaxpr, env)
        for eqn in jaxpr.eqns:
            if id(eqn) not in skip:
                self.eqn(eqn, env, scope, indent)

    def bind_outs(self, eqn, env) -> list[str]:
        outs = []
        for v in eqn.outvars:
            if isinstance(v, Var) and type(v).__name__ != "DropVar":
                env[v] = self.fresh()
                outs.append(env[v])
            else:
                outs.append("_")
        return outs

    def assign(self, eqn, env, expr, indent: int, origin=None, structured=False) -> None:
        """``outs = expr``; ``structured``: expr returns one array or a tuple of them."""
        outs = self.bind_outs(eqn, env)
        if not eqn.primitive.multiple_results or (structured and len(outs) == 1):
            target = outs[0]
        elif len(outs) == 1:
            target = f"({outs[0]},)"
        elif not outs:
            self.emit_expr(expr, indent, origin=origin)
            return
        else:
            target = ", ".join(outs)
        self.emit_expr(expr, indent, f"{target} = ", origin=origin)

    def eqn(self, eqn, env: dict, scope: _Scope, indent: int) -> None:
        name = eqn.primitive.name
        # a folded cond index (see _fold_index_eqns) has no name of its own
        args = [
            None if isinstance(x, Var) and ("index", x) in env else self.atom(x, env)
            for x in eqn.invars
        ]
        if self.simplify and _is_identity(eqn):
            env[eqn.outvars[0]] = args[0]
            return
        handler = HIGHER_ORDER.get(name)
        if handler is not None:
            handler(self, eqn, args, env, scope, indent)
            return
        rule = _RULES.get(name)
        expr = rule(eqn, args, self.mesh) if rule is not None else None
        if expr is None:
            expr = bind_expr(eqn, args)
        self.assign(eqn, env, expr, indent)

    def define(
        self,
        fname: str,
        closed: ClosedJaxpr,
        sig: list,
        outer_env: dict,
        const_atoms: list[str],
        ret: Callable[[list[str]], Any],
        scope: _Scope,
        indent: int,
        doc: str | None,
        decorators: tuple[str, ...] = (),
    ) -> None:
        """Emit ``def fname(...)`` computing ``closed``.

        ``sig`` lists the parameters: ``None`` for one jaxpr input, or ``(name, n)`` for a
        tuple of the next ``n`` inputs unpacked in the body. The jaxpr's leading inputs
        (``len(const_atoms)`` of them) are the caller's values, read through the closure.
        """
        jaxpr = closed.jaxpr
        env = dict(outer_env)
        for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
            env[v] = self.const(c)
        invars = list(jaxpr.invars)
        for v, a in zip(invars, const_atoms, strict=False):
            env[v] = a
        invars = invars[len(const_atoms) :]
        params, unpack = [], []
        for item in sig:
            if item is None:
                v = invars.pop(0)
                env[v] = self.fresh()
                params.append(env[v])
            else:
                pname, n = item
                group, invars = invars[:n], invars[n:]
                names = []
                for v in group:
                    env[v] = self.fresh()
                    names.append(env[v])
                params.append(pname)
                if n:
                    unpack.append(f"{target(names)} = {pname}")
        assert not invars, "signature does not cover the jaxpr's inputs"
        argnames = [env[v] for v in jaxpr.invars[len(const_atoms) :]]
        if (
            self.lines
            and self.lines[-1][0].strip()
            and not self.lines[-1][0].rstrip().endswith(":")
        ):
            self.emit("", 0)
        for d in decorators:
            self.emit(d, indent)
        self.emit_expr(Call(fname, params), indent, "def ", None)
        self.lines[-1] = (self.lines[-1][0] + ":", None)
        if doc:
            self.emit(f'"""{doc}"""', indent + 4)
        for u in unpack:
            self.emit(u, indent + 4)
        inner = _Scope(scope)
        self.body(jaxpr, env, inner, indent + 4)
        self.ret(jaxpr, env, indent + 4, ret, argnames)
        self.emit("", 0)

    def origin(self, eqn, what: str) -> str:
        frame = _jax_private.user_frame(eqn)
        if frame is None:
            return what
        file, line, fn = frame
        mapped = _mapped_origin(file, line)
        if mapped is not None:
            return mapped
        return f"{what}, from {_short_path(file)}:{line} ({fn})"


def _mapped_origin(file: str, line: int) -> str | None:
    """The original origin of a line of source that roundtrip generated, if it is one."""
    best = None
    for start, end, text in _ORIGINS.get(file, ()):
        if start <= line <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end, text)
    return best[2] if best else None


def _short_path(file: str) -> str:
    import os

    try:
        rel = os.path.relpath(file)
    except ValueError:
        return file
    return rel if not rel.startswith("..") else file


def _ranges(origins: list[tuple[int, str]]) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    for line, o in origins:
        if out and out[-1][2] == o and out[-1][1] == line - 1:
            out[-1] = (out[-1][0], line, o)
        else:
            out.append((line, line, o))
    return out


def _type_str(aval) -> str:
    s = aval.str_short(short_dtypes=True)
    if getattr(aval, "weak_type", False):
        s = s.lstrip("~") + " (weak)"
    return s


def _subjaxprs(eqn):
    for v in eqn.params.values():
        if isinstance(v, ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, Jaxpr):
            yield v
        elif isinstance(v, (tuple, list)):
            for b in v:
                if isinstance(b, ClosedJaxpr):
                    yield b.jaxpr


def _is_identity(eqn) -> bool:
    name, p = eqn.primitive.name, eqn.params
    if len(eqn.invars) != 1 or len(eqn.outvars) != 1:
        return False
    a, o = eqn.invars[0].aval, eqn.outvars[0].aval
    if (
        a.shape != o.shape
        or a.dtype != o.dtype
        or getattr(a, "weak_type", 0) != getattr(o, "weak_type", 0)
    ):
        return False
    if name in ("convert_element_type", "reshape", "copy", "copy_p", "squeeze"):
        return True
    if name == "broadcast_in_dim":
        return tuple(p["broadcast_dimensions"]) == tuple(range(a.ndim))
    if name == "transpose":
        return tuple(p["permutation"]) == tuple(range(a.ndim))
    if name.startswith("reduce_") and "axes" in p:
        return not p["axes"]
    return False
