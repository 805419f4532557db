"""The layers, activations and losses, one family per file, each array function beside its
hand-derived VJP."""
