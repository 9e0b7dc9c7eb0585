import os

from kiln.tracking import REDACTED, redact, resolve_tracking_uri, ui_command


def test_secrets_are_redacted():
    params = {"optim.lr": 0.1, "data.s3_secret_access_key": "abc", "logging.api_token": "t",
              "x.password": "p", "aws_access_key_id": "AKIA", "data.path": "s3://b/p"}
    out = redact(params)
    assert out["optim.lr"] == 0.1 and out["data.path"] == "s3://b/p"
    assert {k for k, v in out.items() if v == REDACTED} == {"data.s3_secret_access_key", "logging.api_token",
                                                            "x.password", "aws_access_key_id"}


def test_tracking_uri_resolution(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///rel.db") == f"sqlite:///{os.path.abspath('rel.db')}"
    assert ui_command("sqlite:////a/b.db").startswith("mlflow ui --backend-store-uri sqlite:////a/b.db")
