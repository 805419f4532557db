"""Glue between layers, with hand rules: the residual and positional-embedding add.

``add`` is the ``add`` primitive's structural rule (``nnlite/grad/_prim_arith.py``, NumPy
broadcasting, summed back in the VJP), declared here with ``@hand_rule`` so that a layer
calling ``nl.add`` records one named step in manual mode and in ``show_grad``.
"""

from __future__ import annotations

from ..grad._manual import hand_rule
from ..grad._prim_arith import add as _add
from ..grad._prim_arith import add_vjp as add_vjp

__all__ = ["add", "add_vjp"]

add = hand_rule(add_vjp)(_add)
