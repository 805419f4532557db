"""Removed: ``nnlite.vjp.batched`` was a second rule library; its rules are ``nnlite.rules``'."""

from . import BATCHED_GONE

raise ImportError(BATCHED_GONE)
