"""A small ResNet (He et al. 2016) for small images: residual blocks of Conv + BatchNorm
+ relu, global average pooling, a linear head. A stateful model: BatchNorm's running
statistics are its state (``init_state``; see docs/state.md), trained in train mode and
used in eval mode.

The input is a batch of images ``[batch, H, W(, C)]``, or flat rows ``[batch, H * W]``
(scikit-learn's digits: 64 values per 8x8 image) reshaped to ``image_shape``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

import nnlite as nl


class Block(nl.Module):
    """One residual block: ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; the
    shortcut is the identity, or a strided 1x1 conv + BatchNorm where the block changes the
    channels or the resolution. Params ``/conv1, /bn1, /conv2, /bn2 (, /proj, /bn_proj)``;
    state ``/bn1, /bn2 (, /bn_proj)``."""

    in_features: int
    out_features: int
    strides: int = 1
    kernel_size: int = 3
    momentum: float = 0.9

    @property
    def projects(self) -> bool:
        return self.strides != 1 or self.in_features != self.out_features

    def setup(self):  # the children: init and init_state are derived from them
        k, c_in, c = (self.kernel_size,) * 2, self.in_features, self.out_features
        # no conv bias before a BatchNorm (its bias does that); He init for relu
        conv = dict(use_bias=False, w_init="he_normal")
        self.conv1 = nl.Conv(c_in, c, k, strides=self.strides, **conv)
        self.bn1 = nl.BatchNorm(c, momentum=self.momentum)
        self.conv2 = nl.Conv(c, c, k, **conv)
        self.bn2 = nl.BatchNorm(c, momentum=self.momentum)
        if self.projects:
            self.proj = nl.Conv(c_in, c, (1, 1), strides=self.strides, **conv)
            self.bn_proj = nl.BatchNorm(c, momentum=self.momentum)

    def __call__(self, params, x):
        # Each BatchNorm gets its state and train flag from the call (see docs/state.md).
        h = nl.relu(self.bn1(params.bn1, self.conv1(params.conv1, x)))
        h = self.bn2(params.bn2, self.conv2(params.conv2, h))
        if self.projects:
            x = self.bn_proj(params.bn_proj, self.proj(params.proj, x))
        return nl.relu(h + x)


class ResNet(nl.Module):
    """``image -> conv-bn-relu stem -> residual stages -> global average pool -> logits``.

    Args:
        in_shape: one example's shape, ``(H, W)``, ``(H, W, C)`` or flat ``(H * W,)``
            (reshaped to ``image_shape``); filled from the data set.
        num_classes: logits per example; filled from the data set.
        image_shape: ``[H, W]`` or ``[H, W, C]`` to view flat inputs as (None: ``in_shape``
            itself, or a square one-channel image for flat inputs of a square size).
        channels: output channels of each stage; every stage after the first halves the
            resolution (stride 2).
        blocks: residual blocks per stage.
        kernel_size: of every 3x3-style conv.
        momentum: of every BatchNorm's running statistics.

    Params ``/stem/{conv,bn}``, ``/blocks[i]/...`` (see :class:`Block`), ``/head/{W,b}``;
    state: every BatchNorm's running ``mean`` and ``var`` at the same paths.
    """

    in_shape: tuple[int, ...]
    num_classes: int
    image_shape: tuple[int, ...] | None = None
    channels: tuple[int, ...] = (16, 32)
    blocks: int = 1
    kernel_size: int = 3
    momentum: float = 0.9

    task = "classification"

    def __post_init__(self):
        super().__post_init__()
        if not self.channels or min(self.channels) < 1:
            raise ValueError(
                f"channels must be a non-empty list of positive ints, got {list(self.channels)}"
            )
        for name in ("blocks", "kernel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0 <= self.momentum <= 1:
            raise ValueError(f"momentum must be in [0, 1], got {self.momentum!r}")
        shape = self.image
        if len(shape) not in (2, 3) or min(shape) < 1:
            raise ValueError(
                f"image_shape must be [H, W] or [H, W, C] of positive sizes, got {list(shape)}"
            )
        if math.prod(shape) != math.prod(self.in_shape):
            raise ValueError(
                f"image_shape {list(shape)} holds {math.prod(shape)} values but each example "
                f"has {math.prod(self.in_shape)} (in_shape {list(self.in_shape)})"
            )

    @property
    def image(self) -> tuple[int, ...]:
        """The ``(H, W, C)`` (or ``(H, W)``) an example is viewed as."""
        if self.image_shape is not None:
            return tuple(self.image_shape)
        if len(self.in_shape) == 1:
            side = math.isqrt(self.in_shape[0])
            if side * side != self.in_shape[0]:
                raise ValueError(
                    f"image_shape is required: flat inputs of {self.in_shape[0]} values are "
                    "not a square image; give image_shape: [H, W]"
                )
            return (side, side)
        return tuple(self.in_shape)

    @property
    def in_channels(self) -> int:
        return self.image[2] if len(self.image) == 3 else 1

    def setup(self):  # the children: init and init_state are derived from them
        k, c = (self.kernel_size,) * 2, self.channels[0]
        self.stem = {
            "conv": nl.Conv(self.in_channels, c, k, use_bias=False, w_init="he_normal"),
            "bn": nl.BatchNorm(c, momentum=self.momentum),
        }
        blocks, c_in = [], self.channels[0]
        for stage, c in enumerate(self.channels):
            for i in range(self.blocks):
                strides = 2 if stage > 0 and i == 0 else 1
                blocks.append(Block(c_in, c, strides, self.kernel_size, self.momentum))
                c_in = c
        self.blocks_ = blocks  # params /blocks[i] (the field blocks is the count per stage)
        self.head = nl.Linear(self.channels[-1], self.num_classes)

    def __call__(self, params, x):
        """Logits ``[batch, num_classes]``; called with ``state=`` and ``train=``, it returns
        ``(logits, new_state)`` (train: batch statistics, and updated running ones)."""
        image = self.image if len(self.image) == 3 else (*self.image, 1)
        x = x.reshape(*x.shape[: x.ndim - len(self.in_shape)], *image)
        stem = self.stem
        h = nl.relu(stem["bn"](params.stem.bn, stem["conv"](params.stem.conv, x)))
        for block, p in zip(self.blocks_, params.blocks, strict=True):
            h = block(p, h)
        pooled = jnp.mean(h, axis=(-3, -2))  # global average pooling over H, W
        return self.head(params.head, pooled)
