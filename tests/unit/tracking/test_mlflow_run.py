import os

from mlflow_store import sqlite_store  # noqa: E402

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

    uri = sqlite_store(tmp_path)
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
    # A block asked to stop (a Tune trial its scheduler stopped) raises as its trainer goes:
    # KILLED, however late, so the driver's KILLED and the trial's own verdict agree.
    asked = Run(uri, "e", "asked")
    try:
        with asked.finishing(stopping=lambda: True):
            raise RuntimeError("the Train controller died")
    except RuntimeError:
        pass
    assert client.get_run(asked.run_id).info.status == "KILLED"


def test_a_dataset_two_runs_log_at_once_is_logged_for_both(tmp_path, monkeypatch):
    """Two runs of one experiment that log the same dataset at once (a sweep's trials) race in
    MLflow's SQL store: both find no row and insert one, and the second fails on the unique key
    (CI: a PBT trial lost that way). Planted here: the rival's insert lands first, ours fails as
    it did there, and the second try finds the rival's row."""
    import sqlalchemy.exc
    from mlflow import MlflowClient
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from kiln.tracking.mlflow_run import Run

    uri = sqlite_store(tmp_path)
    ours, rival = Run(uri, "e", "ours"), Run(uri, "e", "rival")
    impl, raced = SqlAlchemyStore._log_inputs_impl, []

    def racing(self, experiment_id, run_id, *args, **kwargs):
        if run_id == ours.run_id and not raced:
            raced.append(run_id)
            rival.log_dataset(str(tmp_path / "bytes"), "f00d")
            raise sqlalchemy.exc.IntegrityError(
                "INSERT INTO datasets", {}, Exception("UNIQUE constraint failed: datasets.experiment_id")
            )
        return impl(self, experiment_id, run_id, *args, **kwargs)

    monkeypatch.setattr(SqlAlchemyStore, "_log_inputs_impl", racing)
    ours.log_dataset(str(tmp_path / "bytes"), "f00d")
    assert raced == [ours.run_id]
    client = MlflowClient(uri)
    for run in (ours, rival):
        logged = client.get_run(run.run_id).inputs.dataset_inputs
        assert [(d.dataset.name, d.dataset.digest) for d in logged] == [("bytes", "f00d")]
