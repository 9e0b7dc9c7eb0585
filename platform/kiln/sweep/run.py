"""Run a sweep on Ray Tune, every trial a full Ray Train + DeepSpeed run, all of it in MLflow.

Train V2 pattern: each Tune trial is a function that builds a `TorchTrainer` and calls `fit()`,
with `TuneReportCallback` forwarding rank 0's reports to Tune, where the scheduler (ASHA,
median) can stop it. MLflow: the driver opens one parent run; each trial opens a child run
keyed by its Tune trial id. A restarted trial soft-deletes its earlier attempt, so the UI shows
one run per trial. Every run is addressed by id through MlflowClient, never through MLflow's
process-global "active run", so concurrent trials cannot log into each other's runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.guard import marked_json
from kiln.launch.on_ray import connect_ray, reads_that_fit
from kiln.launch.preflight import preflight
from kiln.redact import redact_tree, redacted_paths
from kiln.storage import absolute, durable, write_private
from kiln.sweep import pbt as pbt_run
from kiln.sweep.config import STATE_FILE, Sweep, expected_trials, param_space
from kiln.tracking.mlflow_run import Run, experiment_id
from kiln.ui.progress import is_terminal
from kiln.ui.table import format_table

log = logging.getLogger("kiln.sweep")

TRIAL_TAG = "kiln.sweep.trial_id"
SEGMENT_TAG = "kiln.sweep.segment"  # where a start of the trial began: "start", or "<trial>@<step>" (PBT)
SWEEP_TAG = "kiln.sweep"
SWEEP_SUMMARY = "sweep-summary"  # the write guard's kinds: --summary-json, and the state file
SWEEP_STATE = "sweep-state"


def _trial(params: dict[str, Any], ctx: dict[str, Any]) -> None:
    """One trial, on a Tune trial actor: a whole Ray Train run of the drawn config."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback
    from ray.util.queue import Queue

    from kiln.data.check import resolve_against_data
    from kiln.hf_checkpoint import pretrained_shape
    from kiln.launch.resume import lineage, record_run
    from kiln.ray.trainer import build_trainer
    from kiln.tracking.mlflow_run import open_run

    sweep = Sweep.from_dict(ctx["sweep"])
    tctx = ray.tune.get_context()
    trial_id, trial_name = tctx.get_trial_id(), tctx.get_trial_name()
    cfg = sweep.trial_config(params)
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_name=f"{sweep.config.name}-{trial_id}"))
    pbt = sweep.config.scheduler.name == "pbt"
    pointer = pbt_run.restored() if pbt else None  # PBT started this trial again: a fork
    if pointer is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume_from=pointer.start_from()))
    segment = pointer.segment if pointer is not None else pbt_run.FIRST_SEGMENT
    # Each trial is a run's driver: model.init_from's shape is read once here, for its workers.
    m = cfg.model
    pretrained = pretrained_shape(m.init_from, cfg.data.s3_endpoint, cfg.data.s3_region) if m.init_from else None
    cfg, datasets = resolve_against_data(cfg, pretrained)
    uri, parent = ctx["tracking_uri"], ctx["parent_run_id"]
    attempt = _retire_earlier_attempts(uri, cfg.logging.experiment, parent, trial_id, segment)
    run = open_run(
        cfg,
        datasets,
        uri,
        {"launcher": "sweep"},
        parent_run_id=parent,
        tags={
            SWEEP_TAG: sweep.config.name,
            TRIAL_TAG: trial_id,
            "kiln.sweep.trial_name": trial_name,
            "kiln.sweep.attempt": attempt,
            SEGMENT_TAG: segment,
            **lineage(cfg),
            **{f"kiln.sweep.param.{k}": v for k, v in params.items()},
        },
    )
    if pointer is not None:
        pbt_run.end_earlier_segments(uri, cfg.logging.experiment, parent, trial_id, run.run_id, pointer, TRIAL_TAG)
    # A unique Train run name per segment and attempt: a restarted trial starts clean.
    train_name = f"{cfg.logging.run_name}-a{attempt}" + (f"-from-{segment.replace('@', '-')}" if pointer else "")
    # beside its checkpoints, the MLflow run a PBT fork of them names as its parent
    record_run(
        dataclasses.replace(
            cfg,
            logging=dataclasses.replace(cfg.logging, run_name=train_name),
            train=dataclasses.replace(cfg.train, storage_path=ctx["train_storage"]),
        ),
        run.run_id,
        uri,
    )
    inbox = Queue(maxsize=1, actor_options={"num_cpus": 0}) if pbt else None
    callback = pbt_run.trial_reports(inbox, cfg.train.max_steps) if pbt else TuneReportCallback()
    trainer = build_trainer(
        cfg,
        cfg.model.shape(pretrained),
        train_name,
        uri,
        run.run_id,
        callbacks=[callback],
        storage_path=ctx["train_storage"],
    )
    with run.finishing():
        if pbt:
            pbt_run.fit_and_report(trainer, inbox, trial_id, run.run_id)
        else:
            trainer.fit()


def _retire_earlier_attempts(uri: str, experiment: str, parent: str, trial_id: str, segment: str) -> int:
    """Soft-delete the runs of earlier attempts of this trial's segment; return this attempt's
    number. (A PBT trial's earlier segments stay: they are its lineage.)"""
    from kiln.tracking.client import delete_runs

    return (
        delete_runs(
            uri,
            experiment,
            f"tags.mlflow.parentRunId = '{parent}' and tags.`{TRIAL_TAG}` = '{trial_id}' "
            f"and tags.`{SEGMENT_TAG}` = '{segment}'",
        )
        + 1
    )


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


def _scheduler(sweep: Sweep, max_steps: int):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    s = sweep.config.scheduler
    if s.name == "pbt":
        return pbt_run.scheduler(sweep.config, sweep.base_config.train.checkpoint_every)
    if s.name == "asha":
        # time in optimizer steps (every report carries "step"), not in reports.
        return ASHAScheduler(
            time_attr="step", max_t=max_steps, grace_period=s.grace_period, reduction_factor=s.reduction_factor
        )
    if s.name == "median":
        return MedianStoppingRule(
            time_attr="step", grace_period=s.grace_period, min_samples_required=s.min_samples_required
        )
    return FIFOScheduler()


def _search_alg(sweep: Sweep):
    cfg = sweep.config
    if cfg.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=cfg.seed)
    from ray.tune.search import BasicVariantGenerator

    # Tune ignores TuneConfig.max_concurrent_trials for a generator passed in: it takes its own.
    return BasicVariantGenerator(random_state=cfg.seed, max_concurrent=cfg.max_concurrent_trials)


def run_sweep(sweep: Sweep, address: str | None = None, resume: bool = False) -> SweepSummary:
    """Start (or resume) the sweep on Ray Tune and wait for it; return the ranked trials."""
    cfg = sweep.config
    storage = absolute(durable(cfg.storage_path, "sweep.storage_path"))
    exp_dir = os.path.join(storage, cfg.name)
    train_storage = os.path.join(exp_dir, "train")
    base = dataclasses.replace(
        sweep.base_config, train=dataclasses.replace(sweep.base_config.train, storage_path=train_storage)
    )
    checked = preflight(
        base, remote_cluster=bool(address or os.environ.get("RAY_ADDRESS")), storage_field="sweep.storage_path"
    )
    base, uri = checked.cfg, checked.tracking_uri
    # Tune runs each trial in its own working dir: the trials' data path must not be relative.
    sweep.base_tree.setdefault("data", {})["path"] = base.data.path
    if base.data.mix:
        sweep.base_tree["data"]["mix"] = [dataclasses.asdict(m) for m in base.data.mix]
    if not resume and os.path.exists(exp_dir):
        raise KilnError(
            f"sweep {cfg.name!r} already exists at {exp_dir}: resume it with "
            f"`kiln sweep --resume {cfg.name}`, or give the sweep another name"
        )
    # Ray first: a sweep that cannot reach it leaves no parent run and no state behind.
    concurrent_cpus = cfg.max_concurrent_trials * base.parallel.max_workers * base.parallel.cpus_per_worker
    concurrent = dataclasses.replace(
        base, parallel=dataclasses.replace(base.parallel, num_workers=math.ceil(concurrent_cpus), cpus_per_worker=1.0)
    )
    connect_ray(concurrent, address)
    sweep.base_tree["data"]["read_task_cpus"] = reads_that_fit(concurrent).data.read_task_cpus
    parent = _resume_parent(sweep, uri, exp_dir) if resume else _start_parent(sweep, uri, exp_dir)
    ctx = {
        "sweep": sweep.to_dict(),
        "tracking_uri": uri,
        "parent_run_id": parent.run_id,
        "train_storage": train_storage,
    }
    with parent.finishing(stopped_by=(SweepInterrupted,)):  # stopped by its user: KILLED, and resumable
        summary = _fit(sweep, base, ctx, storage, exp_dir, parent, resume)
        _close_parent(parent, summary, sweep)
    return summary


class SweepInterrupted(KilnError):
    """Ctrl-C stopped the sweep after Tune saved its state."""

    exit_code = 130  # stopped by its user, as Ctrl-C anywhere else in Kiln


def _start_parent(sweep: Sweep, uri: str, exp_dir: str) -> Run:
    """A new sweep: its parent run, and the state file `--resume` reads. The file never holds a
    secret: those are masked, and their fields listed, so a resume can say what it lacks."""
    parent = _open_parent(sweep, uri, sweep.base_config.logging.experiment)
    os.makedirs(exp_dir, exist_ok=True)
    state = sweep.to_dict()
    write_private(
        os.path.join(exp_dir, STATE_FILE),
        marked_json(
            SWEEP_STATE,
            {"parent_run_id": parent.run_id, "sweep": redact_tree(state), "secrets_removed": redacted_paths(state)},
        ),
        kind=SWEEP_STATE,
    )
    return parent


def _resume_parent(sweep: Sweep, uri: str, exp_dir: str) -> Run:
    with open(os.path.join(exp_dir, STATE_FILE)) as f:
        state = json.load(f)
    parent = Run(uri, sweep.base_config.logging.experiment, sweep.config.name, run_id=state["parent_run_id"])
    parent.client.update_run(parent.run_id, status="RUNNING")
    return parent


def _fit(sweep: Sweep, base, ctx: dict, storage: str, exp_dir: str, parent: Run, resume: bool) -> SweepSummary:
    """Run the trials on Tune (a fresh Tuner, or the saved one restored) and rank them."""
    from ray import tune

    from kiln.sweep.progress import SweepProgress, SweepState

    cfg = sweep.config
    # The trial function only drives the trainer: a token CPU share (Tune refuses an empty request).
    trainable = tune.with_resources(tune.with_parameters(_trial, ctx=ctx), {"cpu": 0.01})
    progress = (
        [SweepProgress(SweepState(expected_trials(cfg), base.train.max_steps, cfg.metric, cfg.mode))]
        if is_terminal(sys.stderr)
        else []
    )
    if resume:
        tuner = tune.Tuner.restore(exp_dir, trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(cfg),
            tune_config=tune.TuneConfig(
                metric=cfg.metric,
                mode=cfg.mode,
                search_alg=_search_alg(sweep),
                scheduler=_scheduler(sweep, base.train.max_steps),
                num_samples=cfg.num_samples,
                max_concurrent_trials=cfg.max_concurrent_trials if cfg.search == "optuna" else None,
            ),
            # On a terminal Kiln's one-line progress replaces Tune's periodic status table.
            run_config=tune.RunConfig(
                name=cfg.name, storage_path=storage, verbose=0 if progress else 1, callbacks=progress
            ),
        )
    with _InterruptBridge() as interrupt:
        results = tuner.fit()
    if interrupt.seen:
        # Tune stopped the running trials after saving its state, so their status no longer tells.
        raise SweepInterrupted(
            f"sweep {cfg.name!r} interrupted; its state is saved: resume it with "
            f"`kiln sweep --resume {cfg.name}`"
            + (f" --storage-path {cfg.storage_path}" if cfg.storage_path != "runs/sweeps" else "")
        )
    summary = summarise(sweep, results, parent, ctx["tracking_uri"], base.train.max_steps)
    errors = [r.error for r in results if r.error is not None]
    if errors and len(errors) == len(summary.trials):
        raise KilnError(f"every trial of sweep {cfg.name!r} failed; the first: {_first_line(errors[0])}")
    return summary


class _InterruptBridge:
    """Know whether Ctrl-C stopped the sweep, and still let Tune stop it gracefully.

    Tune's own SIGINT handler saves the experiment state and returns from fit() with the running
    trials marked TERMINATED, which a caller cannot tell from a finished sweep. So Kiln owns SIGINT:
    the first one is recorded and forwarded as SIGUSR1, Tune's other graceful-stop signal; a second
    one raises KeyboardInterrupt, for a user who does not want to wait for the final save.
    """

    def __init__(self):
        self.seen = False
        self._previous = None
        self._env = None

    def _handle(self, signum, frame):
        if self.seen:
            raise KeyboardInterrupt
        self.seen = True
        if not callable(signal.getsignal(signal.SIGUSR1)):  # Tune's loop has not started yet
            raise KeyboardInterrupt
        log.warning("Ctrl-C: stopping the sweep after saving its state (Ctrl-C again to abort)")
        signal.raise_signal(signal.SIGUSR1)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            if self._env is None:
                os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
            else:
                os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = self._env
        return False


def _first_line(error: BaseException) -> str:
    cause = error
    while (deeper := getattr(cause, "cause", None) or cause.__cause__) is not None:
        cause = deeper
    text = str(cause).strip().splitlines()
    return text[-1] if text else type(cause).__name__


def _open_parent(sweep: Sweep, uri: str, experiment: str) -> Run:
    cfg = sweep.config
    parent = Run(uri, experiment, cfg.name, tags={SWEEP_TAG: cfg.name, "kiln.role": "sweep"})
    parent.log_params(
        {
            "sweep.search": cfg.search,
            "sweep.scheduler": cfg.scheduler.name,
            "sweep.num_samples": cfg.num_samples,
            "sweep.metric": cfg.metric,
            "sweep.mode": cfg.mode,
            "sweep.max_concurrent_trials": cfg.max_concurrent_trials,
            "sweep.space": json.dumps(cfg.space),
            "sweep.conditional": json.dumps(cfg.conditional),
            "sweep.workers_per_trial": cfg.resources_per_trial.num_workers,
        }
    )
    import yaml

    parent.log_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), "sweep.yaml")
    parent.log_text(sweep.base_config.to_yaml(), "base_config.yaml")
    return parent


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


def _close_parent(parent: Run, summary: SweepSummary, sweep: Sweep) -> None:
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
