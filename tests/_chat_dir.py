"""A tiny Llama model directory with a byte-level BPE tokenizer and a chat template, made in
the test (no download): what a chat model's directory holds, small."""

import json

import jax
import numpy as np
from _common import byte_bpe

import nnlite as nl

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# A ChatML-style template (written for these tests), with a system default and a check
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_chat_dir(d, *, template=TEMPLATE, in_config=False, n_layer=2):
    """A tiny ``LlamaLM`` directory ``d`` with tokenizer files and ``template``, saved as
    ``chat_template.jinja`` (or in tokenizer_config.json when ``in_config``)."""
    words = ["hi", "hello", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus"]
    text = " ".join(np.random.default_rng(0).choice(words, 2000))
    tok = byte_bpe(text, 300, SPECIALS)
    model = nl.hf.LlamaLM(
        vocab_size=tok.get_vocab_size(), context=64, n_layer=n_layer, n_head=4, n_kv_head=2,
        n_embd=16, hidden=32,
    )  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0))
    nl.hf.save_pretrained(d, model, params)
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
    }
    if in_config:
        config["chat_template"] = template
    else:
        (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 1, "bos_token_id": 0}))
    return model, params
