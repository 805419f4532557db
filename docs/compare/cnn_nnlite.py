import jax

import nnlite as nl


# --- model ---
class CNN(nl.Module):
    length: int = 40
    channels: int = 25
    num_classes: int = 10
    dropout: float = 0.1

    def setup(self):
        c = self.channels
        self.convs = [nl.Conv(1, c, (5,), 2), nl.Conv(c, c, (3,), 2), nl.Conv(c, c, (3,), 2)]
        self.drop = nl.Dropout(self.dropout)
        self.head = nl.Linear(c * -(-self.length // 8), self.num_classes)

    def __call__(self, params, x):
        h = x[..., None]
        for conv, p in zip(self.convs, params.convs):
            h = nl.relu(conv(p, h))
        return self.head(params.head, self.drop(nl.Flatten(2)(h)))


# --- end ---


def forward(x, key=None):
    model = CNN()
    return model(model.init(jax.random.key(0)), x, key=key)
