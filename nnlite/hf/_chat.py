"""A model directory's chat template, rendered as ``transformers`` renders it, and a
conversation as token ids with the assistant's tokens marked.

The template is ``chat_template.jinja`` beside ``tokenizer.json`` or ``tokenizer_config.json``'s
``chat_template`` (where ``transformers`` saves them), rendered by a sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``tojson`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables; the text is then
tokenized without adding special tokens. So ``encode_chat`` gives the ids of
``AutoTokenizer.apply_chat_template(messages)``.

The assistant's tokens: with ``{% generation %}`` markers in the template, the text they
enclose (as ``return_assistant_tokens_mask`` finds it); without, each assistant message's
text is what rendering the conversation through that message adds to rendering the messages
before it with the generation prompt (as trl finds completions): the message, and whatever
closes its turn (an end-of-turn token), without the role header the prompt already holds.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ._config import read_json

__all__ = ["ChatTemplate", "encode_chat", "load_chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ValueError):
    """A template that is missing, does not compile, or cannot render a conversation."""


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install jinja2") from None
    return jinja2


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The template in transformers' environment (``_compile_jinja_template``), with a
    ``{% generation %}`` tag that records the character spans it encloses."""
    jinja2 = _jinja()
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 -- jinja2 reads the class attribute

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_mark", [nodes.ContextReference()])
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, context, caller):
            text = caller()
            spans = context.get("__generation_spans")
            if spans is not None:
                spans.append(text)
            return "\x00GEN\x01" + text + "\x00END\x01" if spans is not None else text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Args:
        source: the jinja2 template text.
        special: the tokenizer's special tokens, ``{"bos_token": "<s>", ...}``.
        where: what messages call it (its file).
    """

    def __init__(self, source: str, special: dict[str, str] | None = None, where: str = ""):
        self.source, self.special, self.where = source, dict(special or {}), where or "template"
        try:
            _compile(source)
        except Exception as e:  # noqa: BLE001 -- jinja2's syntax errors: one line
            raise ChatTemplateError(
                f"{self.where}: the chat template does not compile: {e}"
            ) from None

    @property
    def has_generation_marks(self) -> bool:
        return "generation" in self.source and "endgeneration" in self.source

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, as ``apply_chat_template(messages, tokenize=False)``."""
        return self._render(messages, add_generation_prompt, marks=False)

    def _render(self, messages, add_generation_prompt: bool, marks: bool) -> str:
        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **({"__generation_spans": []} if marks else {}),
                **self.special,
            )
        except Exception as e:  # noqa: BLE001 -- raise_exception and template errors
            raise ChatTemplateError(f"{self.where}: {type(e).__name__}: {e}") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """``(text, [(start, end) character spans of the assistant's turns])``."""
        if self.has_generation_marks:
            marked = self._render(messages, False, marks=True)
            text, spans, pos = [], [], 0
            for i, part in enumerate(marked.split("\x00GEN\x01")):
                inner, _, rest = part.partition("\x00END\x01") if i else ("", "", part)
                if i:
                    spans.append((pos, pos + len(inner)))
                    text.append(inner)
                    pos += len(inner)
                text.append(rest)
                pos += len(rest)
            return "".join(text), spans
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            through = self.render(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise ChatTemplateError(
                    f"{self.where}: rendering the conversation up to message {i} is not a "
                    "prefix of rendering all of it, so the assistant's tokens cannot be found; "
                    "mark them with {% generation %} ... {% endgeneration %} in the template"
                )
            spans.append((len(before), len(through)))
        return text, spans


def encode_chat(tokenizer, template: ChatTemplate, messages: list[dict]):
    """``(ids [L] int32, assistant [L] bool)``: the conversation's token ids, those of
    ``apply_chat_template(messages)``, and which of them the assistant wrote (every token
    that overlaps an assistant span, as ``return_assistant_tokens_mask``)."""
    text, spans = template.assistant_spans(messages)
    enc = getattr(tokenizer, "tokenizer", tokenizer).encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    mask = np.zeros(len(ids), bool)
    k = 0
    for t, (start, end) in enumerate(enc.offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = True
    return ids, mask


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate:
    """The chat template of a model directory: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: the
    ``default`` one), with the special tokens of ``tokenizer_config.json`` and
    ``special_tokens_map.json``."""
    d = Path(directory)
    config: dict = {}
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        config = read_json(cfg_path, ChatTemplateError)
    special = {}
    side = d / "special_tokens_map.json"
    for source in (read_json(side, ChatTemplateError) if side.is_file() else {}, config):
        for key in _SPECIAL:
            text = _token_text(source.get(key))
            if text is not None:
                special[key] = text
    if (d / TEMPLATE_FILE).is_file():
        return ChatTemplate(
            (d / TEMPLATE_FILE).read_text(encoding="utf-8"), special, str(d / TEMPLATE_FILE)
        )
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        raise ChatTemplateError(
            f"{d}: no chat template (no {TEMPLATE_FILE}, and no chat_template in "
            "tokenizer_config.json); save one with the tokenizer (tokenizer.chat_template = ...)"
        )
    return ChatTemplate(source, special, f"{cfg_path}: chat_template")
