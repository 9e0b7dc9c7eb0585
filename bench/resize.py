"""What a resize costs: an elastic run loses a node, and the seconds until its first step after.

A two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, as Ray's own elastic tests
use): the head holds one worker of an elastic ZeRO-2 run (`parallel.num_workers: [1, 2]`,
3 CPUs a worker), a second node joins and the run grows to two workers; once the two have
written a checkpoint, the second node is killed (its raylet and workers, no grace). The run
shrinks back to one worker and resumes that checkpoint, resharded. From the kill to the first
step after, split by what the restarted group logged (`restart/*`, kiln.core.meter):

- detection and restart: the kill until the new group's worker processes started (Ray notices
  the lost node, gives up on the old group, asks for a new one; `parallel.start_timeout_s` and
  `parallel.resize_check_s` bound it);
- worker set-up: imports, data source and DeepSpeed engine;
- reshard and load: the checkpoint's download, its conversion to a universal checkpoint and
  the load (`restart/load_s`);
- first step: the first batch and step after the load.

The same split is measured for the growth (node joined until its first step at two workers),
where the first part is the wait for Ray's next resize check. Writes bench/results/resize.md;
`kiln plan --cluster` takes its preemption figure from the shrink's total (kiln.plan.throughput).

    python -m bench.resize        # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
import threading
import time
from pathlib import Path

from bench.common import REPO, machine, publish, results_file
from kiln.clock import RESTART_ENGINE, RESTART_FIRST_STEP, RESTART_LOAD, RESTART_WORKER_START

log = logging.getLogger("bench.resize")
RUN = "resize"


def _registered(run_dir: Path, ranks: int) -> bool:
    """Ray Train's snapshot lists a checkpoint written by `ranks` ranks (a directory alone may
    still be written, and an unregistered checkpoint is not one a restart resumes from)."""
    try:
        text = (run_dir / "checkpoint_manager_snapshot.json").read_text()
    except OSError:
        return False
    return any(
        (run_dir / name / f"kiln_complete.rank{ranks - 1}.json").exists()
        for name in set(re.findall(r"checkpoint_[0-9_.-]+", text))
    )


def _drive(cluster, run_dir: Path, events: dict, done: threading.Event) -> None:
    """Add a node once one worker has a checkpoint; kill it once two have."""

    def wait(ranks: int) -> bool:
        while not done.is_set():
            if _registered(run_dir, ranks):
                return True
            time.sleep(0.5)
        return False

    if not wait(1):
        return
    node = cluster.add_node(num_cpus=3)
    events["joined"] = time.time()
    if not wait(2):
        return
    events["killed"] = time.time()
    cluster.remove_node(node, allow_graceful=False)


def _split(client, run_id: str, since: float) -> dict[str, float]:
    """The restart that followed `since`: its parts in seconds, from what it logged."""

    def history(key):
        return client.get_metric_history(run_id, key)

    starts = sorted((m for m in history(RESTART_WORKER_START) if m.value > since), key=lambda m: m.value)
    if not starts:
        raise SystemExit(f"no restart after {since}: did the run resize?")
    step = starts[0].step  # the group's first step

    def at_step(key):
        return next(m.value for m in history(key) if m.step == step)

    engine, load, first = at_step(RESTART_ENGINE), at_step(RESTART_LOAD), at_step(RESTART_FIRST_STEP)
    return {
        "detect_restart_s": starts[0].value - since,
        "setup_s": engine - starts[0].value,
        "load_s": load,
        "first_step_s": max(0.0, first - engine - load),
        "total_s": first - since,
        "first_step": step,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO / "data/stdlib-bpe"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--start-timeout-s", type=int, default=60)
    p.add_argument("--results", default=results_file("resize"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from mlflow.tracking import MlflowClient
    from ray.cluster_utils import Cluster

    from kiln.config import load_config
    from kiln.launch.on_ray import train

    tmp = Path(tempfile.mkdtemp(prefix="kiln-resize-bench-"))
    sets = [
        f"data.path={args.data}",
        "parallel.num_workers=[1, 2]",
        "parallel.cpus_per_worker=3",
        "parallel.zero_stage=2",
        "parallel.resize_check_s=5",
        f"parallel.start_timeout_s={args.start_timeout_s}",
        f"train.max_steps={args.steps}",
        "train.checkpoint_every=10",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.micro_batch_size=8",
        f"train.storage_path={tmp}/runs",
        f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
        "logging.experiment=bench-resize",
        f"logging.run_name={RUN}",
        "logging.log_model=false",
    ]
    cfg = load_config(str(REPO / "jobs/configs/debug.yaml"), sets)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    events: dict[str, float] = {}
    result: dict = {}
    done = threading.Event()

    def fit() -> None:  # on a thread: Ray adds and removes nodes from the main thread only (signals)
        try:
            result["summary"] = train(cfg, address=cluster.address)
        finally:
            done.set()

    runner = threading.Thread(target=fit, name="kiln-resize-bench-run")
    runner.start()
    try:
        _drive(cluster, tmp / "runs" / RUN, events, done)
        runner.join()
    finally:
        done.set()
        runner.join()
        import ray

        ray.shutdown()  # the driver first: Cluster refuses to remove the node it is connected to
        cluster.shutdown()
    if "summary" not in result:
        raise SystemExit("the run failed: see the log above")
    summary = result["summary"]
    if "killed" not in events:
        raise SystemExit("the run ended before it had grown and written a checkpoint on two workers: give more --steps")
    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    grow, shrink = _split(client, summary.run_id, events["joined"]), _split(client, summary.run_id, events["killed"])
    publish(_section(args, sets, grow, shrink), args.results)
    (tmp / "resize.json").write_text(json.dumps({"grow": grow, "shrink": shrink}))
    return 0


def _section(args, sets: list[str], grow: dict, shrink: dict) -> str:
    rows = [
        ("a node lost (SIGKILL): 2 -> 1 workers", shrink, "detection and restart"),
        ("a node joined: 1 -> 2 workers", grow, "Ray's resize check and restart"),
    ]
    table = "\n".join(
        f"| {what} | {r['total_s']:.1f} | {r['detect_restart_s']:.1f} ({first}) | {r['setup_s']:.1f} | {r['load_s']:.2f} "
        f"| {r['first_step_s']:.1f} |"
        for what, r, first in rows
    )
    return f"""## {time.strftime("%Y-%m-%d %H:%M")} — an elastic run's resize on a two-node local cluster

Command: `python -m bench.resize --steps {args.steps} --start-timeout-s {args.start_timeout_s}`
(settings: `{" ".join(s for s in sets if not s.startswith(("data.path", "train.storage", "logging.tracking")))}`,
the debug flavour on `data/stdlib-bpe`)
Machine: {machine()}

| event | seconds to the first step after | of which: until the new group's workers started | worker set-up | download, reshard and load | first step |
|---|---|---|---|---|---|
{table}

The shrink's first part is Ray's: its elastic policy still counts the lost node for a while and
asks for two workers again, and waits up to `parallel.start_timeout_s` before it asks for one.
`kiln plan --cluster` states preemption costs with the shrink's total (`RESIZE_S` in
kiln.plan.throughput, from this table).
"""


if __name__ == "__main__":
    raise SystemExit(main())
