"""Exports that ``transformers`` reads whole: the tokenizer beside the weights
(``AutoTokenizer`` encodes as the original's), a bfloat16 checkpoint kept bfloat16; and a
trainer's run on a Hugging Face directory exported with ``run.model.export``, sampled
with ``train.sample`` (streamed and not)."""

import json
import sys
import warnings

import jax
import numpy as np
import pytest
import test_hf
from _common import byte_bpe

import nnlite as nl

tf = pytest.fixture(scope="module")(test_hf.tf.__wrapped__)  # transformers and torch
TEXT = "the king shall love the queen and o the king " * 40 + "héllo wörld"
SAMPLES = ["the king shall", "héllo wörld o", "unseen: ∑ ü"]


@pytest.fixture(scope="module")
def src(tf, tmp_path_factory):
    """A bfloat16 Llama and its tokenizer, both saved by transformers."""
    transformers, torch = tf
    pytest.importorskip("tokenizers", reason="pip install tokenizers")
    tok = byte_bpe(TEXT, 300, ("<|endoftext|>", "<s>"))
    d = tmp_path_factory.mktemp("src")
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size() + 4, max_position_embeddings=32, hidden_size=16,
        intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, eos_token_id=0,
        bos_token_id=1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        model.save_pretrained(d)
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>"
        )
        fast.save_pretrained(d)
    return d


def _auto(tf, d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf[0].AutoTokenizer.from_pretrained(d)


def _check_export(tf, src, out):
    """``out`` holds the source's tokenizer (AutoTokenizer encodes alike) and bfloat16
    weights that transformers loads as bfloat16, equal to the source's."""
    theirs, ours = _auto(tf, src), _auto(tf, out)
    for s in SAMPLES:
        assert ours.encode(s) == theirs.encode(s)
        assert ours.decode(ours.encode(s, add_special_tokens=False)) == s
    assert ours.eos_token == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    entries = nl.hf._safetensors.open_file(out / "model.safetensors", ValueError).entries
    assert {dtype.name for dtype, *_ in entries.values()} == {"bfloat16"}


def test_export_writes_the_tokenizer_and_keeps_bfloat16(tf, src, tmp_path):
    model, params = nl.hf.load_pretrained(src)
    out = nl.hf.save_pretrained(tmp_path / "out", model, params, source=src)
    _check_export(tf, src, out)
    a = test_hf._reload(tf, src).state_dict()
    b = test_hf._reload(tf, out).state_dict()  # the bfloat16 weights came back unchanged
    assert all(b[k].dtype == a[k].dtype and (b[k] == a[k]).all() for k in a)
    # a tokenizer of another origin (no tokenizer_config.json beside it): one is written
    tok = nl.hf.load_tokenizer(src)
    bare = nl.hf.Tokenizer(tok.tokenizer, eos_id=0)
    out2 = nl.hf.save_pretrained(tmp_path / "out2", model, params, bare, dtype="float32")
    auto = _auto(tf, out2)
    assert auto.eos_token == "<|endoftext|>" and auto.model_max_length == 32
    assert [auto.encode(s) for s in SAMPLES] == [tok.encode(s).tolist() for s in SAMPLES]
    assert json.loads((out2 / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(TypeError, match="tokenizer: expected an nl.hf.Tokenizer"):
        nl.hf.save_pretrained(tmp_path / "out3", model, params, "gpt2")


def test_a_trainer_run_exports_and_samples(tf, src, tmp_path, capsys):
    """``model.name: hf:DIR`` with LoRA trained for 2 steps: ``run.model.export`` writes the
    tokenizer and bfloat16 (adapters merged); ``train.sample --stream`` prints what ``train.sample`` prints."""
    from train import prepare, sample
    from train.config import config_from_dict
    from train.inference import load_run, until_stop
    from train.loop.trainer import train as train_run

    (tmp_path / "t.txt").write_text(TEXT)
    argv = ["--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "tok")]
    assert prepare.main([*argv, "--tokenizer", f"hf:{src}"]) == 0
    raw = {
        "name": "lora", "model": {"name": f"hf:{src}",
                                  "lora": {"rank": 2, "targets": ["*/attn/q"]}},
        "data": {"name": "tokens", "path": str(tmp_path / "tok"), "context": 16,
                 "placement": "host", "eval_windows": 4},
        "optimizer": {"name": "adamw", "learning_rate": 0.01, "schedule": "constant"},
        "train": {"batch_size": 2, "steps": 2, "eval_every": 2, "log_every": 2},
        "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
    }  # fmt: skip
    run = load_run(train_run(config_from_dict(raw), echo=lambda s: None).run_dir)
    out = run.model.export(tmp_path / "out", run.params)
    _check_export(tf, src, out)
    capsys.readouterr()
    args = ["--run", str(run.run_dir), "--prompt", "the king", "--tokens", "12"]
    args += ["--temperature", "0", "--repetition-penalty", "1.3"]
    assert sample.main(args) == 0
    whole = capsys.readouterr().out
    assert sample.main([*args, "--stream"]) == 0
    assert capsys.readouterr().out == whole and whole.startswith("the king")
    ids = run.encode("the king")
    made = run.model.generate(
        run.params, np.asarray([ids]), 12, jax.random.key(0), 0.0, repetition_penalty=1.3
    )
    made = until_stop(np.asarray(made)[0], len(ids), run.model.stop_ids)
    assert whole == run.decode(made) + "\n" and run.model.stop_ids == (0,)
    assert run.generate("the king", 12, temperature=0.0) == run.decode(
        until_stop(np.asarray(run.model.generate(
            run.params, np.asarray([ids]), 12, jax.random.key(0), 0.0, top_k=40
        ))[0], len(ids), (0,))
    )  # fmt: skip
    programs = nl.hf._generate._run._cache_size()
    assert run.generate("the king shall love", 12, temperature=0.0).startswith("the king")
    assert nl.hf._generate._run._cache_size() == programs  # another length, the same bucket


def test_nnlite_train_runs_its_tools(tmp_path, monkeypatch, capsys):
    from train.__main__ import run

    argv = ["nnlite-train", "sample", "--run", str(tmp_path / "nope"), "--stream"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        run()
    assert e.value.code == 2 and "no such run directory" in capsys.readouterr().err
