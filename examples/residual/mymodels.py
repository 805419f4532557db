"""A model of your own for ``python -m train``: the README's "Write your own module"."""

import jax

import nnlite as nl


class ResidualClassifier(nl.Module):
    """Linear -> residual FFN blocks -> linear head: logits for ``num_classes``."""

    in_features: int  # filled from the data set
    num_classes: int  # filled from the data set
    width: int = 32
    blocks: int = 2

    task = "classification"  # the trainer's loss and metrics: cross-entropy, accuracy

    def init(self, key):
        k_in, k_out, *k_blocks = jax.random.split(key, self.blocks + 2)
        return nl.ParamsDict(
            inp=nl.Linear(self.in_features, self.width).init(k_in),
            blocks=[self.block.init(k) for k in k_blocks],
            out=nl.Linear(self.width, self.num_classes).init(k_out),
        )

    @property
    def block(self):
        return nl.FFN(self.width, (2 * self.width,), self.width, "gelu")

    def __call__(self, params, x, *, key=None):
        h = nl.Linear(self.in_features, self.width)(params.inp, x)
        for p in params.blocks:
            h = nl.add(h, self.block(p, h))  # nl.add: a residual sum with a hand rule
        return nl.Linear(self.width, self.num_classes)(params.out, h)
