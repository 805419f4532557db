"""Chat fine-tuning of a Hugging Face model (issue 45): conversations rendered with the
tokenizer's own chat template as transformers renders them, the loss on the assistant's
tokens only, packed windows equal to unpacked ones per document (the attention's segment
mask and its hand rule), exact resume, one line per bad JSONL line; DPO against a direct
computation of its loss."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _chat_dir import make_chat_dir
from _tolerance import check_rule

import nnlite as nl
from nnlite.nn import _attention

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("tokenizers", reason="pip install tokenizers")
pytest.importorskip("jinja2", reason="pip install jinja2")

WORDS = ["hi", "hello", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus"]
CONVERSATION = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hi how are you"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "two"},
]
# The same layout with the assistant's text marked for transformers' assistant mask
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat") / "tiny"
    d.mkdir()
    make_chat_dir(d, n_layer=1)
    return d


def _auto_tokenizer(d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers = pytest.importorskip("transformers")
        return transformers.AutoTokenizer.from_pretrained(d)


def _ids(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _jsonl(path, n=12, seed=0):
    rng = np.random.default_rng(seed)

    def say(k):
        return " ".join(rng.choice(WORDS, k))

    lines = []
    for i in range(n):
        if i % 3 == 2:
            lines.append({"prompt": say(2), "completion": say(3)})
        else:
            msgs = [{"role": "user", "content": say(2 + i % 3)}]
            msgs.append({"role": "assistant", "content": say(3)})
            lines.append({"messages": msgs})
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return path


def _data(path, tokenizer, context=48, **kw):
    from train.config import DataConfig
    from train.data.chat import chat

    return chat(DataConfig(name="chat", path=str(path), tokenizer=str(tokenizer), **kw), context)


# --- rendering -------------------------------------------------------------------------------
@pytest.mark.parametrize("in_config", [False, True])
def test_rendering_equals_transformers_apply_chat_template(tmp_path, in_config):
    d = tmp_path / "m"
    d.mkdir()
    make_chat_dir(d, in_config=in_config, n_layer=1)
    theirs = _auto_tokenizer(d)
    template, tok = nl.hf.load_chat_template(d), nl.hf.load_tokenizer(d)
    for msgs in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:2]):
        for gen in (False, True):
            text = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert template.render(msgs, add_generation_prompt=gen) == text
        ids, mask = nl.hf.encode_chat(tok, template, msgs)
        assert ids.tolist() == _ids(theirs.apply_chat_template(msgs))
    # the assistant's tokens: each reply and the end of its turn
    ids, mask = nl.hf.encode_chat(tok, template, CONVERSATION)
    assert tok.decode(ids[mask]) == "fine thanks<|im_end|>\ntwo<|im_end|>\n"
    with pytest.raises(ValueError, match="unknown role robot"):
        template.render([{"role": "robot", "content": "x"}])


def test_generation_marks_give_transformers_assistant_mask(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    make_chat_dir(d, template=GENERATION_TEMPLATE, n_layer=1)
    theirs = _auto_tokenizer(d)
    ref = theirs.apply_chat_template(
        CONVERSATION, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = nl.hf.encode_chat(
        nl.hf.load_tokenizer(d), nl.hf.load_chat_template(d), CONVERSATION
    )
    assert ids.tolist() == list(ref["input_ids"])
    assert mask.astype(int).tolist() == list(ref["assistant_masks"]) and mask.sum() > 0


# --- the loss on the assistant's tokens ------------------------------------------------------
def test_loss_is_on_the_assistant_tokens_only(chat_dir, tmp_path):
    from train.model.contract import objective_fn

    path = _jsonl(tmp_path / "c.jsonl")
    data = _data(path, chat_dir, pack=False)
    every = _data(path, chat_dir, pack=False, train_on="all")
    assert data.task == "language_model" and data.x.shape[1:] == (2, 48)
    assert np.array_equal(data.x, every.x)
    mine, all_ = data.y >= 0, every.y >= 0
    assert (mine <= all_).all() and mine.sum() < all_.sum()
    model = nl.hf.Pretrained(str(chat_dir))
    params = jax.jit(model.init)(jax.random.key(0))
    x, y = jnp.asarray(data.x[:4]), jnp.asarray(data.y[:4])
    objective = objective_fn(model)
    loss = objective(params, x, y)[0]
    # a direct computation: the mean cross-entropy of the assistant's next tokens
    logits = model(params, x[:, 0], segment_ids=x[:, 1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    ids = np.asarray(x[:, 0])
    m = np.asarray(y) >= 0
    picked = np.take_along_axis(np.asarray(logp)[:, :-1], ids[:, 1:, None], -1)[..., 0]
    want = -np.mean(picked[m[:, :-1]])
    assert np.isclose(float(loss), want, rtol=1e-6)
    # changing a user token's target changes nothing: the loss has no gradient there
    g = jax.grad(lambda out: objective_fn_on_logits(out, y))(logits)
    user = (np.asarray(every.y[:4]) >= 0) & ~m
    assert user.any() and float(jnp.abs(g[user]).max()) == 0.0
    assert float(jnp.abs(g[m]).max()) > 0
    y_changed = np.where(user, (np.asarray(every.y[:4]) + 1) % data.num_classes, data.y[:4])
    y_changed = np.where(user, -1, y_changed)  # still not a loss target after the change
    assert float(objective(params, x, jnp.asarray(y_changed))[0]) == float(loss)
    # the whole conversation (train_on: all) is another loss
    assert float(objective(params, x, jnp.asarray(every.y[:4]))[0]) != float(loss)


def objective_fn_on_logits(logits, y):
    from train.model.contract import task_objective

    return task_objective("language_model", logits, y, jnp.zeros((1, 2, 1)))[0]


# --- packing ---------------------------------------------------------------------------------
def test_packed_windows_equal_unpacked_ones_per_document(chat_dir, tmp_path):
    path = _jsonl(tmp_path / "c.jsonl")
    packed, alone = _data(path, chat_dir, context=64), _data(path, chat_dir, context=64, pack=False)
    assert len(packed.x) < len(alone.x) and packed.x[:, 1].max() >= 2
    model = nl.hf.Pretrained(str(chat_dir))
    params = jax.jit(model.init)(jax.random.key(0))
    fn = jax.jit(lambda p, x: model(p, x[:, 0], segment_ids=x[:, 1]))
    lp, la = np.asarray(fn(params, packed.x)), np.asarray(fn(params, alone.x))
    docs = 0
    for w in range(len(packed.x)):
        for s in range(1, packed.x[w, 1].max() + 1):
            at = np.flatnonzero(packed.x[w, 1] == s)
            n = len(at)
            np.testing.assert_array_equal(packed.x[w, 0, at], alone.x[docs, 0, :n])
            np.testing.assert_array_equal(packed.y[w, at], alone.y[docs, :n])
            np.testing.assert_allclose(lp[w, at], la[docs, :n], rtol=1e-5, atol=1e-5)
            docs += 1
    assert docs == len(alone.x)


def test_segment_mask_rule_and_model_gradients(chat_dir):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(2, 6, 4, 3)] * 3)
    k, v = k[:, :, :2], v[:, :, :2]
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 3, 3]])
    mask = jnp.logical_and(nl.segment_mask(seg), nl.nn._attention.causal_mask(6, 6)[None, None])
    check_rule(_attention.grouped_attention, q, k, v, mask)  # hand rule == jax.vjp, masked
    assert nl.segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 0, 1]]
    model = nl.hf.load_pretrained(chat_dir)[0]
    params = jax.jit(model.init)(jax.random.key(1))
    tokens = jnp.asarray(rng.integers(0, model.vocab_size, (2, 6)))

    def loss(p):
        return jnp.sum(jnp.tanh(model(p, tokens, segment_ids=seg)))

    auto = jax.jit(jax.grad(loss))(params)
    manual = jax.jit(jax.grad(nl.manual_grads(loss)))(params)
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(manual), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="segment_ids of shape"):
        model(params, tokens, segment_ids=seg[:, :5])
    plain = nl.GroupedQueryAttention(8, 2, rotary=False)
    with pytest.raises(ValueError, match="positions rotate q and k; this layer has rotary=False"):
        plain(plain.init(jax.random.key(0)), jnp.ones((1, 3, 8)), positions=seg[:1, :3])
    # GPT-2's learned positions restart per document too
    gpt = nl.hf.GPT2LM(vocab_size=30, context=8, n_layer=1, n_head=2, n_embd=8)
    p = jax.jit(gpt.init)(jax.random.key(2))
    a, b = tokens[:1, :3] % 30, tokens[1:, :3] % 30
    packed = gpt(p, jnp.concatenate([a, b], 1), segment_ids=jnp.array([[1, 1, 1, 2, 2, 2]]))
    np.testing.assert_allclose(packed[:, :3], gpt(p, a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed[:, 3:], gpt(p, b), rtol=1e-5, atol=1e-6)


# --- the trainer -----------------------------------------------------------------------------
def _run(tmp_path, src, name, steps, resume="fresh", loss=None, lora=None, **data):
    from train.config import config_from_dict
    from train.loop.trainer import train as train_run

    raw = {
        "name": name,
        "model": {"name": f"hf:{src}", **({"lora": lora} if lora else {})},
        "loss": loss or {},
        "data": {"name": "chat", "path": str(tmp_path / "c.jsonl"), "context": 48, **data},
        "optimizer": {"name": "adam", "learning_rate": 0.01},
        "train": {"batch_size": 2, "steps": steps, "eval_every": 2, "log_every": 2},
        "checkpoint": {"every": 2},
        "parallel": {"strategy": "none"},
        "log": {"dir": str(tmp_path / "runs"), "progress": False, "plot": False},
    }
    return train_run(config_from_dict(raw), resume=resume, echo=lambda s: None)


def test_chat_run_resumes_exactly(chat_dir, tmp_path):
    _jsonl(tmp_path / "c.jsonl")
    whole = _run(tmp_path, chat_dir, "whole", 4)
    assert whole.grad_mode == "manual"  # the hand rules cover the packed model
    _run(tmp_path, chat_dir, "split", 2)
    resumed = _run(tmp_path, chat_dir, "split", 4, resume="require")
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    base = nl.hf.load_pretrained(chat_dir)[1]
    assert float(jnp.abs(whole.params.embed.W - base.embed.W).max()) > 0


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"c.jsonl:2: not JSON"),
        ('{"messages": [{"content": "x"}]}', r"c.jsonl:2: messages: message 0 has no 'role'"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r"role 'bot'; expected one of"),
        ('{"text": "x"}', r"c.jsonl:2: keys \['text'\]; expected"),
        ('{"messages": [{"role": "user", "content": "x"}]}', r"c.jsonl:2: no assistant tokens"),
        ("[1, 2]", r"c.jsonl:2: a JSON list, not an object"),
    ],
)
def test_a_bad_line_is_one_line_naming_file_and_line(chat_dir, tmp_path, line, message):
    from train.errors import ConfigError

    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(ok) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=message) as e:
        _data(path, chat_dir)
    assert "\n" not in str(e.value)


def test_the_cli_exits_2_naming_the_line(chat_dir, tmp_path, capsys):
    from train.__main__ import main

    (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    config = tmp_path / "chat.yaml"
    config.write_text(
        f"model: {{name: 'hf:{chat_dir}'}}\n"
        f"data: {{name: chat, path: '{tmp_path / 'c.jsonl'}'}}\n"
        f"log: {{dir: '{tmp_path / 'runs'}'}}\n"
    )
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'c.jsonl'}:2: not JSON" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_pairs_refuse_what_cannot_apply(chat_dir, tmp_path):
    from train.errors import ConfigError

    _triples(tmp_path / "p.jsonl")
    with pytest.raises(ConfigError, match="data.train_on=all: preference pairs score"):
        _data(tmp_path / "p.jsonl", chat_dir, train_on="all")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: the prompt fills data.context=8 tokens"):
        _data(tmp_path / "p.jsonl", chat_dir, context=8)


# --- DPO -------------------------------------------------------------------------------------
def _triples(path, n=6, seed=1):
    rng = np.random.default_rng(seed)

    def say(k):
        return " ".join(rng.choice(WORDS, k))

    lines = [{"prompt": say(3), "chosen": say(2), "rejected": say(4)} for _ in range(n)]
    lines[0]["prompt"] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return lines


def _torch_logps(d, x, y):
    """Summed log-probabilities of the targets, by transformers' model of directory ``d``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    out = np.zeros(x.shape[:2])
    for i in range(x.shape[0]):
        for k in range(2):
            n = int((x[i, k, 1] > 0).sum())
            ids = torch.tensor(x[i, k, 0, :n][None].astype(np.int64))
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), -1).numpy()
            t = y[i, k, :n]
            keep = t >= 0
            out[i, k] = logp[np.flatnonzero(keep), t[keep]].sum()
    return out


@pytest.mark.parametrize("lora", [True, False])
def test_dpo_loss_equals_a_direct_computation(chat_dir, tmp_path, lora):
    from train.model.dpo import DPO

    _triples(tmp_path / "p.jsonl")
    data = _data(tmp_path / "p.jsonl", chat_dir, test_fraction=0.3)
    assert data.x.shape[1:] == (2, 2, 48) and data.y.shape[1:] == (2, 48)
    model = nl.hf.Pretrained(
        str(chat_dir), lora={"rank": 2, "targets": ["*/attn/[qv]"]} if lora else None
    )
    params = jax.jit(model.init)(jax.random.key(0))
    # move the policy away from its base: the adapters' B (LoRA) or every weight
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    scale = 0.3 if lora else 0.05
    moved = [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys, strict=True)]
    if lora:
        mask = jax.tree.leaves(nl.lora_mask(params))
        moved = [m if t else a for a, m, t in zip(leaves, moved, mask, strict=True)]
    params = jax.tree.unflatten(tree, moved)
    x, y = data.x, data.y
    loss, metrics = jax.jit(DPO(model, beta=0.5).objective)(params, x, y)
    # direct: transformers' log-probabilities of the exported policy and of the base
    policy = model.export(tmp_path / "policy", params)
    pi, ref = _torch_logps(policy, x, y), _torch_logps(chat_dir, x, y)
    margin = 0.5 * ((pi[:, 0] - ref[:, 0]) - (pi[:, 1] - ref[:, 1]))
    want = np.mean(np.log1p(np.exp(-margin)))  # -log sigmoid
    assert abs(margin).max() > 0.05  # the policy differs from the reference
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["reward_margin"]), margin.mean(), rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(float(metrics["logp_chosen"]), pi[:, 0].mean(), rtol=1e-4)
    assert float(metrics["reward_accuracy"]) == np.mean(margin > 0)
    # a named reference: the policy itself, so every margin is 0 and the loss log 2
    same, m2 = jax.jit(DPO(model, beta=0.5, reference=str(policy)).objective)(params, x, y)
    np.testing.assert_allclose(float(same), np.log(2), rtol=1e-5)


def test_dpo_with_a_lora_base_kept_in_bfloat16(chat_dir, tmp_path):
    """A LoRA policy whose base is stored in bfloat16 (model.param_dtype): DPO's reference,
    that base without the adapters, is cast up as the policy's is, so the loss is the
    float32 model's on the same rounded weights."""
    from train.model.dpo import DPO

    _triples(tmp_path / "p.jsonl")
    data = _data(tmp_path / "p.jsonl", chat_dir, test_fraction=0.3)
    lora = {"rank": 2, "targets": ["*/attn/[qv]"]}
    m16 = nl.hf.Pretrained(str(chat_dir), lora=lora, param_dtype="bfloat16")
    m32 = nl.hf.Pretrained(str(chat_dir), lora=lora)
    adapters, frozen = nl.lora_split(jax.jit(m16.init)(jax.random.key(0)))
    adapters = {k: v + 0.3 for k, v in adapters.items()}  # the policy moved from its base
    rounded = {k: v.astype(np.float32) for k, v in frozen.items()}
    x, y = data.x, data.y
    loss16, _ = jax.jit(DPO(m16, beta=0.5).objective)(nl.lora_join(adapters, frozen), x, y)
    loss32, _ = jax.jit(DPO(m32, beta=0.5).objective)(nl.lora_join(adapters, rounded), x, y)
    assert abs(float(loss32) - np.log(2)) > 1e-3  # the policy differs from the reference
    np.testing.assert_allclose(float(loss16), float(loss32), rtol=1e-5)


def test_dpo_run_logs_rewards_and_refuses_mismatched_data(chat_dir, tmp_path, capsys):
    from train.errors import ConfigError

    lines = _triples(tmp_path / "c.jsonl", n=8)
    r = _run(tmp_path, chat_dir, "dpo", 4, loss={"name": "dpo", "beta": 0.2},
             lora={"rank": 2, "alpha": 4, "targets": ["*/attn/q", "*/attn/v"]})  # fmt: skip
    records = [json.loads(s) for s in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [rec for rec in records if "rewards_chosen" in rec]
    assert train_rows and all(
        "reward_margin" in rec and "reward_accuracy" in rec for rec in train_rows
    )
    # the policy starts as its reference (margin 0, loss log 2) and moves away: a gradient
    # flows at margin 0 (under the hand rules too) and the loss falls
    assert r.grad_mode == "manual" and train_rows[0]["grad_norm"] > 0
    assert train_rows[-1]["loss"] < np.log(2) and train_rows[-1]["reward_margin"] > 0
    base = nl.hf.load_pretrained(chat_dir)[1]
    np.testing.assert_array_equal(r.params.embed.W, base.embed.W)  # LoRA: the base frozen
    # the run loads back and samples with the directory's tokenizer
    from train import sample
    from train.inference import load_run

    loaded = load_run(r.run_dir)
    out = loaded.predict(r.data.x_test[:1], preprocessed=True)  # a pair's logits
    assert out.shape == (1, 2, 48, r.data.num_classes)
    capsys.readouterr()
    assert sample.main(["--run", str(r.run_dir), "--prompt", "hi", "--tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("hi")
    with pytest.raises(ConfigError, match="which train with loss.name: dpo"):
        _run(tmp_path, chat_dir, "task", 2)
    _jsonl(tmp_path / "c.jsonl")
    with pytest.raises(ConfigError, match="loss.name=dpo trains on preference pairs"):
        _run(tmp_path, chat_dir, "dpo2", 2, loss={"name": "dpo"})
    (tmp_path / "c.jsonl").write_text(
        json.dumps(lines[0]) + "\n" + json.dumps({"messages": CONVERSATION}) + "\n"
    )
    with pytest.raises(ConfigError, match=r"c.jsonl:1: a preference triple among conversations"):
        _run(tmp_path, chat_dir, "mixed", 2, loss={"name": "dpo"})
