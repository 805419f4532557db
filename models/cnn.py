"""1-D CNN classifier (the MNIST-1D paper's ``ConvBase``): conv layers, then a linear head.

The input is a batch of sequences: ``x [batch, length]`` (one channel, as MNIST-1D's
``[n, 40]``) or ``[batch, length, channels]``. Each conv layer is followed by the activation;
the last one's ``[batch, length', channels']`` output is flattened into the head.
"""

import jax
import jax.numpy as jnp

import nnlite as nl


def conv_length(length: int, kernel_size: int, stride: int, padding: int | str) -> int:
    """Output length of a 1-D convolution (as ``lax.conv_general_dilated`` computes it)."""
    if padding == "SAME":
        return -(-length // stride)
    pad = 0 if padding == "VALID" else 2 * padding
    return max((length + pad - kernel_size) // stride + 1, 0)


def conv_lengths(length: int, convs) -> tuple[int, ...]:
    """The sequence length after each layer of ``convs`` (0 once it has vanished)."""
    out = []
    for _, k, s, p in convs:
        length = conv_length(length, k, s, p) if length > 0 else 0
        out.append(length)
    return tuple(out)


class CNN(nl.Module):
    """``[batch, length(, in_channels)] -> conv (activation) x len(convs) -> flatten -> logits``.

    Args:
        length: input sequence length.
        in_channels: input channels (1 for ``x [batch, length]``).
        convs: ``(out_channels, kernel_size, stride, padding)`` of each conv layer; padding is
            an int (zeros at each end), ``"SAME"`` or ``"VALID"``.
        num_classes: logits per example.
        activation: after every conv layer.

    Params: ``/convs[i]/{W [kernel, in, out], b}`` and ``/head/{W, b}``.
    """

    length: int
    in_channels: int
    convs: tuple[tuple[int, int, int, int | str], ...]
    num_classes: int
    activation: str = "relu"

    task = "classification"
    grad_modes = ("autodiff", "manual")

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "convs", tuple(tuple(c) for c in self.convs))  # hashable
        if not self.convs:
            raise ValueError("CNN: convs must name at least one conv layer")
        if self.out_length < 1:
            raise ValueError(
                f"CNN: the conv stack {self.convs} shrinks an input of length {self.length} "
                f"to lengths {self.lengths}; use smaller kernels or strides, or more padding"
            )

    @property
    def lengths(self) -> tuple[int, ...]:
        """The sequence length after each conv layer."""
        return conv_lengths(self.length, self.convs)

    @property
    def out_length(self) -> int:
        return self.lengths[-1]

    @property
    def conv_layers(self) -> tuple[nl.Conv, ...]:
        ins = (self.in_channels, *(c for c, *_ in self.convs[:-1]))
        # He init for relu-like activations (as nl.FFN picks), LeCun otherwise.
        w_init = "he_normal" if self.activation in ("relu", "gelu") else "lecun_normal"
        return tuple(
            nl.Conv(i, c, k, strides=s, padding=p, w_init=w_init)
            for i, (c, k, s, p) in zip(ins, self.convs, strict=True)
        )

    @property
    def head(self) -> nl.Linear:
        return nl.Linear(self.out_length * self.convs[-1][0], self.num_classes)

    def init(self, key: jax.Array) -> nl.ParamsDict:
        *keys, k_head = jax.random.split(key, len(self.convs) + 1)
        convs = [layer.init(k) for layer, k in zip(self.conv_layers, keys, strict=True)]
        return nl.ParamsDict(convs=convs, head=self.head.init(k_head))

    def features(self, params, x):
        """The flattened output of the conv stack, ``[batch, out_length * channels]``."""
        if x.ndim == 2 and self.in_channels == 1:
            x = x[..., None]
        act = nl.get_activation(self.activation)
        for layer, p in zip(self.conv_layers, params.convs, strict=True):
            x = act(layer(p, x))
        return nl.Flatten(2)(nl.ParamsDict(), x)  # [..., length, channels] -> [..., features]

    def __call__(self, params, x, *, key=None):
        """Logits ``[batch, num_classes]``."""
        return self.head(params.head, self.features(params, x))

    def loss(self, params, x, y):
        """Per-example cross-entropy and ``{"accuracy": per-example 0/1}``."""
        logits = self(params, x)
        return nl.softmax_cross_entropy(logits, y), {"accuracy": nl.accuracy(logits, y)}

    def objective(self, params, x, y, *, grad="autodiff"):
        """Mean loss and metrics, differentiable by ``jax.grad``."""
        per_example, metrics = self.loss(params, x, y)
        return nl.reduce(per_example, "mean"), {k: jnp.mean(v) for k, v in metrics.items()}


def build(cfg, data) -> CNN:
    """The cnn of a model config; a ValueError naming the keys if its stack cannot fit."""
    if data.num_classes is None:
        raise ValueError(
            f"model.name=cnn is a classification model but data.name={data.name} is a "
            f"{data.task} data set"
        )
    length, *rest = data.x.shape[1:]
    n = len(cfg.channels)

    def per_layer(v):
        return tuple(v) if isinstance(v, tuple) else (v,) * n

    convs = tuple(
        zip(
            cfg.channels, per_layer(cfg.kernel_size), per_layer(cfg.strides), per_layer(cfg.padding)
        )
    )
    lengths = conv_lengths(length, convs)
    if min(lengths) < 1:
        raise ValueError(
            f"model.kernel_size/strides/padding shrink the input sequence of length {length} "
            f"to lengths {list(lengths)} over the {n} conv layers of model.channels; every "
            f"layer needs length >= 1: use smaller kernels or strides, more padding, or fewer "
            f"layers"
        )
    return CNN(length, rest[0] if rest else 1, convs, data.num_classes, cfg.activation)
