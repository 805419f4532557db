"""The compiled train step, written once for every parallel strategy.

The step carries *flat leaves* of the params and optimizer state (flattened once on the
host, unflattened inside the compiled function), so dispatch never walks a ParamsDict,
and of the model's state (a stateful model's, e.g. BatchNorm's running statistics: updated
by the forward pass, never by the optimizer; an empty list for a stateless model, whose
compiled step is then what it was without state). It
takes the whole (small) data set, already on the device(s), plus a ``[K, batch]`` block of
indices, and runs K optimizer steps with ``lax.scan`` (K=1 is a plain step). Streamed
data (``data.placement: host``) takes the batch itself instead: ``(x, y)`` of ``[K,
batch, ...]``, read on the host and placed a call ahead (``train/data/feed.py``); the rest of
the step is the same code. Params and optimizer state buffers are donated.

How the step is spread over devices (reductions, keys, placement, compilation) is the
business of a strategy object (``train.parallel``); nothing here names a strategy.

Multi-process (``jax.distributed``): the strategy's devices are those of every process;
each process places only its own devices' data and passes its share of the batch indices.

Non-finite steps: with ``nonfinite="stop"`` (the default) the step adds nothing: the loop
reads the per-step losses it returns anyway (a step that breaks the params shows in the
next step's loss, and the replay that explains a stop finds the exact step), so the guard
costs no extra kernel or output. ``"skip"`` and ``"check"`` also report ``nonfinite`` (1.0
when the loss or a new param is not finite), and ``"skip"`` then keeps the old params and
optimizer state. Either way the values stay on the device until the loop looks at them at
a log/eval/checkpoint boundary, so they cost no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import nnlite as nl

from ..model import contract
from ..model import metrics as user_metrics
from ..parallel.base import Strategy
from ..parallel.finite import all_finite
from . import precision


def mean_loss_fn(model, grad: str = "autodiff") -> Callable:
    """``(params, x, y, *, key=None) -> (mean loss, {metric: mean})``, differentiable in mode
    ``grad``: the model's objective, or its task's (see ``train/model/contract.py``)."""
    objective = contract.objective_fn(model, grad)
    if grad == "manual":
        # Every nnlite layer and loss inside runs its hand rule (checked once per
        # trace: a layer without rules is refused by name).
        objective = nl.manual_grads(objective)
    return objective


def uses_key(model) -> bool:
    """Whether training ``model`` needs a random key per step (e.g. dropout): its
    objective then takes ``key=``, derived from the seed and the step number."""
    return contract.uses_key(model)


def tapped_loss_fn(model, grad: str, backward, taps: bool) -> Callable:
    """``((params, taps), x, y, *, key=None) -> (mean loss, metrics)``: :func:`mean_loss_fn`
    with ``backward``'s per-layer policies, and its layers tapped when ``taps``
    (``train/step/backward.py``)."""
    fn = backward.objective(contract.objective_fn(model, grad), taps)
    return nl.manual_grads(fn) if grad == "manual" else fn


def policy_loss_fn(model, grad: str, backward=None) -> Callable:
    """:func:`mean_loss_fn` with ``backward``'s policies, if any (the same signature)."""
    if backward is None or not backward.policies:
        return mean_loss_fn(model, grad)
    fn = tapped_loss_fn(model, grad, backward, taps=False)
    return lambda params, *args, **kw: fn((params, {}), *args, **kw)


def batch_grads_fn(
    model,
    grad: str,
    accum_steps: int,
    strategy: Strategy,
    trainable: Any = None,
    backward=None,
) -> Callable:
    """``(params, state, x, y, key) -> (loss, metrics, grads, state)``: means over the
    global batch, and the model's state after the step's forward pass (None, passed
    through, for a stateless model).

    ``x``/``y`` are this device's share; ``key`` is the step's random key (None for a
    model that takes none, see :func:`uses_key`). With ``accum_steps = k > 1`` the share is
    split into k microbatches whose gradients are summed in one buffer (by the model's own
    accumulating pass when it has one for ``grad``, e.g. the MLP's fused mode) and divided
    by k: the same update as one step on the whole batch, in 1/k of the activation memory.
    ``strategy`` reduces over devices (:class:`train.parallel.base.Strategy`).
    ``trainable``: a tree of bools like the params (None: all train); only the trained
    params are differentiated (the frozen ones are constants of the loss: no weight
    gradient of theirs is computed, by autodiff or by the hand rules), and their gradients
    come out as zeros.
    ``backward`` (a ``train.step.backward.Backward``): per-layer backward policies, and
    with ``by_layer`` each layer's cotangent and gradient norms added to the metrics.

    A stateful model runs in train mode inside ``nl.batch_axis(strategy.axis)``, so its
    batch statistics are those of the global batch on every strategy; with ``accum_steps
    > 1`` its state is threaded through the microbatches (k updates per step, as k
    smaller steps would make).
    """
    tapped = backward is not None and backward.active
    by_layer = tapped and backward.by_layer
    objective = _objective_fn(model, grad, strategy, trainable, backward if tapped else None)
    value_and_grad = jax.value_and_grad(objective, has_aux=True)
    if trainable is not None:
        trained = jax.tree.leaves(trainable)
        if by_layer:  # differentiated: (params, taps), every tap trained
            trained = trained + [True] * len(jax.tree.leaves(backward.zero_taps()))
        value_and_grad = _trained_only(objective, trained)
    accumulate = getattr(model, "accumulate", None) if grad == "fused" else None
    if accumulate is not None and contract.is_stateful(model):
        raise contract.ModelError(
            f"{type(model).__name__} is stateful: its accumulate() pass cannot carry state; "
            f"use loss.grad=autodiff or manual"
        )
    if accum_steps > 1:
        value_and_grad = _microbatched(value_and_grad, accumulate, accum_steps, strategy, grad)

    def batch_grads(params, state, x, y, key=None, scale=None):
        if tapped:  # differentiated: (params, taps); taps {} without by_layer
            params = (params, backward.zero_taps() if by_layer else {})
        (loss, (metrics, state)), grads = value_and_grad(params, state, x, y, key, scale)
        if not tapped:
            loss, metrics, grads = strategy.reduce(
                loss, metrics, grads, local_grads=accumulate is not None
            )
            return loss, metrics, grads, state
        grads, tap_grads = grads  # the taps' sums of squares, then the params' gradients
        tap_grads = strategy.reduce_squares(tap_grads)
        loss, metrics, grads = strategy.reduce(loss, metrics, grads)
        if by_layer:  # sums of squares of a microbatch's cotangents: k^2 the batch's
            unscale = 1.0 if scale is None else 1.0 / scale  # float16: the loss scale's out
            tap_grads = jax.tree.map(lambda s: s * (unscale**2 / accum_steps), tap_grads)
            true_grads = grads if scale is None else jax.tree.map(lambda g: g * unscale, grads)
            metrics = {**metrics, **backward.layer_metrics(tap_grads, true_grads)}
        return loss, metrics, grads, state

    if not contract.is_stateful(model):
        return batch_grads

    def stateful_batch_grads(params, state, x, y, key=None, scale=None):
        with nl.batch_axis(strategy.axis):  # trace time: BatchNorm pmeans over it
            return batch_grads(params, state, x, y, key, scale)

    return stateful_batch_grads


def _objective_fn(model, grad: str, strategy: Strategy, trainable, backward) -> Callable:
    """``(params, state, x, y, key, scale) -> (loss, (metrics, state))``: what a step
    differentiates, the loss over the global batch scaled by float16's loss ``scale``
    (None: unscaled). With a ``backward`` (active), params are ``(params, taps)``; the
    params ``trainable`` leaves out are frozen (``nl.frozen_scope``: the hand rules compute
    no cotangent for them)."""
    if backward is not None:
        loss_fn = tapped_loss_fn(model, grad, backward, backward.by_layer)
    else:
        loss_fn = mean_loss_fn(model, grad)
    keyed = uses_key(model)
    stateful = contract.is_stateful(model)
    frozen_mask = None if trainable is None else [not m for m in jax.tree.leaves(trainable)]

    def scaled_loss(params, state, x, y, key, scale):
        kw = {"key": key} if keyed else {}
        if stateful:
            loss, metrics, state = loss_fn(params, x, y, state=state, **kw)
        else:
            loss, metrics = loss_fn(params, x, y, **kw)
        # float16's loss scale (None otherwise): the gradients come out multiplied by it
        return precision.scale_cotangent(strategy.global_loss(loss), scale), (metrics, state)

    def objective(params, state, x, y, key, scale=None):
        if backward is not None:
            params = (strategy.compute_params(params[0]), params[1])
            model_params = params[0]
        else:
            params = model_params = strategy.compute_params(params)
        if frozen_mask is not None:
            leaves = jax.tree.leaves(model_params)
            frozen = [v for v, m in zip(leaves, frozen_mask, strict=True) if m]
            with nl.frozen_scope(frozen):
                return scaled_loss(params, state, x, y, key, scale)
        return scaled_loss(params, state, x, y, key, scale)

    return objective


def _microbatched(
    value_and_grad: Callable, accumulate, accum_steps: int, strategy: Strategy, grad: str
) -> Callable:
    """``value_and_grad`` over ``accum_steps`` microbatches of this device's share: their
    gradients summed in one buffer (by the model's own ``accumulate`` pass when given) and
    divided by k, their losses and metrics averaged, the model's state threaded through
    them; each microbatch's key folds in its index."""

    def summed(params, state, x, y, key=None, scale=None):
        xs = x.reshape(accum_steps, -1, *x.shape[1:])
        ys = y.reshape(accum_steps, -1, *y.shape[1:])
        acc = jax.tree.map(jnp.zeros_like, params)
        if accumulate is not None:
            acc = strategy.local_accumulator(acc)

        def micro(carry, xyi):
            acc, state = carry
            *xy, i = xyi
            if accumulate is not None:
                loss, metrics, acc = accumulate(params, *xy, acc, grad=grad)
            else:
                k = None if key is None else jax.random.fold_in(key, i)
                (loss, (metrics, state)), g = value_and_grad(params, state, *xy, k, scale)
                acc = jax.tree.map(jnp.add, acc, g)
            return (acc, state), (loss, metrics)

        micro_ids = jnp.arange(accum_steps)
        (acc, state), (losses, metrics) = jax.lax.scan(micro, (acc, state), (xs, ys, micro_ids))
        grads = jax.tree.map(lambda g: g / accum_steps, acc)
        return (jnp.mean(losses), (jax.tree.map(jnp.mean, metrics), state)), grads

    return summed


def _trained_only(objective: Callable, mask: list[bool]) -> Callable:
    """``jax.value_and_grad(objective, has_aux=True)`` that differentiates the leaves of the
    params where ``mask`` is True only; the others get zero gradients (constants, which
    XLA folds away)."""

    def value_and_grad(params, *rest):
        leaves, treedef = jax.tree.flatten(params)
        train = [v for v, m in zip(leaves, mask, strict=True) if m]
        frozen = [v for v, m in zip(leaves, mask, strict=True) if not m]

        def merge(tr, fr):
            it_t, it_f = iter(tr), iter(fr)
            return jax.tree.unflatten(treedef, [next(it_t) if m else next(it_f) for m in mask])

        def of_trained(tr):
            return objective(merge(tr, [jax.lax.stop_gradient(v) for v in frozen]), *rest)

        out, g = jax.value_and_grad(of_trained, has_aux=True)(train)
        return out, merge(g, [jnp.zeros_like(v) for v in frozen])

    return value_and_grad


def tree_norm(tree) -> jax.Array:
    """The L2 norm of every leaf of ``tree`` together, summed in float32."""
    leaves = [jnp.sum(jnp.square(v.astype(jnp.float32))) for v in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(leaves)) if leaves else jnp.float32(0)


VARIADIC_MAX = 1 << 16  # elements: a larger param's three sums are three plain reductions


def _add3(xs, ys):
    return [x + y for x, y in zip(xs, ys, strict=True)]


def global_norms(grads, updates, params) -> dict:
    """``grad_norm``, ``update_norm`` and ``param_norm``: the L2 norm of each tree, in
    float32.

    Each small param's three sums of squares come from one variadic reduction over its
    gradient, update and value (one kernel, its squares fused in), not three: a small
    model's step pays per kernel (the digits MLP's command: ~0.25 s less compile and ~0.08
    s less training on the 2-core VM; on an H200 the GPT-2-small-shaped norms took 1.92 ms
    against 2.03). A param above :data:`VARIADIC_MAX` elements gets three plain
    reductions, which XLA:CPU vectorises (the variadic form took 1.5x their time there).
    Trees whose leaves do not pair up by shape get :func:`tree_norm` each."""
    names, trees = ("grad_norm", "update_norm", "param_norm"), (grads, updates, params)
    leaves = [jax.tree.leaves(t) for t in trees]
    if len({len(ls) for ls in leaves}) != 1 or any(
        len({np.shape(a) for a in trio}) != 1 for trio in zip(*leaves)
    ):
        return {name: tree_norm(t) for name, t in zip(names, trees)}
    zero = jnp.float32(0)
    totals = [zero, zero, zero]
    for trio in zip(*leaves):
        flat = [jnp.square(a.astype(jnp.float32)).reshape(-1) for a in trio]
        if flat[0].size > VARIADIC_MAX:
            sums = [jnp.sum(f) for f in flat]
        else:
            sums = jax.lax.reduce(flat, [zero] * 3, _add3, (0,))
        totals = _add3(totals, sums)
    return {name: jnp.sqrt(t) for name, t in zip(names, totals)}


@dataclass
class Stepper:
    """A compiled multi-step function and the strategy that places its arguments.

    ``run(p_leaves, o_leaves, s_leaves, X, Y, batch) -> (p_leaves, o_leaves, s_leaves,
    metrics[K])``, where ``s_leaves`` are the model state's (``[]`` for a stateless
    model) and ``batch`` is what :meth:`put_indices` returns for a ``[K, B]`` block, or,
    streamed, what :meth:`put_batch` returns (``X``, ``Y`` are then empty tuples).
    """

    strategy: Strategy
    compiled: Callable  # (p_leaves, (o_leaves, s_leaves), X, Y, batch), as strategies compile
    keyed: bool  # the indices travel with their step numbers (a model that takes a key)
    streamed: bool = False  # the step takes (x, y) batches, not indices into X, Y

    def run(self, p_leaves, o_leaves, s_leaves, X, Y, batch):
        # The optimizer and model states travel as one argument (donated together), so a
        # strategy compiles the same five-argument step with or without model state.
        p_leaves, (o_leaves, s_leaves), metrics = self.compiled(
            p_leaves, (o_leaves, s_leaves), X, Y, batch
        )
        return p_leaves, o_leaves, s_leaves, metrics

    @property
    def devices(self) -> list:
        return self.strategy.devices

    def put_state(self, leaves: list) -> list:
        return self.strategy.put_state(leaves)

    def put_data(self, array: np.ndarray) -> Any:
        return self.strategy.put_data(array)

    def put_indices(self, idx: np.ndarray, first_step: int = 0) -> Any:
        """This process's numpy ``[K, B]`` indices of the call whose first step is
        ``first_step``, placed (paired with their step numbers when keyed)."""
        placed = self.strategy.put_indices(idx)
        if not self.keyed:
            return placed
        steps = np.arange(first_step, first_step + idx.shape[0], dtype=np.int32)
        return placed, self.strategy.put_steps(steps)

    def put_batch(self, x: np.ndarray, y: np.ndarray, first_step: int = 0) -> Any:
        """This process's host batch ``x``, ``y`` ``[K, B, ...]`` of the call whose first
        step is ``first_step``, placed (each device only its slice; paired with the step
        numbers when keyed)."""
        placed = self.strategy.put_batch((x, y))
        if not self.keyed:
            return placed
        steps = np.arange(first_step, first_step + x.shape[0], dtype=np.int32)
        return placed, self.strategy.put_steps(steps)

    def get_state(self, leaves: list) -> list:
        """Placed leaves -> one copy each (for evaluation and checkpoints)."""
        return self.strategy.get_state(leaves)

    def abstract_state(self, avals) -> list | None:
        """``ShapeDtypeStruct`` stand-ins for ``put_state(leaves)``, given the leaves' shapes
        and dtypes: what ``run`` can be traced and compiled for ahead of time (None when the
        strategy has no per-leaf sharding: it compiles on its first call)."""
        shardings = self.strategy.state_shardings(avals)
        if shardings is None:
            return None
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(avals, shardings, strict=True)
        ]


def gather_batch(X, Y, idx, window: int | None = None):
    """The batch ``(x, y)`` that indices ``idx [B]`` name in the placed data ``X``, ``Y``.

    ``window=None``: ``idx`` are example rows. ``window=T``: ``X``/``Y`` are token streams
    (``Y`` is ``X`` shifted by one) and ``idx`` are window starts, giving ``[B, T]`` inputs
    and next-token targets, gathered on the device.
    """
    if window is not None:
        idx = idx[:, None] + jnp.arange(window, dtype=idx.dtype)[None, :]
    # The sampler's indices are in range by construction: promising so skips the bounds
    # test and NaN fill of a default gather (the 256x784 gather alone: 85 -> 39 us on the
    # CPU; within noise for the whole MEDIUM step).
    return X.at[idx].get(mode="promise_in_bounds"), Y.at[idx].get(mode="promise_in_bounds")


def step_key(seed: int, step, strategy: Strategy | None = None) -> jax.Array:
    """The random key of training step ``step``: ``fold_in(key(seed), step)``, a pure
    function of both, so a resumed run draws the same dropout masks. Under a data-parallel
    ``strategy`` each device folds in its index too (its share of the batch gets its own
    masks)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return key if strategy is None else strategy.device_key(key)


def build_stepper(
    batch_grads: Callable,
    optimizer: optax.GradientTransformation,
    params_def,
    opt_def,
    strategy: Strategy,
    nonfinite: str = "stop",
    *,
    window: int | None = None,
    key_seed: int | None = None,
    streamed: bool = False,
    state_def=None,
    norms: bool = False,
) -> Stepper:
    """The compiled step for ``strategy`` (see the module docstring).

    ``batch_grads`` is ``batch_grads_fn(model, grad, accum_steps, strategy)``;
    ``state_def`` the tree structure of a stateful model's state (None: stateless). For
    ``nonfinite="skip"`` and ``"check"`` every step also returns a ``nonfinite`` flag (the
    loss and the new params tested), and ``"skip"`` keeps the old state when it is set;
    ``"stop"`` adds nothing (see :func:`step_flags`). ``window``: the data are token
    streams and indices are window starts (:func:`gather_batch`). ``key_seed``: the model
    takes a random key per step, :func:`step_key` of this seed and the step number (the
    indices then travel with their step numbers); None: it takes none. ``streamed``: the
    step takes the batch ``(x, y)`` itself (:meth:`Stepper.put_batch`), not indices.
    ``norms``: each step also returns :func:`global_norms` (on the device, like the loss).
    """
    keyed = key_seed is not None
    state_def = jax.tree.structure(None) if state_def is None else state_def

    def one_step(p_leaves, o_leaves, s_leaves, X, Y, data, step):
        params = jax.tree.unflatten(params_def, p_leaves)
        opt_state = jax.tree.unflatten(opt_def, o_leaves)
        state = jax.tree.unflatten(state_def, s_leaves)
        x, y = data if streamed else gather_batch(X, Y, data, window)
        key = step_key(key_seed, step, strategy) if keyed else None
        scale = precision.loss_scale(opt_state)  # train.precision=float16, else None
        args = (params, state, x, y, key) if scale is None else (params, state, x, y, key, scale)
        loss, metrics, grads, new_state = batch_grads(*args)
        check_replicated(new_state)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, **metrics}
        if scale is not None:
            metrics["loss_scale"] = precision.loss_scale(new_opt_state)
        if norms:
            metrics.update(global_norms(grads, updates, new_params))
            if scale is not None:  # float16: the gradients came out multiplied by the scale
                metrics["grad_norm"] = metrics["grad_norm"] / scale
        if nonfinite != "stop":
            # Non-finite gradients always reach the new params (every optimizer here adds
            # a function of them), so the loss and the new params are all it must read.
            finite = all_finite((loss, new_params))
            metrics["nonfinite"] = 1.0 - finite.astype(loss.dtype)
        if nonfinite == "skip":
            keep = lambda new, old: jnp.where(finite, new, old)
            new_params = jax.tree.map(keep, new_params, params)
            new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
            new_state = jax.tree.map(keep, new_state, state)
        leaves = jax.tree.leaves
        return leaves(new_params), leaves(new_opt_state), leaves(new_state), metrics

    def multi_step(p_leaves, os_leaves, X, Y, batch):
        o_leaves, s_leaves = os_leaves
        data, steps = batch if keyed else (batch, None)
        if jax.tree.leaves(data)[0].shape[0] == 1:
            s = None if steps is None else steps[0]
            first = jax.tree.map(lambda a: a[0], data)
            p_leaves, o_leaves, s_leaves, m = one_step(p_leaves, o_leaves, s_leaves, X, Y, first, s)
            return p_leaves, (o_leaves, s_leaves), jax.tree.map(lambda v: v[None], m)

        def body(carry, xs):
            i, s = xs if keyed else (xs, None)
            p, o, st, m = one_step(*carry, X, Y, i, s)
            return (p, o, st), m

        (p_leaves, o_leaves, s_leaves), m = jax.lax.scan(
            body, (p_leaves, o_leaves, s_leaves), batch
        )
        return p_leaves, (o_leaves, s_leaves), m

    return Stepper(strategy, strategy.compile(multi_step, keyed=keyed), keyed, streamed)


def check_replicated(state) -> None:
    """Under ``shard_map`` the model state comes out replicated (``P()``): a stateful
    layer must make the same update on every device (BatchNorm averages its statistics
    over ``nl.batch_axis``). Refuse, at trace time, a state leaf that varies over the
    mesh, naming it (``pmap`` and ``jit`` have no such types: nothing to check)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        aval = jax.typeof(leaf)
        manual = getattr(aval, "manual_axis_type", None)  # where JAX 0.10 keeps the axes
        varying = manual.varying if manual is not None else getattr(aval, "vma", ())
        if varying:
            raise contract.ModelError(
                f"the model's state {nl.format_path(path)} differs between devices (it "
                f"varies over mesh axis {', '.join(sorted(varying))}): a stateful layer "
                "must average what it stores over nl.current_batch_axis(), as BatchNorm does"
            )


def compile_async(executor: Executor, fn, *args) -> Future:
    """Trace and lower ``fn`` (a ``jax.jit`` function, or a ``Traced`` one when ``args`` is
    empty) on this thread; compile it on ``executor``.

    XLA releases the GIL while it compiles, so several programs compile while this thread
    traces the next one. A later call of ``fn`` with arguments of the same types (shape,
    dtype, weak type and sharding: abstract ``ShapeDtypeStruct`` arguments must carry the
    sharding the real ones will have) finds the executable in jit's caches; wait for the
    future first, or that call compiles the program a second time. The future's result is
    the ``Compiled`` executable; its ``lowered`` attribute the ``Lowered`` program, its
    ``traced`` attribute the ``Traced`` one (whose jaxpr ``nl.flops`` counts).
    """
    traced = fn.trace(*args) if args else fn
    lowered = traced.lower()
    future = executor.submit(lowered.compile)
    future.lowered, future.traced = lowered, traced
    return future


class AfterCompile:
    """``fn`` (a ``jax.jit`` function) while ``job`` (its :func:`compile_async` future)
    may still be compiling it: the first call waits for the job, so that it finds the
    executable in jit's caches rather than compiling the program a second time (a compile
    error is raised there). ``__wrapped__`` is ``fn`` itself, for tracing without waiting
    (``jax.eval_shape``)."""

    def __init__(self, fn, job: Future):
        self.__wrapped__, self._job = fn, job

    def wait(self) -> None:
        """Block until the compile is done (raising its error, if any)."""
        if self._job is not None:
            self._job.result()
            self._job = None

    def __call__(self, *args):
        self.wait()
        return self.__wrapped__(*args)


def step_flags(metrics: dict) -> np.ndarray:
    """A call's per-step non-finite flags as host bools ``[K]``: its ``nonfinite`` metric
    where the stepper reports one, else a non-finite loss (``nonfinite="stop"``)."""
    if "nonfinite" in metrics:
        flags = to_host(metrics["nonfinite"]) != 0
    else:
        flags = ~np.isfinite(to_host(metrics["loss"]))
    return flags.reshape(-1, flags.shape[-1])[0]  # pmap adds a leading device axis


def to_host(x: jax.Array) -> np.ndarray:
    """A numpy copy of ``x``; for an array spread over processes, this process's first shard."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def build_split_eval(model, chunk: int, metrics=()) -> Callable:
    """Jitted ``(params, X, Y) -> {loss, metric: mean}`` over a whole split: the means of
    the model's per-example loss and metrics, computed ``chunk`` examples at a time (a
    ``lax.map``), so a large split (thousands of text windows) never materialises all its
    activations at once. A stateful model's is ``(params, X, Y, state)``, in eval mode.
    ``metrics``: ``(name, function)`` pairs of ``eval.metrics`` (train/model/metrics.py)."""

    @nl.jit
    def evaluate(params, X, Y, *state):
        n = X.shape[0]
        full = n - n % chunk

        def per_example(xy):
            loss, values = user_metrics.per_example(model, params, *xy, *state, metrics=metrics)
            return {"loss": loss, **values}

        parts = []
        if full:
            split = lambda a: a[:full].reshape(full // chunk, chunk, *a.shape[1:])
            values = jax.lax.map(per_example, (split(X), split(Y)))
            parts.append(jax.tree.map(lambda v: v.reshape(full, *v.shape[2:]), values))
        if full < n:
            parts.append(per_example((X[full:], Y[full:])))
        values = jax.tree.map(lambda *v: jnp.concatenate(v), *parts)
        return jax.tree.map(jnp.mean, values)

    return evaluate


def build_chunk_eval(model, metrics=()) -> Callable:
    """Jitted ``(params, x, y, n) -> ({loss, metric: sum}, count)`` over the first ``n``
    rows of one chunk of a split (the rest is padding, so every chunk has one shape): a
    streamed split is evaluated a chunk at a time, its means summed up on the host. A
    stateful model's is ``(params, x, y, n, state)``, in eval mode."""

    @nl.jit
    def sums(params, x, y, n, *state):
        loss, values = user_metrics.per_example(model, params, x, y, *state, metrics=metrics)
        values = {"loss": loss, **values}
        keep = jnp.arange(x.shape[0]) < n

        def masked_sum(v):
            v = v.reshape(v.shape[0], -1)
            return jnp.sum(jnp.where(keep[:, None], v, 0).astype(jnp.float32))

        per_row = loss.reshape(loss.shape[0], -1).shape[1]
        return jax.tree.map(masked_sum, values), n * per_row

    return sums
