"""One MLP training step written five ways: raw JAX, Equinox, Flax NNX, and nnlite (per step
and with several steps per compiled call).

Every implementation starts from the same float32 weights (nnlite's init, copied into each
framework's parameters), trains with the same optimizer on the same batches, and computes
the mean softmax cross-entropy of an ``in -> hidden... (relu) -> classes`` MLP.

Data: the peers take each batch as device arrays passed to the step (the batches are put on
the device once, up front). nnlite does what its training loop does: the data set lives on
the device and each call sends a ``[K, batch]`` block of indices, gathered inside the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclass(frozen=True)
class Spec:
    name: str
    in_features: int
    hidden: tuple[int, ...]
    classes: int
    batch: int

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.in_features, *self.hidden, self.classes)

    def matmul_flops(self) -> int:
        """FLOPs of the matmuls one train step computes: forward ``x @ W`` per layer, the
        weight gradient per layer, and the input gradient of every layer but the first
        (the input is data, so autodiff does not compute its gradient)."""
        s, b = self.sizes, self.batch
        per_layer = [2 * b * i * o for i, o in zip(s[:-1], s[1:])]
        return 2 * sum(per_layer) + sum(per_layer[1:])

    def nnlite_model(self):
        from models.mlp import MLP

        return MLP(self.in_features, self.classes, self.hidden)


SPECS = {
    "small": Spec("small", 64, (32,), 10, 128),
    "medium": Spec("medium", 784, (512, 512), 10, 256),
    "large": Spec("large", 1024, (4096, 4096), 10, 1024),
}
TINY = Spec("tiny", 16, (8, 8), 4, 8)


def nnlite_name(grad: str, steps_per_call: int) -> str:
    """An nnlite row's name: ``nnlite``, ``nnlite manual K=20``, ``nnlite auto K=20``."""
    mode = "" if grad == "autodiff" else f" {grad}"
    k = f" K={steps_per_call}" if steps_per_call > 1 else ""
    return f"nnlite{mode}{k}"


def compile_nnlite(
    model, tx, batch: int, *, grad="autodiff", steps_per_call=1, config=None, **data
):
    """``train.compile_fit``: the trainer's own compiled step for ``model`` with the optimizer
    ``tx`` at ``batch``, ``loss.grad=grad`` (``auto`` resolved as ``python -m train``
    resolves it), ``steps_per_call`` steps a call, the data on the device and nothing logged
    beyond the loss (``log.norms: false``); ``config``: more sections' keys; ``data``:
    ``data=`` or ``tokens=`` as ``train.compile_fit`` takes them."""
    import train

    sections = {
        "train": {"batch_size": batch, "steps_per_call": steps_per_call, "steps": 10**6},
        "loss": {"grad": grad},
        "log": {"norms": False, "progress": False, "plot": False},
        "data": {"placement": "device"},
    }
    for name, keys in (config or {}).items():
        sections[name] = {**sections.get(name, {}), **keys}
    return train.compile_fit(model, sections, optimizer=tx, **data)


def init_weights(spec: Spec, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """nnlite's init of the MLP as host ``[(W [in, out], b [out]), ...]``, float32."""
    p = spec.nnlite_model().init(jax.random.key(seed))
    layers = [*p.ffn.layers, p.head]
    return [(np.asarray(lp.W, np.float32), np.asarray(lp.b, np.float32)) for lp in layers]


def make_data(spec: Spec, n_batches: int, seed: int = 0):
    """Host data: ``X [n, in]`` float32, ``Y [n]`` int32, and each step's row indices."""
    rng = np.random.default_rng(seed)
    n = n_batches * spec.batch
    X = rng.normal(size=(n, spec.in_features)).astype(np.float32)
    Y = rng.integers(0, spec.classes, size=n).astype(np.int32)
    order = rng.permutation(n).astype(np.int32)
    idx = order.reshape(n_batches, spec.batch)  # step s uses rows idx[s % n_batches]
    return X, Y, idx


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class Impl:
    """``reset()`` to the initial weights; ``run(n)`` does n optimizer steps, blocks, and
    returns the last step's loss as a float."""

    name = ""
    steps_per_call = 1
    trains = True  # False: a timing reference that computes no loss (skipped by losses_after)

    def __init__(self, spec, weights, X, Y, idx, tx):
        self.spec, self.weights, self.tx = spec, weights, tx
        self.idx = idx
        self.t = 0
        self.setup(X, Y, idx)
        self.reset()

    def setup(self, X, Y, idx):
        # The peers get the batches as device arrays, one (x, y) pair per distinct step.
        self.batches = [self.batch(X, Y, i) for i in idx]

    def batch(self, X, Y, i):
        """Step inputs ``(x, y)`` on the device for the batch indices ``i``."""
        return jax.device_put(X[i]), jax.device_put(Y[i])

    def reset(self):
        raise NotImplementedError

    def run(self, n: int) -> float:
        raise NotImplementedError


class RawJax(Impl):
    """A plain nested dict of params and ``jax.jit`` with donated params/opt state."""

    name = "raw JAX"

    def loss_fn(self, params, x, y):
        n = len(params)
        for i in range(n):
            layer = params[f"layer{i}"]
            x = x @ layer["W"] + layer["b"]
            if i < n - 1:
                x = jax.nn.relu(x)
        return xent(x, y)

    def setup(self, X, Y, idx):
        super().setup(X, Y, idx)
        tx, loss_fn = self.tx, self.loss_fn

        @partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = step

    def reset(self):
        self.params = {
            f"layer{i}": {"W": jnp.asarray(W), "b": jnp.asarray(b)}
            for i, (W, b) in enumerate(self.weights)
        }
        self.opt_state = self.tx.init(self.params)
        self.t = 0

    def run(self, n):
        params, opt_state, step, batches = self.params, self.opt_state, self.step, self.batches
        nb = len(batches)
        for s in range(self.t, self.t + n):
            x, y = batches[s % nb]
            params, opt_state, loss = step(params, opt_state, x, y)
        self.params, self.opt_state, self.t = params, opt_state, self.t + n
        return float(loss)


class Equinox(Impl):
    """``eqx.nn.MLP``, ``eqx.filter_value_and_grad`` and ``eqx.filter_jit``, as in Equinox's
    examples (batch via ``jax.vmap``)."""

    name = "Equinox"
    donate = "none"  # ``eqx.filter_jit``'s default

    def setup(self, X, Y, idx):
        import equinox as eqx

        super().setup(X, Y, idx)
        tx = self.tx

        @eqx.filter_value_and_grad
        def loss_fn(model, x, y):
            return xent(jax.vmap(model)(x), y)

        @eqx.filter_jit(donate=self.donate)
        def step(model, opt_state, x, y):
            loss, grads = loss_fn(model, x, y)
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        self.step = step

    def reset(self):
        import equinox as eqx

        s = self.spec
        if len(set(s.hidden)) != 1:
            raise ValueError(f"eqx.nn.MLP needs equal hidden sizes, got {s.hidden}")
        model = eqx.nn.MLP(
            s.in_features, s.classes, s.hidden[0], len(s.hidden), jax.nn.relu, key=jax.random.key(0)
        )
        # Equinox stores weight as [out, in].
        model = eqx.tree_at(
            lambda m: [layer.weight for layer in m.layers] + [layer.bias for layer in m.layers],
            model,
            [jnp.asarray(W.T) for W, _ in self.weights] + [jnp.asarray(b) for _, b in self.weights],
        )
        self.model = model
        self.opt_state = self.tx.init(eqx.filter(model, eqx.is_array))
        self.t = 0

    def run(self, n):
        model, opt_state, step, batches = self.model, self.opt_state, self.step, self.batches
        nb = len(batches)
        for s in range(self.t, self.t + n):
            x, y = batches[s % nb]
            model, opt_state, loss = step(model, opt_state, x, y)
        self.model, self.opt_state, self.t = model, opt_state, self.t + n
        return float(loss)


class FlaxNNX(Impl):
    """An ``nnx.Module`` of ``nnx.Linear`` layers, ``nnx.Optimizer(model, tx, wrt=nnx.Param)``,
    ``nnx.value_and_grad`` and ``nnx.jit``, as in the Flax NNX docs."""

    name = "Flax NNX"

    def setup(self, X, Y, idx):
        from flax import nnx

        super().setup(X, Y, idx)

        @nnx.jit
        def step(model, optimizer, x, y):
            def loss_fn(model):
                return xent(model(x), y)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        self.step = step

    def reset(self):
        from flax import nnx

        sizes = self.spec.sizes

        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List(
                    [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
                )

            def __call__(self, x):
                for layer in self.layers[:-1]:
                    x = nnx.relu(layer(x))
                return self.layers[-1](x)

        model = MLP(nnx.Rngs(0))
        for layer, (W, b) in zip(model.layers, self.weights):
            layer.kernel.value = jnp.asarray(W)
            layer.bias.value = jnp.asarray(b)
        self.model = model
        self.optimizer = nnx.Optimizer(model, self.tx, wrt=nnx.Param)
        self.t = 0

    def run(self, n):
        model, optimizer, step, batches = self.model, self.optimizer, self.step, self.batches
        nb = len(batches)
        for s in range(self.t, self.t + n):
            x, y = batches[s % nb]
            loss = step(model, optimizer, x, y)
        self.t += n
        return float(loss)


class Nnlite(Impl):
    """nnlite's training machinery: ``models.mlp.MLP`` and the trainer's compiled step
    (``train.compile_fit``); the data set on the device, ``[K, batch]`` indices sent per
    call, K optimizer steps a call."""

    name = "nnlite"

    def __init__(self, *args, steps_per_call: int = 1, grad: str = "autodiff", **kwargs):
        self.steps_per_call, self.grad = steps_per_call, grad
        self.name = nnlite_name(grad, steps_per_call)
        super().__init__(*args, **kwargs)

    def setup(self, X, Y, idx):
        self.model = self.spec.nnlite_model()
        self.compiled = compiled = self.compile(X, Y, len(idx[0]))  # a train.CompiledFit
        self.stepper, self.X, self.Y = compiled.stepper, compiled.X, compiled.Y
        self.p_def = jax.tree.structure(compiled.params0)
        self._blocks = {}  # (first step % n_batches, K) -> host [K, batch] indices

    def compile(self, X, Y, batch: int):
        """The compiled run: the step gathers each batch from ``X``, ``Y`` on the device (one
        batch of them is the test split the trainer wants)."""
        data = {"train": (X, Y), "test": (X[:batch], Y[:batch])}
        return compile_nnlite(
            self.model,
            self.tx,
            batch,
            grad=self.grad,
            steps_per_call=self.steps_per_call,
            data=data,
        )

    def block(self, t: int, k: int) -> np.ndarray:
        """Host-side indices of steps t..t+k-1 (what the loop's sampler produces)."""
        nb = len(self.idx)
        key = (t % nb, k)
        if key not in self._blocks:
            self._blocks[key] = np.stack([self.idx[(t + j) % nb] for j in range(k)])
        return self._blocks[key]

    def params_from_weights(self):
        """The model's ParamsDict holding ``self.weights``."""
        import nnlite as nl

        layers = [nl.ParamsDict(W=jnp.asarray(W), b=jnp.asarray(b)) for W, b in self.weights]
        return nl.ParamsDict(ffn=nl.ParamsDict(layers=layers[:-1]), head=layers[-1])

    def reset(self):
        params = self.params_from_weights()
        if jax.tree.structure(params) != self.p_def:
            raise ValueError("nnlite benchmark params do not match the model's structure")
        self.p_leaves = self.stepper.put_state(jax.tree.leaves(params))
        self.o_leaves = self.stepper.put_state(jax.tree.leaves(self.tx.init(params)))
        self.t = 0

    def run(self, n):
        # K steps a call; a shorter last call when n is not a multiple of K (as the loop does
        # at an eval/log boundary).
        st, X, Y, block = self.stepper, self.X, self.Y, self.block
        p, o, t, end = self.p_leaves, self.o_leaves, self.t, self.t + n
        while t < end:
            k = min(self.steps_per_call, end - t)
            p, o, _, metrics = st.run(p, o, [], X, Y, st.put_indices(block(t, k), t))
            t += k
        self.p_leaves, self.o_leaves, self.t = p, o, t
        return float(metrics["loss"][-1])


class MatmulFloor(Impl):
    """Not a trainer: only the matmuls of a train step, to bound what any implementation can
    reach. Per step: the forward ``h @ W`` of every layer, then from the top the weight
    gradient ``h^T dz`` (contracting the batch) and the input gradient ``dz W^T`` of every
    layer but the first, with the dimension numbers autodiff gives them; then ``W -= 1e-6 dW``
    so each step depends on the last (no activations, no loss, no Adam). Steps run
    ``steps_per_call`` to a ``lax.scan`` call, so dispatch is amortised too."""

    name = "matmul floor"
    trains = False

    def __init__(self, *args, steps_per_call: int = 1, **kwargs):
        self.steps_per_call = steps_per_call
        super().__init__(*args, **kwargs)

    def setup(self, X, Y, idx):
        super().setup(X, Y, idx)
        k, nb = self.steps_per_call, len(self.batches)
        self.block = jnp.stack([self.batches[j % nb][0] for j in range(k)])  # K steps' inputs

        def one(Ws, x):
            hs = [x]
            for W in Ws:
                hs.append(hs[-1] @ W)
            dz, dWs = hs[-1], [None] * len(Ws)
            for i in reversed(range(len(Ws))):
                dWs[i] = jax.lax.dot_general(hs[i], dz, (((0,), (0,)), ((), ())))
                if i:
                    dz = dz @ Ws[i].T
            return [W - 1e-6 * dW for W, dW in zip(Ws, dWs)]

        self.step = self.scanned(one)

    @staticmethod
    def scanned(one):
        """``one(Ws, x) -> Ws`` over a ``[K, ...]`` block of inputs: one jitted ``lax.scan``
        call, ``Ws`` donated."""

        @partial(jax.jit, donate_argnums=0)
        def steps(Ws, xs):
            Ws, _ = jax.lax.scan(lambda Ws, x: (one(Ws, x), None), Ws, xs)
            return Ws

        return steps

    def reset(self):
        self.Ws = [jnp.asarray(W) for W, _ in self.weights]
        self.t = 0

    def run(self, n):
        if n % self.steps_per_call:
            raise ValueError(
                f"matmul floor: {n} steps is not a multiple of K={self.steps_per_call}"
            )
        Ws = self.Ws
        for _ in range(n // self.steps_per_call):
            Ws = self.step(Ws, self.block)  # (``block``: K steps' inputs)
        self.Ws, self.t = Ws, self.t + n
        return float(jax.tree.leaves(Ws)[-1].ravel()[0])  # (waits for the call)


def peer_rows(classes, args: tuple, steps_per_call: int) -> list:
    """The rows every size has: each of ``classes`` (the peers, nnlite last) on the same
    ``args`` (spec, weights, X, Y, idx, tx), then nnlite at ``steps_per_call`` steps a call
    when that is more than one."""
    rows = [cls(*args) for cls in classes]
    if steps_per_call > 1:
        rows.append(classes[-1](*args, steps_per_call=steps_per_call))
    return rows


def build_all(
    spec: Spec,
    *,
    n_batches: int = 10,
    steps_per_call: int = 10,
    lr: float = 1e-3,
    matmul_floor: bool = False,
):
    """Every implementation on the same weights, data and optimizer (``optax.adam(lr)``);
    with ``matmul_floor``, the :class:`MatmulFloor` reference last."""
    weights = init_weights(spec)
    X, Y, idx = make_data(spec, n_batches)
    tx = optax.adam(lr)
    impls = peer_rows(
        (RawJax, Equinox, FlaxNNX, Nnlite), (spec, weights, X, Y, idx, tx), steps_per_call
    )
    if matmul_floor:
        impls.append(MatmulFloor(spec, weights, X, Y, idx, None, steps_per_call=steps_per_call))
    return impls


def losses_after(impls, n_steps: int) -> dict[str, float]:
    """Reset each implementation that trains, train ``n_steps`` and return its last loss."""
    out = {}
    for impl in (i for i in impls if i.trains):
        impl.reset()
        out[impl.name] = impl.run(n_steps)
        impl.reset()
    return out
