"""Text: corpora, tokenizers, prepared token files (``python -m train.prepare``)."""
