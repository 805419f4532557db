"""The few JAX internals that nnlite needs (show_jaxpr, its rules, the trainer's FLOP count),
in one place.

JAX has no public API for these: where a traced equation came from in the user's source,
and the JVP / forward / backward rules that ``custom_jvp_call`` and ``custom_vjp_call``
equations carry as opaque Python callables. Everything that touches ``jax._src`` for
show_jaxpr lives here, so a JAX upgrade breaks one small file.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
from jax._src import config, source_info_util
from jax._src import shard_map as _shard_map
from jax._src.ad_util import Zero
from jax._src.mesh import use_abstract_mesh
from jax.extend.core import ClosedJaxpr

__all__ = [
    "at_top_level",
    "backend_started",
    "match_varying",
    "partitioned_lowering",
    "result_aval",
    "bind_equation",
    "current_trace",
    "lowered_cost_analysis",
    "inner_tracer",
    "dce_call",
    "custom_jvp_rule",
    "custom_vjp_rules",
    "equation_context",
    "outer_frame",
    "batch_axis_trace_state",
    "manual_trace_state",
    "shape_dtype_struct",
    "shard_map_body",
    "tracer_var",
    "user_frame",
    "user_frames",
    "varying_axes",
]


def user_frame(eqn) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the innermost user frame that created ``eqn``."""
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    return frame.file_name, frame.start_line, frame.function_name


def outer_frame(eqn) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the outermost frame that created ``eqn`` other than
    JAX's tracing machinery: for an equation no user code made (``show_jaxpr(jnp.linalg.det,
    ...)``), the JAX function that was traced."""
    tb = eqn.source_info.traceback
    for frame in reversed(tb.frames if tb is not None else ()):
        if (
            "/jax/_src/" in frame.file_name
            and "/jax/_src/numpy/" not in frame.file_name
            and (
                "/jax/_src/lax/" not in frame.file_name
                and "/jax/_src/scipy/" not in frame.file_name
            )
        ):
            continue
        return frame.file_name, frame.line_num, frame.function_name
    return None


@functools.cache
def manual_trace_state():
    """A JAX config state that is part of JAX's trace context, set while manual mode is.

    JAX caches what it traces (``jax.jit``, ``jax.checkpoint``) by function, argument types
    and trace context; manual mode changes what nnlite layers trace to (their hand rules),
    so it must be in that key, or a ``jax.checkpoint`` traced for autodiff first would be
    reused in manual mode. Registered when nnlite is imported (``nnlite/core/_mode.py``):
    registered later, on first use, it would lengthen the trace context of every call
    after it, so each function traced (or compiled ahead of time) before that first use
    would miss JAX's caches on its next call and be traced and lowered again (the
    trainer's step, compiled ahead of time, was traced twice in every run).
    """
    return config.bool_state(
        "nnlite_manual_grads",
        False,
        "nnlite: tracing in manual-gradient mode (set by nnlite.manual_grads, not by users)",
        include_in_trace_context=True,
    )


@functools.cache
def batch_axis_trace_state():
    """A JAX config state in JAX's trace context: the mapped axis the batch is split over
    (``nnlite.batch_axis``). Batch statistics trace to a ``pmean`` over it, so it must key
    JAX's caches as manual mode does. Registered when nnlite is imported, for the reason
    :func:`manual_trace_state` gives."""
    return config.string_or_object_state(
        "nnlite_batch_axis",
        None,
        "nnlite: the mapped axis the batch is split over (set by nnlite.batch_axis)",
        include_in_trace_context=True,
    )


def user_frames(eqn):
    """``(file, line, function)`` of every user frame that created ``eqn``, innermost first
    (JAX's own frames left out; the caller filters further)."""
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        yield frame.file_name, frame.start_line, frame.function_name


@contextlib.contextmanager
def equation_context(eqn):
    """Trace in ``eqn``'s place: its source line, name stack and context (what
    ``jax.core.eval_jaxpr`` does), so equations made here point at the user's code."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def bind_equation(eqn, invals: list) -> list:
    """Bind ``eqn``'s primitive to ``invals`` as ``jax.core.eval_jaxpr`` does (its params
    made bindable); returns the list of outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with equation_context(eqn):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def tracer_var(x):
    """The jaxpr variable a ``make_jaxpr`` tracer stands for (``None`` for anything else):
    how show_grad finds, in the traced jaxpr, the values a hand-rule call recorded."""
    return getattr(x, "val", None) if isinstance(x, jax.core.Tracer) else None


@contextlib.contextmanager
def shard_map_body(mesh, manual_axes: frozenset, check_vma: bool):
    """The context JAX traces a ``shard_map`` body in: its manual axes bound, the manual
    abstract mesh current, ``check_vma`` set. Rules that show_jaxpr traces itself (the JVP
    rule of a ``custom_jvp`` in the body, ...) need it to see the same types."""
    inner = _shard_map._as_manual_mesh(mesh, frozenset(manual_axes))
    with (
        _shard_map._extend_axis_env(mesh, frozenset(manual_axes)),
        use_abstract_mesh(inner),
        config._check_vma(check_vma),
    ):
        yield


def shape_dtype_struct(aval):
    """A ``jax.ShapeDtypeStruct`` that traces as ``aval``, manual axis types included.

    Inside ``shard_map`` a value's type records the manual axes it varies along
    (``f32[2]{V:batch}``); that needs the aval's sharding, over the manual abstract mesh.
    """
    mat = getattr(aval, "mat", None)
    if mat is None or mat.empty:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
    return jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        weak_type=aval.weak_type,
        sharding=aval.sharding,
        manual_axis_type=mat,
    )


def varying_axes(aval) -> frozenset:
    """The manual mesh axes along which a value inside ``shard_map`` varies (``{V:batch}``).

    Empty outside ``shard_map`` and under ``check_vma=False``.
    """
    return frozenset(getattr(getattr(aval, "mat", None), "varying", ()))


def custom_jvp_rule(eqn):
    """The JVP rule of a ``custom_jvp_call`` as a closed jaxpr.

    Inputs ``(*primals, *tangents)``, outputs ``(*primal_outs, *tangent_outs)``; every
    tangent is instantiated (no symbolic zeros), matching ``symbolic_zeros=False``.
    Returns ``(closed_jaxpr, out_zeros)``: which output tangents the rule left as zeros.
    The rule's constants (arrays it closes over) are the closed jaxpr's consts.
    """
    n = len(eqn.invars) - eqn.params["num_consts"]
    jaxpr, consts, out_zeros = eqn.params["jvp_jaxpr_fun"].call_wrapped(*([False] * n))
    return ClosedJaxpr(jaxpr, list(consts)), list(out_zeros)


def custom_vjp_rules(eqn):
    """The forward and backward rules of a ``custom_vjp_call``.

    Returns ``(fwd, res_fwds, bwd)``: ``fwd`` a closed jaxpr from the primal inputs to
    ``(*residuals_not_forwarded, *outputs)``; ``res_fwds[i]`` the input index a residual
    forwards (or None); ``bwd(*residuals, *cotangents)`` a Python function returning one
    cotangent per primal input, ``None`` where the rule gave a symbolic zero.
    """
    params = eqn.params
    n = len(eqn.invars) - params["num_consts"]
    jaxpr, consts = params["fwd_jaxpr_thunk"].call_wrapped(*([True] * n))
    _, _, input_fwds = params["out_trees"]()
    nc = params["num_consts"]
    res_fwds = [None if f is None else f - nc for f in input_fwds]
    bwd = params["bwd"]

    def bwd_fn(*args: Any):
        return [None if isinstance(ct, Zero) else ct for ct in bwd.call_wrapped(*args)]

    return ClosedJaxpr(jaxpr, list(consts)), res_fwds, bwd_fn


def select_and_scatter_add(source, operand, window_dimensions, window_strides, padding):
    """Add each window's cotangent ``source`` at the position of that window's maximum in
    ``operand`` (the first one on ties): the backward pass of a max pool, as XLA's
    ``SelectAndScatter``. JAX exposes it only as the transpose of its own max-pool JVP."""
    from jax._src.lax import windowed_reductions

    return windowed_reductions._select_and_scatter_add(
        source, operand, jax.lax.ge_p, window_dimensions, window_strides, padding
    )


def dce_call(fn, *args) -> Any:
    """``fn(*args)`` with only the equations its outputs need: traced to a jaxpr, dead code
    eliminated (JAX's ``dce_jaxpr``), evaluated. Used where a rule computes more
    cotangents than are wanted (a frozen weight's), so the caller's trace never holds them.
    """
    from jax._src.interpreters import partial_eval as pe

    flat, in_tree = jax.tree.flatten(args)
    out_tree = []

    def flat_fn(*xs):
        out, tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, list(xs))))
        out_tree.append(tree)
        return out

    closed = jax.make_jaxpr(flat_fn)(*flat)
    jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    from jax.extend.core import jaxpr_as_fun

    outs = jaxpr_as_fun(ClosedJaxpr(jaxpr, closed.consts))(*(x for x, u in zip(flat, used) if u))
    return jax.tree.unflatten(out_tree[0], outs)


def of_current_trace(tree: Any) -> bool:
    """Whether every tracer in ``tree`` belongs to the trace now running: False for one
    recorded inside a transformation that has ended (a custom_vjp function traced apart,
    a vmap), which may not be used here."""
    from jax._src import core

    current = core.trace_ctx.trace
    return all(
        getattr(x, "_trace", current) is current
        for x in jax.tree.leaves(tree)
        if isinstance(x, core.Tracer)
    )


def at_top_level() -> bool:
    """Whether no trace is running (JAX's ``trace_state_clean``): a ``jax.jit`` called here
    compiles a program of its own, and only such a one may carry ``compiler_options``."""
    from jax._src import core

    return core.trace_state_clean()


def backend_started() -> bool:
    """Whether JAX has started a backend in this process (``xla_bridge._backends``, filled
    by the first computation or ``jax.devices()``). A JAX without that dict: a RuntimeError
    naming it, not a guess."""
    from jax._src import xla_bridge

    backends = getattr(xla_bridge, "_backends", None)
    if not isinstance(backends, dict):
        raise RuntimeError(
            "nnlite reads jax._src.xla_bridge._backends (a dict) to tell whether JAX's "
            f"backend has started; this JAX {jax.__version__} has {type(backends).__name__}"
        )
    return bool(backends)


def current_trace() -> Any:
    """The trace now running (JAX's ``trace_ctx.trace``)."""
    from jax._src import core

    return core.trace_ctx.trace


def inner_tracer(x: Any, outer: Any) -> bool:
    """Whether ``x`` is a tracer of a trace other than ``outer`` (nl.summary: inside
    ``jax.vjp`` in the params, a value that depends on them is the vjp's tracer, one that
    does not stays a tracer of the trace outside)."""
    from jax._src import core

    return isinstance(x, core.Tracer) and x._trace is not outer


def lowered_cost_analysis(lowered) -> dict | None:
    """XLA's cost analysis of a lowered (not yet compiled) program: before compilation every
    dot is counted (a GPU's compiled program calls cuBLAS for them, whose FLOPs its own
    analysis leaves out).

    ``Lowered.cost_analysis()`` is implemented only by clients outside the PJRT C API: a
    GPU's CUDA plugin raises ``NotImplementedError`` (JAX turns it into None), which left a
    GPU run with no FLOP count and no MFU. The lowered module is the same on any backend and
    the analysis only reads it, so the CPU client counts it there. None where neither can
    (no CPU backend: ``JAX_PLATFORMS=cuda``)."""
    cost = lowered.cost_analysis()
    if cost is None:
        from jax._src.lib import _jax

        try:
            cpu = jax.devices("cpu")[0].client
        except RuntimeError:
            return None
        cost = _jax.hlo_module_cost_analysis(cpu, lowered.compiler_ir("hlo").as_hlo_module())
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return cost


def result_aval(name: str, avals, shape, dtype):
    """The abstract value of a primitive's result computed from ``avals`` (nnlite's fused
    attention): inside ``shard_map`` it varies along the manual axes its operands do
    (which must agree: :func:`match_varying`), and it carries the current mesh's sharding."""
    from jax._src import core

    core.standard_vma_rule(name, *avals)
    return core.ShapedArray(
        shape,
        dtype,
        sharding=core.get_cur_mesh_sharding(),
        manual_axis_type=avals[0].manual_axis_type,
    )


def match_varying(*xs):
    """``xs`` made to vary along the same manual axes (``pvary`` where one does not), as JAX's
    own binary primitives are before they bind."""
    from jax._src import core

    return core.auto_insert_reshard(*xs)


def partitioned_lowering(ctx) -> bool:
    """Whether ``ctx`` (a lowering rule's context) lowers a program that XLA will partition
    over several devices (``jit`` with shardings, a ``shard_map`` body with automatic axes):
    an opaque custom call there would be replicated, so a rule lowers to XLA ops instead.
    A single device, and a ``shard_map`` body manual along every axis, are not."""
    from jax._src import sharding_impls as si

    axis = ctx.module_context.axis_context
    if isinstance(axis, si.SPMDAxisContext):
        return set(axis.mesh.axis_names) != set(axis.manual_axes)
    if isinstance(axis, si.ShardingContext):
        return axis.num_devices > 1
    if isinstance(axis, si.ReplicaAxisContext):
        return False
    return not isinstance(axis, si.SingleDeviceAxisContext)
