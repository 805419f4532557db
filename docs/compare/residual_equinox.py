import equinox as eqx
import jax


# --- model ---
class ResidualClassifier(eqx.Module):
    inp: eqx.nn.Linear
    blocks: list
    out: eqx.nn.Linear

    def __init__(self, in_features, num_classes, width=32, depth=2, *, key):
        k_in, k_out, *k_blocks = jax.random.split(key, depth + 2)
        self.inp = eqx.nn.Linear(in_features, width, key=k_in)
        self.blocks = [
            eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=k) for k in k_blocks
        ]
        self.out = eqx.nn.Linear(width, num_classes, key=k_out)

    def __call__(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


# --- end ---


def forward(x):
    return jax.vmap(ResidualClassifier(64, 10, key=jax.random.key(0)))(x)
