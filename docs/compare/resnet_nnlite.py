import jax
import jax.numpy as jnp

import nnlite as nl


# --- model ---
class Block(nl.Module):
    channels: int

    def setup(self):
        c = self.channels
        self.conv1, self.bn1 = nl.Conv(c, c, (3, 3), use_bias=False), nl.BatchNorm(c)
        self.conv2, self.bn2 = nl.Conv(c, c, (3, 3), use_bias=False), nl.BatchNorm(c)

    def __call__(self, params, x):
        h = nl.relu(self.bn1(params.bn1, self.conv1(params.conv1, x)))
        return nl.relu(x + self.bn2(params.bn2, self.conv2(params.conv2, h)))


class ResNet(nl.Module):
    channels: int = 16
    depth: int = 2
    num_classes: int = 10

    def setup(self):
        c = self.channels
        self.conv, self.bn = nl.Conv(1, c, (3, 3), use_bias=False), nl.BatchNorm(c)
        self.blocks = [Block(c) for _ in range(self.depth)]
        self.head = nl.Linear(c, self.num_classes)

    def __call__(self, params, x):
        h = nl.relu(self.bn(params.bn, self.conv(params.conv, x)))
        for block, p in zip(self.blocks, params.blocks):
            h = block(p, h)
        return self.head(params.head, jnp.mean(h, axis=(1, 2)))


# --- end ---


def forward(x):
    model = ResNet()
    params, state = model.init(jax.random.key(0)), model.init_state()
    return model(params, x, state=state, train=True)[0]
