import os

from kiln.redact import REDACTED, redact
from kiln.tracking.server import resolve_tracking_uri, ui_command


def test_secrets_are_redacted():
    params = {
        "optim.lr": 0.1,
        "data.s3_secret_access_key": "abc",
        "logging.api_token": "t",
        "x.password": "p",
        "aws_access_key_id": "AKIA",
        "data.path": "s3://b/p",
        "HF_TOKEN": "hf",
        "x.tokens_secret": "s",
        "data.tokenizer": "bpe",
        "data.train_tokens": 1339392,
        "data.val_tokens": 9,
    }
    out = redact(params)
    assert out["optim.lr"] == 0.1 and out["data.path"] == "s3://b/p"
    # the tokenizer and token counts are plain settings, not credentials
    assert out["data.tokenizer"] == "bpe" and out["data.train_tokens"] == 1339392
    assert {k for k, v in out.items() if v == REDACTED} == {
        "data.s3_secret_access_key",
        "logging.api_token",
        "x.password",
        "aws_access_key_id",
        "HF_TOKEN",
        "x.tokens_secret",
    }


def test_tracking_uri_resolution(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///rel.db") == f"sqlite:///{os.path.abspath('rel.db')}"
    assert ui_command("sqlite:////a/b.db").startswith("mlflow ui --backend-store-uri sqlite:////a/b.db")


def test_url_passwords_and_environment_secrets_are_scrubbed(monkeypatch):
    from kiln.redact import redact_tree, scrub

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # a setting, not a secret: left alone
    assert scrub("postgresql://mlflow:hunter22@db:5432/mlflow") == "postgresql://mlflow:***@db:5432/mlflow"
    assert scrub("https://kiln:p4ss@minio.internal:9000/x") == "https://kiln:***@minio.internal:9000/x"
    assert scrub("s3://bucket/path and http://host:5000") == "s3://bucket/path and http://host:5000"
    assert scrub("key wJalrXUtnFEMI/K7MDENG leaked; mode token") == "key *** leaked; mode token"
    tree = {
        "parallel": {"deepspeed": {"wandb": {"api_key": "k-123456789", "project": "p"}}},
        "data": {"s3_endpoint": "http://u:pw123456@minio:9000"},
        "list": ["wJalrXUtnFEMI/K7MDENG"],
    }
    assert redact_tree(tree) == {
        "parallel": {"deepspeed": {"wandb": {"api_key": REDACTED, "project": "p"}}},
        "data": {"s3_endpoint": "http://u:***@minio:9000"},
        "list": [REDACTED],
    }


def test_the_first_process_to_end_a_run_decides_its_status(tmp_path):
    """A sweep's driver ends a stopped trial's run KILLED; the trial's own process, torn down
    after, must not turn it FAILED. A run still running is ended as its process says."""
    from mlflow import MlflowClient

    from kiln.tracking.mlflow_run import Run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    stopped, failed = Run(uri, "e", "stopped"), Run(uri, "e", "failed")
    MlflowClient(uri).set_terminated(stopped.run_id, "KILLED")  # the driver, first
    for run in (stopped, failed):
        try:
            with run.finishing():
                raise RuntimeError("the trial's workers were torn down")
        except RuntimeError:
            pass
    client = MlflowClient(uri)
    assert client.get_run(stopped.run_id).info.status == "KILLED"
    assert client.get_run(failed.run_id).info.status == "FAILED"
