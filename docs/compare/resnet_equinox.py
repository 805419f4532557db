import equinox as eqx
import jax
import jax.numpy as jnp


# --- model ---
class Block(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm

    def __init__(self, c, *, key):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv2d(c, c, 3, padding="SAME", use_bias=False, key=k1)
        self.bn1 = eqx.nn.BatchNorm(c, axis_name="batch", mode="batch")
        self.conv2 = eqx.nn.Conv2d(c, c, 3, padding="SAME", use_bias=False, key=k2)
        self.bn2 = eqx.nn.BatchNorm(c, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        h, state = self.bn1(self.conv1(x), state)
        h, state = self.bn2(self.conv2(jax.nn.relu(h)), state)
        return jax.nn.relu(x + h), state


class ResNet(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, channels=16, depth=2, num_classes=10, *, key):
        k_conv, k_head, *k_blocks = jax.random.split(key, depth + 2)
        self.conv = eqx.nn.Conv2d(1, channels, 3, padding="SAME", use_bias=False, key=k_conv)
        self.bn = eqx.nn.BatchNorm(channels, axis_name="batch", mode="batch")
        self.blocks = [Block(channels, key=k) for k in k_blocks]
        self.head = eqx.nn.Linear(channels, num_classes, key=k_head)

    def __call__(self, x, state):
        h, state = self.bn(self.conv(x), state)
        h = jax.nn.relu(h)
        for block in self.blocks:
            h, state = block(h, state)
        return self.head(jnp.mean(h, axis=(1, 2))), state


# --- end ---


def forward(x):
    model, state = eqx.nn.make_with_state(ResNet)(key=jax.random.key(0))
    images = jnp.moveaxis(x, -1, 1)  # channels first
    run = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")
    return run(images, state)[0]
