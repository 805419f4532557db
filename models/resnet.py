"""A small ResNet (He et al. 2016) for small images: residual blocks of Conv + BatchNorm
+ relu, global average pooling, a linear head. A stateful model: BatchNorm's running
statistics are its state (``init_state``; see docs/state.md), trained in train mode and
used in eval mode.

The input is a batch of images ``[batch, H, W(, C)]``, or flat rows ``[batch, H * W]``
(scikit-learn's digits: 64 values per 8x8 image) reshaped to ``image_shape``.
"""

from __future__ import annotations

import math

import jax
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

    def layers(self) -> dict[str, nl.Module]:
        k, c_in, c = (self.kernel_size,) * 2, self.in_features, self.out_features
        # no conv bias before a BatchNorm (its bias does that); He init for relu
        conv = dict(use_bias=False, w_init="he_normal")
        out = {
            "conv1": nl.Conv(c_in, c, k, strides=self.strides, **conv),
            "bn1": nl.BatchNorm(c, momentum=self.momentum),
            "conv2": nl.Conv(c, c, k, **conv),
            "bn2": nl.BatchNorm(c, momentum=self.momentum),
        }
        if self.projects:
            out["proj"] = nl.Conv(c_in, c, (1, 1), strides=self.strides, **conv)
            out["bn_proj"] = nl.BatchNorm(c, momentum=self.momentum)
        return out

    def init(self, key: jax.Array) -> nl.ParamsDict:
        layers = self.layers()
        keys = jax.random.split(key, len(layers))
        return nl.ParamsDict(
            **{n: layer.init(k) for (n, layer), k in zip(layers.items(), keys, strict=True)}
        )

    def init_state(self) -> nl.ParamsDict:
        layers = self.layers()
        return nl.ParamsDict(**{n: m.init_state() for n, m in layers.items() if n.startswith("bn")})

    def __call__(self, params, x, *, state, train=False, key=None):
        layers, new = self.layers(), {}

        def conv_bn(conv, bn, h):
            h = layers[conv](params[conv], h)
            h, new[bn] = layers[bn](params[bn], h, state=state[bn], train=train)
            return h

        h = nl.relu(conv_bn("conv1", "bn1", x))
        h = conv_bn("conv2", "bn2", h)
        shortcut = conv_bn("proj", "bn_proj", x) if self.projects else x
        return nl.relu(h + shortcut), nl.ParamsDict(**new)


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

    def stem(self) -> tuple[nl.Conv, nl.BatchNorm]:
        k, c = (self.kernel_size,) * 2, self.channels[0]
        conv = nl.Conv(self.in_channels, c, k, use_bias=False, w_init="he_normal")
        return conv, nl.BatchNorm(c, momentum=self.momentum)

    def residual_blocks(self) -> tuple[Block, ...]:
        out, c_in = [], self.channels[0]
        for stage, c in enumerate(self.channels):
            for i in range(self.blocks):
                strides = 2 if stage > 0 and i == 0 else 1
                out.append(Block(c_in, c, strides, self.kernel_size, self.momentum))
                c_in = c
        return tuple(out)

    @property
    def head(self) -> nl.Linear:
        return nl.Linear(self.channels[-1], self.num_classes)

    def init(self, key: jax.Array) -> nl.ParamsDict:
        blocks = self.residual_blocks()
        k_conv, k_bn, k_head, *keys = jax.random.split(key, len(blocks) + 3)
        conv, bn = self.stem()
        return nl.ParamsDict(
            stem=nl.ParamsDict(conv=conv.init(k_conv), bn=bn.init(k_bn)),
            blocks=[b.init(k) for b, k in zip(blocks, keys, strict=True)],
            head=self.head.init(k_head),
        )

    def init_state(self) -> nl.ParamsDict:
        return nl.ParamsDict(
            stem=nl.ParamsDict(bn=self.stem()[1].init_state()),
            blocks=[b.init_state() for b in self.residual_blocks()],
        )

    def __call__(self, params, x, *, state, train=False, key=None):
        """``(logits [batch, num_classes], new_state)``; ``train``: batch statistics (and
        updated running ones), else the running statistics."""
        image = self.image if len(self.image) == 3 else (*self.image, 1)
        x = x.reshape(*x.shape[: x.ndim - len(self.in_shape)], *image)
        conv, bn = self.stem()
        h, stem_state = bn(
            params.stem.bn, conv(params.stem.conv, x), state=state.stem.bn, train=train
        )
        h = nl.relu(h)
        block_states = []
        for i, block in enumerate(self.residual_blocks()):
            with self.params_scope(f"/blocks[{i}]"):
                h, s = block(params.blocks[i], h, state=state.blocks[i], train=train)
            block_states.append(s)
        pooled = jnp.mean(h, axis=(-3, -2))  # global average pooling over H, W
        new_state = nl.ParamsDict(stem=nl.ParamsDict(bn=stem_state), blocks=block_states)
        return self.head(params.head, pooled), new_state
