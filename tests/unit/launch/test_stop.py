"""A run stopped by SIGTERM (`ray job stop`, a scheduler) or Ctrl-C ends KILLED in MLflow, not
FAILED, and the command exits 130 with one line."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[3]


def test_sigterm_marks_the_run_killed(byte_dataset, tmp_path):
    db = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "kiln.launch.local", "--config", str(REPO / "jobs/configs/debug.yaml"),
           "--set", f"data.path={byte_dataset}", "--set", f"logging.tracking_uri={db}",
           "--set", "logging.experiment=stop", "--set", "train.max_steps=100000", "--set", "parallel.num_workers=1"]
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
    assert proc.returncode == 130, err[-3000:]
    assert "kiln: interrupted" in err and "Traceback" not in err
    assert MlflowClient(db).get_run(run.info.run_id).info.status == "KILLED"
