"""A run stopped by SIGTERM (`ray job stop`, a scheduler) or Ctrl-C ends KILLED in MLflow, not
FAILED, and the command exits 128 + the signal (143 for SIGTERM, 130 for Ctrl-C) with one line."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow_store import sqlite_store  # noqa: E402

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

REPO = Path(__file__).resolve().parents[3]


def test_sigterm_marks_the_run_killed(byte_dataset, tmp_path):
    db = sqlite_store(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "kiln.launch.local",
        "--config",
        str(REPO / "jobs/configs/debug.yaml"),
        "--set",
        f"data.path={byte_dataset}",
        "--set",
        f"logging.tracking_uri={db}",
        "--set",
        "logging.experiment=stop",
        "--set",
        "train.max_steps=100000",
        "--set",
        "parallel.num_workers=1",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        # Training has begun (so the store exists, made by the run's own process) ...
        while not any("step 1/100000" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        client = MlflowClient(db)
        (run,) = client.search_runs([client.get_experiment_by_name("stop").experiment_id])
        # ... and MLflow holds some of its steps.
        while not client.get_metric_history(run.info.run_id, "loss/train"):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        assert client.get_run(run.info.run_id).info.status == "RUNNING"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(lines)
    assert proc.returncode == 143, err[-3000:]
    assert "kiln: interrupted (SIGTERM)" in err and "Traceback" not in err
    assert MlflowClient(db).get_run(run.info.run_id).info.status == "KILLED"


def test_the_exit_code_is_128_plus_the_signal_that_stopped_the_command():
    """Ctrl-C (KeyboardInterrupt) 130, SIGTERM 143: what a shell reports for a process the
    signal ended, and what Kubernetes and Slurm read as a termination."""
    from kiln.launch.console import Stopped, run_reporting_errors

    def raising(e):
        def command():
            raise e

        return command

    assert run_reporting_errors(raising(KeyboardInterrupt())) == 130
    assert run_reporting_errors(raising(Stopped(signal.SIGTERM))) == 143
