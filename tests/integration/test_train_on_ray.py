"""A 2-worker DeepSpeed ZeRO-2 run on a real Ray cluster, reading Parquet from loopback S3,
logging to a real MLflow store. One run proves several things, to keep the suite short."""

import glob
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow.fs as pafs
import pytest
from mlflow.tracking import MlflowClient

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.launch.on_ray import train
from kiln.storage import resolve

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(REPO / "tests/dashboards"))
from mlflow_store import sqlite_store  # noqa: E402
from prom_queries import dashboard_queries_without_data  # noqa: E402
from render_panels import render as render_panels  # noqa: E402

KILN = str(Path(sys.executable).parent / "kiln")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _zero2_config(s3_dataset: str, s3_server: str, tmp: Path, run_name: str, *more: str):
    return load_config(REPO / "jobs/configs/debug.yaml", _zero2_overrides(s3_dataset, s3_server, tmp, run_name, *more))


def _zero2_overrides(s3_dataset: str, s3_server: str, tmp: Path, run_name: str, *more: str) -> list[str]:
    return [
        f"data.path={s3_dataset}",
        f"data.s3_endpoint={s3_server}",
        "train.max_steps=40",
        "train.eval_every=20",
        "train.eval_batches=4",  # the config's 0 is the whole split: 100 batches a rank each time
        "schedule.warmup_steps=5",
        "train.micro_batch_size=8",
        f"logging.tracking_uri={sqlite_store(tmp)}",
        "logging.experiment=integration",
        f"logging.run_name={run_name}",
        f"train.storage_path={tmp}/runs",
        "train.checkpoint_every=20",
        "train.keep_checkpoints=1",
        "train.profile.start_step=10",
        "train.profile.steps=2",
        "train.profile.ranks=all",
        # the health guard under Ray: a NaN in rank 0's loss at step 15 is left out on both ranks
        "train.health.policy=skip",
        "train.health.inject=nan@15",
        # dropout: a resumed run must restore each rank's RNG to match the uninterrupted one
        "model.dropout=0.1",
        *more,
    ]


@dataclass
class Zero2Run:
    summary: object
    db: str
    tmp: Path
    started: float
    ended: float
    frames: list


@pytest.fixture
def zero2(ray_cluster, s3_server, s3_dataset, prometheus, tmp_path_factory) -> Zero2Run:
    """One uninterrupted 2-worker ZeRO-2 run, checked by the test that asks for it."""
    address, _, _ = ray_cluster
    tmp = tmp_path_factory.mktemp("zero2")
    cfg = _zero2_config(s3_dataset, s3_server, tmp, "zero2-s3")
    assert cfg.parallel.num_workers == 2 and cfg.parallel.zero_stage == 2
    started = time.time()
    terminal = FakeTerminal()  # the driver draws its progress bar from rank 0's posts
    summary = train(cfg, address=address, progress_stream=terminal)
    frames = [f for f in terminal.getvalue().split("\r\x1b[K") if f]
    return Zero2Run(summary, f"sqlite:///{tmp}/mlflow.db", tmp, started, time.time(), frames)


def test_zero2_two_workers_from_s3_to_mlflow(zero2, prometheus, s3_dataset):
    summary, db, tmp_path, frames = zero2.summary, zero2.db, zero2.tmp, zero2.frames
    assert len(frames) >= 2 and "step 40/40" in frames[-1] and "tok/s" in frames[-1], frames[-3:]

    # A real Prometheus scraped Ray's endpoint during the run: every dashboard query has data.
    started, ended = zero2.started, zero2.ended
    empty = dashboard_queries_without_data(prometheus, "zero2-s3", started, ended)
    assert not empty, empty
    # ... and the same panels render to one PNG from that data (dashboards/render_panels.py), at
    # the step the check above evaluated them at: on 2 busy cores a node's agent is scraped with
    # gaps, and a fresh clone once drew no Node CPU at a 5 s step where the 2 s one had data.
    drawn = render_panels(prometheus, "zero2-s3", started - 5, ended + 30, tmp_path / "dashboard.png", step="2s")
    assert {t for t, n in drawn.items() if n == 0} <= {"Node GPU"}, drawn
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    client = MlflowClient(db)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "zero2-s3"
    # params: the flattened config, with the data resolved from S3
    assert run.data.params["parallel.zero_stage"] == "2"
    assert run.data.params["data.path"] == s3_dataset
    assert run.data.params["model.vocab_size"] == "512" and run.data.params["model.seq_len"] == "64"
    assert run.data.tags["kiln.num_workers"] == "2" and run.data.tags["kiln.version"]
    assert (
        run.data.tags["kiln.health.1"]
        == "step 15: skipped the step's 1 micro-batch(es): loss is not finite on 1 of 2 rank(s)"
    )
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "health/skipped_batches")] == [
        (15, 1.0)
    ]
    # metric history: one point per step, and the loss falls
    hist = sorted(client.get_metric_history(run.info.run_id, "loss/train"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(1, 41))
    first, last = sum(m.value for m in hist[:5]) / 5, sum(m.value for m in hist[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert first == pytest.approx(math.log(512), rel=0.1)  # starts near uniform
    for name in ("loss/val", "lr", "grad_norm", "throughput/tokens_per_s", "time/step_s", "mfu", "memory/rss_gib"):
        assert client.get_metric_history(run.info.run_id, name), name
    assert len(client.get_metric_history(run.info.run_id, "loss/val")) == 2
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)  # MLflow system metrics
    # artifacts: the resolved config and the data manifest
    arts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "data")
    }
    assert {"config.yaml", "data/manifest.json"} <= arts
    # the profiling window of both ranks, and the end-of-run plots
    profile = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert {f"profile/{f}_rank{r}.{x}" for r in (0, 1) for f, x in (("trace", "json"), ("top_ops", "txt"))} <= profile
    trace = json.loads(
        Path(client.download_artifacts(run.info.run_id, "profile/trace_rank0.json", str(tmp_path))).read_text()
    )
    assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {f"plots/{n}.png" for n in ("loss", "lr", "throughput", "step_time")}
    manifest = json.loads(
        Path(client.download_artifacts(run.info.run_id, "data/manifest.json", str(tmp_path))).read_text()
    )
    assert manifest["tokenizer"]["vocab_size"] == 512
    # the DeepSpeed checkpoint went through ray.train.report into storage_path, from both ranks
    ckpt = Path(summary.checkpoint)
    assert ckpt.is_relative_to(tmp_path / "runs")
    # keep_checkpoints=1: Ray Train deleted step 20's once step 40's was registered
    assert [p for p in ckpt.parent.iterdir() if p.is_dir() and p.name.startswith("checkpoint_")] == [ckpt]
    files = {p.name for p in ckpt.rglob("*") if p.is_file()}
    assert (
        "latest" in files
        and {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
    )
    # the summary a user sees
    text = summary.render()
    assert "unigram entropy" in text and "bits/token" in text and summary.run_id in text


def test_a_tensor_parallel_run_survives_a_dead_worker_and_a_dead_driver(
    ray_cluster, s3_server, s3_dataset, checkpoint_tensors, tmp_path
):
    """TP=2 on 2 Ray workers (one replica; both read the same rows), with dropout, checkpoints on
    S3. `kiln train` is submitted; after the step-10 checkpoint one worker is SIGKILLed and Ray
    Train restarts the group from it; after the step-20 checkpoint the driver itself is
    SIGKILLed, and the same command is submitted again under the run's name. It resumes from
    step 20 into the same MLflow run, and ends with the uninterrupted run's loss at every step
    (each logged once) and bitwise its weights and optimizer slices, rank by rank. No worker's
    local checkpoint copy is left behind, and a third submission, with nothing left to train,
    is refused. The uninterrupted run is the same config under torchrun, without Ray
    (`kiln.launch.local`): Ray Train's workers and torchrun's ranks read the same rows and draw
    the same dropout, so the two launchers' runs are bitwise alike too. (Data-parallel ZeRO-2
    resumes after a dead node in test_two_nodes; bitwise, without Ray, in
    tests/unit/launch/test_local.py.)"""
    import torch

    address, _, env = ray_cluster
    tp = [
        "parallel.tensor_parallel=2",
        "parallel.zero_stage=1",
        "train.max_steps=30",
        "train.checkpoint_every=10",
        "train.eval_every=10",
        "train.profile.start_step=0",
        "train.health.inject=",
        "train.max_failures=1",
    ]
    whole = _torchrun(_zero2_overrides(s3_dataset, s3_server, tmp_path, "tp-whole", *tp), tmp_path, env)
    storage = f"s3://kiln-test/resume-{uuid.uuid4().hex[:8]}"
    named = _zero2_overrides(s3_dataset, s3_server, tmp_path, "tp-named", *tp, f"train.storage_path={storage}")
    copies = set(glob.glob(os.path.join(tempfile.gettempdir(), "kiln-ckpt-*")))  # workers' local checkpoints
    before = {p.pid for p in _train_workers()}
    with (tmp_path / "first.log").open("w") as out:
        first = subprocess.Popen(
            [
                KILN,
                "train",
                "--config",
                str(REPO / "jobs/configs/debug.yaml"),
                "--address",
                address,
                *[a for o in named for a in ("--set", o)],
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        try:
            snapshot = resolve(f"{storage}/tp-named/checkpoint_manager_snapshot.json", s3_server)
            victims = _new_train_workers(before, first)  # found first: the kill follows the checkpoint at once
            _wait_for_checkpoint(snapshot, 10, first)
            victims[-1].send_signal(signal.SIGKILL)  # Ray Train restarts the group from step 10
            _wait_for_restart(tmp_path, "tp-named", first)  # its first step logged, before the driver dies
            _wait_for_checkpoint(snapshot, 20, first)
            first.send_signal(signal.SIGKILL)  # the driver dies: its job, controller and workers end
            first.wait(timeout=60)
            psutil.wait_procs([p for p in _train_workers() if p.pid not in before], timeout=120)
        finally:
            if first.poll() is None:
                first.kill()
    resumed = train(load_config(REPO / "jobs/configs/debug.yaml", named), address=address)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kiln-ckpt-*"))) <= copies

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("integration").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([whole.run_id, resumed.run_id])  # one run each
    tags = client.get_run(resumed.run_id).data.tags
    assert tags["kiln.restarts"] == "1" and tags["kiln.resumes"] == "1", tags
    assert "checkpoint_" in tags["kiln.restart.1"] and "checkpoint_" in tags["kiln.resume.1"], tags
    assert client.get_run(resumed.run_id).info.status == "FINISHED"
    want = {m.step: m.value for m in client.get_metric_history(whole.run_id, "loss/train")}
    got = [(m.step, m.value) for m in client.get_metric_history(resumed.run_id, "loss/train")]
    assert sorted(step for step, _ in got) == list(range(1, 31))  # each step once over three worker groups
    assert dict(got) == pytest.approx(want, rel=1e-6)
    assert client.get_metric_history(resumed.run_id, "time/tensor_parallel_comm_s")[-1].value > 0
    final = resolve(resumed.checkpoint, s3_server)
    pafs.copy_files(final.path, str(tmp_path / "final"), source_filesystem=final.fs)
    a, b = checkpoint_tensors(whole.checkpoint), checkpoint_tensors(tmp_path / "final")
    assert a.keys() == b.keys() and any("mp_rank_01" in k for k in a), sorted(a)[:10]
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:10]

    with pytest.raises(
        ConfigError,
        match=r"logging.run_name = 'tp-named': that run already trained to step 30 "
        r"\(train.max_steps = 30\)",
    ):
        train(load_config(REPO / "jobs/configs/debug.yaml", named), address=address)
    with pytest.raises(
        ConfigError,
        match=r"'tp-named' has checkpoints in s3://kiln-test/resume-\w+/tp-named "
        r"already, .*train.resume_from starts a new run",
    ):
        train(
            load_config(
                REPO / "jobs/configs/debug.yaml",
                [*named, "train.max_steps=40", f"train.resume_from={whole.checkpoint}"],
            ),
            address=address,
        )


def test_diloco_resumes_exactly_after_a_dead_worker_on_ray(
    ray_cluster, s3_server, s3_dataset, checkpoint_tensors, tmp_path
):
    """DiLoCo (H=5) on 2 Ray workers, checkpoints every 7 steps: between syncs, so each holds
    every replica's own weights and inner optimizer state beside the anchor and outer momentum
    (`kiln_replica.rank<r>.pt`, uploaded to storage by each worker). After the step-7
    checkpoint one worker is SIGKILLed; Ray Train restarts the group from storage, and the run
    ends with the uninterrupted run's loss at every step (1e-6) and its weights bitwise. The NaN
    planted in rank 0's loss at step 15 is left out on both replicas in both runs (the health
    guard under `train.health.policy: skip`). The uninterrupted run is torchrun's, as in the
    tensor-parallel test above."""
    import torch

    address, _, env = ray_cluster
    diloco = [
        "parallel.zero_stage=0",
        "parallel.sync=diloco",
        "parallel.sync_every=5",
        "train.max_steps=20",
        "train.checkpoint_every=7",
        "train.keep_checkpoints=2",
        "train.eval_every=10",
        "train.profile.start_step=0",
        "train.max_failures=1",
    ]
    whole = _torchrun(_zero2_overrides(s3_dataset, s3_server, tmp_path, "diloco-whole", *diloco), tmp_path, env)
    named = _zero2_overrides(s3_dataset, s3_server, tmp_path, "diloco-killed", *diloco)
    client, killed = _run_killed_after_checkpoint(named, "diloco-killed", 7, address, env, tmp_path)
    skipped = client.get_metric_history(killed.info.run_id, "health/skipped_batches")
    assert skipped and skipped[-1].value == 1.0
    _assert_same_losses(client, whole.run_id, killed.info.run_id, 20)
    final = max(p for p in (tmp_path / "runs/diloco-killed").glob("checkpoint_*") if p.is_dir())
    replicas = sorted(p.name for p in final.rglob("kiln_replica.rank*.pt"))
    assert replicas == ["kiln_replica.rank0.pt", "kiln_replica.rank1.pt"], replicas
    a, b = checkpoint_tensors(whole.checkpoint), checkpoint_tensors(final)
    assert a.keys() == b.keys() and a and not [k for k in a if not torch.equal(a[k], b[k])]


def test_fsdp2_resumes_exactly_after_a_dead_worker_on_ray(ray_cluster, s3_server, s3_dataset, tmp_path):
    """torch's FSDP2 at ZeRO-3 (`parallel.engine: fsdp2`) on 2 Ray Train workers, reading S3: its
    checkpoints are torch's distributed checkpoint, each worker's shards uploaded to storage.
    After the step-6 checkpoint one worker is SIGKILLed; the restarted group loads the shards
    from storage, and the run ends with the uninterrupted torchrun run's loss at every step
    (1e-6) and, exported to Hugging Face format, its weights bitwise."""
    from safetensors.torch import load_file

    address, _, env = ray_cluster
    fsdp2 = [
        "parallel.engine=fsdp2",
        "parallel.zero_stage=3",
        "train.max_steps=14",
        "train.checkpoint_every=6",
        "train.keep_checkpoints=2",
        "train.eval_every=6",
        "train.max_failures=1",
    ]
    whole = _torchrun(_zero2_overrides(s3_dataset, s3_server, tmp_path, "fsdp2-whole", *fsdp2), tmp_path, env)
    named = _zero2_overrides(s3_dataset, s3_server, tmp_path, "fsdp2-killed", *fsdp2)
    client, killed = _run_killed_after_checkpoint(named, "fsdp2-killed", 6, address, env, tmp_path)
    _assert_same_losses(client, whole.run_id, killed.info.run_id, 14)
    weights = []
    for source, out in ((whole.checkpoint, "whole-hf"), (tmp_path / "runs/fsdp2-killed", "killed-hf")):
        done = subprocess.run([KILN, "export", str(source), "--output", str(tmp_path / out)], env=env, cwd=tmp_path)
        assert done.returncode == 0
        weights.append(load_file(tmp_path / out / "model.safetensors"))
    a, b = weights
    assert a.keys() == b.keys() and a and all(a[k].equal(b[k]) for k in a)


def _assert_same_losses(client, want_run: str, got_run: str, steps: int) -> None:
    """The run `got_run` (over two worker groups) trained each of `steps` steps once, at the
    loss `want_run` had there (1e-6)."""
    want = {m.step: m.value for m in client.get_metric_history(want_run, "loss/train")}
    got = [(m.step, m.value) for m in client.get_metric_history(got_run, "loss/train")]
    assert sorted(step for step, _ in got) == list(range(1, steps + 1))
    assert dict(got) == pytest.approx(want, rel=1e-6)


@dataclass
class Reference:
    run_id: str
    checkpoint: Path


def _torchrun(overrides: list[str], tmp_path: Path, env: dict) -> Reference:
    """The run of `overrides` uninterrupted, on 2 ranks under torchrun (`kiln.launch.local`), not
    Ray: the reference a Ray run that lost workers is held to. Its MLflow run and last checkpoint."""
    summary = tmp_path / "reference.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--standalone",
            "-m",
            "kiln.launch.local",
            "--config",
            str(REPO / "jobs/configs/debug.yaml"),
            *[a for o in overrides for a in ("--set", o)],
            "--summary-json",
            str(summary),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = json.loads(summary.read_text())
    return Reference(done["run_id"], Path(done["checkpoint"]))


def _run_killed_after_checkpoint(overrides: list[str], name: str, step: int, address: str, env: dict, tmp_path: Path):
    """`kiln train` of `overrides` on the test cluster with one of its 2 Ray Train workers
    SIGKILLed once Ray Train holds the checkpoint of `step`: Ray Train restarts the group from
    storage, and the run must finish. (client, its MLflow run), which must say one restart."""
    before = {p.pid for p in _train_workers()}
    with (tmp_path / f"{name}.log").open("w") as out:
        driver = subprocess.Popen(
            [KILN, "train", "--config", str(REPO / "jobs/configs/debug.yaml"), "--address", address]
            + [a for o in overrides for a in ("--set", o)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        try:
            victims = _new_train_workers(before, driver)  # found first: the kill follows the checkpoint at once
            _wait_for_checkpoint(tmp_path / f"runs/{name}/checkpoint_manager_snapshot.json", step, driver)
            victims[-1].send_signal(signal.SIGKILL)  # Ray Train restarts the group from storage
            assert driver.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        finally:
            if driver.poll() is None:
                driver.kill()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    killed = client.search_runs(
        [client.get_experiment_by_name("integration").experiment_id], f"attributes.run_name = '{name}'"
    )[0]
    assert killed.data.tags["kiln.restarts"] == "1", killed.data.tags
    return client, killed


def _wait_for_checkpoint(snapshot, step: int, driver: subprocess.Popen) -> None:
    """Until Ray Train has registered a checkpoint of `step` or later in storage."""
    deadline = time.time() + 600
    while True:
        if snapshot.exists():
            latest = json.loads(snapshot.read_bytes()).get("latest_checkpoint_result") or {}
            if latest.get("metrics", {}).get("step", 0) >= step:
                return
        assert driver.poll() is None, f"the driver ended with {driver.returncode} before step {step}"
        assert time.time() < deadline, f"Ray Train registered no checkpoint of step {step}"
        time.sleep(0.3)


def _new_train_workers(before: set[int], driver: subprocess.Popen, n: int = 2) -> list[psutil.Process]:
    """The `n` Ray Train workers `driver`'s run started (none of the pids in `before`), once all
    are up. Scanning the processes takes long on a loaded machine: done before the checkpoint
    wait, the kill that follows it lands while the run is still training."""
    deadline = time.time() + 600
    while len(found := [p for p in _train_workers() if p.pid not in before]) < n:
        assert driver.poll() is None, f"the driver ended with {driver.returncode} before its workers started"
        assert time.time() < deadline, f"{len(found)} of {n} Ray Train workers started"
        time.sleep(0.2)
    assert len(found) == n, found
    return found


def _wait_for_restart(tmp_path: Path, name: str, driver: subprocess.Popen) -> None:
    """Until the MLflow run `name` holds the restarted group's tag (logged at its first step)."""
    client, deadline = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), time.time() + 600
    while True:
        experiment = client.get_experiment_by_name("integration")
        found = experiment and client.search_runs([experiment.experiment_id], f"attributes.run_name = '{name}'")
        if found and "kiln.restarts" in found[0].data.tags:
            return
        assert driver.poll() is None, f"the driver ended with {driver.returncode} before a restart was logged"
        assert time.time() < deadline, "no restart logged"
        time.sleep(0.3)


def _train_workers() -> list[psutil.Process]:
    """Ray Train's worker processes on this machine, oldest first."""
    found = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        if "ray::RayTrainWorker" in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return sorted(found, key=lambda p: p.info["create_time"])


def test_pipeline_two_replicas_by_two_stages_on_ray(ray_cluster, s3_server, s3_dataset, tmp_path):
    """4 Ray Train workers = 2 data-parallel replicas x 2 pipeline stages (4 logical CPUs on 2
    cores, all held by the workers: reads reserve none, data.read_task_cpus=0). Each replica's
    stages read the same batches from S3 by data-parallel rank: with Ray Data's split across all
    4 workers this deadlocked. It must train and finish, with a pipeline checkpoint from every
    stage. A NaN at step 14 makes the health guard roll back: every rank downloads the step-10
    checkpoint from storage, reloads it and goes on with the data after the bad batch. The data
    is a mixture, reshuffled each epoch, read from both of its datasets (here the S3 dataset
    twice, under two names) by Ray Data read tasks."""
    address, _, _ = ray_cluster
    db = sqlite_store(tmp_path)
    cfg = load_config(
        REPO / "jobs/configs/debug.yaml",
        [
            f"data.mix=[{{path: {s3_dataset}, name: a}}, {{path: {s3_dataset}, name: b, weight: 3}}]",
            "data.reshuffle=true",
            f"data.s3_endpoint={s3_server}",
            "parallel.num_workers=4",
            "parallel.zero_stage=1",
            "parallel.pipeline_stages=2",
            "parallel.micro_batches=2",
            "data.read_task_cpus=0",
            "train.max_steps=30",
            "train.eval_every=0",
            "train.eval_batches=2",
            "schedule.warmup_steps=5",
            "train.micro_batch_size=4",
            f"logging.tracking_uri={db}",
            "logging.experiment=integration",
            "logging.run_name=pp2-dp2",
            f"train.storage_path={tmp_path}/runs",
            "train.checkpoint_every=10",
            "train.health.policy=rollback",
            "train.health.inject=nan@14",
        ],
    )
    summary = train(cfg, address=address)
    client = MlflowClient(db)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED" and run.data.params["parallel.pipeline_stages"] == "2"
    event = run.data.tags["kiln.health.1"]
    assert event.startswith("step 14: rolled back to checkpoint_") and "skipping the data of steps 11-14" in event, (
        event
    )
    rollbacks = client.get_metric_history(run.info.run_id, "health/rollbacks")
    assert [(m.step, m.value) for m in rollbacks] == [(14, 1.0)], rollbacks
    hist = sorted(client.get_metric_history(run.info.run_id, "loss/train"), key=lambda m: m.step)
    assert [m.step for m in hist] == sorted([*range(1, 31), *range(11, 14)])  # 11-13 trained again
    assert sum(m.value for m in hist[-5:]) / 5 < sum(m.value for m in hist[:5]) / 5 - 0.5
    # 2 micro-batches x 4 sequences x 2 replicas x 64 tokens per step
    assert summary.metrics["tokens/seen"] == 30 * 2 * 4 * 2 * 64
    # the realised shares of a few 64-row blocks (test_mixture checks them against the weights)
    shares = summary.metrics["data/mix/a_frac"], summary.metrics["data/mix/b_frac"]
    assert sum(shares) == pytest.approx(1) and shares[1] > 0 and run.data.params["data.mix.b.weight"] == "3.0"
    files = {p.name for p in Path(summary.checkpoint).rglob("*") if p.is_file()}
    layer_files = {f for f in files if f.startswith("layer_") and f.endswith("-model_states.pt")}
    # embedding + block 1 from stage 0, block 2 + norm from stage 1 (the tied head is the embedding)
    assert layer_files == {f"layer_0{i}-model_states.pt" for i in range(4)}, files


def test_runs_compare_lists_runs_in_metric_order(tmp_path):
    import mlflow

    db = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(db)
    exp = client.create_experiment("cmp")
    for name, val in (("b", 2.0), ("a", 1.0), ("c", 3.0)):
        rid = client.create_run(exp, run_name=name).info.run_id
        client.log_metric(rid, "loss/val", val, step=1)
    del mlflow
    out = subprocess.run(
        [KILN, "runs", "compare", "--experiment", "cmp", "--tracking-uri", db, "--sort", "loss/val"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines()[2:]]
    assert names == ["a", "b", "c"]
