"""Small pieces several test files share: a user's module on the import path, a user's
project written from a dict, the quiet run settings, tiny configs and models, transformers
imported quietly, a byte-level BPE tokenizer, and the manual-against-autodiff check of a
language model. Not a test file."""

import contextlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import pytest
from _tolerance import assert_close_f32

import nnlite as nl

ROOT = Path(__file__).resolve().parents[1]

# An 8-16-4 MLP (configs/digits_mlp.yaml) on the ``npz`` fixture's data: quick to start.
NPZ_MLP = ["name=run", "data.name=npz", "model.hidden_sizes=[16]"]

# configs/shakespeare_gpt.yaml at test size: one layer of width 16 over 16 tokens, 8
# sequences a batch (the test adds data.path and data.eval_windows).
TINY_GPT = [
    "data.name=text",
    "model.context=16",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "train.batch_size=8",
]

# A user's language model, as source text for their own module (it needs ``jax``,
# ``jax.numpy as jnp`` and ``nnlite as nl`` imported): token + position embeddings, one
# causal transformer block, a linear head.
TINY_LM = '''
class TinyLM(nl.Module):
    """Token + position embeddings, one causal transformer block, a linear head."""

    vocab_size: int
    context: int
    width: int = 16

    task = "language_model"

    def init(self, key):
        k = jax.random.split(key, 4)
        return nl.ParamsDict(
            tok=nl.Embedding(self.vocab_size, self.width).init(k[0]),
            pos=nl.Embedding(self.context, self.width).init(k[1]),
            block=nl.TransformerBlock(self.width, 2, causal=True).init(k[2]),
            head=nl.Linear(self.width, self.vocab_size).init(k[3]),
        )

    def __call__(self, params, x, *, key=None):
        tok = nl.Embedding(self.vocab_size, self.width)(params.tok, x)
        pos = nl.Embedding(self.context, self.width)(params.pos, jnp.arange(x.shape[-1]))
        h = nl.TransformerBlock(self.width, 2, causal=True)(params.block, nl.add(tok, pos))
        return nl.Linear(self.width, self.vocab_size)(params.head, h)
'''


def quiet_log(log_dir) -> list[str]:
    """Overrides: the run's directory under ``log_dir``, no progress bar, no plot."""
    return [f"log.dir={log_dir}", "log.progress=false", "log.plot=false"]


def cli_sets(*overrides: str) -> list[str]:
    """The overrides as the CLI takes them: ``--set`` before each."""
    return [x for o in overrides for x in ("--set", o)]


def fit_config(name: str, log_dir) -> dict:
    """``train.fit``'s config of the tests' small npz classifiers: Adam at 0.01, batches of
    64, every step logged, an evaluation every 5, no checkpoints, quiet logs in ``log_dir``."""
    return {
        "name": name,
        "data": {"name": "npz"},
        "optimizer": {"name": "adam", "learning_rate": 0.01},
        "train": {"batch_size": 64, "log_every": 1, "eval_every": 5},
        "checkpoint": {"every": 0},
        "log": {"dir": str(log_dir), "progress": False, "plot": False},
    }


@contextlib.contextmanager
def user_module(root: Path, name: str, source: str):
    """A user's module ``name`` (``source`` dedented) written into ``root``; inside, ``root``
    is on ``sys.path``; after, it is off it and the module is forgotten. Yields ``root``."""
    (root / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(name, None)


def write_files(root: Path, files: dict[str, str]) -> Path:
    """A user's project: each ``{relative path: text}`` written under ``root`` (dedented,
    leading blank lines dropped), directories made as needed. Returns ``root``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def python_c(code: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def import_transformers(reason: str):
    """``(transformers, torch)`` imported with their import-time warnings silenced (the suite
    turns warnings into errors), transformers' progress bars and info lines off; the test is
    skipped with ``reason`` where either is not installed (test-only extras)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch = pytest.importorskip("torch", reason=reason)
        transformers = pytest.importorskip("transformers", reason=reason)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers, torch


def byte_bpe(text: str, vocab_size: int, specials=("<|endoftext|>",)):
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2's kind) trained on ``text``; the
    caller has checked that ``tokenizers`` is installed (a test-only extra)."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([text], trainer)
    return tok


def assert_lm_manual_grads_close(model, params, tokens, *, ops: int, **call):
    """The next-token loss's gradient through ``nl.manual_grads`` equals autodiff's to
    ``ops`` float32 roundings (tests/_tolerance.py); ``call`` goes to the model. Returns the
    manual gradient."""

    def loss(p):
        logits = model(p, tokens[:, :-1], **call)
        return nl.softmax_cross_entropy(logits, tokens[:, 1:], reduction="mean")

    auto = jax.jit(jax.grad(loss))(params)
    hand = jax.jit(jax.grad(nl.manual_grads(loss)))(params)
    assert_close_f32(hand, auto, ops=ops)
    return hand
