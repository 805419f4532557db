"""1-D CNN classifier (the MNIST-1D paper's ``ConvBase``): conv layers, then a linear head.

The input is a batch of sequences: ``x [batch, length]`` (one channel, as MNIST-1D's
``[n, 40]``) or ``[batch, length, channels]``. Each conv layer is followed by the activation;
the last one's ``[batch, length', channels']`` output is flattened into the head.
"""

from __future__ import annotations

import nnlite as nl

CNN_PADDINGS = ("SAME", "VALID")


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
    """``[batch, length(, in_channels)] -> conv (activation) x len(channels) -> flatten ->
    logits``.

    Args:
        in_shape: one example's shape, ``(length,)`` (one channel) or ``(length,
            in_channels)``; filled from the data set.
        num_classes: logits per example; filled from the data set.
        channels: output channels of each conv layer.
        kernel_size, strides: one for all layers, or one per layer.
        padding: zeros added at each end of the sequence (one int for all layers, or one
            per layer), or ``"SAME"`` (output length ``ceil(length / stride)``) or
            ``"VALID"`` (none).
        activation: after every conv layer.

    Params: ``/convs[i]/{W [kernel, in, out], b}`` and ``/head/{W, b}``.
    """

    in_shape: tuple[int, ...]
    num_classes: int
    channels: tuple[int, ...] = (25, 25, 25)
    kernel_size: int | tuple[int, ...] = (5, 3, 3)
    strides: int | tuple[int, ...] = 2
    padding: int | str | tuple[int | str, ...] = 1
    activation: str = "relu"

    task = "classification"

    def __post_init__(self):
        super().__post_init__()
        if len(self.in_shape) not in (1, 2) or min(self.in_shape) < 1:
            raise ValueError(
                f"in_shape must be (length,) or (length, channels) of sequences, got "
                f"{self.in_shape}"
            )
        if not self.channels or min(self.channels) < 1:
            raise ValueError(
                f"channels must be a non-empty list of positive ints, got {list(self.channels)}"
            )
        n = len(self.channels)
        for key in ("kernel_size", "strides", "padding"):
            v = getattr(self, key)
            if isinstance(v, tuple) and len(v) != n:
                raise ValueError(
                    f"{key} has {len(v)} entries but channels has {n} layers; give one value "
                    "for all layers or one per layer"
                )
        for i, (_, k, st, pad) in enumerate(self.conv_specs):
            if k < 1:
                raise ValueError(f"kernel_size must be >= 1, got {k} (layer {i})")
            if st < 1:
                raise ValueError(f"strides must be >= 1, got {st} (layer {i})")
            if isinstance(pad, str) and pad not in CNN_PADDINGS:
                raise ValueError(
                    f"padding {pad!r} is not one of {', '.join(CNN_PADDINGS)} or a "
                    f"non-negative int (layer {i})"
                )
            if isinstance(pad, int) and pad < 0:
                raise ValueError(f"padding must be >= 0, got {pad} (layer {i})")
        nl.get_activation(self.activation)
        if min(self.lengths) < 1:
            raise ValueError(
                f"kernel_size/strides/padding shrink the input sequence of length "
                f"{self.length} to lengths {list(self.lengths)} over the {n} conv layers of "
                "channels; every layer needs length >= 1: use smaller kernels or strides, "
                "more padding, or fewer layers"
            )

    @classmethod
    def from_convs(cls, in_shape, convs, num_classes: int, activation: str = "relu") -> CNN:
        """The CNN of ``convs``: ``(out_channels, kernel_size, stride, padding)`` per layer."""
        channels, kernels, strides, paddings = zip(*convs, strict=True)
        return cls(tuple(in_shape), num_classes, channels, kernels, strides, paddings, activation)

    def setup(self):  # the children: init is derived from them
        ins = (self.in_channels, *self.channels[:-1])
        # He init for relu-like activations (as nl.FFN picks), LeCun otherwise.
        w_init = "he_normal" if self.activation in ("relu", "gelu") else "lecun_normal"
        self.convs = [
            nl.Conv(i, c, (k,), strides=s, padding=p, w_init=w_init)
            for i, (c, k, s, p) in zip(ins, self.conv_specs, strict=True)
        ]
        self.flatten = nl.Flatten(2)  # [..., length, channels] -> [..., features]
        self.head = nl.Linear(self.out_length * self.channels[-1], self.num_classes)

    @property
    def length(self) -> int:
        return self.in_shape[0]

    @property
    def in_channels(self) -> int:
        return self.in_shape[1] if len(self.in_shape) == 2 else 1

    @property
    def conv_specs(self) -> tuple[tuple[int, int, int, int | str], ...]:
        """``(out_channels, kernel_size, stride, padding)`` of each conv layer."""
        n = len(self.channels)
        per_layer = [
            v if isinstance(v, tuple) else (v,) * n
            for v in (self.kernel_size, self.strides, self.padding)
        ]
        return tuple(zip(self.channels, *per_layer, strict=True))

    @property
    def lengths(self) -> tuple[int, ...]:
        """The sequence length after each conv layer."""
        return conv_lengths(self.length, self.conv_specs)

    @property
    def out_length(self) -> int:
        return self.lengths[-1]

    def features(self, params, x):
        """The flattened output of the conv stack, ``[batch, out_length * channels]``."""
        if x.ndim == 2 and self.in_channels == 1:  # [batch, length]: one channel
            x = x[..., None]
        act = nl.get_activation(self.activation)
        for conv, p in zip(self.convs, params.convs, strict=True):
            x = act(conv(p, x))
        return self.flatten(x)

    def __call__(self, params, x, *, key=None):
        """Logits ``[batch, num_classes]``."""
        return self.head(params.head, self.features(params, x))
