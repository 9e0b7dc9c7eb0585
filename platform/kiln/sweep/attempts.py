"""A trial's attempts: each time Tune starts a trial, which Train run and MLflow run it trains in.

A trial starts once, and again after `kiln sweep --resume` (or Tune's retry of a failed trial).
Under ASHA, median or FIFO, a trial cut after a checkpoint goes on from its newest one: the same
Train run (Ray Train restores it from storage), the same MLflow run, where rank 0 logs only the
steps it does not hold yet. A trial cut before its first checkpoint, and every PBT segment,
starts anew: a new MLflow run that soft-deletes the runs of the segment's earlier attempts, and
a Train run of its own (`<trial run>-a<attempt>`), so the UI shows one run per trial segment.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from kiln.sweep import pbt as pbt_run
from kiln.sweep.summary import SEGMENT_TAG, TRIAL_TAG
from kiln.tracking.mlflow_run import Run

if TYPE_CHECKING:
    from kiln.launch.resume import StoredRun

log = logging.getLogger("kiln.sweep")

ATTEMPT_TAG = "kiln.sweep.attempt"  # how many times the trial (its segment, under PBT) has started
TRAIN_RUN_TAG = "kiln.sweep.train_run"  # the Train run it trains in: what a later attempt goes on in


def new(cfg, datasets, uri: str, parent: str, train_storage: str, pointer, tags: dict) -> tuple[Run, str]:
    """A trial's segment from its start: a new MLflow child run, which replaces the runs of its
    earlier attempts, and a Train run name of its own, so that a restarted trial starts clean."""
    from kiln.launch.resume import lineage, record_run
    from kiln.tracking.mlflow_run import open_run

    attempt = retire_earlier(uri, cfg.logging.experiment, parent, tags[TRIAL_TAG], tags[SEGMENT_TAG])
    segment = tags[SEGMENT_TAG]
    train_name = f"{cfg.logging.run_name}-a{attempt}" + (f"-from-{segment.replace('@', '-')}" if pointer else "")
    tags = tags | {ATTEMPT_TAG: attempt, TRAIN_RUN_TAG: train_name, **lineage(cfg)}
    run = open_run(cfg, datasets, uri, {"launcher": "sweep"}, parent_run_id=parent, tags=tags)
    if pointer is not None:
        pbt_run.end_earlier_segments(
            uri, cfg.logging.experiment, _of_trial(parent, tags[TRIAL_TAG]), run.run_id, pointer
        )
    # beside its checkpoints, the MLflow run that a PBT fork of them, or this trial going on, names
    record_run(_in_sweep_storage(cfg, train_name, train_storage), run.run_id, uri)
    return run, train_name


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """An earlier attempt of a trial, cut (Ctrl-C, a dead driver) after a checkpoint."""

    run_id: str
    attempt: int
    train_name: str
    stored: StoredRun
    """Where its Train run is, and its newest complete checkpoint."""


def interrupted(cfg, uri: str, parent: str, trial_id: str, train_storage: str) -> Interrupted | None:
    """The earlier attempt of this trial that a checkpoint short of `train.max_steps` lets go on;
    None where there is none (it then starts again from step 0)."""
    from kiln.launch.resume import stored_run
    from kiln.tracking.client import search_runs

    found = search_runs(uri, cfg.logging.experiment, _of_trial(parent, trial_id))
    if not found:
        return None
    run_id, run_tags = max(found, key=lambda r: int(r[1].get(ATTEMPT_TAG, 0)))
    attempt, train_name = int(run_tags.get(ATTEMPT_TAG, 0)), run_tags.get(TRAIN_RUN_TAG)
    if not train_name:  # a run a Kiln before this tag started: it starts again
        return None
    stored = stored_run(_in_sweep_storage(cfg, train_name, train_storage))
    if stored is None or stored.mlflow_run_id != run_id or stored.step >= cfg.train.max_steps:
        return None
    return Interrupted(run_id, attempt, train_name, stored)


def go_on(cfg, uri: str, earlier: Interrupted, tags: dict) -> tuple[Run, str, str]:
    """An interrupted trial, going on: Ray Train resumes its Train run (the same name and
    storage) from the newest checkpoint, into the same MLflow run, where rank 0 logs only the
    steps that run does not hold yet (`kiln.launch.resume`)."""
    from kiln.tracking.mlflow_run import reopen_run

    log.info(
        "trial %s goes on from its checkpoint at step %d (%s)",
        tags[TRIAL_TAG],
        earlier.stored.step,
        earlier.stored.checkpoint,
    )
    run = reopen_run(cfg, uri, earlier.run_id, earlier.stored.checkpoint)
    run.set_tags({ATTEMPT_TAG: earlier.attempt + 1})
    return run, earlier.train_name, earlier.stored.checkpoint


def _in_sweep_storage(cfg, train_name: str, train_storage: str):
    """`cfg` as the Train run `train_name` under the sweep's storage sees it."""
    return dataclasses.replace(
        cfg,
        logging=dataclasses.replace(cfg.logging, run_name=train_name),
        train=dataclasses.replace(cfg.train, storage_path=train_storage),
    )


def retire_earlier(uri: str, experiment: str, parent: str, trial_id: str, segment: str) -> int:
    """Soft-delete the runs of earlier attempts of this trial's segment; return this attempt's
    number (one more than any before it, whether it started anew or went on). A PBT trial's
    earlier segments stay: they are its lineage."""
    from kiln.tracking.client import delete_runs

    earlier = delete_runs(uri, experiment, _of_trial(parent, trial_id) + f" and tags.`{SEGMENT_TAG}` = '{segment}'")
    return max((int(tags.get(ATTEMPT_TAG, 1)) for _, tags in earlier), default=0) + 1


def _of_trial(parent: str, trial_id: str) -> str:
    """The MLflow filter for a trial's runs, every attempt and segment, under its sweep's parent."""
    return f"tags.mlflow.parentRunId = '{parent}' and tags.`{TRIAL_TAG}` = '{trial_id}'"
