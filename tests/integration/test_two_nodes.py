"""Multi-node, elastic and failures, proven on one machine, in one `ray job submit` run.

`jobs/pretrain.py` is submitted as an elastic ZeRO-2 run, `parallel.num_workers: [1, 2]` with 3
CPUs a worker, so the session's head (4 CPUs) holds one worker: it starts on one node. A second
Ray node joins with `ray start --address` (3 CPUs and a custom resource): the run grows to two
workers, one a node, resharding its checkpoint. Once the two have written a checkpoint, the
whole second node dies (its raylet and everything under it, the training worker included): the
run shrinks back to one worker, which resumes the two's checkpoint on S3 (the loopback server),
and completes. MLflow, a real `mlflow server` started and stopped with `kiln services up|down`
as a team would, shows one run with each step once, the world size over steps and both resizes.
The run's `data.index_log` shows each train row once an epoch across the sizes, and its final
loss is within step-to-step noise of the same run on one worker throughout.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import boto3
import psutil
import pytest
from mlflow.tracking import MlflowClient

from kiln.launch.local import free_port

sys.path.insert(0, str(Path(__file__).parent))
from ray_nodes import BIN, node_ports, process_tree, ray_daemons, runs_program  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 200  # ~0.2 s a step: time to grow, checkpoint at two workers and shrink (by step ~60); an epoch of 164 steps and a second begun
LABEL = "kiln_node_b"  # the second node's custom resource: how the test tells the nodes apart
PREFIX = "cluster-runs/spread/"  # the run's directory in the bucket (train.storage_path/run name)


class SecondNode:
    """A worker node on this machine with its own logical CPUs and label. Its ports are chosen
    per start, so its raylet can be found (and killed) by its node-manager port."""

    def __init__(self, gcs_address: str, env: dict):
        self.gcs_address, self.env, self.manager_port = gcs_address, env, 0
        self.monitors: list[psutil.Process] = []  # the log monitor `ray start` starts beside the raylet

    def start(self) -> None:
        gcs_port = int(self.gcs_address.rsplit(":", 1)[1])
        before = {p.pid for p in ray_daemons(gcs_port)}
        ports = node_ports()
        self.manager_port = ports["--node-manager-port"]
        out = subprocess.run(
            [
                str(BIN / "ray"),
                "start",
                f"--address={self.gcs_address}",
                "--num-cpus=3",
                f"--resources={json.dumps({LABEL: 1})}",
                "--disable-usage-stats",
                *(f"{k}={v}" for k, v in ports.items()),
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        # Beyond the raylet's tree, `ray start` starts the node's log monitor. It names the GCS,
        # as do new workers on any node: so the new process that is a log monitor.
        self.monitors = [p for p in ray_daemons(gcs_port) if p.pid not in before and runs_program(p, "log_monitor.py")]

    def raylet(self) -> psutil.Process:
        found = [
            p
            for p in psutil.process_iter(["cmdline"])
            if f"--node_manager_port={self.manager_port}" in " ".join(p.info["cmdline"] or [])
        ]
        assert len(found) == 1, f"expected one raylet on port {self.manager_port}, found {len(found)}"
        return found[0]

    def kill(self) -> int:
        """SIGKILL the raylet and everything under it (its workers, agents), and the node's
        other daemons (its log monitor, which `ray start` starts beside the raylet and which
        polled the session's logs for the rest of the session): a lost machine. How many."""
        raylet = self.raylet()
        roots = [raylet, *self.monitors]
        victims = [p for root in roots for p in process_tree(root)]
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        return len(victims)


def _s3(endpoint: str):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )  # conftest's S3_ENV


def _keys(endpoint: str, prefix: str) -> list[str]:
    s3 = _s3(endpoint)
    return [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="kiln-test", Prefix=prefix)
        for o in page.get("Contents", [])
    ]


def _checkpoints(endpoint: str) -> list[str]:
    # directories only: Ray also keeps checkpoint_manager_snapshot.json beside them
    return sorted(
        {
            k[len(PREFIX) :].split("/")[0]
            for k in _keys(endpoint, PREFIX)
            if k[len(PREFIX) :].startswith("checkpoint_") and "/" in k[len(PREFIX) :]
        }
    )


def _wait_for_a_registered_checkpoint(endpoint: str, job: subprocess.Popen, log: Path, ranks: int) -> None:
    """Until Ray Train's checkpoint-manager snapshot on S3 lists a checkpoint written by `ranks`
    ranks: a directory alone may still be uploading, and an unregistered checkpoint is not one a
    restart resumes from."""
    s3 = _s3(endpoint)
    deadline = time.time() + 600
    while True:
        assert job.poll() is None, log.read_text()[-4000:]
        assert time.time() < deadline, f"Ray Train registered no checkpoint of {ranks} ranks"
        with contextlib.suppress(s3.exceptions.NoSuchKey):
            body = s3.get_object(Bucket="kiln-test", Key=f"{PREFIX}checkpoint_manager_snapshot.json")["Body"].read()
            names = set(re.findall(rb"checkpoint_[0-9_.-]+", body))
            if any(
                f"{PREFIX}{n.decode()}/kiln_complete.rank{ranks - 1}.json" in _keys(endpoint, PREFIX + n.decode())
                for n in names
            ):
                return
        time.sleep(0.5)


def _services(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", "services", *map(str, args)], capture_output=True, text=True, timeout=180
    )


@pytest.mark.timeout(1500)
def test_an_elastic_job_grows_onto_a_new_node_and_shrinks_when_it_dies(ray_cluster, s3_server, s3_dataset, tmp_path):
    """The MLflow server is the team's `kiln services up`, checked on the way."""
    gcs, dashboard, env = ray_cluster
    root, port = tmp_path / "services", free_port()
    up = _services("up", "--dir", root, "--port", port)
    assert up.returncode == 0, up.stderr
    mlflow_url = f"http://127.0.0.1:{port}"
    try:
        assert f"export MLFLOW_TRACKING_URI={mlflow_url}" in up.stdout
        _check_services_guards(root, port, tmp_path)
        out = _submit_and_kill(SecondNode(gcs, env), dashboard, env, s3_server, s3_dataset, mlflow_url, tmp_path)
        _check(out, dashboard, s3_server, mlflow_url)
        _check_each_row_once_an_epoch(tmp_path / "indices", s3_server)
        _check_final_loss_against_a_fixed_run(env, s3_server, s3_dataset, mlflow_url, tmp_path)
        # the run's artifacts went through the server into the services directory
        assert list((root / "artifacts").rglob("config.yaml")) and (root / "mlflow.db").exists()
    finally:
        down = _services("down", "--dir", root)
    assert down.returncode == 0 and "stopped mlflow" in down.stdout, down.stdout + down.stderr
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{mlflow_url}/health", timeout=2)  # nothing answers any more
    assert not (root / "services.json").exists()


def _check_each_row_once_an_epoch(indices: Path, endpoint: str) -> None:
    """data.index_log, each step as the group that kept it trained it: 16 rows a step on one
    worker or two, and in every epoch each train row once (the epoch's tail that does not fill
    a micro-batch on every replica, fewer than 8 x 2 rows, is left out)."""
    from kiln.data.indices import trained_ids

    steps = trained_ids(indices)
    assert sorted(steps) == list(range(1, STEPS + 1)) and {len(v) for v in steps.values()} == {16}
    s3 = _s3(endpoint)
    manifest = json.loads(s3.get_object(Bucket="kiln-test", Key="stdlib-bpe/manifest.json")["Body"].read())
    rows = {
        i
        for shard in manifest["splits"]["train"]["shards"]
        for i in range(shard["first_id"], shard["first_id"] + shard["rows"])
    }
    epochs: dict[int, list[int]] = {}
    for step in sorted(steps):
        for epoch, sample in steps[step]:
            epochs.setdefault(epoch, []).append(sample)
    assert len(epochs) >= 2, {e: len(ids) for e, ids in epochs.items()}  # the run went round the data
    for epoch, ids in epochs.items():
        assert len(set(ids)) == len(ids) and set(ids) <= rows, f"epoch {epoch} read a row twice, or not a train row"
        if epoch < max(epochs):  # complete
            assert len(rows) - 16 < len(ids), (epoch, len(ids), len(rows))


def _check_final_loss_against_a_fixed_run(env, s3_server, s3_dataset, mlflow_url, tmp_path) -> None:
    """The same run on one worker all along (its 2 micro-batches a step make the elastic run's
    16 rows): on the same tokens, the elastic run ends within step-to-step noise of it."""
    fixed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.launch.local",
            "--config",
            "jobs/configs/debug.yaml",
            "--set",
            f"data.path={s3_dataset}",
            "--set",
            f"data.s3_endpoint={s3_server}",
            "--set",
            "parallel.num_workers=1",
            "--set",
            "parallel.zero_stage=2",
            "--set",
            "train.grad_accum_steps=2",
            "--set",
            f"train.max_steps={STEPS}",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.eval_batches=2",
            "--set",
            "train.micro_batch_size=8",
            "--set",
            "schedule.warmup_steps=2",
            "--set",
            f"train.storage_path={tmp_path / 'fixed'}",
            "--set",
            f"logging.tracking_uri={mlflow_url}",
            "--set",
            "logging.experiment=two-nodes-fixed",
            "--set",
            "logging.run_name=fixed",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert fixed.returncode == 0, fixed.stderr[-4000:]
    client = MlflowClient(mlflow_url)

    def losses(experiment: str) -> list[float]:
        run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
        history = client.get_metric_history(run.info.run_id, "loss/train")
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    elastic, alone = losses("two-nodes"), losses("two-nodes-fixed")
    assert len(elastic) == len(alone) == STEPS
    noise = statistics.stdev(alone[-50:])  # how much one step's loss moves about its trend
    gap = statistics.fmean(elastic[-20:]) - statistics.fmean(alone[-20:])
    assert abs(gap) < noise, (gap, noise)


def _check_services_guards(root: Path, port: int, tmp_path: Path) -> None:
    """Bound to loopback only; a second `up` and a busy port are refused in one line."""
    ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    local = [line.split()[3] for line in ss.splitlines()]
    assert local and all(a.startswith("127.0.0.1:") for a in local), ss
    again = _services("up", "--dir", root, "--port", port)
    assert again.returncode == 1 and "already running" in again.stderr and "Traceback" not in again.stderr
    busy = _services("up", "--dir", tmp_path / "other", "--port", port)
    assert busy.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in busy.stderr
    assert "running" in _services("status", "--dir", root).stdout


def _edited_checkout(tmp_path: Path) -> tuple[Path, str]:
    """A copy of the checkout (its .git whole: the runtime env decides what of it travels) whose
    `kiln` differs from the one installed on the nodes: each worker warns a token at start. Its
    job must run this copy (jobs/runtime_env.yaml)."""
    copy = tmp_path / "checkout"
    local = {".venv", "data", "runs", "mlruns", "mlartifacts", "mlflow.db", ".whl", ".device"}  # the top level's
    shutil.copytree(REPO, copy, ignore=lambda d, names: [n for n in names if Path(d) == REPO and n in local])
    token = f"edited-{uuid.uuid4().hex[:8]}"
    trainer = copy / "platform/kiln/ray/trainer.py"
    # the installed line, however the formatter wraps it
    installed = re.compile(r'logging\.getLogger\("kiln\.train"\)\.info\(\s*"rank %d of %d on node %s"')
    assert installed.search(trainer.read_text())
    edited = f'logging.getLogger("kiln.train").warning("{token} rank %d of %d on node %s"'
    trainer.write_text(installed.sub(lambda _: edited, trainer.read_text()))
    return copy, token


def _submit_and_kill(node, dashboard, env, s3_server, s3_dataset, mlflow_url, tmp_path) -> str:
    log_path = tmp_path / "job.log"
    checkout, token = _edited_checkout(tmp_path)
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
        f"data.path={s3_dataset}",
        "--set",
        f"data.s3_endpoint={s3_server}",
        "--set",
        "parallel.num_workers=[1, 2]",
        "--set",
        "parallel.cpus_per_worker=3",
        "--set",
        "parallel.zero_stage=2",
        "--set",
        "parallel.resize_check_s=5",
        "--set",
        "parallel.start_timeout_s=30",
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        "train.checkpoint_every=10",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.micro_batch_size=8",
        "--set",
        "schedule.warmup_steps=2",
        "--set",
        "train.storage_path=s3://kiln-test/cluster-runs",
        "--set",
        f"logging.tracking_uri={mlflow_url}",
        "--set",
        "logging.experiment=two-nodes",
        "--set",
        "logging.run_name=spread",
        "--set",
        f"data.index_log={tmp_path / 'indices'}",
    ]
    job = None
    try:
        with log_path.open("w") as log:
            job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=checkout)
            _wait_for_a_registered_checkpoint(s3_server, job, log_path, ranks=1)  # on the head alone
            node.start()  # a node joins: the run grows to two workers
            _wait_for_a_registered_checkpoint(s3_server, job, log_path, ranks=2)
            assert node.kill() >= 2  # the raylet and at least the training worker under it
            rc = job.wait(timeout=900)
        out = log_path.read_text()
        assert rc == 0 and "succeeded" in out, out[-5000:]
        # Every worker group ran the submitted copy: one worker, two, one again.
        assert out.count(f"{token} rank 0 of 1") >= 2 and out.count(f"{token} rank 1 of 2") == 1, out[-5000:]
        # The job's console is Kiln's: Ray's report dicts and DeepSpeed's notices stayed in workers.log.
        assert "TrainingReport(" not in out and "Setting accelerator to CPU" not in out, out[-5000:]
        return out
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        with contextlib.suppress(AssertionError):
            node.kill()  # leave the session cluster as it was: one node


def _check(out: str, dashboard: str, s3_server: str, mlflow_url: str) -> None:
    assert "unigram entropy" in out and f"{STEPS} steps on 1 worker(s)" in out  # the job printed its summary
    # The summary names the checkpoint by its URI; a model on S3 is not logged, with a warning.
    assert f"checkpoint        s3://kiln-test/{PREFIX}checkpoint_" in out, out[-3000:]
    assert "the model is not exported or logged to MLflow" in out, out[-3000:]
    client = MlflowClient(mlflow_url)
    runs = client.search_runs([client.get_experiment_by_name("two-nodes").experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # the restart continued the same run
    run = runs[0]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    # The commit is right although the job's copy of .git holds only HEAD and the refs.
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == tags["kiln.git_commit"] == head, tags
    # Two resizes, each with its reason and cost; the world size over steps went 1, 2, 1.
    assert tags["kiln.resizes"] == "2" and "kiln.restarts" not in tags, tags
    assert tags["kiln.resize.1"].startswith("1 -> 2 workers (the cluster has room for more); resumed from "), tags
    assert tags["kiln.resize.2"].startswith("2 -> 1 workers (a worker or its node was lost); resumed from "), tags
    costs = client.get_metric_history(run.info.run_id, "resize/restart_s")
    assert len(costs) == 2 and all(0 < m.value < 600 for m in costs), costs
    sizes = [
        int(m.value)
        for m in sorted(
            client.get_metric_history(run.info.run_id, "parallel/workers"), key=lambda m: (m.step, m.timestamp)
        )
    ]
    assert [n for i, n in enumerate(sizes) if i == 0 or n != sizes[i - 1]] == [1, 2, 1], sizes
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss/train")]
    assert sorted(steps) == list(range(1, STEPS + 1))  # every step logged, and once only
    losses = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss/train"), key=lambda m: m.step)]
    assert max(losses[-20:]) < min(losses[:5]), losses  # it went on learning across the sizes
    # The last worker group was the head's one worker.
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard, detail=True, limit=100)
    head = [n.node_id for n in nodes if "kiln_head" in n.resources_total]
    seconds = [n for n in nodes if LABEL in n.resources_total]
    assert len(head) == 1 and len(seconds) == 1, [(n.node_id, n.state, n.resources_total) for n in nodes]
    assert tags["kiln.placement"] == head[0], (tags["kiln.placement"], head)
    # MLflow has system metrics of both nodes: rank 0's as system/..., the second node's under its id.
    from kiln.ray.trainer import node_label

    assert "system/cpu_utilization_percentage" in run.data.metrics, sorted(run.data.metrics)
    per_node = {f"system/{node_label(n.node_id)}/cpu_utilization_percentage" for n in seconds}
    assert per_node & set(run.data.metrics), (per_node, sorted(run.data.metrics))
    # Every checkpoint is on shared storage, the last of the one worker left: its ZeRO shard and marker.
    final = _checkpoints(s3_server)[-1]
    names = {k.rsplit("/", 1)[-1] for k in _keys(s3_server, f"{PREFIX}{final}/")}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "kiln_complete.rank0.json"} <= names, names
    assert "kiln_complete.rank1.json" not in names, names
