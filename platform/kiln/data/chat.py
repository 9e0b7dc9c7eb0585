"""Chat templates: a tokenizer's own Jinja template turns a list of messages into the text its
model was tuned on, as transformers' `apply_chat_template` renders it.

Rendered with Jinja2's immutable sandbox (a template is data that came with a checkpoint, not
code to trust), with the same options and helpers transformers gives templates: trim_blocks,
lstrip_blocks, the loop-controls extension, `raise_exception`, a `tojson` that keeps non-ASCII
text, and `strftime_now`. Hand-written because transformers' renderer needs its tokenizer
classes, which Kiln's `tokenizers` files do not use.
"""

from __future__ import annotations

import json
from datetime import datetime

from kiln.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


def template_of(companions: dict[str, str]) -> str | None:
    """The chat template a tokenizer came with: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of named ones, of which 'default')."""
    if TEMPLATE_FILE in companions:
        return companions[TEMPLATE_FILE]
    found = special_tokens(companions).get("chat_template")
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def special_tokens(companions: dict[str, str]) -> dict:
    """tokenizer_config.json's settings, its special tokens as plain strings (bos_token, ...)."""
    try:
        config = json.loads(companions.get(CONFIG_FILE) or "{}")
    except ValueError:
        return {}
    if not isinstance(config, dict):
        return {}
    return {k: v.get("content") if isinstance(v, dict) and k.endswith("_token") else v for k, v in config.items()}


def render(template: str, messages: list[dict], companions: dict[str, str], add_generation_prompt: bool) -> str:
    """The text `template` makes of `messages` ([{role, content}, ...])."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ConfigError(f"the chat template refuses these messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals |= {"raise_exception": raise_exception, "strftime_now": lambda f: datetime.now().strftime(f)}
    tokens = {k: v for k, v in special_tokens(companions).items() if k.endswith("_token") and isinstance(v, str)}
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **tokens)
    except TemplateError as e:
        raise ConfigError(f"the tokenizer's chat template does not render: {e}") from None
