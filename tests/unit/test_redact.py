"""One redaction for everything Kiln prints or writes: URL credentials of any scheme, bare
tokens, passwords holding `@`, and credentials known by their shape."""

import pytest

from kiln.redact import scrub


@pytest.mark.parametrize(
    "text, expected",
    [
        ("htpp://user:hunter2@127.0.0.1:9", "htpp://user:***@127.0.0.1:9"),  # a misspelt scheme
        ("http://ghp_hunter2TOKENVALUE@host/x", "http://***@host/x"),  # a token as the whole userinfo
        ("https://u:hunter2@corp@host:9/p", "https://u:***@host:9/p"),  # '@' inside the password
        ("postgresql://mlflow:hunter22@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
        ("id AKIAIOSFODNN7EXAMPLE end", "id *** end"),
        ("gh ghp_abcdefghijklmnopqrstuvwxyz0123456789 hf hf_abcdefghijklmnopqrstuvwxyz12", "gh *** hf ***"),
        ("http://me:pa#ss/w?rd@host:9/p", "http://me:***@host:9/p"),  # '#', '/' and '?' in the password
        ("--s3-endpoint kiln:hunter2@127.0.0.1:9 failed", "--s3-endpoint kiln:***@127.0.0.1:9 failed"),  # no scheme
        ("s3://me:hunter2@bucket/x", "s3://me:***@bucket/x"),
        (
            "parallel.deepspeed = [{'aws_secret_access_key': 'hunter2'}] is not a mapping",
            "parallel.deepspeed = [{'aws_secret_access_key': '***'}] is not a mapping",
        ),  # a quoted mapping
        ('{"token": "hunter2", "n": 1}', '{"token": "***", "n": 1}'),  # JSON
        (
            "setup_commands: 'export WANDB_API_KEY=hunter2' is wrong",
            "setup_commands: 'export WANDB_API_KEY=***' is wrong",
        ),
        ("--set parallel.deepspeed.api_key=hunter2", "--set parallel.deepspeed.api_key=***"),
    ],
)
def test_secrets_are_masked(text, expected):
    assert scrub(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "write to a@b.com",
        "http://host/path@v2",
        "s3://bucket/prefix",
        "tokens 1234",
        "`ray start` without RAY_AUTH_MODE=token",
        "secret_file: ~/.aws/key",
        "tokens/s: 1234, max_new_tokens=5",
        "line 3, column 5: x",
    ],
)
def test_what_is_not_a_secret_is_left_alone(text):
    assert scrub(text) == text
