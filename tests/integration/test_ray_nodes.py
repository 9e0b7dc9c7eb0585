"""A cluster of its own, started by the test like a user's `ray start --head` on a 1-CPU
machine, with no autoscaler: a job submitted there with the default paths trains (its reads
fit beside the worker), keeps its checkpoints and MLflow store after the cluster stops (not in
Ray's temporary copy of the job's working dir), and the session's clean-up stops only the
cluster it started: the other one keeps running until the test stops it, to its last worker."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
from mlflow.tracking import MlflowClient

from kiln.launch.local import free_port

sys.path.insert(0, str(Path(__file__).parent))
from ray_nodes import BIN, ray_cluster_processes, ray_daemons, start_head, stop_ray_cluster, wait_for_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _names(procs: list[psutil.Process]) -> set[str]:
    return {" ".join(p.cmdline()[:2]) for p in procs if p.is_running()}


def _submit(dashboard: str, env: dict, byte_dataset: Path) -> str:
    """The README's job, with the default storage path and MLflow store; its output."""
    cmd = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        dashboard,
        "--runtime-env",
        "jobs/runtime_env.yaml",
        "--",
        sys.executable,
        "jobs/pretrain.py",
        "--config",
        "jobs/configs/debug.yaml",
        "--set",
        f"data.path={byte_dataset}",
        "--set",
        "parallel.num_workers=1",
        "--set",
        "parallel.zero_stage=0",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "logging.experiment=job-paths",
        "--set",
        "logging.run_name=durable",
    ]
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout + out.stderr


def test_a_job_on_a_small_fixed_cluster_trains_and_keeps_its_runs(ray_cluster, byte_dataset, tmp_path):
    gcs, _, env = ray_cluster
    session_port = int(gcs.rsplit(":", 1)[1])
    session = ray_daemons(session_port)  # not its workers: Ray ends idle ones whenever it likes
    assert any("gcs_server" in n for n in _names(session)) and any("raylet" in n for n in _names(session))

    home = tmp_path / "kiln-home"  # where a job's relative paths go ($KILN_HOME, else ~/kiln)
    env = {k: v for k, v in env.items() if k not in ("MLFLOW_TRACKING_URI", "KILN_STORAGE_PATH", "RAY_ADDRESS")}
    env["KILN_HOME"] = str(home)
    other_port, dash_port = free_port(), free_port()
    # Its own temp dir: a second head in /tmp/ray would rewrite the session's Prometheus
    # service-discovery file.
    with tempfile.TemporaryDirectory(prefix="kr-", dir="/tmp") as temp_dir:
        start_head(other_port, dash_port, env, "--num-cpus=1", f"--temp-dir={temp_dir}")
        other = ray_cluster_processes(other_port)
        try:
            assert not {p.pid for p in other} & {p.pid for p in session}
            assert any("raylet" in n for n in _names(other)) and any("gcs_server" in n for n in _names(other))
            wait_for_port(dash_port, timeout=120)
            said = _submit(f"http://127.0.0.1:{dash_port}", env, byte_dataset)
        finally:
            stop_ray_cluster(other_port)
        # The one worker holds the one CPU: the reads ran with none reserved, and said so.
        assert "reading with 0 CPUs reserved" in said, said[-3000:]
        # Relative outputs in Ray's temporary copy of the job went to KILN_HOME instead, saying so.
        assert "train.storage_path = 'runs' is relative" in said and f"writing to {home}/runs" in said, said[-3000:]
        assert f"checkpoint        {home}/runs/durable/checkpoint_" in said, said[-3000:]

    # After `ray stop` (and its temp dir gone): the checkpoints, the worker log and the MLflow run.
    run_dir = home / "runs" / "durable"
    assert len([p for p in run_dir.glob("checkpoint_*") if p.is_dir()]) == 2  # steps 2 and 4, all kept
    assert (run_dir / "workers.log").stat().st_size > 0
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("job-paths").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss/train")) == [1, 2, 3, 4]

    assert not [p for p in other if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert ray_cluster_processes(other_port) == []
    assert all(p.is_running() for p in session), "stopping another cluster touched the session's"
