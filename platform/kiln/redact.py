"""Secrets never leave in clear: params, tags, artifacts and log lines pass through here.

`redact` drops the value of any credential-named key; `scrub` masks URL passwords and the value
of every credential-named environment variable in free text; `ScrubFilter` applies `scrub` to
log records on their way to a handler.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import Any

# "token" as in a credential, not the tokenizer or a count of tokens (data.tokenizer, data.train_tokens).
SECRET_PATTERN = re.compile(
    r"(secret|token(?!izer|s(?![a-z]))|password|passwd|credential|api[_-]?key|"
    r"access[_-]?key|auth)",
    re.I,
)
REDACTED = "***"

# The userinfo of any URL, whatever its scheme (a misspelt one too): `user:password@` or a bare
# `token@`. After `user:` the password runs to the word's last `@`, so one holding `@`, `#`,
# `?` or `/` is masked whole (a port and a path holding `@` are masked too: too much, never
# too little); a bare token stops at the path.
URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/\s'\":@]+:[^\s'\"]*|[^/\s'\"]*)@")
# The same without a scheme (`--s3-endpoint user:pw@host:9`): a user name, a colon, anything
# up to the word's last `@`, then a host.
BARE_USERINFO = re.compile(r"(?<![\w.:/@%+-])(?P<scheme>)(?P<userinfo>[\w.~%+-]+:(?!//)[^\s'\"]*)@(?=[\w\[])")
# A credential-named key and its value, as Python, JSON and YAML print a mapping and as a shell
# or `--set` assigns it: `'aws_secret_access_key': '...'`, `"token": "..."`, `API_KEY=...`.
_KEY = r"[\w.-]*" + SECRET_PATTERN.pattern + r"[\w.-]*"
KEY_VALUE = re.compile(
    r"(?P<key>(?P<q>['\"]?)" + _KEY + r"(?P=q)\s*(?::\s*|=))"
    r"(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s,;}\]&|'\"]+)",
    re.I,
)
SETTING_WORDS = {"token", "true", "false", "none", "null", "''", '""', REDACTED}  # values that are settings
# Credentials recognisable by their shape wherever they appear: AWS access key ids, GitHub and
# Hugging Face tokens.
TOKEN_SHAPES = re.compile(
    r"\b(?:(?:AKIA|ASIA)[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|hf_[A-Za-z0-9]{20,})\b"
)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Drop the value of any key that looks like a credential; scrub the rest (`scrub`)."""
    return {
        k: (REDACTED if SECRET_PATTERN.search(k) else scrub(v) if isinstance(v, str) else v) for k, v in params.items()
    }


def redact_tree(tree: Any) -> Any:
    """`redact` through nested dicts and lists: a config as a whole, before it becomes YAML."""
    if isinstance(tree, dict):
        return {
            k: (REDACTED if isinstance(k, str) and SECRET_PATTERN.search(k) else redact_tree(v))
            for k, v in tree.items()
        }
    if isinstance(tree, list):
        return [redact_tree(v) for v in tree]
    return scrub(tree) if isinstance(tree, str) else tree


def redacted_paths(tree: Any, prefix: str = "") -> list[str]:
    """The dotted paths in a tree whose values `redact_tree` masks: what a file written with
    the masked tree no longer holds."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return [prefix] if redact_tree(tree) != tree else []
    found = []
    for k, v in items:
        path = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(k, str) and SECRET_PATTERN.search(k):
            found.append(path)
        else:
            found.extend(redacted_paths(v, path))
    return found


def scrub(text: str) -> str:
    """Text with URL credentials masked (`user:***@`, or `***@` for a bare token), well-known
    token shapes masked, and the value of every credential-named environment variable (AWS
    keys, MLflow and Ray tokens, ...) replaced by ***."""
    text = URL_USERINFO.sub(_mask_userinfo, text)
    text = BARE_USERINFO.sub(_mask_userinfo, text)
    text = KEY_VALUE.sub(_mask_value, text)
    text = TOKEN_SHAPES.sub(REDACTED, text)
    for value in _environment_secrets():
        text = text.replace(value, REDACTED)
    return text


def _mask_userinfo(m: re.Match) -> str:
    user, colon, _ = m.group("userinfo").partition(":")
    return m.group("scheme") + (f"{user}:{REDACTED}" if colon else REDACTED) + "@"


def _mask_value(m: re.Match) -> str:
    value = m.group("value")
    if value.strip("'\"").lower() in SETTING_WORDS or value.startswith(("$", "/", "~")):
        return m.group(0)  # `RAY_AUTH_MODE=token`, `${VAR}`, a file that holds the secret
    quote = value[0] if value[0] in "'\"" else ""
    return m.group("key") + quote + REDACTED + quote


def _environment_secrets() -> list[str]:
    # Short values ("1", "true", "token" as RAY_AUTH_MODE) are settings, not secrets.
    return sorted(
        {v for k, v in _environment().items() if SECRET_PATTERN.search(k) and len(v) >= 8}, key=len, reverse=True
    )


def _environment() -> dict[str, str]:
    """A copy of the environment, taken while other threads may change it (MLflow's telemetry
    removes a variable of its own: iterating os.environ then raises KeyError or RuntimeError)."""
    for _ in range(10):
        try:
            return dict(os.environ)
        except (KeyError, RuntimeError):
            continue
    return dict(os.environ)


def configure_logging() -> None:
    """INFO to stderr for a command front end, with every line passed through `scrub`. MLflow's
    own notices (creating a store's tables, system metrics starting) from WARNING, unless
    $MLFLOW_LOGGING_LEVEL says otherwise; read by MLflow when it is imported, here and in the
    Ray workers that inherit this environment."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(ScrubFilter())


class ScrubFilter(logging.Filter):
    """Masks secrets in log records on their way to a handler (see `scrub`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = scrub(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True
