"""show_jaxpr's printer core: walks a jaxpr and prints one Python statement per equation.

The core holds empty tables and knows no primitive: rule modules register into it with
``register`` when imported -- ``_rules.py`` (first-order primitives), ``_nested.py`` (jit,
cond, while, scan, custom_jvp/vjp, remat) and ``_parallel.py`` (shard_map and
collectives). Imports point one way: those modules import this one, never the reverse;
``_show_jaxpr.py`` (the public API) imports them all. Expressions come from ``_exprs.py``.
"""

from __future__ import annotations

import builtins
import itertools
import keyword
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from ..core import _jax_private
from ._exprs import (
    Call,
    Rule,
    UnsupportedPrimitiveError,
    array_expr,
    bind_expr,
    flat,
    pystr,
    render,
    scalar_expr,
    target,
    tuple_or_single,
)

__all__ = [
    "CONSTS_DICT",
    "HIGHER_ORDER",
    "IMPORT_LINES",
    "JITTED",
    "JITTED_BODIES",
    "ORIGINS",
    "RULES",
    "Printer",
    "register",
    "sanitize",
    "single_ret",
]

_IMPORTS = {
    "jax": "import jax",
    "jnp": "import jax.numpy as jnp",
    "np": "import numpy as np",
    "nnlite": "import nnlite",  # nnlite's own primitives (its fused attention)
    "lax": "from jax import lax",
    "prims": "from jax.extend.core import primitives as prims",
    "P": "from jax.sharding import PartitionSpec as P",
}
_RESERVED = set(keyword.kwlist) | set(dir(builtins)) | set(_IMPORTS) | {"carry", "xs", "res", "ct"}
CONSTS_DICT = "LARGE_CONSTS"
#: The import statements a printed module may start with.
IMPORT_LINES = frozenset(_IMPORTS.values())

#: primitive name -> rule printing one first-order equation (see ``_rules.py``).
RULES: dict[str, Rule] = {}
#: primitive name -> ``handler(printer, eqn, args, env, scope, indent)`` for equations
#: that carry jaxprs (or need statements of their own).
HIGHER_ORDER: dict[str, Callable] = {}
#: primitive name -> ``namer(eqn) -> str``: the nested function the equation defines.
FUNCTION_NAMES: dict[str, Callable] = {}
#: primitive name -> ``(jit name, rule)``: a public function that wraps its primitive in a
#: ``jax.jit`` of that name (``lax.fft``); the jit prints as the rule's call.
JITTED: dict[str, tuple[str, Rule]] = {}
#: jit name -> ``[(printed call, function)]``: public functions that are a ``jax.jit`` of
#: that name around several equations (``jnp.linalg.cholesky``); a jit whose body is exactly
#: what one of them traces to at the same operands prints as that call.
JITTED_BODIES: dict[str, list[tuple[str, Callable]]] = {}
#: ``pass(jaxpr, env) -> ids of equations not to print`` run before printing a body.
BODY_PASSES: list[Callable] = []
#: generated file name -> ``(first line, last line, origin)`` of each nested construct.
ORIGINS: dict[str, list[tuple[int, int, str]]] = {}


def register(
    *,
    rules: dict[str, Rule] | None = None,
    higher_order: dict[str, Callable] | None = None,
    body_pass: Callable | None = None,
    function_names: dict[str, Callable] | None = None,
    jitted: dict[str, tuple[str, Rule]] | None = None,
    jitted_bodies: dict[str, list[tuple[str, Callable]]] | None = None,
) -> None:
    """Add rules to the printer (called once by each rule module when it is imported)."""
    RULES.update(rules or {})
    JITTED.update(jitted or {})
    JITTED_BODIES.update(jitted_bodies or {})
    HIGHER_ORDER.update(higher_order or {})
    FUNCTION_NAMES.update(function_names or {})
    if body_pass is not None and body_pass not in BODY_PASSES:
        BODY_PASSES.append(body_pass)


def single_ret(outs, _args):
    """A function's return: one value bare, several as a tuple."""
    return tuple_or_single(outs)


def sanitize(name: str) -> str:
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


class Printer:
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
        self.fn_names: dict[tuple, str] = {}  # (base name, computation key) -> name
        self.fn_counts: dict[str, int] = {}
        self.jvp_depth = 0  # custom_jvp rules being printed inside one another

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

    def unique(self, base: str, key: Any) -> str:
        """The nested function's name: one per computation, so that two different
        functions never share a name (a body reading an outer ``f`` and defining its own
        ``f`` would fail). The k-th other computation of the same name is ``name_k``; a
        trailing ``_k`` is dropped first, so that printing again gives the same names."""
        base = self.base_name(base)
        if (base, key) not in self.fn_names:
            n = self.fn_counts.get(base, 0)
            self.fn_counts[base] = n + 1
            name = base if n == 0 else f"{base}_{n}"
            self.taken.add(name)
            self.fn_names[(base, key)] = name
        return self.fn_names[(base, key)]

    @staticmethod
    def base_name(name: str) -> str:
        return re.sub(r"_\d+$", "", sanitize(name)) or "fn"

    def function_name(self, eqn) -> str | None:
        """The name of the nested function an equation prints as (``None``: it has none)."""
        namer = FUNCTION_NAMES.get(eqn.primitive.name)
        return sanitize(namer(eqn)) if namer is not None else None

    # -- atoms ------------------------------------------------------------------------------------
    def atom(self, x, env) -> str:
        if isinstance(x, Literal):
            a = x.aval
            s = scalar_expr(x.val, a.dtype, getattr(a, "weak_type", False))
            self.used.add(s.split(".")[0] if s[:3] in ("np.", "jnp") else "")
            return s
        return env[x]

    def closed_over(self, value, env) -> str:
        """A nested jaxpr's constant: a module-level constant, or, for a tracer of the trace
        that made the enclosing jaxpr (a rule closing over one of its values), that value's
        name in the enclosing function."""
        if isinstance(value, jax.core.Tracer):
            v = _jax_private.tracer_var(value)
            if v is not None and v in env:
                return env[v]
            raise UnsupportedPrimitiveError(
                f"a nested function closes over a traced value ({value.aval.str_short()}) of a "
                "trace that has finished: it has no name in the printed source"
            )
        return self.const(value)

    def const(self, value) -> str:
        key = id(value)
        if key in self.const_names:
            return self.const_names[key]
        self.const_keep.append(value)
        cname = f"C{len(self.const_names)}"
        self.taken.add(cname)
        self.const_names[key] = cname
        dt = getattr(value, "dtype", None)
        is_key = dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
        weak = (
            getattr(jax.typeof(value), "weak_type", False)
            if isinstance(value, jax.Array)
            else False
        )
        if is_key:
            data = np.asarray(jax.random.key_data(value))
            impl = str(jax.random.key_impl(value))
            shape = f"key<{impl}>{list(value.shape)}".replace(" ", "")
        else:
            data = np.asarray(value)
            # the same spelling for a jax.Array and the NumPy array the printed source holds
            shape = _type_str(jax.core.ShapedArray(data.shape, data.dtype, weak_type=weak))
        if data.size > self.max_const_size:
            self.large[cname] = value
            expr = f"{CONSTS_DICT}[{cname!r}]"
            note = f"{shape}, too large to print: supplied by roundtrip()"
        else:
            expr = array_expr(data)
            self.used.add("np")
            if data.ndim == 0 and not is_key:
                # a 0-d NumPy value would trace as a literal: keep it an array constant
                expr = f"jnp.asarray({_weak_scalar(data) if weak else expr})"
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
        try:
            self.body(closed.jaxpr, env, _Scope(), 4)
        except UnsupportedPrimitiveError as e:
            if getattr(e, "located", False):
                raise
            # no user code made it (e.g. show_jaxpr(jnp.linalg.det, ...)): the JAX function
            m = re.search(r"primitive '[\w-]+'", str(e))
            frame = next(
                (fr for q in closed.jaxpr.eqns if (fr := _jax_private.outer_frame(q))), None
            )
            where = f"{_short_path(frame[0])}:{frame[1]} ({frame[2]})" if frame else "JAX"
            msg = str(e)
            if m is not None:
                msg = f"{msg[: m.end()]} from {where}{msg[m.end() :]}"
            raise UnsupportedPrimitiveError(msg) from None
        self.ret(closed.jaxpr, env, 4, single_ret)
        head = [_IMPORTS[k] for k in _IMPORTS if k in self.used]
        text = []
        if head:
            text += head + ["", ""]
        if self.const_lines:
            text += self.const_lines + ["", ""]
        if self.large:
            text = [f"# Needs {CONSTS_DICT}, a dict of the constants too large to print."] + text
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
        for mod in ("jnp", "np", "lax", "prims", "jax", "nnlite"):
            if re.search(rf"(?<![\w.]){mod}\.", s):
                self.used.add(mod)
        if re.search(r"(?<![\w.])P\(", s):
            self.used.add("P")

    def ret(self, jaxpr: Jaxpr, env, indent: int, fmt: Callable, args=()) -> None:
        outs = [self.atom(v, env) for v in jaxpr.outvars]
        self.emit_expr(fmt(outs, list(args)), indent, "return ")

    # -- bodies -----------------------------------------------------------------------------------
    def body(self, jaxpr: Jaxpr, env: dict, scope: _Scope, indent: int) -> None:
        skip = set()
        for fold in BODY_PASSES:
            skip |= fold(jaxpr, env)
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
        # a folded cond index (see _nested.fold_index_eqns) has no name of its own
        args = [
            None
            if isinstance(x, Var) and (("index", x) in env or ("apply", x) in env)
            else self.atom(x, env)
            for x in eqn.invars
        ]
        if self.simplify and _is_identity(eqn):
            env[eqn.outvars[0]] = args[0]
            return
        try:
            handler = HIGHER_ORDER.get(name)
            if handler is not None:
                handler(self, eqn, args, env, scope, indent)
                return
            rule = RULES.get(name)
            expr = rule(eqn, args, self.mesh) if rule is not None else None
            if expr is None:
                expr = bind_expr(eqn, args)
                why = (
                    "parameters its public function never gives"
                    if name in RULES
                    else ("no public function makes it")
                )
                self.emit(f"# {name}: {why}; bound directly", indent)
        except UnsupportedPrimitiveError as e:
            raise self.refusal(eqn, e) from None
        self.assign(eqn, env, expr, indent)

    def refusal(self, eqn, e: UnsupportedPrimitiveError) -> UnsupportedPrimitiveError:
        """``e`` naming the primitive and the source line it came from (once: the innermost
        equation's line, not those of the constructs around it)."""
        if getattr(e, "located", False):
            return e
        msg = str(e)
        m = re.search(r"primitive '[\w-]+'", msg)
        if m is None:
            msg = f"show_jaxpr cannot print primitive {eqn.primitive.name!r}: {msg}"
            m = re.search(r"primitive '[\w-]+'", msg)
        frame = _jax_private.user_frame(eqn)
        if frame is None:  # made inside JAX: an enclosing equation names the user's line
            return UnsupportedPrimitiveError(msg)
        file, line, fn = frame
        where = _mapped_origin(file, line) or f"{_short_path(file)}:{line} ({fn})"
        msg = f"{msg[: m.end()]} from {where}{msg[m.end() :]}"
        err = UnsupportedPrimitiveError(msg)
        err.located = True
        return err

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
            env[v] = self.closed_over(c, outer_env)
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
    for start, end, text in ORIGINS.get(file, ()):
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


def _weak_scalar(data) -> str:
    """A Python scalar whose ``jnp.asarray`` is the weakly typed 0-d ``data``."""
    return scalar_expr(data[()], data.dtype, weak=True)


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
