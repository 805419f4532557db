"""The config's ``data`` section: which data set (a built-in's name or a user's factory,
train/data/registry.py) and the settings the built-ins read. No JAX or numpy here."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schema import MAX_SEED, Where, choice
from .registry import NEEDS_PATH, check

PLACEMENTS = ("auto", "device", "host")
# data.eval_windows: null evaluates this many tokens of windows (train/data/feed.py's
# EVAL_TOKENS_PER_CHUNK: one compiled chunk)
EVAL_TOKENS = 2**15


@dataclass(frozen=True)
class DataConfig:
    # A built-in data set (train/data/registry.py), or your factory "module:function"
    # returning a data source (train/data/source.py), called with `options` as keywords
    name: str = "digits"
    options: dict = field(default_factory=dict)  # data.name module:function: its arguments
    # npz: file with arrays x, y (x_test, y_test); text: a UTF-8 file; tokens: a directory
    # written by nnlite-train prepare; arrays: a directory of x.npy, y.npy (x_test.npy,
    # y_test.npy), memory-mapped
    path: str | None = None
    # Where the training set lives: "device" (whole, each step gathers its batch there),
    # "host" (each batch read on the host and sent a call ahead, streamed), or "auto"
    # (device when the training set takes at most 256 MiB there, else host)
    placement: str = choice("auto", PLACEMENTS)
    # digits/npz without x_test: held-out share, stratified; arrays without x_test.npy: the
    # last rows
    test_fraction: float = 0.2
    split_seed: int = 0  # seed of the fixed train/test split
    num_samples: int = 5000  # mnist1d: total examples generated (80% train)
    val_fraction: float = 0.1  # text, shakespeare_char: the tail of the text held out
    # text, shakespeare_char, tokens: the fixed validation windows each evaluation runs;
    # null: as many as hold EVAL_TOKENS tokens (one compiled evaluation chunk: 512 windows
    # of 64, 128 of 256), so a short run does not spend most of its time evaluating
    eval_windows: int | None = None
    # text, shakespeare_char, tokens: tokens per training window; null: the model's context field
    # when the config sets it, else 64. Fills the model's `context`.
    context: int | None = None
    # chat: the Hugging Face directory whose tokenizer and chat template render the
    # conversations; null: the model's (model.name "hf:DIR")
    tokenizer: str | None = None
    # chat: which tokens take a loss: the assistant's (assistant) or every token (all)
    train_on: str = choice("assistant", ("assistant", "all"))
    # chat: several conversations in one window, each attending only to itself
    pack: bool = True

    def eval_windows_for(self, context: int) -> int:
        """The validation windows of ``context`` tokens evaluated (``eval_windows``)."""
        if self.eval_windows is not None:
            return self.eval_windows
        return max(1, EVAL_TOKENS // context)

    def check(self, where: Where) -> None:
        """The rules of the section's values; a user's factory is imported and its
        ``data.options`` checked against its signature."""
        where.at_least("data.", self, ("num_samples", "eval_windows", "context"), 1)
        if not 0 <= self.split_seed <= MAX_SEED:
            raise where.bad("data.split_seed", f"must be in [0, {MAX_SEED}], got {self.split_seed}")
        for key in ("test_fraction", "val_fraction"):
            if not 0.0 < getattr(self, key) < 1.0:
                raise where.bad(f"data.{key}", f"must be in (0, 1), got {getattr(self, key)}")
        if self.name in NEEDS_PATH and not self.path:
            raise where.bad("data.path", f"is required when data.name is {self.name}")
        at = where.sources.get("data.options", where.of("data.name"))
        check(self.name, self.options, where.search, at)
