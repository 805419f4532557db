import jax

import nnlite as nl


# --- model ---
class CNN(nl.Module):
    length: int = 40
    channels: int = 25
    num_classes: int = 10
    dropout: float = 0.1

    uses_key = True

    @property
    def convs(self):
        c = self.channels
        return [nl.Conv(1, c, (5,), 2), nl.Conv(c, c, (3,), 2), nl.Conv(c, c, (3,), 2)]

    @property
    def head(self):
        return nl.Linear(self.channels * -(-self.length // 8), self.num_classes)

    def init(self, key):
        *k_convs, k_head = jax.random.split(key, 4)
        convs = [conv.init(k) for conv, k in zip(self.convs, k_convs)]
        return nl.ParamsDict(convs=convs, head=self.head.init(k_head))

    def __call__(self, params, x, *, key=None):
        h = x[..., None]
        for conv, p in zip(self.convs, params.convs):
            h = nl.relu(conv(p, h))
        h = nl.Dropout(self.dropout)(nl.Flatten(2)(h), key=key)
        return self.head(params.head, h)


# --- end ---


def forward(x, key=None):
    model = CNN()
    return model(model.init(jax.random.key(0)), x, key=key)
