"""Every run loads back (#45, #46): each kind of run, trained a few steps in each
precision, reads back with ``train.load_run``, ``train.sample`` / ``train.predict`` and
``--fast-dev-run`` on its own ``config.yaml``; and a model field of any type the trainer
accepts round-trips through that file.

The kinds: a shipped model, a user's model (``module:Class`` in the test's directory,
with tuple fields), a Hugging Face directory fine-tuned whole (``hf:DIR``) and with LoRA.
The directory is a tiny random Llama made by transformers' ``save_pretrained`` with a
BPE ``tokenizer.json``, as a downloaded model holds.
"""

import json
import math
import os
import sys
import warnings

import jax
import numpy as np
import pytest
import yaml
from _common import byte_bpe, import_transformers

import nnlite as nl
import train
from train import predict, prepare, sample
from train.__main__ import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

USER_MODELS = '''
import enum
import math
from typing import TYPE_CHECKING, Literal

import jax
import nnlite as nl

if TYPE_CHECKING:
    from somewhere import NotAtRunTime


class Mode(enum.Enum):
    PLAIN = "plain"
    SCALED = "scaled"


class TupleMLP(nl.Module):
    """Fields of every type the trainer accepts; in_shape (a bare tuple) from the data."""

    in_shape: tuple
    num_classes: int
    hidden: tuple = (8,)
    widths: tuple[tuple[int, ...], ...] = ((1, 2), (3,))
    scales: dict[str, float] = None
    mode: Mode = Mode.PLAIN
    kind: Literal["a", "b"] = "a"
    clip: float = math.inf
    gain: float = 2  # an int default of a float field: reads back as 2.0, equal
    note: "NotAtRunTime" = "resolved at type-checking time only"
    names: list = ("x",)
    task = "classification"

    def setup(self):
        n = math.prod(self.in_shape)
        self.ffn = nl.FFN(n, self.hidden, self.num_classes)

    def __call__(self, params, x, *, key=None):
        out = self.ffn(params.ffn, x.reshape(x.shape[0], -1))
        return out * 2.0 if self.mode is Mode.SCALED else out


class Holder(TupleMLP):
    act: object = jax.nn.relu  # a function: no config.yaml can hold it


class Rewrites(TupleMLP):
    def __post_init__(self):  # hidden (8,) becomes (16,), which reads back as (32,)
        object.__setattr__(self, "hidden", tuple(2 * h for h in self.hidden))
        super().__post_init__()
'''

RUN_KINDS = ("shipped", "user", "hf_full", "hf_lora")
# --fast-dev-run (a whole training, resume and load_run of its own, ~3 s each) on one
# precision of each kind, each precision twice: what it reads of config.yaml is the same
# in both precisions (params and checkpoints stay float32), and load_run runs on all
DEV_RUNS = {("shipped", "bfloat16"), ("user", "float32"), ("hf_full", "float32"),
            ("hf_lora", "bfloat16")}  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The test's directory: a user's model module, an npz, a text, a Hugging Face Llama
    directory (transformers-made) and that text prepared with its tokenizer."""
    d = tmp_path_factory.mktemp("loadback")
    (d / "lbmodels.py").write_text(USER_MODELS)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    np.savez(d / "small.npz", x=x[:64], y=y[:64], x_test=x[64:], y_test=y[64:])
    words = ["the", "king", "shall", "love", "o", "cat"]
    (d / "text.txt").write_text(" ".join(rng.choice(words, 1500)))
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("lbmodels", None)


@pytest.fixture(scope="module")
def llama(project):
    """``project`` with ``llama/`` (made by transformers) and ``tokens/`` (the text prepared
    with its tokenizer); made once, for the runs that need it."""
    if not (project / "tokens").is_dir():
        _llama_dir(project / "llama", (project / "text.txt").read_text())
        args = ["--input", str(project / "text.txt"), "--out", str(project / "tokens")]
        assert prepare.main([*args, "--tokenizer", f"hf:{project / 'llama'}"]) == 0
    return project


def _llama_dir(path, text):
    reason = (
        "transformers, torch and tokenizers are test-only extras: pip install 'nnlite[hf-test]'"
    )
    pytest.importorskip("tokenizers", reason=reason)
    transformers, torch = import_transformers(reason)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = byte_bpe(text, 270)
        cfg = transformers.LlamaConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))


def _config(project, kind: str, precision: str) -> dict:
    lm = {"name": "tokens", "path": str(project / "tokens"), "context": 16, "eval_windows": 8}
    model, data = {
        "shipped": ({"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 8},
                    {"name": "text", "path": str(project / "text.txt"), "context": 16,
                     "eval_windows": 8}),
        "user": ({"name": "lbmodels:TupleMLP", "hidden": [4, 4], "mode": "scaled"},
                 {"name": "npz", "path": str(project / "small.npz")}),
        "hf_full": ({"name": f"hf:{project / 'llama'}"}, lm),
        "hf_lora": ({"name": f"hf:{project / 'llama'}",
                     "lora": {"rank": 2, "alpha": 4, "targets": ["*/attn/q", "*/attn/v"]}}, lm),
    }[kind]  # fmt: skip
    return {
        "name": f"{kind}_{precision}",
        "model": model,
        "data": data,
        "train": {"batch_size": 4, "steps": 2, "eval_every": 2, "log_every": 1,
                  "precision": precision},
        "log": {"dir": str(project / "runs"), "progress": False, "plot": False},
    }  # fmt: skip


def _same_tree(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", RUN_KINDS)
def test_every_run_loads_back(request, project, kind, precision, capsys):
    if kind.startswith("hf"):
        request.getfixturevalue("llama")
    run = train.fit(config=_config(project, kind, precision), resume="fresh", echo=lambda s: None)
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())["model"]
    if kind == "hf_full":
        assert saved["lora"] is None  # "no LoRA" as config.yaml says it, and reads it
    back = train.load_run(run.run_dir, "last")
    assert back.model == run.model and back.step == 2
    _same_tree(back.params, run.params)
    for part in {k.split("/")[0].split("[")[0] for k in _keys(back.checkpoint)}:
        nl.load(back.checkpoint, subtree=part)  # each part reads without a template
    capsys.readouterr()
    if back.model.task == "language_model":
        argv = ["--run", str(run.run_dir), "--prompt", "the king", "--tokens", "3"]
        assert sample.main(argv) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith("the king")
    else:
        out = project / f"{kind}_{precision}.npz"
        argv = ["--run", str(run.run_dir), "--data", str(project / "small.npz"), "--out", str(out)]
        assert predict.main(argv) == 0, capsys.readouterr().err
        assert np.load(out)["predictions"].shape[0] == 64
    if (kind, precision) in DEV_RUNS:
        argv = ["--config", str(run.run_dir / "config.yaml"), "--fast-dev-run", "1"]
        assert main(argv) == 0, capsys.readouterr().err


def _keys(checkpoint) -> list[str]:
    import safetensors

    with safetensors.safe_open(str(checkpoint), "numpy") as f:
        return list(f.keys())


def test_fields_of_every_accepted_type_round_trip(project):
    """The user model's fields as config.yaml writes them (lists, a mapping's null, an
    Enum's value, .inf) read back as the model that trained."""
    raw = _config(project, "user", "float32") | {"name": "user_types"}
    run = train.fit(config=raw, resume="fresh", echo=lambda s: None)
    saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())["model"]
    assert saved["in_shape"] == [6] and saved["hidden"] == [4, 4]
    assert saved["widths"] == [[1, 2], [3]] and saved["mode"] == "scaled"
    assert saved["clip"] == math.inf and saved["names"] == ["x"]
    back = train.load_run(run.run_dir)
    assert back.model == run.model
    assert back.model.in_shape == (6,) and back.model.mode.value == "scaled"
    assert type(back.model.hidden) is tuple and back.model.widths == ((1, 2), (3,))
    assert back.predict(np.zeros((2, 6), np.float32)).shape == (2, 2)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        ({"name": "lbmodels:TupleMLP", "widths": [[1, "x"]]}, r"model.widths: expected int, got 'x'"),
        ({"name": "lbmodels:TupleMLP", "mode": "loud"}, r"model.mode: 'loud' is not one of 'plain', 'scaled'"),
        ({"name": "lbmodels:TupleMLP", "scales": {"a": "x"}}, r"model.scales.a: expected float"),
        ({"name": "lbmodels:Holder"}, r"model.act: Holder.act = .* cannot be written to the run's config.yaml"),
        ({"name": "lbmodels:Rewrites"}, r"model.hidden = \(16,\) reads back from the run's config.yaml as \(32,\)"),
    ],
    ids=["nested tuple", "enum", "mapping", "function", "changed by the class"],
)  # fmt: skip
def test_a_field_that_would_not_load_back_is_refused_before_training(project, model, match):
    raw = _config(project, "user", "float32") | {"model": model, "name": "refused"}
    with pytest.raises(train.ConfigError, match=match):
        train.fit(config=raw, resume="fresh", echo=lambda s: None)
    assert not (project / "runs" / "refused").exists()


def test_which_takes_last_and_names_the_choices(project):
    run_dir = project / "runs" / "user_float32"
    if not run_dir.is_dir():
        train.fit(config=_config(project, "user", "float32"), resume="fresh", echo=lambda s: None)
    assert train.load_run(run_dir, which="last").step == train.load_run(run_dir).step
    with pytest.raises(train.ConfigError, match=r"which must be one of 'latest', 'last', 'best', got 'newest'"):  # fmt: skip
        train.load_run(run_dir, which="newest")


def test_an_empty_lora_is_full_fine_tuning(llama):
    """What older runs wrote for "no LoRA" (``lora: []``) reads as none."""
    for empty in ([], (), {}, None):
        m = nl.hf.Pretrained(llama / "llama", lora=empty)
        assert m.lora is None and m.trainable(None) is None


def test_a_run_resumes_with_another_count_of_validation_windows(tmp_path):
    """A run written with data.eval_windows: 2400 (the default until it became null)
    resumes under the new default: the training data and its order are the same."""
    from train.checkpoint.resume import check_resumable
    from train.config import config_from_dict, to_dict

    def cfg(**data):
        return config_from_dict({"data": {"name": "text", "path": "t.txt", **data}})

    meta = {"config": json.dumps(to_dict(cfg(eval_windows=2400)))}
    check_resumable(cfg(), meta, tmp_path / "ckpt")
    with pytest.raises(train.ConfigError, match="data.val_fraction=0.1 but the config has"):
        check_resumable(cfg(val_fraction=0.2), meta, tmp_path / "ckpt")
