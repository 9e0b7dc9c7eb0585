"""The MLflow calls other layers need, in the one package that imports MLflow.

The Ray worker, the launchers and the sweep record a few things in MLflow besides a run's
metrics (placement, restarts, a node's system metrics, an earlier attempt retired); they call
these functions, and `connect` where they query runs themselves. Kiln never sets MLflow's
process-wide tracking URI: every call names its store.
"""

from __future__ import annotations

import time
from typing import Any


def installed() -> bool:
    """Whether MLflow can be imported here (the local launcher runs without it)."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def errors() -> tuple[type[BaseException], ...]:
    """MLflow's own exception class, where MLflow is installed: what a store or server raises."""
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:
        return ()
    return (MlflowException,)


def connect(tracking_uri: str) -> Any:
    """An MlflowClient of `tracking_uri`."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri)


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """`metrics` on a run, in one batch, stamped now."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    connect(tracking_uri).log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def logged_through(tracking_uri: str, run_id: str, metric: str = "loss/train") -> int:
    """The last step whose metrics the run holds (each step's metrics go in one batch)."""
    return max((m.step for m in connect(tracking_uri).get_metric_history(run_id, metric)), default=0)


def node_monitor(tracking_uri: str, run_id: str, node_id: str):
    """A started MLflow system-metrics monitor of this node, logging as `system/<node_id>/...`."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=10, node_id=node_id, tracking_uri=tracking_uri)
    monitor.start()
    return monitor


def record_placement(tracking_uri: str, run_id: str, nodes: list[str]) -> None:
    """Which node each rank runs on (updated after a restart): `kiln.placement`, rank order."""
    connect(tracking_uri).set_tag(run_id, "kiln.placement", ",".join(nodes))


def record_restart(tracking_uri: str, run_id: str, checkpoint: str, workers: int, size_metric: str) -> str:
    """The same MLflow run continues after a restart of its worker group, now of `workers`:
    count it and say where it resumed; what was recorded. A group of another size than the
    run's last logged `size_metric` (the meter's `parallel/workers`, logged with every metrics
    step) is a resize (`kiln.resizes`, `kiln.resize.<n>`): its reason, and `resize/restart_s`,
    the seconds from the last step the old group logged to this restart (detection and the new
    group's start)."""
    client = connect(tracking_uri)
    history = client.get_metric_history(run_id, size_metric)
    last = max(history, key=lambda m: (m.step, m.timestamp), default=None)
    if last is None or int(last.value) == workers:
        n = count_event(client, run_id, "restart", f"resumed from {checkpoint}")
        return f"restart {n} after a worker failure: resuming from {checkpoint}"
    was = int(last.value)
    client.log_metric(run_id, "resize/restart_s", max(0.0, time.time() - last.timestamp / 1000), step=last.step)
    why = "a worker or its node was lost" if workers < was else "the cluster has room for more"
    detail = f"{was} -> {workers} workers ({why}); resumed from {checkpoint}"
    return f"resize {count_event(client, run_id, 'resize', detail)}: {detail}"


def count_event(client, run_id: str, event: str, detail: str) -> int:
    """Count one more `event` on a run (tag `kiln.<event>s`) and say what it was (tag
    `kiln.<event>.<n>`); its number n."""
    n = int(client.get_run(run_id).data.tags.get(f"kiln.{event}s", "0")) + 1
    client.set_tag(run_id, f"kiln.{event}s", str(n))
    client.set_tag(run_id, f"kiln.{event}.{n}", detail)
    return n


def search_runs(tracking_uri: str, experiment: str, filter_string: str) -> list[tuple[str, dict[str, str]]]:
    """An experiment's live runs that match `filter_string`: each one's id and tags."""
    client = connect(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return [
        (r.info.run_id, dict(r.data.tags)) for r in client.search_runs([exp.experiment_id], filter_string=filter_string)
    ]


def delete_runs(tracking_uri: str, experiment: str, filter_string: str) -> list[tuple[str, dict[str, str]]]:
    """Soft-delete an experiment's live runs that match `filter_string`; each deleted one's id and tags."""
    found = search_runs(tracking_uri, experiment, filter_string)
    client = connect(tracking_uri)
    for run_id, _ in found:
        client.delete_run(run_id)
    return found
