"""The backward pass per layer, in training: backward policies by path
(``loss.backward_policies``), each layer's cotangent and gradient norms compiled into the
step (``log.grad_by_layer``), and the layer whose backward first produced a non-finite
cotangent (the non-finite guard's replay).

All three are one ``nl.layer_hook`` (:class:`LayerHook`) around the model's objective, at
trace time: the model's code does not change and nothing runs per step in Python.

- A policy wraps the matching layer's call in ``nl.backward_policy(layer, ...).around``:
  the same forward, the policy in the backward's hand rules.
- A *tap* is an identity with a hand rule (``tap`` / ``tap_vjp``): its cotangent passes
  through unchanged and its second argument, a zero ``[2, 2]`` slot per layer
  differentiated beside the params, receives ``[sum of squares, count of non-finite]`` of
  the cotangent leaving the layer's input (row 0) and arriving at its output (row 1). So
  the step's one backward pass also yields every layer's statistics, reduced over the
  devices like a gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnlite as nl

from ..errors import ConfigError
from ..model import contract, gradmode
from .backward_config import PolicySpec, parse_policies, slash_path
from .step import tree_norm

IN, OUT = 0, 1  # a slot's rows


def _tap(v, slot, row):
    """``v``; its VJP passes the cotangent on and reports it in ``slot[row]``."""
    return v


def tap_vjp(v, slot, row, dret):
    """``(dret, dslot)``: ``dslot[row] = [sum of squares of dret's finite elements, count
    of its non-finite elements]``, zeros elsewhere."""
    d = dret.astype(jnp.float32)
    finite = jnp.isfinite(d)
    stats = jnp.stack([jnp.sum(jnp.where(finite, d * d, 0.0)), jnp.sum(~finite).astype(d.dtype)])
    return dret, jnp.zeros_like(slot).at[row].set(stats.astype(slot.dtype))


_tap.__name__ = "tap"
tap = nl.vjp.custom_vjp(_tap, tap_vjp)


def _is_float(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def tap_tree(tree, slot, row):
    """Every float array of ``tree`` tapped into ``slot[row]`` (the others as they are)."""
    return jax.tree.map(lambda a: tap(a, slot, row) if _is_float(a) else a, tree)


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One layer call of the objective, in forward order."""

    key: str  # its name in metrics and messages: the path (``#2`` for a second call)
    path: str  # where it sits in the model ("" for the model itself)
    depth: int
    param_path: tuple | None  # where its params sit in the model's params (None: unknown)
    float_input: bool  # its input is a float array (a cotangent leaves through it)


def param_index(params) -> dict[int, tuple]:
    """``id`` of each ParamsDict / list node of ``params`` -> its path."""
    out: dict[int, tuple] = {}

    def walk(node, path):
        if isinstance(node, (nl.ParamsDict, dict)):
            out.setdefault(id(node), path)
            for k in node:
                walk(node[k], (*path, k))
        elif isinstance(node, (list, tuple)):
            out.setdefault(id(node), path)
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(params, ())
    return out


class LayerHook:
    """The ``nl.layer_hook`` of a training objective: applies ``policies`` and taps the
    layers named in ``taps`` (``{key: slot}``), recording every call in ``self.layers``."""

    def __init__(self, policies: Sequence[PolicySpec] = (), taps: dict | None = None):
        self.policies = tuple(policies)
        self.taps = taps or {}
        self.layers: list[LayerInfo] = []
        self.matched: dict[int, list[str]] = {}  # policy -> the layers it matched
        self._counts: dict[str, int] = {}
        self._ids: dict[int, tuple] = {}
        self._active: set[int] = set()
        self._apart = 0  # inside a float32-backward layer's call

    def __call__(self, call: nl.LayerCall):
        if id(call.module) in self._active or self._apart:
            # a policy's own call of the same layer, or a layer inside a float32-backward
            # layer (traced apart, in a custom_vjp: its backward is the outer layer's)
            return call.run(*call.args, **call.kwargs)
        if call.depth == 0:
            self._ids = param_index(call.params)
        n = self._counts[call.path] = self._counts.get(call.path, 0) + 1
        name = call.path or type(call.module).__name__
        key = name if n == 1 else f"{name}#{n}"
        args = list(call.args)
        float_input = len(args) >= 2 and _is_float(args[1])
        self.layers.append(
            LayerInfo(key, call.path, call.depth, self._ids.get(id(call.params)), float_input)
        )
        slot = self.taps.get(key)
        if slot is not None and float_input:
            args[1] = tap_tree(args[1], slot, IN)
        run, apart = call.run, False
        if len(args) >= 2 and call.path:
            for i, spec in enumerate(self.policies):
                if spec.matches(call.path):
                    self.matched.setdefault(i, []).append(call.path)
                    run = _with_policy(call.module, spec, run)
                    apart = apart or spec.float32
        self._active.add(id(call.module))
        self._apart += apart
        try:
            out = run(*args, **call.kwargs)
        finally:
            self._active.discard(id(call.module))
            self._apart -= apart
        return out if slot is None else tap_tree(out, slot, OUT)


def _with_policy(module, spec: PolicySpec, run: Callable) -> Callable:
    policy = nl.backward_policy(module, **spec.policy_kwargs())

    def call(params, x, *rest, **kwargs):
        inner = lambda p, h, **kw: run(p, h, *rest, **kw)  # noqa: E731
        return policy.around(inner, params, x, **kwargs)

    return call


def hooked(objective: Callable, hook_of: Callable[[Any], LayerHook]) -> Callable:
    """``objective(params, *args, **kw)`` as ``fn((params, taps), *args, **kw)``, run under
    the hook ``hook_of(taps)`` (taps beside the params: differentiated with them, and
    inside what ``nl.manual_grads`` walks)."""

    def fn(pt, *args, **kwargs):
        params, taps = pt
        with nl.layer_hook(hook_of(taps)):
            return objective(params, *args, **kwargs)

    return fn


@dataclasses.dataclass
class Backward:
    """What the trainer does to a model's backward pass (see the module docstring)."""

    policies: tuple[PolicySpec, ...] = ()
    layers: tuple[LayerInfo, ...] = ()  # the objective's layer calls, in forward order
    by_layer: bool = False  # log.grad_by_layer: the step reports each layer's norms
    matched: tuple[int, ...] = ()  # how many layer calls each policy applies to

    def describe(self) -> str | None:
        """The line under the banner: each policy and how many layers it applies to."""
        if not self.policies:
            return None
        parts = [
            f"{spec.describe()} ({n} layer{'s' * (n != 1)})"
            for spec, n in zip(self.policies, self.matched, strict=False)
        ]
        return "backward policies: " + "; ".join(parts)

    @property
    def active(self) -> bool:
        return bool(self.policies) or self.by_layer

    def zero_taps(self) -> dict:
        return {info.key: jnp.zeros((2, 2), jnp.float32) for info in self.layers}

    def objective(self, objective: Callable, taps: bool) -> Callable:
        """``fn((params, taps), *args, **kw)``: ``objective`` with the policies, and with
        the layers tapped when ``taps``."""
        return hooked(objective, lambda t: LayerHook(self.policies, t if taps else None))

    def layer_metrics(self, tap_grads: dict, grads) -> dict:
        """``cotangent_norm/<layer>`` (of the cotangent leaving its input; nan when it is
        not finite) and ``grad_norm/<layer>`` (of its params' gradient) for each layer
        below the model, from the taps' and the params' gradients (inside the step)."""
        metrics = {}
        for info in self.layers:
            if not info.path:
                continue
            if info.float_input:
                s = tap_grads[info.key][IN]
                metrics[f"cotangent_norm/{info.key}"] = jnp.where(s[1] > 0, jnp.nan, jnp.sqrt(s[0]))
            sub = subtree(grads, info.param_path)
            if sub is not None and jax.tree.leaves(sub):
                metrics[f"grad_norm/{info.key}"] = tree_norm(sub)
        return metrics


def subtree(tree, path: tuple | None):
    """The node of ``tree`` at ``path`` (None when there is none)."""
    if path is None:
        return None
    node = tree
    for p in path:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def discover(objective: Callable, params, *args, policies=(), **kwargs) -> LayerHook:
    """Trace ``objective(params, *args, **kwargs)`` once on shapes (nothing runs) and return
    the hook that saw it: its layer calls, and which policies matched."""
    hook = LayerHook(policies)

    def fn(params, *a, **kw):
        with nl.layer_hook(hook):
            return objective(params, *a, **kw)

    jax.eval_shape(lambda p, a, kw: fn(p, *a, **kw), params, args, kwargs)
    return hook


# -- the non-finite guard: which layer's backward went non-finite first -------------------


def first_bad_layer(layers: Sequence[LayerInfo], stats: dict, grads) -> str | None:
    """The layer whose backward first produced a non-finite value, from one step's tap
    statistics ``{key: [2, 2]}`` and params' gradient: a layer whose output cotangent was
    finite and whose input cotangent (or params' gradient) was not; the innermost such
    layer, and of those the last called forward (the first to run backward). A line such
    as ``cotangent leaving blocks[2].attn``; None when no layer qualifies."""

    def bad(info, row):
        return float(np.asarray(stats[info.key])[row][1]) > 0

    def bad_params(info):
        sub = subtree(grads, info.param_path)
        return sub is not None and not all(np.all(np.isfinite(g)) for g in jax.tree.leaves(sub))

    root = next((i for i in layers if not i.path), None)
    if root is not None and bad(root, OUT):
        return f"cotangent arriving at the model's output ({root.key}), from the loss"
    candidates = []
    for order, info in enumerate(layers):
        if bad(info, OUT):
            continue
        cot = info.float_input and bad(info, IN)
        if cot or bad_params(info):
            candidates.append((order, info, cot))
    inner = [
        c for c in candidates if not any(o is not c and _inside(o[1], c[1]) for o in candidates)
    ]
    if not inner:
        return None
    _, info, cot = max(inner, key=lambda c: c[0])
    if not info.path:  # the model as a whole: no layer to name beyond the leaf
        return None
    return f"cotangent leaving {info.key}" if cot else f"gradient of {info.key}'s params"


def _inside(child: LayerInfo, parent: LayerInfo) -> bool:
    """Whether ``child``'s path lies strictly inside ``parent``'s."""
    if child.depth <= parent.depth:
        return False
    if not parent.path:
        return True
    c, p = slash_path(child.path).split("/"), slash_path(parent.path).split("/")
    return c[: len(p)] == p


# -- building it from the config ----------------------------------------------------------


def build_backward(cfg, model, data, strategy, grad) -> Backward | None:
    """The run's :class:`Backward` (None when the config asks for nothing of it).

    ``grad`` is ``loss.grad`` resolved (``train.model.gradmode.GradMode``). Refuses (one
    ConfigError line) policies without manual gradients, a policy glob that names no
    layer, and per-layer norms with a model's own fused pass."""
    policies = parse_policies(cfg.loss.backward_policies, "the config")
    by_layer = cfg.log.grad_by_layer
    if not policies and not by_layer and not cfg.train.check_grads:
        return None
    if policies and grad.mode != "manual":
        why = f" (loss.grad={grad.describe()}" + (f": {grad.note})" if grad.note else ")")
        raise ConfigError(
            f"loss.backward_policies act on the hand rules and need manual gradients; this "
            f"run differentiates with {grad.mode}{why}; set loss.grad=manual"
        )
    if by_layer and grad.mode == "fused":
        raise ConfigError(
            "log.grad_by_layer needs loss.grad=autodiff or manual (the fused pass has no "
            "layers to measure); this run has loss.grad=fused"
        )
    params = contract.param_shapes(model)
    x, y = gradmode.microbatch(cfg, data, strategy)
    kw = {}
    if contract.uses_key(model):
        kw["key"] = jax.eval_shape(jax.random.key, 0)
    if contract.is_stateful(model):
        kw["state"] = jax.eval_shape(model.init_state)
    objective = contract.objective_fn(model, grad.mode)
    hook = discover(objective, params, x, y, policies=policies, **kw)
    for i, spec in enumerate(policies):
        if i not in hook.matched:
            paths = [slash_path(info.path) for info in hook.layers if info.path]
            shown = ", ".join(dict.fromkeys(paths[:12])) + (", ..." if len(paths) > 12 else "")
            raise ConfigError(
                f"loss.backward_policies[{i}]: layers {spec.layers!r} matches no layer of "
                f"model.name={cfg.model.name}; its layers are {shown or 'none'}"
            )
    matched = tuple(len(hook.matched[i]) for i in range(len(policies)))
    return Backward(policies, tuple(hook.layers), by_layer, matched)


def replay_first_bad_layer(model, grad_mode: str, backward, params, x, y, **kw) -> str | None:
    """Run one step's backward pass on this host's device with every layer tapped (and the
    run's policies), and name the layer whose backward first went non-finite
    (:func:`first_bad_layer`); ``params``, ``x``, ``y``, ``kw`` as the step's objective
    takes them. For the non-finite guard's replay: compiled once, at the failure."""
    policies = backward.policies if backward is not None else ()
    objective = contract.objective_fn(model, grad_mode)
    hook = discover(objective, params, x, y, policies=policies, **kw)
    probe = Backward(policies, tuple(hook.layers), True)
    fn = probe.objective(objective, taps=True)
    if grad_mode == "manual":
        fn = nl.manual_grads(fn)

    @jax.jit
    def grads(params, taps, x, y, kw):
        loss = lambda pt: fn(pt, x, y, **kw)[0]  # noqa: E731
        return jax.grad(loss)((params, taps))

    g, tap_grads = jax.device_get(grads(params, probe.zero_taps(), x, y, kw))
    return first_bad_layer(probe.layers, tap_grads, g)
