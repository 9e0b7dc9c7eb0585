"""The tracking server goes away mid-run: training goes on, and every step's metrics reach MLflow
once it is back. A real `mlflow server` on loopback (started by `kiln services up`) is killed
and started again under a local-launcher run; no Ray."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient
from mlflow_store import sqlite_store  # noqa: E402

from kiln.launch.local import free_port
from kiln.tracking import services
from kiln.tracking.mlflow_run import MLflowLogger
from kiln.tracking.sender import Sender, undelivered

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

REPO = Path(__file__).resolve().parents[3]
STEPS = 600  # about 40 ms each: the outage falls inside training


def test_training_goes_on_through_an_mlflow_outage_and_loses_no_metric(byte_dataset, tmp_path):
    port = free_port()
    root = tmp_path / "services"
    services.up(root, port=port)
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kiln.launch.local",
        "--config",
        str(REPO / "jobs/configs/debug.yaml"),
        "--set",
        f"data.path={byte_dataset}",
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "schedule.warmup_steps=5",
        "--set",
        f"logging.tracking_uri={url}",
        "--set",
        "logging.experiment=outage",
        "--set",
        "logging.progress_every=5",
        "--set",
        f"train.storage_path={tmp_path}/runs",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        _wait_for_step(lines, proc, 30)
        for server, _ in services.status(root):  # the server dies mid-run, as in a crash
            os.killpg(server.pid, signal.SIGKILL)
        down_at, step_at_down = time.time(), _last_step(lines)
        time.sleep(5)  # dozens of steps; the restart below adds its own ~15 s of outage
        step_at_up = _last_step(lines)
        services.up(root, port=port)  # the same store, back on the same port
        up_at = time.time()
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        services.down(root)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 0, err[-3000:]
    # Training did not stall while the server was away.
    assert step_at_up - step_at_down >= min(20, STEPS - step_at_down), (step_at_down, step_at_up)
    assert f"MLflow at {url} failed" in err or f"MLflow at {url} has not answered" in err, err[-3000:]
    assert "answers again" in err, err[-3000:]
    assert "val loss" in stdout

    # What the server stored, read from its backend store directly.
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("outage").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "loss/train")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # none lost, none twice
    # Steps trained while the server was down are there, stamped with when they trained.
    during = [m for m in history if down_at * 1000 <= m.timestamp <= up_at * 1000]
    assert len(during) >= min(20, STEPS - step_at_down), (len(during), step_at_down, step_at_up)
    assert run.info.status == "FINISHED"
    assert not list((tmp_path / "runs").glob("*/undelivered-metrics-*.jsonl"))


def _wait_for_step(lines: list[str], proc: subprocess.Popen, step: int) -> None:
    deadline = time.time() + 300
    while _last_step(lines) < step:
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.time() < deadline, "".join(lines)[-3000:]
        time.sleep(0.2)


def _last_step(lines: list[str]) -> int:
    steps = [int(m.group(1)) for line in list(lines) for m in re.finditer(r"step (\d+)/", line)]
    return max(steps, default=0)


def test_metrics_that_never_reach_mlflow_are_written_to_a_file(tmp_path, caplog):
    # A server that never answers: the sender warns, and at the end writes what it holds.
    url = f"http://127.0.0.1:{free_port()}"
    sender = Sender(MlflowClient(url), "0123abcd", url, stall_warn_s=0.5)
    caplog.set_level(logging.WARNING, logger="kiln.tracking.sender")
    sender.send_metrics([Metric("loss/train", 5.0 - s, 1000 + s, s) for s in range(1, 4)])
    deadline = time.time() + 30
    while not sender.in_outage:
        assert time.time() < deadline
        time.sleep(0.1)
    assert sender.pending_metrics() == 3
    spill = tmp_path / "runs" / "undelivered-metrics-0123abcd.jsonl"
    sender.close(timeout=1.0, spill_path=str(spill))
    lines = spill.read_text().splitlines()
    assert [json.loads(line) for line in lines][0] == {"key": "loss/train", "value": 4.0, "timestamp": 1001, "step": 1}
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    said = caplog.text
    assert f"MLflow at {url}" in said and str(spill) in said and "3 metrics" in said


def test_a_killed_rank_loses_no_metric_it_handed_over_and_its_restart_delivers_them(tmp_path):
    """Rank 0 is SIGKILLed during an outage, holding metrics it could not deliver; the restarted
    rank 0 on the same node (a real SQLite store standing in for the server that is back)
    delivers them first and skips the steps it trains again, so each step is logged once."""
    store = sqlite_store(tmp_path)
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("journal")).info.run_id
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the outage
    script = (
        "import sys\n"
        "from kiln.tracking.mlflow_run import MLflowLogger\n"
        f"logger = MLflowLogger({dead!r}, {run_id!r}, system_metrics=False, spill_dir={str(tmp_path)!r}, "
        "flush_every=5)\n"
        "for step in range(1, 13):\n"
        "    logger.log({'loss/train': 10.0 - step, 'lr': 0.001}, step)\n"
        "print('logged', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "logged"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    journal = tmp_path / f"undelivered-metrics-{run_id}.jsonl"
    held = undelivered(str(journal))
    assert len(held) == 24 and sorted({m["step"] for m in held}) == list(range(1, 13))  # none lost

    successor = MLflowLogger(store, run_id, system_metrics=False, spill_dir=str(tmp_path))
    for step in range(10, 16):  # resumed from a checkpoint at step 9: 10-12 train again
        successor.log({"loss/train": 1.0, "lr": 0.001}, step)
    successor.close()
    history = sorted(client.get_metric_history(run_id, "loss/train"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, 16))  # each step once
    assert [m.value for m in history[:12]] == [10.0 - s for s in range(1, 13)]  # the killed rank's values
    assert not journal.exists()  # everything delivered: nothing left behind


def test_a_sender_behind_catches_up_in_few_calls_and_keeps_the_order(tmp_path):
    """Metrics queued while a delivery is under way go in one log_batch (up to MLflow's 1,000),
    in the order they were handed over, and a tag stays a call of its own. A real SQLite store;
    the first call is held until 40 steps have queued behind it."""
    uri = sqlite_store(tmp_path)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("sender")).info.run_id
    calls, release = [], threading.Event()
    real = client.log_batch

    def held(run, metrics=(), tags=()):
        calls.append((len(metrics), len(tags)))
        if len(calls) == 1:
            release.wait(30)
        return real(run, metrics=metrics, tags=tags)

    client.log_batch = held
    sender = Sender(client, run_id, uri)
    per_step = [Metric(f"m{k}", 0.0, 1000, 0) for k in range(25)]
    sender.send_metrics(per_step)
    deadline = time.time() + 10
    while not calls:  # the first delivery is under way
        assert time.time() < deadline
        time.sleep(0.01)
    for step in range(1, 41):
        sender.send_metrics([Metric(m.key, float(step), 1000 + step, step) for m in per_step])
        if step == 20:
            sender.send_tags([RunTag("kiln.note", "half way")])
    release.set()
    assert sender.wait_idle(30)
    sender.close(timeout=5.0, spill_path=str(tmp_path / "spill.jsonl"))
    # the held call, then steps 1-20 together, the tag, steps 21-40 together
    assert calls == [(25, 0), (500, 0), (0, 1), (500, 0)]
    history = client.get_metric_history(run_id, "m3")
    assert [(h.step, h.value) for h in sorted(history, key=lambda h: h.step)] == [(s, float(s)) for s in range(41)]
    assert client.get_run(run_id).data.tags["kiln.note"] == "half way"
