"""``python -m train.prepare --input FILE_OR_DIR --out DIR [--tokenizer char|byte|bpe]
...``: tokenise text of any size into memmappable token files (the command's options and
the whole story: train/data/text/prepare.py, docs/data.md)."""

import sys

from .data.text.prepare import main

if __name__ == "__main__":
    sys.exit(main())
