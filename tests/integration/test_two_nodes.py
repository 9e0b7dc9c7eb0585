"""Multi-node, proven on one machine: a second Ray node joins the session's head with
`ray start --address`, a `ray job submit` run puts one ZeRO-2 worker on each node
(STRICT_SPREAD), checkpoints to the loopback S3 server and logs to a real `mlflow server`.
The second node is then killed mid-run and started again; the job resumes from the last
checkpoint on S3 and completes, in one MLflow run."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import psutil
import pytest
from mlflow.tracking import MlflowClient

from kiln import services
from kiln.train.local import free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
STEPS = 60
LABEL = "kiln_node_b"  # the second node's custom resource: how the test tells the nodes apart


class SecondNode:
    """A worker node on this machine with its own logical CPUs and label. Its ports are fixed
    per start, so its raylet can be found (and killed) by its node-manager port."""

    def __init__(self, gcs_address: str, env: dict):
        self.gcs_address, self.env, self.manager_port = gcs_address, env, 0

    def start(self) -> None:
        self.manager_port = free_port()
        ports = {"--node-manager-port": self.manager_port, "--object-manager-port": free_port(),
                 "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
                 "--metrics-export-port": free_port(), "--runtime-env-agent-port": free_port()}
        out = subprocess.run(
            [str(BIN / "ray"), "start", f"--address={self.gcs_address}", "--num-cpus=2",
             f"--resources={json.dumps({LABEL: 1})}", "--disable-usage-stats",
             *(f"{k}={v}" for k, v in ports.items())],
            env=self.env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr

    def kill(self) -> int:
        """SIGKILL the raylet and everything under it (its workers, agents): a lost machine.
        Returns how many processes died."""
        raylets = [p for p in psutil.process_iter(["cmdline"])
                   if p.info["cmdline"] and f"--node_manager_port={self.manager_port}" in " ".join(p.info["cmdline"])]
        assert len(raylets) == 1, f"expected one raylet on port {self.manager_port}, found {len(raylets)}"
        victims = [*raylets[0].children(recursive=True), raylets[0]]
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        return len(victims)


def _checkpoints(endpoint: str, prefix: str) -> set[str]:
    keys = _keys(endpoint, prefix)
    return {k[len(prefix):].split("/")[0] for k in keys if k[len(prefix):].startswith("checkpoint_")}


def _keys(endpoint: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")  # conftest's S3_ENV
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="kiln-test", Prefix=prefix)
            for o in page.get("Contents", [])]


def _nodes(dashboard: str) -> list:
    from ray.util.state import list_nodes

    return list_nodes(address=dashboard, detail=True, limit=100)


@pytest.mark.timeout(1200)
def test_job_spread_over_two_nodes_survives_losing_one(ray_cluster, s3_server, s3_dataset, tmp_path):
    gcs, dashboard, env = ray_cluster
    mlflow_url = services.up(tmp_path / "services", port=free_port())[0].url
    try:
        _submit_kill_and_check(gcs, dashboard, env, s3_server, s3_dataset, mlflow_url, tmp_path)
    finally:
        services.down(tmp_path / "services")


def _submit_kill_and_check(gcs, dashboard, env, s3_server, s3_dataset, mlflow_url, tmp_path) -> None:
    node = SecondNode(gcs, env)
    node.start()
    log_path = tmp_path / "job.log"
    try:
        cmd = [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--",
               sys.executable, "jobs/pretrain.py", "--config", "jobs/configs/debug.yaml",
               "--set", f"data.path={s3_dataset}", "--set", f"data.s3_endpoint={s3_server}",
               "--set", "parallel.num_workers=2", "--set", "parallel.zero_stage=2",
               "--set", "parallel.placement_strategy=STRICT_SPREAD",
               "--set", f"train.max_steps={STEPS}", "--set", "train.checkpoint_every=10",
               "--set", "train.max_failures=1", "--set", "train.eval_every=0", "--set", "train.eval_batches=2",
               "--set", "train.micro_batch_size=8", "--set", "schedule.warmup_steps=2",
               "--set", "train.storage_path=s3://kiln-test/cluster-runs",
               "--set", f"logging.tracking_uri={mlflow_url}", "--set", "logging.experiment=two-nodes",
               "--set", "logging.run_name=spread"]
        with log_path.open("w") as log:
            job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            deadline = time.time() + 600
            # Kill the node once two checkpoints are on S3: Ray Train has registered one by then.
            while len(_checkpoints(s3_server, "cluster-runs/spread/")) < 2:
                assert job.poll() is None, log_path.read_text()[-4000:]
                assert time.time() < deadline, "no checkpoint reached S3"
                time.sleep(1)
            assert node.kill() >= 2  # the raylet and at least the training worker on it
            time.sleep(3)
            node.start()  # the machine comes back (as a new Ray node)
            rc = job.wait(timeout=900)
        out = log_path.read_text()
        assert rc == 0 and "succeeded" in out, out[-5000:]
    finally:
        if "job" in locals() and job.poll() is None:
            job.kill()
        with contextlib.suppress(AssertionError):
            node.kill()  # leave the session cluster as it was: one node

    client = MlflowClient(mlflow_url)
    runs = client.search_runs([client.get_experiment_by_name("two-nodes").experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["kiln.restarts"] == "1" and "checkpoint_" in run.data.tags["kiln.restart.1"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss/train")]
    assert set(steps) == set(range(1, STEPS + 1))
    # The restarted group placed one rank on the head and one on the second node's new incarnation.
    nodes = _nodes(dashboard)
    head = [n.node_id for n in nodes if "kiln_head" in n.resources_total]
    seconds = [n for n in nodes if LABEL in n.resources_total]
    assert len(head) == 1 and len(seconds) == 2, [(n.node_id, n.state) for n in nodes]
    placement = run.data.tags["kiln.placement"].split(",")
    assert len(placement) == 2 and head[0] in placement
    newest = max(seconds, key=lambda n: n.start_time_ms)
    assert newest.node_id in placement and newest.node_id != head[0]
    # The final checkpoint is on shared storage, with both ranks' ZeRO shards.
    assert len(_checkpoints(s3_server, "cluster-runs/spread/")) >= STEPS // 10
    final = sorted(_checkpoints(s3_server, "cluster-runs/spread/"))[-1]
    names = {k.rsplit("/", 1)[-1] for k in _keys(s3_server, f"cluster-runs/spread/{final}/")}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names, names
