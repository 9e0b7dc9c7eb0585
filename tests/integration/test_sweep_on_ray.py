"""A Ray Tune sweep on the shared Ray cluster: 6 trials (issue 4 asks for at least 6), each a
2-worker Ray Train + DeepSpeed run on 2 cores (logical CPUs oversubscribed), ASHA stopping the
laggards, every trial a child run in a real MLflow store, and `kiln runs compare` ranking them.
Midway the driver gets Ctrl-C and the sweep is resumed with `kiln sweep --resume`: an interrupted
trial goes on from its newest checkpoint, into its own MLflow run, and there is one run per
trial all the same. The driver runs with planted secrets in its environment, and nothing the
sweep prints or writes holds one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "bad_inputs"))
from cases import ENV_SECRETS  # noqa: E402
from mlflow_store import sqlite_store  # noqa: E402

from kiln.launch.resume import registered_checkpoint  # noqa: E402
from kiln.storage import resolve  # noqa: E402

KILN = str(Path(sys.executable).parent / "kiln")
MAX_STEPS = 20


@pytest.mark.timeout(1800)  # 6 Ray Train runs plus restarts, on 2 cores
def test_asha_sweep_six_trials_parent_and_children_in_mlflow(ray_cluster, byte_dataset, tmp_path):
    address, _, env = ray_cluster
    env = env | ENV_SECRETS
    db = sqlite_store(tmp_path)
    sweep = {
        "name": "it-sweep",
        "base": str(REPO / "jobs/configs/debug.yaml"),
        "overrides": {
            "data.path": str(byte_dataset),
            "train.max_steps": MAX_STEPS,
            "train.eval_every": 5,
            "train.eval_batches": 2,
            "train.checkpoint_every": 3,  # before ASHA's first rung (5): what an interrupted trial goes on from
            "train.micro_batch_size": 8,
            "schedule.warmup_steps": 2,
            "logging.tracking_uri": db,
            "logging.experiment": "sweep-it",
            "logging.progress_every": 10,
        },
        # The grid's points in order: adamw, rmsprop, sgd with cosine, then the three with constant.
        # SGD at lr 0.01 trails everything, so ASHA has something to stop; the first SGD trial
        # starts once one of the first two has finished, so each rung has a bar by then.
        "space": {
            "optim.name": {"grid": ["adamw", "rmsprop", "sgd"]},
            "schedule.name": {"grid": ["cosine", "constant"]},
        },
        "conditional": {"optim.name=sgd": {"optim.lr": 0.01}, "optim.name=rmsprop": {"optim.lr": 1e-3}},
        "search": "grid",
        "scheduler": {"name": "asha", "grace_period": 5, "reduction_factor": 2},
        # Two trials at a time, 2 workers each at half a logical CPU: 4 workers on 2 cores. (A
        # 4-trial grid whose second point was SGD raced adamw to the first rung, and stopped nothing.)
        "max_concurrent_trials": 2,
        "resources_per_trial": {"num_workers": 2, "cpus_per_worker": 0.5},
        "storage_path": str(tmp_path / "sweeps"),
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "summary.json"
    # Ctrl-C once the first two trials each hold a checkpoint (step 3, before ASHA's first rung
    # at 5). ASHA never stops the first trial to reach a rung, so at least one of them is cut
    # running, and goes on after the resume.
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [KILN, "sweep", "--config", str(path), "--address", address],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    train = tmp_path / "sweeps" / "it-sweep" / "train"
    deadline = time.time() + 900
    while len(_checkpointed(train)) < 2 and first.poll() is None:
        assert time.time() < deadline, "the first two trials never checkpointed"
        time.sleep(0.5)
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=300) == 130  # interrupted by its user
    said = (tmp_path / "first.log").read_text()
    assert "kiln: error: sweep 'it-sweep' interrupted" in said and "kiln sweep --resume it-sweep" in said, said[-3000:]
    proc = subprocess.run(
        [
            KILN,
            "sweep",
            "--resume",
            "it-sweep",
            "--storage-path",
            str(tmp_path / "sweeps"),
            "--address",
            address,
            "--summary-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(out.read_text())
    trials = summary["trials"]
    assert len(trials) == 6 and all(t["status"] != "error" for t in trials), trials

    # ASHA stopped at least one trial before its last step, and at least one ran to the end.
    stopped = [t for t in trials if t["status"] == "stopped early"]
    assert stopped and all(t["steps"] < MAX_STEPS for t in stopped), trials
    assert any(t["steps"] == MAX_STEPS for t in trials)
    assert summary["trial_steps_run"] == sum(t["steps"] for t in trials) < 6 * MAX_STEPS

    # MLflow: one parent, one child per trial, each with its params and per-step history.
    lrs = {when.split("=")[1]: then["optim.lr"] for when, then in sweep["conditional"].items()}
    base_lr = yaml.safe_load(Path(sweep["base"]).read_text())["optim"]["lr"]
    client = MlflowClient(db)
    exp = client.get_experiment_by_name("sweep-it")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kiln.role") == "sweep"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_id == summary["parent_run_id"] and parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 6 == len(runs) - 1  # one run per trial, restarted or gone on
    # A trial cut after its checkpoint went on from it, in its first attempt's Train run and
    # MLflow run (the history check below: each step once), not from step 0.
    went_on = [c for c in children if c.data.tags.get("kiln.resumes")]
    assert went_on and all(c.data.tags["kiln.sweep.attempt"] == "2" for c in went_on), [c.data.tags for c in children]
    for c in went_on:
        name = c.info.run_name  # the trial's run name; its attempts' Train runs add -a<n>
        assert (train / f"{name}-a1").is_dir() and not (train / f"{name}-a2").exists(), sorted(os.listdir(train))
        assert (
            c.data.tags["kiln.resume.1"].startswith("checkpoint_")
            and c.data.tags["kiln.sweep.train_run"] == f"{name}-a1"
        )
    by_trial = {c.data.tags["kiln.sweep.trial_id"]: c for c in children}
    assert set(by_trial) == {t["trial_id"] for t in trials}
    for t in trials:
        child = by_trial[t["trial_id"]]
        p = child.data.params
        # the same param names as a single run's
        assert p["optim.name"] == t["params"]["optim.name"] and p["schedule.name"] == t["params"]["schedule.name"]
        assert p["parallel.num_workers"] == "2" and p["train.max_steps"] == str(MAX_STEPS)
        assert float(p["optim.lr"]) == lrs.get(t["params"]["optim.name"], base_lr)  # a conditional's, or the base's
        hist = sorted(m.step for m in client.get_metric_history(child.info.run_id, "loss/train"))
        assert hist == list(range(1, t["steps"] + 1)), (t, hist)
        val = client.get_metric_history(child.info.run_id, "loss/val")
        assert min(m.value for m in val) == t["metric"]
        assert child.info.status == ("KILLED" if t["status"] == "stopped early" else "FINISHED")

    # The parent carries the best trial and a summary table.
    best = min(trials, key=lambda t: t["metric"])
    assert summary["best"]["trial_id"] == best["trial_id"]
    assert parent.data.metrics["best/loss/val"] == best["metric"]
    assert parent.data.tags["kiln.sweep.best_run_id"] == by_trial[best["trial_id"]].info.run_id
    assert parent.data.tags["kiln.sweep.best.optim.name"] == best["params"]["optim.name"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"trials.md", "best_config.yaml", "sweep.yaml", "summary.json"} <= artifacts
    # Every trial logged its LR schedule as a PNG.
    assert [a.path for a in client.list_artifacts(children[0].info.run_id, "schedule")] == ["schedule/lr.png"]

    # `kiln runs compare` lists the trials in metric order.
    cmp = subprocess.run(
        [
            KILN,
            "runs",
            "compare",
            "--experiment",
            "sweep-it",
            "--sweep",
            "it-sweep",
            "--tracking-uri",
            db,
            "--sort",
            "loss/val",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert cmp.returncode == 0, cmp.stderr
    lines = cmp.stdout.strip().splitlines()[2:]
    listed = [line.split()[1] for line in lines]  # the run-id column (12 chars)
    expected = sorted(children, key=lambda c: c.data.metrics["loss/val"])
    assert listed == [c.info.run_id[:12] for c in expected]

    # No planted secret in the console, the state file, the MLflow store or anything else written.
    printed = said + proc.stdout + proc.stderr + cmp.stdout + cmp.stderr
    written = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert any(f.name == "kiln-sweep.json" for f in written)
    assert not [s for s in ENV_SECRETS.values() if s in printed]
    assert not [(f.name, s) for f in written for s in ENV_SECRETS.values() if s.encode() in f.read_bytes()]


def _checkpointed(train: Path) -> list[str]:
    """The trials' Train runs with a checkpoint Ray Train has registered (what a resume starts
    from, as `kiln.launch.resume` reads it)."""
    runs = sorted(train.iterdir()) if train.is_dir() else []
    return [d.name for d in runs if registered_checkpoint(resolve(str(d))) is not None]


PBT_STEPS = 12


@pytest.mark.timeout(1200)  # 4 concurrent trials and their restarts, on 2 cores
def test_pbt_exploits_by_forking_another_trials_checkpoint(byte_dataset, tmp_path):
    """PBT on an embedded Ray (the driver starts its own, as with no cluster): 4 trials (issue 40
    asks for 4) at four learning rates, deciding at step 6 (a checkpoint) whether to copy a
    better trial, and not at step 12, their last. A copy is a fork: the trial starts again, in a
    new MLflow run tagged with its parent, at the other trial's checkpoint step with a mutated LR
    from the space. The embedded Ray must give back a stopped trial's worker CPUs, or the
    restarted trials wait for data for ever."""
    db = sqlite_store(tmp_path)
    lrs = [1e-4, 3e-4, 1e-3, 3e-3]
    sweep = {
        "name": "it-pbt",
        "base": str(REPO / "jobs/configs/debug.yaml"),
        "overrides": {
            "data.path": str(byte_dataset),
            "train.max_steps": PBT_STEPS,
            "train.eval_every": 6,
            "train.checkpoint_every": 6,
            "train.eval_batches": 2,
            "train.micro_batch_size": 8,
            "schedule.warmup_steps": 2,
            "logging.tracking_uri": db,
            "logging.experiment": "pbt-it",
        },
        "space": {"optim.lr": {"grid": lrs}},
        "search": "grid",
        # Synchronous: the decision sees all four trials, so the worst copies the best whatever the
        # order they reach step 6 in (asynchronous, a slow machine once made none). Four workers of
        # 0.45 logical CPU fit the embedded Ray's 2 together with the trials' own 0.01 each.
        "scheduler": {"name": "pbt", "synch": True},
        "max_concurrent_trials": 4,
        "resources_per_trial": {"num_workers": 1, "cpus_per_worker": 0.45},
        "storage_path": str(tmp_path / "sweeps"),
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    proc = subprocess.run(
        [KILN, "sweep", "--config", str(path), "--summary-json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1100,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(out.read_text())
    assert summary["exploits"] >= 1 and "PBT: " in proc.stdout, summary
    ended = [(t["trial_id"], t["status"], t["steps"]) for t in summary["trials"]]
    assert all(status == "completed" and steps == PBT_STEPS for _, status, steps in ended), (ended, proc.stdout[-3000:])

    client = MlflowClient(db)
    exp = client.get_experiment_by_name("pbt-it")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    parent = next(r for r in runs.values() if r.data.tags.get("kiln.role") == "sweep")
    assert parent.data.metrics["sweep/exploits"] == summary["exploits"]
    trial_of = {rid: r.data.tags.get("kiln.sweep.trial_id") for rid, r in runs.items()}
    # Each segment ran once: no decision at the last step (12, a multiple of 6) started the
    # trials again to train 7-12 twice (a second attempt retires the first's run).
    attempts = {rid: r.data.tags.get("kiln.sweep.attempt") for rid, r in runs.items() if trial_of[rid]}
    assert set(attempts.values()) == {"1"}, attempts
    exploits = 0
    for r in runs.values():
        tags = r.data.tags
        if tags.get("kiln.sweep.segment", "start") == "start":
            continue
        # A segment starts at its parent's checkpoint step, from the parent's MLflow run, which
        # logged that step itself: it goes on from there, not from step 0.
        step, donor = int(tags["kiln.parent.step"]), tags["kiln.parent.mlflow_run_id"]
        assert 0 < step < PBT_STEPS and tags["kiln.sweep.segment"] == f"{trial_of[donor]}@{step}"
        steps = sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss/train"))
        assert steps == list(range(step + 1, steps[-1] + 1)), (tags, steps)
        assert step in {m.step for m in client.get_metric_history(donor, "loss/train")}
        assert tags["kiln.parent.checkpoint"].startswith(str(tmp_path / "sweeps" / "it-pbt" / "train"))
        assert float(r.data.params["optim.lr"]) in lrs  # a mutation stays in the space
        if trial_of[donor] != tags["kiln.sweep.trial_id"]:
            exploits += 1  # another trial's checkpoint (a pause restarts a trial from its own)
    assert exploits == summary["exploits"]
    # Each trial's earlier segments end where it went on, naming the run it went on in.
    for r in runs.values():
        later = [
            s
            for s in runs.values()
            if s.data.tags.get("kiln.sweep.trial_id") == r.data.tags.get("kiln.sweep.trial_id")
            and s.info.start_time > r.info.start_time
        ]
        if r.data.tags.get("kiln.sweep.trial_id") and later:
            assert r.data.tags["kiln.sweep.continued_in"].split()[0] in {s.info.run_id for s in later}
