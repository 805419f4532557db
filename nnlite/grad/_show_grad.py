"""``show_grad``: a loss's backward pass as runnable Python, at the level of layers.

The loss runs once, eagerly, in manual-gradient mode with a tape: every hand-rule call
(``linear``, ``relu``, ``conv``, ``layer_norm``, ``softmax_cross_entropy``, ...) records its
arguments and result. The tape is printed as a function: the forward calls, each result
named after the layer path of the params it uses, then the hand VJPs in reverse order,
summing cotangents where a value feeds several calls, and finally the ParamsDict of
gradients. Arrays that no rule produced are matched by value to a known one seen through
a reshape or cast (a layer folding its batch axes), or printed as literals when small and
not differentiable (causal masks, dropout keys).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core._mode import manual_scope

__all__ = ["show_grad"]

_LITERAL_LIMIT = 4096  # elements: larger non-differentiable constants are refused


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


class _Names:
    def __init__(self):
        self.by_id: dict[int, tuple[str, Any]] = {}  # id(array) -> (name, array)
        self.used: set[str] = set()

    def fresh(self, base: str) -> str:
        base = _ident(base)
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name

    def add(self, arr, name: str) -> None:
        self.by_id[id(arr)] = (name, arr)


def _literal(a) -> str:
    """Source for a small non-differentiable array: a lower-triangular (causal) mask or a
    literal, broadcast to ``a``'s shape when it repeats along its leading axes."""
    arr = np.asarray(a)
    core = arr
    while core.ndim > 1 and all(np.array_equal(core[0], c) for c in core[1:]):
        core = core[0]
    mod = "np" if isinstance(a, np.ndarray) else "jnp"
    if core.ndim == 2 and core.dtype == np.bool_ and core.shape[0] == core.shape[1]:
        if np.array_equal(core, np.tril(np.ones(core.shape, bool))):
            src = f"{mod}.tril({mod}.ones({core.shape}, bool))"
            return src if core.shape == arr.shape else f"{mod}.broadcast_to({src}, {arr.shape})"
    if core.size > _LITERAL_LIMIT:
        raise ValueError(
            f"show_grad: a non-differentiable argument of shape {arr.shape} is too large to "
            "print; call show_grad on a smaller batch"
        )
    if core.ndim == 1 and np.array_equal(core, np.arange(core.size)):
        src = f"{mod}.arange({core.size}, dtype={mod}.{core.dtype})"
    else:
        src = f"{mod}.array({core.tolist()}, {mod}.{core.dtype})"
    return src if core.shape == arr.shape else f"{mod}.broadcast_to({src}, {arr.shape})"


def _is_float(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact)


def show_grad(loss_fn: Callable, params: Any, *batch: Any, **kwargs: Any) -> str:
    """Python source of the backward pass of ``loss_fn(params, *batch)`` by hand VJPs.

    Executing the source defines ``grad(params, <batch names>)`` returning the gradient
    ParamsDict, equal to ``jax.grad(loss_fn)(params, *batch)`` (for a loss returning
    ``(loss, aux)``, of the loss). Every layer and loss inside must be an nnlite one (or
    carry ``nl.hand_rule`` rules): it is traced in manual-gradient mode.

    Args:
        loss_fn: ``loss_fn(params, *batch, **kwargs) -> scalar`` (or ``(scalar, aux)``).
        params: the params (a ParamsDict); batch: the other arguments, concrete arrays.
        kwargs: passed to ``loss_fn`` as they are (e.g. ``key=``).

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
        >>> print(src.splitlines()[8])
            linear_layers_0 = linear(x, params.layers[0].W, params.layers[0].b)
        >>> ns = {}
        >>> exec(src, ns)
        >>> g = ns["grad"](p, x, y)
        >>> bool(jnp.allclose(g.layers[0].W, jax.grad(loss)(p, x, y).layers[0].W, atol=1e-6))
        True
    """
    tape: list = []
    with manual_scope(True, tape):
        out = loss_fn(params, *batch, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    if not tape or tape[-1][3] is not loss:
        raise ValueError(
            "show_grad: the loss must be the result of an nnlite loss or reduction (a hand "
            "rule such as nl.reduce(..., 'mean')), so that its backward pass starts there"
        )

    names = _Names()
    try:
        arg_names = list(inspect.signature(loss_fn).parameters)[: 1 + len(batch)]
    except (TypeError, ValueError):
        arg_names = []
    if len(arg_names) < 1 + len(batch) or not all(n.isidentifier() for n in arg_names):
        arg_names = ["params", *(f"arg{i}" for i in range(len(batch)))]
    p_name, *b_names = arg_names
    for n in arg_names:
        names.used.add(n)

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    param_ids = {}
    for path, leaf in leaves:
        expr = _path_expr(p_name, path)
        names.add(leaf, expr)
        param_ids[id(leaf)] = expr
    for n, b in zip(b_names, batch, strict=True):
        for path, leaf in jax.tree_util.tree_flatten_with_path(b)[0]:
            names.add(leaf, _path_expr(n, path))

    fwd: list[str] = []
    rules: set[str] = set()
    consts: list[str] = []
    entries = []  # (fn, arg exprs, arg bases for cotangents, static, out name)

    def resolve(a) -> tuple[str, tuple[str, Any] | None]:
        """Expression for argument ``a`` and, for a differentiable one, ``(base name, base
        array)`` its cotangent flows back to."""
        if a is None or isinstance(a, (bool, int, float, str)):
            return repr(a), None
        if id(a) in names.by_id:
            name, arr = names.by_id[id(a)]
            return name, (name, arr) if _is_float(a) else None
        if _is_float(a):
            for name, arr in list(names.by_id.values()):
                if _is_float(arr) and arr.size == a.size and arr.dtype == a.dtype:
                    if np.array_equal(np.asarray(arr).ravel(), np.asarray(a).ravel()):
                        return f"{name}.reshape{tuple(a.shape)}", (name, arr)
            raise ValueError(
                f"show_grad: an argument of shape {tuple(a.shape)} was computed outside any "
                "hand rule and is not a reshape of a known value; compute it with nnlite "
                "layers or ops (nl.add, ...)"
            )
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(a))
            impl = str(jax.random.key_impl(a))
            name = names.fresh("key")
            consts.append(
                f"{name} = jax.random.wrap_key_data(jnp.array({data.tolist()}, "
                f"jnp.{data.dtype}), impl={impl!r})"
            )
            names.add(a, name)
            return name, None
        name = names.fresh("mask" if a.dtype == np.bool_ else "const")
        consts.append(f"{name} = {_literal(a)}")
        names.add(a, name)
        return name, None

    counts: dict[str, int] = {}
    names.used.update(fn.__name__ for fn, *_ in tape)  # never shadow a rule
    names.used.update(fn.f_vjp.__name__ for fn, *_ in tape)
    for fn, args, static, out in tape:
        exprs, bases = zip(*(resolve(a) for a in args), strict=True) if args else ((), ())
        label = next((param_ids[id(a)] for a in args if id(a) in param_ids), None)
        if label is not None:
            label = label.rsplit(".", 1)[0] if "." in label[len(p_name) :] else label
            label = label[len(p_name) :]
        if label:
            out_name = names.fresh(f"{fn.__name__}{label}")
        else:
            counts[fn.__name__] = counts.get(fn.__name__, 0) + 1
            out_name = names.fresh(f"{fn.__name__}_out{counts[fn.__name__]}")
        names.add(out, out_name)
        rules.update({fn.__name__, fn.f_vjp.__name__})
        kw = "".join(
            f", {k}={resolve(v)[0] if hasattr(v, 'shape') else repr(v)}" for k, v in static.items()
        )
        fwd.append(f"    {out_name} = {fn.__name__}({', '.join(exprs)}{kw})")
        entries.append((fn, exprs, bases, kw, out_name))

    bwd: list[str] = []
    have_ct: set[str] = set()
    last = entries[-1][4]
    bwd.append(f"    d_{last} = jnp.ones_like({last})")
    have_ct.add(last)
    for fn, exprs, bases, kw, out_name in reversed(entries):
        if out_name not in have_ct:
            continue  # nothing downstream needs it (a metric)
        targets, adds = [], []
        for i, base in enumerate(bases):
            if base is None:
                targets.append("_")
                continue
            bname, barr = base
            d = f"d_{_ident(bname)}"
            if bname not in have_ct and exprs[i] == bname:
                targets.append(d)  # first cotangent of this value: assign it directly
                have_ct.add(bname)
                continue
            tmp = f"d{i}_{out_name}"
            targets.append(tmp)
            ct = tmp if exprs[i] == bname else f"{tmp}.reshape{tuple(barr.shape)}"
            if bname in have_ct:
                adds.append(f"    {d} = {d} + {ct}")
            else:
                adds.append(f"    {d} = {ct}")
                have_ct.add(bname)
        call = f"{fn.f_vjp.__name__}({', '.join(exprs)}, d_{out_name}{kw})"
        bwd.append(f"    {', '.join(targets)} = {call}")
        bwd.extend(adds)

    grads = []
    for path, _leaf in leaves:
        expr = _path_expr(p_name, path)
        grads.append(f"d_{_ident(expr)}" if expr in have_ct else f"jnp.zeros_like({expr})")
    header = [
        "import jax",
        "import jax.numpy as jnp",
        "import numpy as np",
        "",
        f"from nnlite.rules import {', '.join(sorted(rules))}",
        "",
        f"def grad({', '.join(arg_names)}):",
    ]
    body = [f"    {c}" for c in consts] + ["    # forward: each layer's call, its result kept"]
    body += fwd + ["    # backward: the hand VJPs in reverse"] + bwd
    leaves_src = ",\n        ".join(grads)
    body.append(
        f"    return jax.tree.unflatten(\n        jax.tree.structure({p_name}),\n"
        f"        [\n        {leaves_src},\n        ],\n    )"
    )
    return "\n".join(header + body) + "\n"
