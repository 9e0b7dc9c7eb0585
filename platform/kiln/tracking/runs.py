"""`kiln runs list|compare`: read MLflow and print a table."""

from __future__ import annotations

from typing import Any

from kiln.core.config import default_experiment
from kiln.errors import ConfigError, KilnError
from kiln.tracking.server import check_store, resolve_tracking_uri
from kiln.ui.table import format_table

DEFAULT_METRICS = ("loss/train", "loss/val", "throughput/tokens_per_s", "mfu")


def fetch_runs(
    experiment: str = "",
    tracking_uri: str = "",
    sort: str | None = None,
    limit: int = 50,
    sweep: str | None = None,
    descending: bool = False,
):
    """Runs of an experiment (empty: $MLFLOW_EXPERIMENT_NAME, else kiln), newest first, or ranked by `sort`. Sweep parents (which hold no
    per-step metrics) are left out of a ranking; `sweep` keeps only that sweep's trials."""
    from mlflow.tracking import MlflowClient

    experiment = experiment or default_experiment()
    if limit < 1:
        raise ConfigError(f"--limit {limit}: expected a positive number of runs")
    for flag, text in (("--sweep", sweep), ("--sort", sort)):
        if text and any(q in text for q in "'\"`"):
            raise ConfigError(f"{flag} {text!r}: expected a name without quotes or backticks")
    uri = resolve_tracking_uri(tracking_uri)
    check_store(uri, "--tracking-uri", read_only=True)  # MlflowClient would create a store to say it is empty
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise KilnError(f"no MLflow experiment {experiment!r} at {uri}; experiments there: {names}")
    order = [f"metrics.`{sort}` {'DESC' if descending else 'ASC'}"] if sort else ["attributes.start_time DESC"]
    filters = []
    if sweep:
        filters.append(f"tags.`kiln.sweep` = '{sweep}'")
    runs = client.search_runs(
        [exp.experiment_id], filter_string=" and ".join(filters), order_by=order, max_results=limit
    )
    if sort:  # MLflow puts runs without the metric first or last depending on the store
        runs = [r for r in runs if r.data.tags.get("kiln.role") != "sweep"]
        sign = -1 if descending else 1
        runs = sorted(runs, key=lambda r: (sort not in r.data.metrics, sign * r.data.metrics.get(sort, 0.0)))
    return runs


def run_record(r) -> dict[str, Any]:
    """One run as `kiln runs --json` and `kiln.runs` give it."""
    return {
        "run_id": r.info.run_id,
        "run_name": r.info.run_name,
        "status": r.info.status,
        "params": dict(r.data.params),
        "metrics": dict(r.data.metrics),
    }


def runs_table(
    runs, metrics=DEFAULT_METRICS, params=("model.flavour", "optim.name", "optim.lr", "schedule.name")
) -> str:
    header = ["run", "run id", "status", *params, *metrics]
    rows = []
    for r in runs:
        row = [r.info.run_name or "", r.info.run_id[:12], r.info.status]
        row += [r.data.params.get(p, "") for p in params]
        row += [_fmt(r.data.metrics.get(m)) for m in metrics]
        rows.append(row)
    return format_table(header, rows)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if abs(v) >= 1000 else f"{v:.4g}"
