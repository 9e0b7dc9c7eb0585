"""A training worker killed mid-run: Ray Train restarts the group, Kiln resumes from the newest
reported checkpoint, the run completes, and MLflow shows one run that records the restart."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]
KILN = str(Path(sys.executable).parent / "kiln")
STEPS = 60


def _worker_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::RayTrainWorker"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(900)
def test_sigkilled_worker_restarts_from_last_checkpoint_in_the_same_run(ray_cluster, byte_dataset, tmp_path):
    address, _, env = ray_cluster
    db = f"sqlite:///{tmp_path}/mlflow.db"
    storage = tmp_path / "runs"
    out = tmp_path / "summary.json"
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(
        [KILN, "train", "--config", str(REPO / "jobs/configs/debug.yaml"), "--address", address,
         "--summary-json", str(out),
         "--set", f"data.path={byte_dataset}", "--set", f"train.max_steps={STEPS}", "--set", "train.checkpoint_every=10",
         "--set", "train.max_failures=1", "--set", "train.eval_every=0", "--set", "train.eval_batches=2",
         "--set", "train.micro_batch_size=8", "--set", "schedule.warmup_steps=2",
         "--set", f"train.storage_path={storage}", "--set", f"logging.tracking_uri={db}",
         "--set", "logging.experiment=failure", "--set", "logging.run_name=killed-worker"],
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.time() + 600
        # Kill once the second checkpoint (step 20) is on storage: the controller registers a report
        # when it next polls the workers, so by then it holds the first one at least.
        while len(list((storage / "killed-worker").glob("checkpoint_*"))) < 2:
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.time() < deadline, "no checkpoint was reported"
            time.sleep(0.5)
        pids = _worker_pids()
        assert len(pids) == 2, pids
        victim = max(pids)
        subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(victim)], check=True)
        assert proc.wait(timeout=600) == 0, (tmp_path / "train.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    summary = json.loads(out.read_text())
    client = MlflowClient(db)
    exp = client.get_experiment_by_name("failure")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # the restart continued the same run
    run = runs[0]
    assert run.info.run_id == summary["run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["kiln.restarts"] == "1"
    assert "checkpoint_" in run.data.tags["kiln.restart.1"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss/train")]
    # every step was logged, and the steps after the checkpoint twice at most (before and after)
    assert set(steps) == set(range(1, STEPS + 1)) and max(steps) == STEPS
    assert len(steps) < 2 * STEPS
    assert summary["metrics"]["step"] == STEPS
