"""Chat templates: a tokenizer's own Jinja template turns a list of messages into the text its
model was tuned on, as transformers' `apply_chat_template` renders it.

Rendered with Jinja2's immutable sandbox (a template is data that came with a checkpoint, not
code to trust), with the same options and helpers transformers gives templates: trim_blocks,
lstrip_blocks, the loop-controls extension, `raise_exception`, a `tojson` that keeps non-ASCII
text, and `strftime_now`. Hand-written because transformers' renderer needs its tokenizer
classes, which Kiln's `tokenizers` files do not use.
"""

from __future__ import annotations

import functools
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
    """tokenizer_config.json's settings, its special tokens as plain strings (bos_token, ...).
    Not to be changed: one dict per config text (a Llama 3 config is ~50 KB of JSON, read
    once rather than at every render)."""
    return _settings(companions.get(CONFIG_FILE) or "{}")


@functools.lru_cache(maxsize=8)
def _settings(config_text: str) -> dict:
    try:
        config = json.loads(config_text)
    except ValueError:
        return {}
    if not isinstance(config, dict):
        return {}
    return {k: v.get("content") if isinstance(v, dict) and k.endswith("_token") else v for k, v in config.items()}


def _raise_exception(message: str):
    raise ConfigError(f"the chat template refuses these messages: {message}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled once (a conversation renders it 2 x its assistant turns + 1 times)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": lambda f: datetime.now().strftime(f)}
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ConfigError(f"the tokenizer's chat template does not render: {e}") from None


def render(template: str, messages: list[dict], companions: dict[str, str], add_generation_prompt: bool) -> str:
    """The text `template` makes of `messages` ([{role, content}, ...])."""
    from jinja2 import TemplateError

    tokens = {k: v for k, v in special_tokens(companions).items() if k.endswith("_token") and isinstance(v, str)}
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **tokens)
    except TemplateError as e:
        raise ConfigError(f"the tokenizer's chat template does not render: {e}") from None


ROLES = ("system", "user", "assistant", "tool")


def message_problem(messages) -> str | None:
    """Why a record's messages are not a conversation Kiln can render, in words, or None."""
    if not isinstance(messages, list) or not messages:
        return "expected a non-empty list of {role, content} messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not an object with string fields 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}; expected one of {list(ROLES)}"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to learn from"
    return None


def encode_chat(tok, template: str, companions: dict[str, str], messages: list[dict]):
    """The conversation's ids as transformers' apply_chat_template(messages, tokenize=True) gives
    them, each token the model is not to be scored on (all but the assistant turns, each with
    the template's end of turn) stored as -(id + 1).

    An assistant turn's text is what rendering through it adds to rendering up to its cue
    (add_generation_prompt): the template places it, whatever its markup. A template whose
    renders are not prefixes of one another cannot be cut so, and is refused."""
    import numpy as np

    full = render(template, messages, companions, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(template, messages[:i], companions, add_generation_prompt=True)
        through = render(template, messages[: i + 1], companions, add_generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise ConfigError(
                "the chat template renders a conversation's beginning differently from the whole "
                "conversation, so its assistant turns cannot be found; give another with --chat-template"
            )
        spans.append((len(before), len(through)))
    encoding = tok.encode_with_offsets(full)
    ids = np.asarray(encoding[0], dtype=np.int32)
    scored = np.array([any(a <= start < b for a, b in spans) for start, _ in encoding[1]], dtype=bool)
    return np.where(scored, ids, -ids - 1).astype(np.int32)
