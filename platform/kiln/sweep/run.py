"""Run a sweep on Ray Tune, every trial a full Ray Train + DeepSpeed run, all of it in MLflow.

Train V2 pattern: each Tune trial is a function that builds a `TorchTrainer` and calls `fit()`,
with `TuneReportCallback` forwarding rank 0's reports to Tune, where the scheduler (ASHA,
median) can stop it. MLflow: the driver opens one parent run; each trial opens a child run
keyed by its Tune trial id. A trial that `--resume` starts again goes on from its newest
checkpoint into the same run (ASHA, median, FIFO), or soft-deletes its earlier attempt where it
had none, so the UI shows one run per trial. Every run is addressed by id through MlflowClient,
never through MLflow's process-global "active run", so concurrent trials cannot log into each
other's runs.
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
from typing import Any

from kiln.errors import KilnError
from kiln.guard import marked_json
from kiln.launch.on_ray import connect_ray, reads_that_fit
from kiln.launch.preflight import preflight
from kiln.ray.private import tune_stop_requested
from kiln.redact import redact_tree, redacted_paths
from kiln.storage import absolute, durable, write_private
from kiln.sweep import attempts
from kiln.sweep import pbt as pbt_run
from kiln.sweep.config import STATE_FILE, Sweep, expected_trials, param_space
from kiln.sweep.summary import SEGMENT_TAG, TRIAL_TAG, SweepSummary, close_parent, summarise
from kiln.tracking.mlflow_run import Run
from kiln.ui.progress import is_terminal

log = logging.getLogger("kiln.sweep")

SWEEP_TAG = "kiln.sweep"
SWEEP_STATE = "sweep-state"  # the write guard's kind for the state file (SWEEP_SUMMARY: --summary-json's)


def _trial(params: dict[str, Any], ctx: dict[str, Any]) -> None:
    """One trial, on a Tune trial actor: a whole Ray Train run of the drawn config."""
    import ray.tune
    from ray.util.queue import Queue

    from kiln.data.check import resolve_against_data
    from kiln.hf_checkpoint import pretrained_shape
    from kiln.ray.trainer import build_trainer

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
    tags = {
        SWEEP_TAG: sweep.config.name,
        TRIAL_TAG: trial_id,
        "kiln.sweep.trial_name": trial_name,
        SEGMENT_TAG: segment,
        **{f"kiln.sweep.param.{k}": v for k, v in params.items()},
    }
    # An interrupted trial goes on from its newest checkpoint, into its MLflow run (a PBT trial
    # restarts as a fork instead); without one it starts again, replacing its earlier attempt.
    went_on = None if pbt else attempts.interrupted(cfg, uri, parent, trial_id, ctx["train_storage"])
    if went_on is not None:
        run, train_name, resumed_from = attempts.go_on(cfg, uri, went_on, tags)
    else:
        run, train_name = attempts.new(cfg, datasets, uri, parent, ctx["train_storage"], pointer, tags)
        resumed_from = None
    inbox = Queue(maxsize=1, actor_options={"num_cpus": 0}) if pbt else None
    callback = pbt_run.trial_reports(inbox, cfg.train.max_steps) if pbt else _metric_reports(sweep.config.metric)
    trainer = build_trainer(
        cfg,
        cfg.model.shape(pretrained),
        train_name,
        uri,
        run.run_id,
        callbacks=[callback],
        storage_path=ctx["train_storage"],
        resumed_from=resumed_from,
    )
    with run.finishing(stopping=tune_stop_requested()):  # stopped by its scheduler: KILLED
        if pbt:
            pbt_run.fit_and_report(trainer, inbox, trial_id, run.run_id)
        else:
            trainer.fit()


def _metric_reports(metric: str):
    """Tune's report callback for an ASHA, median or FIFO trial, passing on the reports that carry
    the sweep's metric. A checkpoint between two evaluations reports no `loss/val`, and Tune
    refuses a result without the metric it ranks by (strict metric checking): the whole sweep
    failed at a trial's first such checkpoint. The schedulers decide on the evaluations only."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class MetricReports(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metric in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)

    return MetricReports()


def _scheduler(sweep: Sweep, max_steps: int):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    s = sweep.config.scheduler
    if s.name == "pbt":
        return pbt_run.scheduler(sweep.config, sweep.base_config.train.checkpoint_every, max_steps)
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
        close_parent(parent, summary, sweep)
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
