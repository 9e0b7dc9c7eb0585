"""One redaction for everything Kiln prints or writes: URL credentials of any scheme, bare
tokens, passwords holding `@`, and credentials known by their shape."""

import pytest

from kiln.redact import scrub


@pytest.mark.parametrize("text, expected", [
    ("htpp://user:hunter2@127.0.0.1:9", "htpp://user:***@127.0.0.1:9"),  # a misspelt scheme
    ("http://ghp_hunter2TOKENVALUE@host/x", "http://***@host/x"),  # a token as the whole userinfo
    ("https://u:hunter2@corp@host:9/p", "https://u:***@host:9/p"),  # '@' inside the password
    ("postgresql://mlflow:hunter22@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
    ("id AKIAIOSFODNN7EXAMPLE end", "id *** end"),
    ("gh ghp_abcdefghijklmnopqrstuvwxyz0123456789 hf hf_abcdefghijklmnopqrstuvwxyz12", "gh *** hf ***"),
])
def test_secrets_are_masked(text, expected):
    assert scrub(text) == expected


@pytest.mark.parametrize("text", ["write to a@b.com", "http://host/path@v2", "s3://bucket/prefix", "tokens 1234"])
def test_what_is_not_a_secret_is_left_alone(text):
    assert scrub(text) == text
