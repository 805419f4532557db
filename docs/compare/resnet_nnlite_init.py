import jax
import jax.numpy as jnp

import nnlite as nl


# --- model ---
class Block(nl.Module):
    channels: int

    @property
    def layers(self):
        c = self.channels
        conv = nl.Conv(c, c, (3, 3), use_bias=False)
        return {"conv1": conv, "bn1": nl.BatchNorm(c), "conv2": conv, "bn2": nl.BatchNorm(c)}

    def init(self, key):
        keys = jax.random.split(key, 4)
        return nl.ParamsDict({n: m.init(k) for (n, m), k in zip(self.layers.items(), keys)})

    def init_state(self):
        return nl.ParamsDict(
            bn1=self.layers["bn1"].init_state(), bn2=self.layers["bn2"].init_state()
        )

    def __call__(self, params, x, *, state, train=False, key=None):
        m = self.layers
        h = m["conv1"](params.conv1, x)
        h, s1 = m["bn1"](params.bn1, h, state=state.bn1, train=train)
        h = m["conv2"](params.conv2, nl.relu(h))
        h, s2 = m["bn2"](params.bn2, h, state=state.bn2, train=train)
        return nl.relu(x + h), nl.ParamsDict(bn1=s1, bn2=s2)


class ResNet(nl.Module):
    channels: int = 16
    depth: int = 2
    num_classes: int = 10

    @property
    def stem(self):
        c = self.channels
        return nl.Conv(1, c, (3, 3), use_bias=False), nl.BatchNorm(c)

    def init(self, key):
        k_conv, k_head, *k_blocks = jax.random.split(key, self.depth + 2)
        conv, bn = self.stem
        return nl.ParamsDict(
            conv=conv.init(k_conv),
            bn=bn.init(k_conv),
            blocks=[Block(self.channels).init(k) for k in k_blocks],
            head=nl.Linear(self.channels, self.num_classes).init(k_head),
        )

    def init_state(self):
        blocks = [Block(self.channels).init_state() for _ in range(self.depth)]
        return nl.ParamsDict(bn=self.stem[1].init_state(), blocks=blocks)

    def __call__(self, params, x, *, state, train=False, key=None):
        conv, bn = self.stem
        h, s_bn = bn(params.bn, conv(params.conv, x), state=state.bn, train=train)
        h, s_blocks = nl.relu(h), []
        for p, s in zip(params.blocks, state.blocks):
            h, s = Block(self.channels)(p, h, state=s, train=train)
            s_blocks.append(s)
        logits = nl.Linear(self.channels, self.num_classes)(params.head, jnp.mean(h, axis=(1, 2)))
        return logits, nl.ParamsDict(bn=s_bn, blocks=s_blocks)


# --- end ---


def forward(x):
    model = ResNet()
    params, state = model.init(jax.random.key(0)), model.init_state()
    return model(params, x, state=state, train=True)[0]
