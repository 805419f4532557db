"""``python -m train --config configs/NAME.yaml``: nnlite's training CLI (run from the repo root)."""
