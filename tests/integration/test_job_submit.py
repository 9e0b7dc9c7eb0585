"""`ray job submit` against a `ray start --head` cluster runs jobs/pretrain.py, and the run lands
in MLflow."""

import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_ray_job_submit_runs_pretrain(ray_cluster, byte_dataset, tmp_path):
    _, dashboard, env = ray_cluster
    db = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--",
           sys.executable, "jobs/pretrain.py", "--config", "jobs/configs/debug.yaml",
           "--set", f"data.path={byte_dataset}", "--set", "train.max_steps=20", "--set", "schedule.warmup_steps=5",
           "--set", "train.eval_every=0", "--set", "train.micro_batch_size=8",
           "--set", f"logging.tracking_uri={db}", "--set", "logging.experiment=jobs",
           "--set", f"train.storage_path={tmp_path}/runs"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-2000:])
    assert "succeeded" in out.stdout
    assert "unigram entropy" in out.stdout  # the job printed its summary
    client = MlflowClient(db)
    runs = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert len(client.get_metric_history(runs[0].info.run_id, "loss/train")) == 20
