import jax

import nnlite as nl


# --- model ---
class ResidualClassifier(nl.Module):
    in_features: int
    num_classes: int
    width: int = 32
    depth: int = 2

    @property
    def block(self):
        return nl.FFN(self.width, (2 * self.width,), self.width, "gelu")

    def init(self, key):
        k_in, k_out, *k_blocks = jax.random.split(key, self.depth + 2)
        return nl.ParamsDict(
            inp=nl.Linear(self.in_features, self.width).init(k_in),
            blocks=[self.block.init(k) for k in k_blocks],
            out=nl.Linear(self.width, self.num_classes).init(k_out),
        )

    def __call__(self, params, x, *, key=None):
        h = nl.Linear(self.in_features, self.width)(params.inp, x)
        for p in params.blocks:
            h = nl.add(h, self.block(p, h))
        return nl.Linear(self.width, self.num_classes)(params.out, h)


# --- end ---


def forward(x):
    model = ResidualClassifier(64, 10)
    return model(model.init(jax.random.key(0)), x)
