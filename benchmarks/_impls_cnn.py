"""One 1-D CNN training step (the MNIST-1D paper's ``ConvBase``) written the same five ways
as ``_impls.py`` writes the MLP: raw JAX, Equinox, Flax NNX, nnlite per step and nnlite with
several steps per compiled call.

The model: ``x [batch, length]`` as one input channel, conv layers (``kernel, stride,
padding`` each, relu after each), flatten, a linear head; mean softmax cross-entropy. All
start from nnlite's float32 init, copied into each framework's layout: Equinox's
``Conv1d`` is channels-first (weight ``[out, in, k]``, activations ``[C, L]``), so its head
sees the features in ``(channel, position)`` order and gets its rows permuted to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._impls import Equinox, FlaxNNX, Nnlite, RawJax, peer_rows, xent


@dataclass(frozen=True)
class CnnSpec:
    name: str
    length: int
    convs: tuple[tuple[int, int, int, int], ...]  # (out_channels, kernel, stride, padding)
    classes: int
    batch: int

    @property
    def in_features(self) -> int:  # the data's feature count, as Spec has it
        return self.length

    def describe(self) -> str:
        layers = ", ".join(f"conv{k}/{s} {c}" for c, k, s, _ in self.convs)
        return f"{self.length} -> {layers} (relu) -> flatten -> {self.classes}"

    def nnlite_model(self):
        from models.cnn import CNN

        return CNN.from_convs((self.length,), self.convs, self.classes)

    @property
    def out_length(self) -> int:
        return self.nnlite_model().out_length


# The MNIST-1D paper's ConvBase (3 conv layers of 25 channels), at batch 512.
CNN_SPECS = {"cnn": CnnSpec("cnn", 40, ((25, 5, 2, 1), (25, 3, 2, 1), (25, 3, 2, 1)), 10, 512)}
CNN_TINY = CnnSpec("cnn-tiny", 12, ((3, 3, 2, 1), (4, 3, 1, 1)), 4, 8)


def init_weights(spec: CnnSpec, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """nnlite's init as host ``[(W [k, in, out], b), ..., (W_head [L*C, classes], b)]``."""
    p = spec.nnlite_model().init(jax.random.key(seed))
    layers = [*p.convs, p.head]
    return [(np.asarray(lp.W, np.float32), np.asarray(lp.b, np.float32)) for lp in layers]


def conv1d(x, W, stride: int, padding: int):
    """``x [batch, length, in]``, ``W [k, in, out]`` -> ``[batch, length', out]``."""
    return jax.lax.conv_general_dilated(
        x, W, (stride,), [(padding, padding)], dimension_numbers=("NWC", "WIO", "NWC")
    )


class RawJaxCnn(RawJax):
    """Plain dict params, ``lax.conv_general_dilated`` (NWC), ``jax.jit`` with donation."""

    def loss_fn(self, params, x, y):
        h = x[..., None]
        for i, (_, _, stride, pad) in enumerate(self.spec.convs):
            layer = params[f"conv{i}"]
            h = jax.nn.relu(conv1d(h, layer["W"], stride, pad) + layer["b"])
        h = h.reshape(h.shape[0], -1)
        return xent(h @ params["head"]["W"] + params["head"]["b"], y)

    def reset(self):
        *convs, (Wh, bh) = self.weights
        self.params = {f"conv{i}": {"W": jnp.asarray(W), "b": jnp.asarray(b)}
                       for i, (W, b) in enumerate(convs)}  # fmt: skip
        self.params["head"] = {"W": jnp.asarray(Wh), "b": jnp.asarray(bh)}
        self.opt_state = self.tx.init(self.params)
        self.t = 0


class EquinoxCnn(Equinox):
    """``eqx.nn.Conv1d`` layers and ``eqx.nn.Linear`` in an ``eqx.Module`` (one example,
    channels-first, batch via ``jax.vmap``), ``eqx.filter_jit``, as in Equinox's examples."""

    def reset(self):
        import equinox as eqx

        spec = self.spec
        chans = (1, *(c for c, *_ in spec.convs))
        keys = jax.random.split(jax.random.key(0), len(spec.convs) + 1)

        class ConvNet(eqx.Module):
            convs: list
            head: eqx.nn.Linear

            def __init__(self):
                self.convs = [
                    eqx.nn.Conv1d(cin, c, k, stride=s, padding=p, key=key)
                    for cin, (c, k, s, p), key in zip(chans, spec.convs, keys)
                ]
                flat = spec.out_length * chans[-1]
                self.head = eqx.nn.Linear(flat, spec.classes, key=keys[-1])

            def __call__(self, x):
                h = x[None, :]  # [1, length]: one input channel
                for conv in self.convs:
                    h = jax.nn.relu(conv(h))
                return self.head(h.reshape(-1))

        model = ConvNet()
        *convs, (Wh, bh) = self.weights
        L, C = spec.out_length, chans[-1]
        # nnlite flattens [L, C] position-major; Equinox's [C, L] is channel-major.
        Wh_eqx = Wh.reshape(L, C, -1).transpose(1, 0, 2).reshape(L * C, -1)
        model = eqx.tree_at(
            lambda m: [c.weight for c in m.convs] + [c.bias for c in m.convs]
            + [m.head.weight, m.head.bias],
            model,
            [jnp.asarray(W.transpose(2, 1, 0)) for W, _ in convs]  # [k, in, out] -> [out, in, k]
            + [jnp.asarray(b[:, None]) for _, b in convs]  # Conv1d bias is [out, 1]
            + [jnp.asarray(Wh_eqx.T), jnp.asarray(bh)],
        )  # fmt: skip
        self.model = model
        self.opt_state = self.tx.init(eqx.filter(model, eqx.is_array))
        self.t = 0


class FlaxNNXCnn(FlaxNNX):
    """``nnx.Conv`` (channels-last) and ``nnx.Linear`` layers, ``nnx.Optimizer``, ``nnx.jit``."""

    def reset(self):
        from flax import nnx

        spec = self.spec
        chans = (1, *(c for c, *_ in spec.convs))

        class ConvNet(nnx.Module):
            def __init__(self, rngs):
                self.convs = nnx.List(
                    [
                        nnx.Conv(cin, c, (k,), strides=(s,), padding=[(p, p)], rngs=rngs)
                        for cin, (c, k, s, p) in zip(chans, spec.convs)
                    ]
                )
                self.head = nnx.Linear(spec.out_length * chans[-1], spec.classes, rngs=rngs)

            def __call__(self, x):
                h = x[..., None]
                for conv in self.convs:
                    h = nnx.relu(conv(h))
                return self.head(h.reshape(h.shape[0], -1))

        model = ConvNet(nnx.Rngs(0))
        *convs, (Wh, bh) = self.weights
        for conv, (W, b) in zip(model.convs, convs):
            conv.kernel.value = jnp.asarray(W)
            conv.bias.value = jnp.asarray(b)
        model.head.kernel.value = jnp.asarray(Wh)
        model.head.bias.value = jnp.asarray(bh)
        self.model = model
        self.optimizer = nnx.Optimizer(model, self.tx, wrt=nnx.Param)
        self.t = 0


class NnliteCnn(Nnlite):
    """``models.cnn.CNN`` through the trainer's compiled step (``train.compile_fit``), as
    ``python -m train`` runs it."""

    def params_from_weights(self):
        import nnlite as nl

        layers = [nl.ParamsDict(W=jnp.asarray(W), b=jnp.asarray(b)) for W, b in self.weights]
        return nl.ParamsDict(convs=layers[:-1], head=layers[-1])


def make_data(spec: CnnSpec, n_batches: int, seed: int = 0):
    """Host data: ``X [n, length]`` float32, ``Y [n]`` int32, and each step's row indices."""
    rng = np.random.default_rng(seed)
    n = n_batches * spec.batch
    X = rng.normal(size=(n, spec.length)).astype(np.float32)
    Y = rng.integers(0, spec.classes, size=n).astype(np.int32)
    return X, Y, rng.permutation(n).astype(np.int32).reshape(n_batches, spec.batch)


def build_all_cnn(spec: CnnSpec, *, n_batches: int = 10, steps_per_call: int = 10, lr=1e-3):
    """Every implementation on the same weights, data and optimizer (``optax.adam(lr)``)."""
    weights = init_weights(spec)
    X, Y, idx = make_data(spec, n_batches)
    tx = optax.adam(lr)
    peers = (RawJaxCnn, EquinoxCnn, FlaxNNXCnn, NnliteCnn)
    impls = peer_rows(peers, (spec, weights, X, Y, idx, tx), steps_per_call)
    # every layer's hand VJP (loss.grad: manual) and the trainer's default (auto), side by
    # side with autodiff, one step per call as configs/mnist1d_cnn.yaml runs (XLA:CPU runs
    # convolutions inside a lax.scan ~8x slower)
    for grad in ("manual", "auto"):
        impls.append(NnliteCnn(spec, weights, X, Y, idx, tx, grad=grad))
    return impls
