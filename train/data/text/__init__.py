"""Text: corpora, tokenizers, prepared token files (``nnlite-train prepare``)."""
