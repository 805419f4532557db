import equinox as eqx
import jax


# --- model ---
class CNN(eqx.Module):
    convs: list
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, length=40, channels=25, num_classes=10, dropout=0.1, *, key):
        k1, k2, k3, k_head = jax.random.split(key, 4)
        c = channels
        self.convs = [
            eqx.nn.Conv1d(1, c, 5, 2, padding="SAME", key=k1),
            eqx.nn.Conv1d(c, c, 3, 2, padding="SAME", key=k2),
            eqx.nn.Conv1d(c, c, 3, 2, padding="SAME", key=k3),
        ]
        self.drop = eqx.nn.Dropout(dropout)
        self.head = eqx.nn.Linear(c * -(-length // 8), num_classes, key=k_head)

    def __call__(self, x, *, key=None):
        h = x[None]
        for conv in self.convs:
            h = jax.nn.relu(conv(h))
        return self.head(self.drop(h.ravel(), key=key, inference=key is None))


# --- end ---


def forward(x, key=None):
    model = CNN(key=jax.random.key(0))
    if key is None:
        return jax.vmap(model)(x)
    return jax.vmap(lambda x, k: model(x, key=k))(x, jax.random.split(key, len(x)))
