"""A model of your own for ``nnlite-train``: the README's "Write your own module"."""

import nnlite as nl


class ResidualClassifier(nl.Module):
    """Linear -> residual FFN blocks -> linear head: logits for ``num_classes``."""

    in_features: int  # filled from the data set
    num_classes: int  # filled from the data set
    width: int = 32
    depth: int = 2

    task = "classification"  # the trainer's loss and metrics: cross-entropy, accuracy

    def setup(self):  # the children, declared once: init(key) is derived from them
        self.inp = nl.Linear(self.in_features, self.width)
        self.blocks = [nl.FFN(self.width, (2 * self.width,), self.width, "gelu")] * self.depth
        self.out = nl.Linear(self.width, self.num_classes)

    def __call__(self, params, x):
        h = self.inp(params.inp, x)
        for block, p in zip(self.blocks, params.blocks):
            h = nl.add(h, block(p, h))  # nl.add: a residual sum with a hand rule
        return self.out(params.out, h)
