"""Broken Hugging Face directories: a weight file or shard that is truncated, empty,
foreign or missing, a wrong ``config.json``, a tokenizer that does not fit the embedding.
Each is one ``nl.hf.HFConfigError`` line naming the file, and the trainer's CLI prints that
line and exits 2; directories made by ``transformers`` itself, then broken."""

import json
import shutil
import warnings

import pytest
import test_hf

import nnlite as nl

tf = pytest.fixture(scope="module")(test_hf.tf.__wrapped__)  # transformers and torch


@pytest.fixture(scope="module")
def made(tf, tmp_path_factory):
    """A tiny Llama saved by transformers in one file and in shards, with a tokenizer."""
    transformers, torch = tf
    tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")
    cfg = transformers.LlamaConfig(
        vocab_size=40, max_position_embeddings=16, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("made")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(root / "one")
        model.save_pretrained(root / "sharded", max_shard_size="1KB")
        torch.save(model.state_dict(), root / "pytorch.bin")
    vocab = {f"t{i}": i for i in range(30)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(root / "one" / "tokenizer.json"))
    big = {f"t{i}": i for i in range(50)}  # more ids than the model's 40 embedding rows
    tokenizers.Tokenizer(tokenizers.models.WordLevel(big, unk_token="t0")).save(
        str(root / "big.json")
    )
    return root


def _config(d, **change):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v != "DROP"}))


def _truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def _shard(d, i=2):
    return sorted(d.glob("model-*.safetensors"))[i - 1]


BROKEN = {
    "truncated": ("one", lambda d, root: _truncate(d / "model.safetensors", -50),
                  r"model.safetensors: truncated: \d+ bytes, its header describes \d+"),
    "cut in its header": ("one", lambda d, root: _truncate(d / "model.safetensors", 40),
                          r"model.safetensors: truncated: 40 bytes, shorter than its"),
    "empty": ("one", lambda d, root: d.joinpath("model.safetensors").write_bytes(b""),
              r"model.safetensors: not a safetensors file: 0 bytes \(empty or truncated\)"),
    "text": ("one", lambda d, root: d.joinpath("model.safetensors").write_text("<html>404</html>"),
             r"model.safetensors: not a safetensors file \(text: "),
    "pytorch": ("one", lambda d, root: shutil.copy(root / "pytorch.bin", d / "model.safetensors"),
                r"model.safetensors: not a safetensors file \(a zip archive \(a PyTorch"),
    "missing": ("one", lambda d, root: (d / "model.safetensors").unlink(),
                r"one: no model.safetensors nor model.safetensors.index.json"),
    "only pytorch": ("one", lambda d, root: (
        (d / "model.safetensors").unlink(),
        shutil.copy(root / "pytorch.bin", d / "pytorch_model-00001-of-00001.bin"),
    ), r"one: no model.safetensors .* \(it has pytorch_model-00001-of-00001.bin, a pickle"),
    "missing shard": ("sharded", lambda d, root: _shard(d).unlink(),
                      r"model.safetensors.index.json: shard model-00002-of-\d+.safetensors is "
                      "missing"),
    "truncated shard": ("sharded", lambda d, root: _truncate(_shard(d), -4),
                        r"model-00002-of-\d+.safetensors: truncated"),
    "config not json": ("one", lambda d, root: d.joinpath("config.json").write_text("{'a': 1"),
                        r"config.json: not a JSON object \(Expecting property name"),
    "config lacks a key": ("one", lambda d, root: _config(d, hidden_size="DROP"),
                           r"config.json: missing key 'hidden_size'"),
    "config wrong type": ("one", lambda d, root: _config(d, num_hidden_layers="two"),
                          r"config.json: a key has a value of the wrong type"),
    "unknown model_type": ("one", lambda d, root: _config(d, model_type="bert"),
                           r"config.json: model_type 'bert' is not supported; supported: gpt2"),
    "tensor shape": ("one", lambda d, root: _config(d, intermediate_size=12),
                     r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' has "
                     r"shape \(\d+, \d+\), .*config.json implies"),
    "tokenizer too big": ("one", lambda d, root: shutil.copy(root / "big.json",
                                                        d / "tokenizer.json"),
                          r"tokenizer.json: 50 tokens, more than the model's 40 embedding rows"),
    "tokenizer not json": ("one", lambda d, root: d.joinpath("tokenizer.json").write_text("nope"),
                           r"tokenizer.json: not a readable tokenizers file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_file_is_one_line_naming_it(made, tmp_path, case):
    which, breaks, message = BROKEN[case]
    d = tmp_path / which
    shutil.copytree(made / which, d)
    nl.hf.load_pretrained(d)  # whole, it loads
    breaks(d, made)
    with pytest.raises(nl.hf.HFConfigError, match=message) as e:
        nl.hf.load_pretrained(d)
    assert "\n" not in str(e.value) and str(d) in str(e.value)
    with pytest.raises(nl.hf.HFConfigError, match=message):  # the trainer's model too
        nl.hf.Pretrained(d)


@pytest.mark.parametrize("case", ["truncated", "missing shard", "config lacks a key"])
def test_the_cli_prints_one_line_and_exits_2(made, tmp_path, capsys, case):
    from train.__main__ import main

    which, breaks, message = BROKEN[case]
    d = tmp_path / which
    shutil.copytree(made / which, d)
    breaks(d, made)
    (tmp_path / "t.txt").write_text("t1 t2 t3 " * 40)
    (tmp_path / "c.yaml").write_text(
        json.dumps({
            "name": "broken", "model": {"name": f"hf:{d}"},
            "data": {"name": "text", "path": str(tmp_path / "t.txt"), "context": 8},
            "train": {"batch_size": 2, "steps": 1},
            "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
        })
    )  # fmt: skip
    assert main(["--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("error: ") and str(d) in err[0]
    assert __import__("re").search(message, err[0])
