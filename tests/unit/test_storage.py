"""Transient S3 errors are retried with backoff; anything else fails at once. Against a real
S3-compatible server (moto_server) on loopback that comes up only after the first attempts."""

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.launch.local import free_port
from kiln.storage import is_transient, resolve, retry_transient

MOTO = str(Path(sys.executable).parent / "moto_server")


@pytest.fixture
def s3_env(monkeypatch):
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)


def test_a_read_retries_while_s3_is_away_and_goes_on_when_it_is_back(s3_env, caplog):
    port = free_port()
    loc = resolve("s3://kiln-retry/ds", f"http://127.0.0.1:{port}")
    server: list[subprocess.Popen] = []
    late = threading.Timer(
        2.5,
        lambda: server.append(
            subprocess.Popen(
                [MOTO, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        ),
    )
    caplog.set_level(logging.WARNING, logger="kiln.storage")
    calls = []

    def read():
        calls.append(time.monotonic())
        return loc.fs.get_file_info("kiln-retry")

    late.start()
    try:
        info = retry_transient(read, "listing the bucket", attempts=8, first_wait_s=0.5, max_wait_s=2)
    finally:
        late.cancel()
        late.join()
        for proc in server:
            proc.terminate()
            proc.wait(timeout=30)
    assert info.type.name == "NotFound"  # the server answered: there is no such bucket
    assert len(calls) >= 2, calls  # the first attempts met no server and were retried
    assert "listing the bucket failed (attempt 1 of 8), retrying in 0.5 s: " in caplog.text
    assert "AWS Error NETWORK_CONNECTION" in caplog.text


def test_other_errors_and_the_last_attempt_are_raised_at_once(s3_env):
    calls = []

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://kiln-retry/ds/part-00000.parquet")

    with pytest.raises(FileNotFoundError):
        retry_transient(missing, "reading a shard")
    assert calls == [1]
    assert is_transient(OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate."))
    assert not is_transient(OSError("Parquet magic bytes not found in footer"))

    def always_down():
        calls.append(1)
        raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7")

    calls.clear()
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):
        retry_transient(always_down, "reading a shard", attempts=3, first_wait_s=0.01)
    assert len(calls) == 3


def test_private_files_are_owner_only_and_whole(tmp_path):
    import os
    import stat

    from kiln.storage import write_private

    path = tmp_path / "state.json"
    write_private(path, '{"endpoint": "http://u:p@h"}')
    write_private(path, "{}")  # replaced whole
    assert path.read_text() == "{}" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_jobs_relative_outputs_go_to_a_durable_home_and_nothing_else_moves(monkeypatch, tmp_path, caplog):
    """In a Ray job's temporary working copy (Ray's job supervisor sets its JobConfig, runtime
    env included), a relative output path goes under $KILN_HOME; an absolute or s3:// one, or
    any path outside a job or in a job without a working dir, stays as given."""
    import json

    from kiln.storage import RAY_JOB_CONFIG_ENV, durable

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(RAY_JOB_CONFIG_ENV, raising=False)
    assert durable("runs", "train.storage_path") == "runs"  # not a job: the cwd is the user's
    monkeypatch.setenv(RAY_JOB_CONFIG_ENV, json.dumps({"runtime_env": {"py_modules": ["gcs://x.zip"]}}))
    assert durable("runs", "train.storage_path") == "runs"  # a job run where it was submitted from
    monkeypatch.setenv(RAY_JOB_CONFIG_ENV, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_1.zip"}}))
    with caplog.at_level(logging.WARNING, logger="kiln.storage"):
        assert durable("runs", "train.storage_path", "KILN_STORAGE_PATH") == str(tmp_path / "home" / "runs")
    assert "train.storage_path = 'runs' is relative" in caplog.text and "$KILN_STORAGE_PATH" in caplog.text
    for kept in ("/abs/runs", "s3://bucket/runs", "~/runs"):
        assert durable(kept, "train.storage_path") == kept
    monkeypatch.delenv("KILN_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert durable("mlflow.db", "logging.tracking_uri") == str(tmp_path / "user" / "kiln" / "mlflow.db")
