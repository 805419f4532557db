"""``python -m train.prepare`` and the token-file reader: tokenizers and their round trips,
the file format, bad inputs, interrupted runs, window sampling and the prefetcher."""

import doctest
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _inject
import numpy as np
import pytest

from train import prepare
from train.config import ConfigError, DataConfig
from train.data import prefetch
from train.data.builtin import text_dataset
from train.data.dataset import WindowIndices, host_batch
from train.data.prefetch import Prefetcher, PrefetchError
from train.data.text import corpus as text
from train.data.text import sources, staging, tokenizer, tokens
from train.data.text.tokens import TokenFiles, process_share, window_starts

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the", "King", "naïve", "Größe", "日本語", "🎉", "ça", "tab\tstop", "  two  spaces",
    "line\r\n", "\n", "\n\n", "x", "<|endoftext|>", "end.", "é", "ü",
)  # fmt: skip


def make_text(lines: int, seed: int = 0) -> str:
    """ASCII, multi-byte UTF-8 (2, 3, 4 bytes), tabs, CRLF, runs of spaces and newlines."""
    rng = random.Random(seed)
    return "".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + "\n" for _ in range(lines)
    )


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1000 bytes (cut inside multi-byte characters) and bpe pieces of 300."""
    monkeypatch.setattr(sources, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(sources, "BPE_PIECE_CHARS", 300)


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = prepare.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def prepared(capsys, src, out, *options) -> TokenFiles:
    rc, _, err = run(capsys, "--input", src, "--out", out, *options)
    assert rc == 0, err
    return TokenFiles(out, verify=True)


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".prepare-" in p.name or ".replaced-" in p.name]


# -- each tokenizer -------------------------------------------------------------------------


def test_char_matches_the_text_data_set_and_drops_unseen_validation_chars(
    tmp_path, capsys, small_chunks
):
    corpus = make_text(400) + "only in validation: ☃\n"
    (tmp_path / "a.txt").write_text(corpus, encoding="utf-8", newline="")
    data = prepared(capsys, tmp_path / "a.txt", tmp_path / "out", "--val-fraction", "0.2")
    old = text.encode_corpus(corpus, 0.2)  # how data.name: text encodes the same file
    assert data.tokenizer.vocab == old.vocab and data.vocab_size == len(old.vocab)
    np.testing.assert_array_equal(data.train, old.train)
    np.testing.assert_array_equal(data.val, old.val)
    assert data.dtype == np.uint8
    dropped = data.meta["dropped_val_chars"]
    assert dropped == {"count": old.dropped_count, "chars": old.dropped} and "☃" in old.dropped
    train_text = corpus[: int(len(corpus) * 0.8)]
    assert data.tokenizer.decode(data.train) == train_text
    assert data.tokenizer.decode(data.tokenizer.encode(train_text)) == train_text
    with pytest.raises(ConfigError, match="outside the vocabulary: '☃'"):
        data.tokenizer.encode("☃")
    # the batches and evaluation windows of a run are those of data.name: text
    context, batch_size = 16, 8
    cfg = DataConfig(name="text", val_fraction=0.2, eval_windows=40)
    ds = text_dataset("text", corpus, cfg, context)
    sampler = WindowIndices(5, ds.num_indices, batch_size)
    for step in (0, 1, 99):
        starts = window_starts(5, step, batch_size, data.num_starts(context))
        for new, old in zip(data.windows(starts, context), host_batch(ds, sampler.batch(step))):
            np.testing.assert_array_equal(new, old)
    x_val, y_val = data.windows(data.eval_starts(context, 40), context, split="val")
    np.testing.assert_array_equal(x_val, ds.x_test)
    np.testing.assert_array_equal(y_val, ds.y_test)


def test_byte_tokens_are_the_file_bytes(tmp_path, capsys, small_chunks):
    raw = make_text(300).encode("utf-8")
    (tmp_path / "a.txt").write_bytes(raw)
    data = prepared(capsys, tmp_path / "a.txt", tmp_path / "out", "--tokenizer", "byte")
    assert data.dtype == np.uint8 and data.vocab_size == 256
    n = int(len(raw) * 0.9)
    assert data.train.tobytes() == raw[:n] and data.val.tobytes() == raw[n:]
    tok = data.tokenizer
    whole = raw.decode("utf-8")
    assert tok.decode(tok.encode(whole)) == whole
    assert tok.decode(tok.encode("日")[:2]) == "\ufffd"  # a cut character, not an exception


def test_bpe_round_trip_is_exact(tmp_path, capsys, small_chunks):
    corpus = make_text(600)
    (tmp_path / "a.txt").write_text(corpus, encoding="utf-8", newline="")
    out = tmp_path / "out"
    data = prepared(capsys, tmp_path / "a.txt", out, "--tokenizer", "bpe", "--vocab-size", "400")
    tok = data.tokenizer
    assert data.dtype == np.uint16 and data.vocab_size == tok.vocab_size <= 400
    assert (out / "tokenizer.json").is_file() and tok.eot_id == 0
    # each split's part of the file ends with <|endoftext|>; decoding skips it
    assert data.train[-1] == data.val[-1] == tok.eot_id
    assert tok.decode(data.train) + tok.decode(data.val) == corpus
    for s in (corpus, " lead", "trail  \n\n", "\r\n\t x", "<|endoftext|>", "🎉é日", ""):
        assert tok.decode(tok.encode(s)) == s
    assert tok.eot_id not in tok.encode("a <|endoftext|> b").tolist()  # text stays text
    assert len(tok.encode(corpus)) < 0.6 * len(corpus.encode())  # it did learn merges
    spec = tokenizer.to_spec(tok)  # what a checkpoint can carry instead of the directory
    assert tokenizer.from_spec(spec).decode(tok.encode(corpus)) == corpus
    assert tokenizer.from_dir(out).encode(corpus).tolist() == tok.encode(corpus).tolist()


def test_dtype_is_the_smallest_that_holds_the_vocabulary(tmp_path, capsys):
    wide = "".join(chr(0x4E00 + i) for i in range(300)) * 3  # 300 characters: > uint8
    (tmp_path / "wide.txt").write_text(wide, encoding="utf-8")
    data = prepared(capsys, tmp_path / "wide.txt", tmp_path / "a")
    assert data.dtype == np.uint16 and data.vocab_size == 300
    rc, _, err = run(capsys, "--input", tmp_path / "wide.txt", "--out", tmp_path / "b", "--dtype", "uint8")  # fmt: skip
    assert rc == 2 and "300 ids do not fit --dtype uint8 (at most 256)" in err
    assert not (tmp_path / "b").exists() and no_leftovers(tmp_path)
    data = prepared(capsys, tmp_path / "wide.txt", tmp_path / "c", "--tokenizer", "byte", "--dtype", "uint32")  # fmt: skip
    assert data.dtype == np.uint32 and data.train.tobytes() != b""
    assert bytes(data.train.astype(np.uint8)) == wide.encode()[: len(data.train)]
    assert prepare.smallest_dtype(256) == "uint8" and prepare.smallest_dtype(257) == "uint16"
    assert prepare.smallest_dtype(65536) == "uint16" and prepare.smallest_dtype(65537) == "uint32"


# -- the input rules, the format, determinism ----------------------------------------------


def test_directory_files_in_sorted_order_split_per_file(tmp_path, capsys):
    src = tmp_path / "src"
    files = {"b.txt": "bbbb" * 30, "a/z.txt": "zz" * 50, "a/y.rst": "yyy" * 10, "c.txt": ""}
    for name, body in {**files, ".hidden.txt": "hidden", ".git/x.txt": "git"}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(body)
    data = prepared(capsys, src, tmp_path / "out", "--tokenizer", "byte", "--val-fraction", "0.25")  # fmt: skip
    order = ["a/y.rst", "a/z.txt", "b.txt", "c.txt"]
    assert [s["path"] for s in data.meta["sources"]] == order
    assert [s["bytes"] for s in data.meta["sources"]] == [len(files[n]) for n in order]
    cut = [int(len(files[n]) * 0.75) for n in order]
    assert data.train.tobytes().decode() == "".join(files[n][:c] for n, c in zip(order, cut))
    assert data.val.tobytes().decode() == "".join(files[n][c:] for n, c in zip(order, cut))
    data = prepared(capsys, src, tmp_path / "txt", "--tokenizer", "byte", "--glob", "*.txt")
    assert [s["path"] for s in data.meta["sources"]] == ["a/z.txt", "b.txt", "c.txt"]
    # an --out inside --input is not read back as input next time
    prepared(capsys, src, src / "tokens", "--tokenizer", "byte")
    data = prepared(capsys, src, src / "tokens", "--tokenizer", "byte", "--force")
    assert [s["path"] for s in data.meta["sources"]] == order


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_prepare_is_deterministic_and_meta_checks_out(tmp_path, capsys, small_chunks, kind):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text(make_text(150, seed=i), encoding="utf-8")
    extra = ["--vocab-size", "300"] if kind == "bpe" else []
    a = prepared(capsys, src, tmp_path / "a", "--tokenizer", kind, *extra)
    prepared(capsys, src, tmp_path / "b", "--tokenizer", kind, *extra)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(["meta.json", "train.bin", "val.bin"] + ["tokenizer.json"] * (kind == "bpe"))  # fmt: skip
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    meta = a.meta
    assert meta["format_version"] == prepare.FORMAT_VERSION and meta["tokenizer"]["kind"] == kind
    assert meta["train"]["tokens"] == len(a.train) > 0 and meta["val"]["tokens"] == len(a.val) > 0
    assert meta["val_fraction"] == 0.1 and "int(n * (1 - val_fraction))" in meta["split"]
    # a damaged file: the cheap check sees a wrong size, verify=True a wrong checksum
    train_bin = tmp_path / "a" / "train.bin"
    raw = bytearray(train_bin.read_bytes())
    raw[len(raw) // 2] ^= 1
    train_bin.write_bytes(raw)
    TokenFiles(tmp_path / "a")
    with pytest.raises(ConfigError, match="sha256 .* does not match meta.json"):
        TokenFiles(tmp_path / "a", verify=True)
    train_bin.write_bytes(raw[:-2])
    with pytest.raises(ConfigError, match="bytes, but meta.json says"):
        TokenFiles(tmp_path / "a")


def test_existing_out_is_kept_unless_force(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is fine
    prepared(capsys, tmp_path / "a.txt", out)
    (out / "mine.txt").write_text("keep me")
    rc, _, err = run(capsys, "--input", tmp_path / "a.txt", "--out", out, "--tokenizer", "byte")
    assert rc == 2 and "exists and is not empty" in err and "--force" in err
    assert (out / "mine.txt").exists() and TokenFiles(out).meta["tokenizer"]["kind"] == "char"
    data = prepared(capsys, tmp_path / "a.txt", out, "--tokenizer", "byte", "--force")
    assert data.meta["tokenizer"]["kind"] == "byte" and not (out / "mine.txt").exists()
    assert no_leftovers(tmp_path)


# -- bad input: one line, exit 2 ---------------------------------------------------------------


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    return tmp_path / "fifo"


def _bad_inputs(tmp_path):
    """name -> (input path, options, expected message)."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "nul.txt").write_bytes(b"text\x00more")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "cut.txt").write_bytes("日本".encode()[:-1])
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empties").mkdir()
    (tmp_path / "empties" / "a.txt").write_bytes(b"")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("fine\n")
    (tmp_path / "mixed" / "b.bin").write_bytes(bytes(range(256)))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "ok.txt").write_text("ok text\n" * 10)
    (tmp_path / "a_file").write_text("x")
    ok = tmp_path / "ok.txt"
    return {
        "missing": (tmp_path / "nope", [], "no such file or directory"),
        "broken symlink": (tmp_path / "dangling", [], "a broken symbolic link"),
        "empty file": (tmp_path / "empty.txt", [], "the file is empty"),
        "empty dir": (tmp_path / "empty_dir", [], "no files to read"),
        "only empty files": (tmp_path / "empties", [], "all 1 files are empty"),
        "NUL byte": (tmp_path / "nul.txt", [], "is binary (a NUL byte at offset 4)"),
        "NUL byte bpe": (tmp_path / "nul.txt", ["--tokenizer", "bpe"], "is binary"),
        "binary in a dir": (tmp_path / "mixed", [], "b.bin is binary"),
        "latin-1": (tmp_path / "latin1.txt", [], "is not UTF-8 text (byte 0xe9 near offset 0)"),
        "cut UTF-8": (tmp_path / "cut.txt", [], "is not UTF-8 text"),
        "FIFO": (_fifo(tmp_path), [], "is not a regular file"),
        "unknown tokenizer": (ok, ["--tokenizer", "word"], "--tokenizer 'word': expected one of char, byte, bpe"),
        "unknown dtype": (ok, ["--dtype", "int8"], "--dtype 'int8': expected auto"),
        "vocab too large": (ok, ["--tokenizer", "bpe", "--vocab-size", str(2**32 + 1)], "too large for the largest token dtype, uint32"),
        "vocab too small": (ok, ["--tokenizer", "bpe", "--vocab-size", "256"], "too small for bpe, which needs at least 257"),
        "vocab vs dtype": (ok, ["--tokenizer", "bpe", "--vocab-size", "300", "--dtype", "uint8"], "300 ids do not fit --dtype uint8"),
        "vocab for char": (ok, ["--vocab-size", "100"], "only --tokenizer bpe takes a vocabulary size"),
        "val 0": (ok, ["--val-fraction", "0"], "--val-fraction 0.0: expected a number in (0, 1)"),
        "val 1": (ok, ["--val-fraction", "1"], "expected a number in (0, 1)"),
        "val nan": (ok, ["--val-fraction", "nan"], "expected a number in (0, 1)"),
        "val word": (ok, ["--val-fraction", "some"], "invalid float value: 'some'"),
        "tiny train": (tmp_path / "a_file", [], "the train split came out empty"),
        "tiny val": (ok, ["--val-fraction", "1e-17"], "the val split came out empty"),
        "out is a file": (ok, ["--out", tmp_path / "a_file"], "exists and is not a directory"),
        "out under a file": (ok, ["--out", tmp_path / "a_file" / "sub"], "is not a directory"),
    }  # fmt: skip


@pytest.fixture
def bad_inputs(tmp_path):
    return _bad_inputs(tmp_path)


BAD_NAMES = [
    "missing", "broken symlink", "empty file", "empty dir", "only empty files", "NUL byte",
    "NUL byte bpe", "binary in a dir", "latin-1", "cut UTF-8", "FIFO", "unknown tokenizer",
    "unknown dtype", "vocab too large", "vocab too small", "vocab vs dtype", "vocab for char",
    "val 0", "val 1", "val nan", "val word", "tiny train", "tiny val", "out is a file", "out under a file",
]  # fmt: skip


def test_every_bad_input_is_tested(tmp_path):
    assert sorted(BAD_NAMES) == sorted(_bad_inputs(tmp_path))


def assert_one_line_error(rc: int, out: str, err: str, expected: str) -> None:
    assert rc == 2, err
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("error: ") and expected in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, bad_inputs, name):
    src, options, expected = bad_inputs[name]
    out = tmp_path / "out"
    argv = ["--input", src, "--out", out, *options]
    rc, stdout, err = run(capsys, *argv)
    assert_one_line_error(rc, stdout, err, expected)
    assert not out.exists() and no_leftovers(tmp_path)


def test_byte_reads_any_bytes(tmp_path, capsys):
    (tmp_path / "b.bin").write_bytes(bytes(range(256)) * 4)
    data = prepared(capsys, tmp_path / "b.bin", tmp_path / "out", "--tokenizer", "byte")
    assert np.concatenate([data.train, data.val]).tolist() == list(range(256)) * 4


def test_unreadable_directory_and_file(tmp_path, capsys, monkeypatch):
    """Permission denied (tests run as root, whom chmod does not stop: simulated)."""
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "a.txt").write_text("text\n")
    real_scandir = os.scandir

    def scandir(path="."):
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    rc, out, err = run(capsys, "--input", tmp_path / "d", "--out", tmp_path / "o")
    assert_one_line_error(rc, out, err, "cannot list")
    assert "sub (Permission denied)" in err
    monkeypatch.undo()

    def denied(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sources, "open", denied, raising=False)
    rc, out, err = run(capsys, "--input", tmp_path / "d", "--out", tmp_path / "o")
    assert_one_line_error(rc, out, err, "cannot read sub/a.txt (Permission denied)")
    assert not (tmp_path / "o").exists() and no_leftovers(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_for_real(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "a.txt").chmod(0)
    rc, out, err = run(capsys, "--input", tmp_path / "a.txt", "--out", tmp_path / "o")
    assert_one_line_error(rc, out, err, "cannot read a.txt (Permission denied)")


def cli(*argv, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train.prepare", *map(str, argv)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env, **kw,
    )  # fmt: skip


def test_cli_help_and_bad_input_in_a_subprocess(tmp_path):
    p = cli("--help")
    assert p.returncode == 0 and "--tokenizer {char,byte,bpe}" in p.stdout
    (tmp_path / "b.txt").write_bytes(b"\x00\x01\x02")
    p = cli("--input", tmp_path / "b.txt", "--out", tmp_path / "o")
    assert_one_line_error(p.returncode, p.stdout, p.stderr, "b.txt is binary (a NUL byte")
    p = cli("--input", tmp_path / "b.txt")
    assert_one_line_error(p.returncode, p.stdout, p.stderr, "the following arguments are required: --out")  # fmt: skip


# -- interrupted runs leave nothing half-written -------------------------------------------


def has_tokens(staged: Path) -> bool:
    return (staged / "train.bin").exists() and (staged / "train.bin").stat().st_size > 0


def start_paused(tmp_path, out, *options, ready=has_tokens) -> tuple[subprocess.Popen, Path]:
    """A prepare of 3 files that sleeps after each chunk; returns once ``ready(its
    staging directory)``, by default once it has written part of train.bin there."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i in range(3):
        (src / f"{i}.txt").write_text(make_text(200, seed=i))
    argv = ["prepare", "--input", src, "--out", out, *options]
    proc = subprocess.Popen(
        [sys.executable, "-m", "_inject", *map(str, argv)],
        cwd=ROOT, env=_inject.env(prepare_pause=30), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        staged = [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.prepare-")]
        if staged and ready(staged[0]):
            return proc, staged[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("prepare never got ready")


def test_sigkill_leaves_no_out_and_the_next_run_cleans_up(tmp_path, capsys):
    out = tmp_path / "out"
    proc, staged = start_paused(tmp_path, out)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate(timeout=30)
    assert not out.exists() and staged.exists()  # the half-written work is only beside it
    rc, _, err = run(capsys, "--input", tmp_path / "src", "--out", out)
    assert rc == 0, err
    assert f"removed {staged}" in err and not staged.exists() and no_leftovers(tmp_path)
    TokenFiles(out, verify=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_remove_the_staging_directory(tmp_path, sig):
    out = tmp_path / "out"
    proc, staged = start_paused(tmp_path, out)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3, stderr
    assert stderr.strip() == f"stopped by {sig.name}: nothing was written to --out"
    assert not out.exists() and not staged.exists() and no_leftovers(tmp_path)


def test_sigterm_stops_bpe_training_at_once(tmp_path):
    """The trainer's native code does not delay the signal handler (it runs on a thread)."""
    out = tmp_path / "out"
    proc, staged = start_paused(
        tmp_path, out, "--tokenizer", "bpe", "--vocab-size", "300", ready=Path.is_dir
    )
    time.sleep(0.3)  # inside the trainer, which waits for its next text
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "stopped by SIGTERM" in stderr, stderr
    assert time.monotonic() - t0 < 5
    assert not out.exists() and not staged.exists()


def test_bpe_without_the_tokenizers_package_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("some text\n" * 10)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers fails
    rc, out, err = run(capsys, "--input", tmp_path / "a.txt", "--out", tmp_path / "o", "--tokenizer", "bpe")  # fmt: skip
    assert_one_line_error(rc, out, err, "pip install 'nnlite[text]'")


def test_a_running_prepares_staging_directory_is_not_removed(tmp_path, capsys):
    proc, staged = start_paused(tmp_path, tmp_path / "out")
    try:
        assert staging.clean_leftovers(tmp_path / "out") == [] and staged.exists()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert staging.clean_leftovers(tmp_path / "out") == [staged]


# -- the reader -------------------------------------------------------------------------------


@pytest.fixture
def char_data(tmp_path, capsys):
    corpus = make_text(300)
    (tmp_path / "a.txt").write_text(corpus, encoding="utf-8")
    return prepared(capsys, tmp_path / "a.txt", tmp_path / "out"), corpus


def test_windows_are_next_token_pairs_from_the_files(char_data):
    data, corpus = char_data
    context = 16
    n = data.num_starts(context)
    assert n == len(data.train) - context
    starts = np.array([0, 5, n - 1])
    x, y = data.windows(starts, context)
    assert x.shape == y.shape == (3, context) and x.dtype == y.dtype == np.int32
    for i, s in enumerate(starts):
        np.testing.assert_array_equal(x[i], data.train[s : s + context])
        np.testing.assert_array_equal(y[i], data.train[s + 1 : s + context + 1])
    assert data.tokenizer.decode(x[0]) == corpus[:context]
    with pytest.raises(ValueError, match=r"window starts must lie in \[0, "):
        data.windows(np.array([n]), context)
    xv, _ = data.windows(data.eval_starts(context, 4), context, split="val")
    assert xv.shape == (4, context)
    with pytest.raises(ConfigError, match="needs 100001"):
        data.num_starts(100_000)


def test_window_starts_are_a_pure_function_of_seed_and_step():
    n, b = 10_000, 32
    a = window_starts(seed=3, step=17, batch_size=b, num_starts=n)
    np.testing.assert_array_equal(a, window_starts(3, 17, b, n))
    assert not np.array_equal(a, window_starts(3, 18, b, n))
    assert not np.array_equal(a, window_starts(4, 17, b, n))
    assert a.min() >= 0 and a.max() < n
    # the same windows as today's text data (train.data.WindowIndices) draw
    np.testing.assert_array_equal(a, WindowIndices(3, n, b).batch(17))
    big = window_starts(0, 0, 1000, 2**33)
    assert big.dtype == np.int64 and big.max() > 2**31


def test_process_shares_make_up_the_global_batch():
    starts = window_starts(0, 5, 24, 10_000)
    for count in (1, 2, 3, 4, 8):
        shares = [process_share(starts, p, count) for p in range(count)]
        assert all(len(s) == 24 // count for s in shares)
        np.testing.assert_array_equal(np.concatenate(shares), starts)
    block = np.stack([starts, starts + 1])  # [steps, batch]: shares are columns
    np.testing.assert_array_equal(process_share(block, 1, 2), block[:, 12:])
    with pytest.raises(ValueError, match="does not split over 5 processes"):
        process_share(starts, 0, 5)
    with pytest.raises(ValueError, match=r"process_index 2 is not in \[0, 2\)"):
        process_share(starts, 2, 2)


def test_reader_rejects_what_is_not_a_prepared_directory(tmp_path, char_data):
    with pytest.raises(ConfigError, match="no such directory"):
        TokenFiles(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no meta.json"):
        TokenFiles(tmp_path)
    data, _ = char_data
    meta = dict(data.meta, format_version=99)
    (data.directory / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="format_version 99, this nnlite reads 1"):
        TokenFiles(data.directory)


# -- the prefetcher -------------------------------------------------------------------------


def test_prefetcher_keeps_order_and_runs_at_most_depth_ahead():
    calls = []

    def fn(step):
        calls.append(step)
        return step * 10

    with Prefetcher(fn, range(100), depth=2) as items:
        assert items.get() == 0
        time.sleep(0.3)  # the producer fills the queue, then waits
        assert len(calls) <= 1 + 2 + 1  # the one taken, the queue, the one being put
        assert [items.get() for _ in range(5)] == [10, 20, 30, 40, 50]
    with Prefetcher(fn, range(4)) as items:
        assert list(items) == [0, 10, 20, 30]
        with pytest.raises(StopIteration):
            items.get()


def test_prefetcher_raises_the_producers_error_at_its_item():
    def fn(step):
        if step == 3:
            raise ConfigError("disk says no")
        return step

    items = Prefetcher(fn, range(10))
    assert [items.get() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ConfigError, match="disk says no") as info:
        items.get()
    assert "on item 3" in "".join(info.value.__notes__)
    assert info.traceback[-1].name == "fn"  # the producer's traceback comes along
    with pytest.raises(StopIteration):  # and the producer stopped
        items.get()


def test_prefetcher_times_out_instead_of_hanging():
    release = threading.Event()
    items = Prefetcher(lambda step: release.wait(), range(3), timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(PrefetchError, match="within 0.3 s: the data source is stalled"):
        items.get()
    assert time.monotonic() - t0 < 2
    release.set()
    items.close()
    assert not items._thread.is_alive()


def test_prefetcher_notices_a_producer_that_vanished(monkeypatch):
    items = Prefetcher(lambda s: s, range(3), timeout=10)
    items._stop.set()  # the producer leaves without a result, as if killed
    items._thread.join()
    while not items._queue.empty():
        items._queue.get()
    items._stop.clear()
    with pytest.raises(PrefetchError, match="ended without a result"):
        items.get()


# -- docs and docstrings ------------------------------------------------------------------------


def test_docstring_examples_run():
    for module in (tokenizer, tokens, prefetch):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__


DOC = ROOT / "docs/data.md"


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", DOC.read_text()))))
def test_docs_data_python_blocks_run(index, tmp_path, monkeypatch, capsys):
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[index]
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"docs/data.md[python block {index}]", "exec"), {"__name__": "docs"})
