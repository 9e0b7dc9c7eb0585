"""Population-based training (`sweep.scheduler.name: pbt`), done with Kiln's forks.

Ray Tune's PBT copies a leading trial into a trailing one: it pauses the trailing trial, gives
it the leader's last Tune checkpoint and a mutated config, and starts it again. Ray Train V2's
`TuneReportCallback` hands Tune metrics only, so a PBT trial reports for itself:
- its Train run's controller passes every report, with the path of the Train checkpoint it
  carries, to the trial (`TrialReports`, through a one-slot queue: the controller is at most a
  report ahead of Tune's decisions. The workers are not held: they train on to their next
  report while Tune decides, so a paused or exploited trial may have trained past the
  decision's step. Those steps are lost, not wrong: the fork starts from the step's checkpoint);
- the trial reports the metrics to Tune, with a Tune checkpoint that is a pointer (`POINTER`)
  naming that Train checkpoint, its trial and its MLflow run, never a copy of the weights;
- a trial started with a pointer is a fork (`train.resume_from`) of that checkpoint: another
  trial's after an exploit, its own after a pause. It goes on at the checkpoint's step with its
  weights, optimizer moments and data position, and the new settings.

Each start of a trial is a segment: a new MLflow child run of the sweep, tagged with its trial
and with its parent (`kiln.parent.*`, as any fork), so MLflow shows each trial's lineage.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from typing import Any

from kiln.sweep.config import SweepConfig

log = logging.getLogger(__name__)

POINTER = "kiln-pbt.json"  # the whole of a PBT trial's Tune checkpoint
CHECKPOINT_PATH = "kiln.checkpoint_path"  # a report's Train checkpoint, on its way to the trial
FIRST_SEGMENT = "start"  # the segment of a trial that starts from step 0


@dataclass(frozen=True)
class Pointer:
    """A Train checkpoint a PBT trial reported, as Tune keeps it for an exploit."""

    trial_id: str
    checkpoint: str
    """The Train checkpoint's directory (`<storage>/<train run>/checkpoint_<time>`)."""
    step: int
    mlflow_run_id: str

    @property
    def segment(self) -> str:
        """The segment a trial that starts from this checkpoint is: whose, and at what step."""
        return f"{self.trial_id}@{self.step}"

    def start_from(self) -> str:
        """What `train.resume_from` takes: the checkpoint, or where Ray Train's `num_to_keep`
        has removed it since, the newest complete one of the same run (a later step)."""
        if os.path.isdir(self.checkpoint):
            return self.checkpoint
        run_dir = os.path.dirname(self.checkpoint.rstrip("/"))
        log.warning(
            "PBT: checkpoint %s is gone (train.keep_checkpoints); the trial forks the newest of %s",
            self.checkpoint,
            run_dir,
        )
        return run_dir


def donor(segment: str) -> str | None:
    """The trial whose checkpoint a segment (`Pointer.segment`) started from; None for a
    trial's first segment."""
    return None if segment == FIRST_SEGMENT else segment.split("@", 1)[0]


def restored() -> Pointer | None:
    """The checkpoint Tune started this trial with (after an exploit or a pause); None at first."""
    from ray import tune

    ckpt = tune.get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as d, open(os.path.join(d, POINTER)) as f:
        return Pointer(**json.load(f))


def scheduler(cfg: SweepConfig, checkpoint_every: int, max_steps: int):
    """Tune's PBT over the sweep's space: each entry is also the field's mutation, and every
    mutated value is brought back within the entry's bounds (`Bounds`), which validation checked
    against the field's range."""
    from kiln.sweep.config import param_space
    from kiln.sweep.pbt_scheduler import SurvivorsPBT

    s = cfg.scheduler
    domains = param_space(cfg)
    mutations = {
        k: (list(arg) if kind in ("choice", "grid") else domains[k])
        for k, (kind, arg) in ((k, next(iter(v.items()))) for k, v in cfg.space.items())
    }
    return SurvivorsPBT(  # Tune's PBT, that a failed trial does not stop
        max_steps=max_steps,
        time_attr="step",
        perturbation_interval=s.perturbation_interval or checkpoint_every,
        hyperparam_mutations=mutations,
        quantile_fraction=s.quantile_fraction,
        synch=s.synch,
        resample_probability=s.resample_probability,
        custom_explore_fn=Bounds(cfg.space),
    )


class Bounds:
    """PBT's explore step moves a number by x0.8 or x1.2 and never looks at its range; this
    brings it back within its space entry's [low, high] (randint: high - 1)."""

    def __init__(self, space: dict[str, Any]):
        self.ranges = {}
        for dotted, spec in space.items():
            kind, arg = next(iter(spec.items()))
            if kind in ("uniform", "loguniform", "randint"):
                self.ranges[dotted] = (arg[0], arg[1] - 1 if kind == "randint" else arg[1])

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        for dotted, (low, high) in self.ranges.items():
            if dotted in config:
                value = min(max(config[dotted], low), high)
                config[dotted] = int(value) if isinstance(low, int) and isinstance(high, int) else float(value)
        return config


def trial_reports(inbox, max_steps: int):
    """The Train callback of a PBT trial: on the trial's controller, each report and the path
    of its checkpoint go to the trial (`fit_and_report`). The last report's checkpoint is not
    offered: a finished trial is nobody's starting point."""
    from ray.train.v2.api.callback import UserCallback

    class TrialReports(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            item = dict(metrics[0])
            if checkpoint is not None and int(item.get("step", max_steps)) < max_steps:
                item[CHECKPOINT_PATH] = checkpoint.path
            inbox.put(item)  # blocks until the trial has taken the report before

    return TrialReports()


def fit_and_report(trainer, inbox, trial_id: str, mlflow_run_id: str) -> None:
    """Run the trial's Train run, and report each of its reports to Tune, with a pointer to its
    checkpoint. Tune stops a paused or exploiting trial inside `tune.report` (SystemExit), and
    with the trial actor goes the Train run it owns."""
    from queue import Empty

    from ray import tune

    failed: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 (raised again on the trial's own thread)
            failed.append(e)

    worker = threading.Thread(target=fit, name="kiln-pbt-fit", daemon=True)
    worker.start()
    while worker.is_alive() or not inbox.empty():
        try:
            metrics = inbox.get(timeout=1.0)
        except Empty:
            continue
        path = metrics.pop(CHECKPOINT_PATH, None)
        if path is None:
            tune.report(metrics)
            continue
        pointer = Pointer(trial_id, path, int(metrics["step"]), mlflow_run_id)
        with tempfile.TemporaryDirectory(prefix="kiln-pbt-") as d:
            with open(os.path.join(d, POINTER), "w") as f:
                json.dump(asdict(pointer), f)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))  # copied before it returns
    if failed:
        raise failed[0]


def end_earlier_segments(uri: str, experiment: str, of_trial: str, run_id: str, pointer: Pointer) -> None:
    """The trial's earlier segments (its runs, found by the MLflow filter `of_trial`) end where
    this one forked: Tune stopped them, so one still marked RUNNING is KILLED, and each names the
    run the trial went on in. A segment that names a run since retired (Tune started that
    segment again: a new attempt) names this one."""
    from kiln.tracking.client import connect

    client = connect(uri)
    exp = client.get_experiment_by_name(experiment)
    found = client.search_runs([exp.experiment_id], filter_string=of_trial)
    live = {r.info.run_id for r in found}  # soft-deleted runs are not found
    for r in found:
        went_on_in = r.data.tags.get("kiln.sweep.continued_in", "").split(" ")[0]
        if r.info.run_id == run_id or went_on_in in live:
            continue
        client.set_tag(
            r.info.run_id, "kiln.sweep.continued_in", f"{run_id} (from trial {pointer.trial_id}'s step {pointer.step})"
        )
        if r.info.status == "RUNNING":
            client.set_terminated(r.info.run_id, "KILLED")
