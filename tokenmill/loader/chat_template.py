"""Render a model's Hugging Face-style chat template into the prompt text it was trained on.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable sandbox
with the same whitespace rules and helpers (`raise_exception`, `tojson`, `strftime_now`) that
transformers gives them, because templates are written against exactly that environment.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template. ChatML is the most widely trained-on format and needs no
# special tokens from the template's side beyond the `<|im_start|>`/`<|im_end|>` markers it writes.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's turn format, for Gemma GGUFs that carry no template (the 270M one does not): roles
# "user" and "model", a system message folded into the first user turn, BOS up front.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def builtin_chat_template(vocabulary: Mapping[str, int]) -> str | None:
    """A template for a model file that ships none, recognised by its turn-marker tokens, or
    None for the ChatML default."""
    if "<start_of_turn>" in vocabulary and "<end_of_turn>" in vocabulary:
        return GEMMA_CHAT_TEMPLATE
    return None


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Reject malformed messages here, where the error can name the field."""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} must be a mapping, got {type(message).__name__}")
        for field in ("role", "content"):
            value = message.get(field)
            if not isinstance(value, str):
                raise ValueError(f"message {index} needs a string {field!r}, got {value!r}")


def render_chat_template(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages`; `template=None` means `DEFAULT_CHAT_TEMPLATE`. `tools`
    (OpenAI's function tools) are handed to a template that renders them itself."""
    validate_messages(messages)
    # A token the model lacks stays undefined, as in transformers, so `is defined` tests still work.
    tokens = {"bos_token": bos_token, "eos_token": eos_token}
    defined: dict[str, Any] = {name: text for name, text in tokens.items() if text is not None}
    if tools is not None:
        defined["tools"] = [dict(tool) for tool in tools]
    compiled = _compile(template if template is not None else DEFAULT_CHAT_TEMPLATE)
    return compiled.render(
        messages=[dict(message) for message in messages],
        add_generation_prompt=add_generation_prompt,
        **defined,
    )


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Compiling is costly and every request of a model renders the same template."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """jinja2's own `tojson` HTML-escapes `<`, `>` and `&`, which would corrupt a prompt."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
