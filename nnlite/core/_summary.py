"""``nl.summary(model, x)``: a table of a model's layers, as Keras' ``summary()``,
Lightning's ``ModelSummary`` or ``nnx.tabulate(compute_flops=True)`` give.

The model is traced once on abstract inputs (``jax.eval_shape``: nothing is computed or
allocated) while every module call is recorded (path, output shape, the params it was
given). Each distinct layer call is then traced alone, forward and forward + backward, and
``nl.flops`` counts its FLOPs from the jaxpr (a loop's body times its trip count: a scanned
stack counts every layer); the activation memory it keeps for the backward pass is what
``jax.vjp`` holds on to, the layer's params aside (its input included). Totals come from
the whole model the same way (rows nest, so they do not add up).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compose
from ._flops import flops as count_flops
from ._jax_private import current_trace, inner_tracer

__all__ = ["Summary", "summary"]


@dataclasses.dataclass
class Summary:
    """The rows (one per layer call, in call order; ``depth`` 1 for the model's own
    children) and the model's totals. ``str()`` is the table; ``rows``/``totals`` hold the
    numbers (``flops_forward``, ``flops_backward`` and ``activation_bytes`` are None where
    the layer cannot run alone)."""

    name: str
    rows: list[dict]
    totals: dict

    def __str__(self) -> str:
        head = ("layer", "type", "output", "params", "bytes", "fwd FLOPs", "bwd FLOPs", "act. mem")
        body = [
            (
                "  " * (r["depth"] - 1) + r["path"],
                r["type"],
                _shape(r["output_shape"]),
                f"{r['params']:,}",
                _bytes(r["param_bytes"]),
                _num(r["flops_forward"]),
                _num(r["flops_backward"]),
                _bytes(r["activation_bytes"]),
            )
            for r in self.rows
        ]
        t = self.totals
        body.append(
            (
                "total",
                self.name,
                _shape(t["output_shape"]),
                f"{t['params']:,}",
                _bytes(t["param_bytes"]),
                _num(t["flops_forward"]),
                _num(t["flops_backward"]),
                _bytes(t["activation_bytes"]),
            )
        )
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
        fmt = lambda row: "  ".join(  # noqa: E731
            str(c).ljust(w) if i < 3 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        rule = "-" * len(fmt(head))
        return "\n".join([fmt(head), rule, *map(fmt, body[:-1]), rule, fmt(body[-1])])

    def __repr__(self) -> str:
        return str(self)


def _shape(s) -> str:
    if s is None:
        return "-"
    if isinstance(s, list):
        return ", ".join(_shape(x) for x in s)
    return "[" + ", ".join(map(str, s)) + "]"


def _num(x) -> str:
    if x is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def _bytes(x) -> str:
    if x is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x} B"


def _is_array(a) -> bool:
    return isinstance(a, jax.Array | np.ndarray | jax.ShapeDtypeStruct) or hasattr(a, "aval")


def _aval(a):
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype) if _is_array(a) else a


def _size_bytes(tree) -> tuple[int, int]:
    leaves = [a for a in jax.tree.leaves(tree) if _is_array(a)]
    n = sum(math.prod(np.shape(a)) for a in leaves)
    return n, sum(math.prod(np.shape(a)) * np.dtype(a.dtype).itemsize for a in leaves)


def _flops(fn, *args) -> float | None:
    # Counted from the traced program (nl.flops): nothing compiles, loops count whole.
    try:
        return float(count_flops(jax.jit(fn).trace(*args))["flops"])
    except Exception:  # noqa: BLE001 - a layer that cannot run alone shows "-"
        return None


def _costs(
    call, params, args, wrt_inputs=True, flops=True
) -> tuple[float | None, float | None, int | None]:
    """Forward FLOPs, backward FLOPs and kept activation bytes of ``call(params, *args)``
    on abstract ``params``/``args``. The float leaves of ``args`` are differentiated too
    where ``wrt_inputs`` says (a bool, or one per leaf): a layer inside a model passes its
    input's cotangent back when that input depends on the params."""
    leaves, treedef = jax.tree.flatten(args)
    wrt = wrt_inputs if isinstance(wrt_inputs, list | tuple) else [wrt_inputs] * len(leaves)
    is_float = [
        w and _is_array(a) and jnp.issubdtype(a.dtype, jnp.floating)
        for a, w in zip(leaves, wrt, strict=True)
    ]
    arrays = [a for a in leaves if _is_array(a)]

    def forward(p, arrs):
        it = iter(arrs)
        full = [next(it) if _is_array(a) else a for a in leaves]
        return call(p, *jax.tree.unflatten(treedef, full))

    def split(p, arrs):
        floats = [a for a, f in zip(_expand(arrs, leaves), is_float, strict=True) if f]
        return floats

    def with_floats(p, arrs, floats):
        it, out, k = iter(floats), [], 0
        for a, f in zip(leaves, is_float, strict=True):
            if _is_array(a):
                out.append(next(it) if f else arrs[k])
                k += 1
        return forward(p, out)

    kept: list[int] = []

    def forward_backward(p, arrs, cts):
        floats = split(p, arrs)
        out, vjp = jax.vjp(lambda p, fl: with_floats(p, arrs, fl), p, floats)
        own = {id(t) for t in jax.tree.leaves(p)}
        kept.append(
            sum(
                math.prod(r.shape) * np.dtype(r.dtype).itemsize
                for r in jax.tree.leaves(vjp)
                if hasattr(r, "dtype") and id(r) not in own
            )
        )
        return out, vjp(cts)  # the output too: else a linear layer's forward is dead code

    fwd = _flops(forward, params, arrays) if flops else None
    # the cotangent is an argument, as training's is (a constant one of ones could fold)
    try:
        cts = jax.eval_shape(forward, params, arrays)
    except Exception:  # noqa: BLE001
        return fwd, None, None
    cts = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, _ct_dtype(o.dtype)), cts)
    if not flops:  # the activations only: traced once
        try:
            jax.eval_shape(forward_backward, params, arrays, cts)
        except Exception:  # noqa: BLE001
            return None, None, None
        return None, None, kept[0]
    both = _flops(forward_backward, params, arrays, cts)
    bwd = None if fwd is None or both is None else max(both - fwd, 0.0)
    return fwd, bwd, (kept[0] if kept else None)


def _ct_dtype(dtype):
    """The cotangent dtype of an output of ``dtype`` (float0 for integers)."""
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jax.dtypes.float0


def _expand(arrs, leaves):
    it = iter(arrs)
    return [next(it) if _is_array(a) else a for a in leaves]


def summary(
    model: Any, x: Any, *args: Any, params: Any = None, flops: bool = True, **kwargs: Any
) -> Summary:
    """The layers of ``model`` called as ``model(params, x, *args, **kwargs)``: each
    module call's path (its params' path, else the attribute it was declared as), type,
    output shape, parameter count and bytes, forward and backward FLOPs and the activation
    memory its backward pass keeps; with totals. ``x`` may be an array or a
    ``jax.ShapeDtypeStruct``; ``params`` defaults to ``model.init`` (traced, not run).
    ``flops=False`` leaves the FLOP columns out ("-"): each distinct layer call is traced
    twice more otherwise, forward and forward + backward (nothing compiles either way).

    Example:
        >>> import jax.numpy as jnp, nnlite as nl
        >>> table = nl.summary(nl.FFN(8, (16,), 4), jnp.zeros((2, 8)))
        >>> [(r["path"], r["output_shape"], r["params"]) for r in table.rows]
        [('layers[0]', (2, 16), 144), ('layers[1]', (2, 4), 68)]
        >>> table.totals["params"]
        212
    """
    if params is None:
        params = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    params = jax.tree.map(_aval, params)
    x = jax.tree.map(_aval, x)
    state = {}  # traced keyword arrays: a stateful model's state
    if "state" in kwargs:
        state = {"state": jax.tree.map(_aval, kwargs.pop("state"))}
    elif callable(getattr(model, "init_state", None)):
        # a stateful model (BatchNorm): in eval mode, on its initial state's shapes
        state = {"state": jax.eval_shape(model.init_state)}
        kwargs = {"train": False, **kwargs}
    records, out = _trace_calls(model, params, x, args, kwargs, state)

    rows, seen = [], {}
    records.sort(key=lambda r: r[0])
    for _, path, depth, module, p, rest, kw, o, needs_ct in records:
        n, nbytes = _size_bytes(p) if p is not None else (0, 0)
        key = None
        try:
            leaves = str(jax.tree.leaves((p, rest)))
            key = (module, jax.tree.structure((p, rest)), leaves, str(kw), needs_ct)
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in seen:
            costs = seen[key]
        else:
            # keyword arrays (a layer's state) travel as arguments: the last one, a dict
            if getattr(module, "has_params", True):
                call = lambda pp, *a, _m=module: _m(pp, *a[:-1], **a[-1])  # noqa: E731
            else:
                call = lambda pp, *a, _m=module: _m(*a[:-1], **a[-1])  # noqa: E731
            costs = _costs(call, p, (*rest, kw), wrt_inputs=needs_ct, flops=flops)
            if key is not None:
                seen[key] = costs
        if "state" in kw and isinstance(o, tuple) and len(o) == 2:
            o = o[0]  # a stateful layer's (output, new state)
        shapes = [tuple(a.shape) for a in jax.tree.leaves(o) if hasattr(a, "shape")]
        rows.append(
            {
                "path": path,
                "depth": depth,
                "type": type(module).__name__,
                "output_shape": shapes[0] if len(shapes) == 1 else shapes,
                "params": n,
                "param_bytes": nbytes,
                "flops_forward": costs[0],
                "flops_backward": costs[1],
                "activation_bytes": costs[2],
            }
        )
    n, nbytes = _size_bytes(params)
    # the model's own backward pass: the params' gradients (what training computes)
    stateful = bool(state)

    def call(p, x, *a):  # the output alone (a stateful model's new state aside)
        *a, st = a
        out = model(p, x, *a, **kwargs, **st)
        return out[0] if stateful else out

    fwd, bwd, act = _costs(call, params, (x, *args, state), wrt_inputs=False, flops=flops)
    shapes = [tuple(a.shape) for a in jax.tree.leaves(out[0] if stateful else out)]
    totals = {
        "output_shape": shapes[0] if len(shapes) == 1 else shapes,
        "params": n,
        "param_bytes": nbytes,
        "flops_forward": fwd,
        "flops_backward": bwd,
        "activation_bytes": act,
    }
    return Summary(type(model).__name__, rows, totals)


def _trace_calls(model, params, x, args: tuple, kwargs: dict, state: dict) -> tuple[list, Any]:
    """Every module call of ``model(params, x, *args, **kwargs, **state)`` traced on
    abstract values (nothing computed): ``(records, out)``, each record with, per leaf of
    the call's inputs, whether training sends a cotangent back through it. The model runs
    under ``jax.vjp`` in its params: an input that does not depend on them (the model's
    own input, as a first layer gets it) needs none, so its layer's backward FLOPs leave
    that cotangent out, as training and the model's total do."""

    def trace(under_vjp: bool) -> tuple[list, Any]:
        records: list[tuple] = []
        order: dict[int, int] = {}  # frame id -> pre-order position (ancestors first)
        keep: list = []  # the frames, alive until the table is built (ids stay unique)
        outer: list = []  # the trace outside jax.vjp

        def observe(frame, module, a, kw, out):
            if frame.parent is None:
                return
            chain, f = [], frame
            while f.parent is not None:
                chain.append(f)
                f = f.parent
            for f in reversed(chain):
                if id(f) not in order:
                    order[id(f)] = len(order)
                    keep.append(f)
            rest = a[1:] if getattr(module, "has_params", True) else a
            kw = {k: v for k, v in kw.items() if k != "key"}
            needs_ct = tuple(
                not outer or inner_tracer(v, outer[0]) for v in jax.tree.leaves((*rest, kw))
            )
            records.append(
                (
                    order[id(frame)],
                    _path(chain),
                    len(chain),
                    module,
                    jax.tree.map(_aval, frame.params),
                    jax.tree.map(_aval, tuple(rest)),
                    jax.tree.map(_aval, kw),
                    jax.tree.map(_aval, out),
                    needs_ct,
                )
            )

        def run(p, x, st):
            def call(p):
                return model(p, x, *args, **kwargs, **st)

            if not under_vjp:
                return call(p)
            outer.append(current_trace())
            return jax.vjp(call, p)[0]

        _compose.CALL_OBSERVERS.append(observe)
        try:
            return records, jax.eval_shape(run, params, x, state)
        finally:
            _compose.CALL_OBSERVERS.remove(observe)

    try:
        return trace(under_vjp=True)
    except Exception:  # noqa: BLE001 - a model jax.vjp cannot trace: every input needs one
        return trace(under_vjp=False)


def _path(chain: list) -> str:
    """``blocks[0].attn``: each call's params path below its caller (what the params
    printout shows), else the attribute it was declared as, else its type."""
    parts = []
    for f in reversed(chain):
        parent, seg = f.parent, None
        if f.params is not None:
            parent.locate(f.module, f.params)  # builds the caller's index of its params
            seg = (parent._ids or {}).get(id(f.params))
        if not seg:
            seg = f.segment
        parts.append(_compose._format(seg) if seg else type(f.module).__name__)
    return ".".join(parts)
