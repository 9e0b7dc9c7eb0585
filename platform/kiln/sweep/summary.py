"""A sweep's result: each trial's row (its best metric, the steps it ran, how it ended), ranked,
as the console's table, `--summary-json` and the parent MLflow run's metrics, tags and artifacts.
`summarise` reads it from Tune's results and the trials' MLflow runs, and marks each child run
FINISHED, KILLED (stopped early) or FAILED.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from kiln.guard import marked_json
from kiln.sweep import pbt as pbt_run
from kiln.sweep.config import Sweep
from kiln.tracking.mlflow_run import Run, experiment_id
from kiln.ui.table import format_table

TRIAL_TAG = "kiln.sweep.trial_id"
SEGMENT_TAG = "kiln.sweep.segment"  # where a start of the trial began: "start", or "<trial>@<step>" (PBT)
SWEEP_SUMMARY = "sweep-summary"  # the write guard's kind for --summary-json


@dataclass
class TrialRow:
    trial_id: str
    run_id: str
    params: dict[str, Any]
    metric: float
    steps: int
    status: str


@dataclass
class SweepSummary:
    name: str
    parent_run_id: str
    tracking_uri: str
    experiment: str
    metric: str
    mode: str
    trials: list[TrialRow]
    max_steps: int
    best: TrialRow | None
    scheduler: str = "asha"
    exploits: int = 0
    """PBT: the trials started again from another trial's checkpoint."""

    @property
    def trial_steps_run(self) -> int:
        return sum(t.steps for t in self.trials)

    @property
    def trial_steps_full(self) -> int:
        return self.max_steps * len(self.trials)

    def table(self) -> str:
        keys = sorted({k for t in self.trials for k in t.params})
        header = ["rank", "trial", *keys, self.metric, "steps", "status", "mlflow run"]
        rows = [
            [
                str(i + 1),
                t.trial_id,
                *(str(t.params.get(k, "")) for k in keys),
                f"{t.metric:.4f}",
                f"{t.steps}/{self.max_steps}",
                t.status,
                t.run_id[:12],
            ]
            for i, t in enumerate(self.trials)
        ]
        return format_table(header, rows, markdown=True)

    def render(self) -> str:
        saved = 1 - self.trial_steps_run / max(1, self.trial_steps_full)
        out = [
            f"Kiln sweep '{self.name}': {len(self.trials)} trials, ranked by {self.metric} ({self.mode})",
            self.table(),
            f"PBT: {self.exploits} exploits (a trial forked from another's checkpoint, with mutated settings)"
            if self.scheduler == "pbt"
            else f"trial-steps run {self.trial_steps_run} of {self.trial_steps_full} "
            f"({100 * saved:.0f}% saved by early stopping)",
        ]
        if self.best:
            out.append(
                f"best: trial {self.best.trial_id} {self.metric} = {self.best.metric:.4f} with "
                + ", ".join(f"{k}={v}" for k, v in sorted(self.best.params.items()))
            )
        out.append(f"MLflow parent run {self.parent_run_id} (experiment '{self.experiment}')")
        return "\n".join(out)

    def to_json(self) -> str:
        return marked_json(
            SWEEP_SUMMARY,
            dataclasses.asdict(self)
            | {"trial_steps_run": self.trial_steps_run, "trial_steps_full": self.trial_steps_full},
        )


def summarise(sweep: Sweep, results, parent: Run, uri: str, max_steps: int) -> SweepSummary:
    """Rank the trials and mark each child run: FINISHED, or KILLED when stopped early."""
    from kiln.tracking.client import connect

    cfg = sweep.config
    client = connect(uri)
    exp_id = experiment_id(client, sweep.base_config.logging.experiment)
    runs = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")
    # a trial's newest segment holds its result (PBT starts a trial again, in a new run)
    children = {r.data.tags.get(TRIAL_TAG): r for r in sorted(runs, key=lambda r: r.info.start_time)}
    exploits = sum(
        pbt_run.donor(r.data.tags.get(SEGMENT_TAG, pbt_run.FIRST_SEGMENT)) not in (None, r.data.tags.get(TRIAL_TAG))
        for r in runs
    )  # a trial that went on from another's checkpoint, not its own
    rows = []
    for result in results:
        trial_id = os.path.basename(result.path).split("_")[1] if result.path else ""
        m = result.metrics or {}
        trial_id = m.get("trial_id", trial_id)
        steps = int(m.get("step", 0))
        history = result.metrics_dataframe
        value = m.get(cfg.metric, float("nan"))
        if history is not None and cfg.metric in history:  # best reported value of the trial
            col = history[cfg.metric].dropna()
            if len(col):
                value = float(col.min() if cfg.mode == "min" else col.max())
        child = children.get(trial_id)
        if child is not None:
            # Workers keep training while a stop decision travels back to them, so the child run
            # may hold steps past the last one Tune saw: count what was actually trained.
            logged = client.get_metric_history(child.info.run_id, "loss/train")
            steps = max([steps] + [h.step for h in logged])
            seen = [h.value for h in client.get_metric_history(child.info.run_id, cfg.metric)]
            if seen:  # likewise an evaluation Tune never saw is still the trial's result
                seen += [] if math.isnan(value) else [value]
                value = float(min(seen) if cfg.mode == "min" else max(seen))
        if result.error is not None:
            status = "error"
        elif steps < max_steps:
            status = "stopped early"
        else:
            status = "completed"
        if child is not None:
            if status == "stopped early":
                client.set_tag(child.info.run_id, "kiln.sweep.stopped_early", f"at step {steps}")
                client.set_terminated(child.info.run_id, "KILLED")
            elif status == "error":
                client.set_terminated(child.info.run_id, "FAILED")
            elif child.info.status != "FINISHED":
                # Tune stops a trial that reached max_t, sometimes before its fit() returns: the
                # run is then left RUNNING, or marked FAILED by the interrupted trial. It ran every
                # step without an error, so it finished.
                client.set_terminated(child.info.run_id, "FINISHED")
        params = {k: v for k, v in (result.config or {}).items()}
        rows.append(TrialRow(trial_id, child.info.run_id if child else "", params, value, steps, status))
    sign = 1 if cfg.mode == "min" else -1
    rows.sort(key=lambda t: (math.isnan(t.metric), sign * t.metric if not math.isnan(t.metric) else 0))
    best = rows[0] if rows and not math.isnan(rows[0].metric) else None
    return SweepSummary(
        cfg.name,
        parent.run_id,
        uri,
        sweep.base_config.logging.experiment,
        cfg.metric,
        cfg.mode,
        rows,
        max_steps,
        best,
        cfg.scheduler.name,
        exploits,
    )


def close_parent(parent: Run, summary: SweepSummary, sweep: Sweep) -> None:
    best = summary.best
    metrics: dict[str, float] = {
        "sweep/trials": len(summary.trials),
        "sweep/trial_steps_run": summary.trial_steps_run,
        "sweep/trial_steps_full": summary.trial_steps_full,
        "sweep/trials_stopped_early": sum(t.status == "stopped early" for t in summary.trials),
        "sweep/exploits": summary.exploits,
    }
    if best is not None:
        metrics[f"best/{summary.metric}"] = best.metric
        parent.client.set_tag(parent.run_id, "kiln.sweep.best_trial_id", best.trial_id)
        parent.client.set_tag(parent.run_id, "kiln.sweep.best_run_id", best.run_id)
        for k, v in best.params.items():
            parent.client.set_tag(parent.run_id, f"kiln.sweep.best.{k}", str(v))
        parent.log_text(sweep.trial_config(best.params).to_yaml(), "best_config.yaml")
    parent.log_metrics(metrics)
    parent.log_text(summary.table() + "\n", "trials.md")
    parent.log_text(summary.to_json(), "summary.json")
