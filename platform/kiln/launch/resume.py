"""A named run submitted again resumes: from its newest checkpoint, into the same MLflow run.

Ray Train restores a run that is built again with the same `RunConfig(name, storage_path)`
from the checkpoint manager's snapshot it keeps in storage (`SNAPSHOT`), and hands every worker
the newest checkpoint (`ray.train.get_checkpoint()`). So a job that is resubmitted, by a person,
by a KubeRay RayJob's `backoffLimit` or after its driver died, under its `logging.run_name` and
`train.storage_path`, continues where its last checkpoint left it. What Ray does not know is
the MLflow run: Kiln keeps its id beside the checkpoints (`RECORD`), reopens that run, and rank
0 logs only the steps MLflow does not hold yet. A run that already reached `train.max_steps` is
refused rather than silently retrained or left as it is.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from dataclasses import dataclass

from kiln.config import RunConfig
from kiln.core.checkpoint import MARKER, find_checkpoint
from kiln.errors import ConfigError
from kiln.redact import scrub
from kiln.storage import Location, is_url, resolve, write_once

log = logging.getLogger(__name__)

SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's, in the run's directory
RECORD = "kiln-run.json"  # Kiln's, beside it: the MLflow run this run logs to


@dataclass(frozen=True)
class StoredRun:
    """What storage holds of a run of this name."""

    directory: str
    """The run's directory (local path or s3:// URI)."""
    step: int
    """The step of its newest complete checkpoint."""
    checkpoint: str
    """That checkpoint's directory name (`checkpoint_<time>`)."""
    mlflow_run_id: str | None
    tracking_uri: str | None


def _run_dir(cfg: RunConfig) -> Location:
    d = cfg.data
    return resolve(cfg.train.storage_path, d.s3_endpoint, d.s3_region).join(cfg.logging.run_name)


def stored_run(cfg: RunConfig) -> StoredRun | None:
    """The run named `logging.run_name` under `train.storage_path`, if a checkpoint of it is
    stored there; None for a new run."""
    where = _run_dir(cfg)
    latest = registered_checkpoint(where)
    if latest is None:
        return None  # no run, or one that died before its first checkpoint: it starts from step 0
    known = _recorded(where)
    return StoredRun(
        where.uri,
        int(latest.get("metrics", {}).get("step", 0)),
        latest["checkpoint_dir_name"],
        known.get("mlflow_run_id"),
        known.get("tracking_uri"),
    )


def registered_checkpoint(run_dir: Location) -> dict | None:
    """What Ray Train's snapshot in a run's directory records of its newest registered checkpoint
    (`checkpoint_dir_name`, and the `metrics` reported with it); None where it records none (a
    checkpoint directory alone may still be uploading, and is not one a resume starts from)."""
    snapshot = run_dir.join(SNAPSHOT)
    if not snapshot.exists():
        return None
    latest = json.loads(snapshot.read_bytes()).get("latest_checkpoint_result") or {}
    return latest if latest.get("checkpoint_dir_name") else None


def check_resumable(cfg: RunConfig, stored: StoredRun) -> None:
    """A stored run goes on from its own checkpoint, and only to a later `train.max_steps`."""
    if cfg.train.resume_from:
        raise ConfigError(
            f"logging.run_name = {cfg.logging.run_name!r} has checkpoints in {stored.directory} already, and a run "
            "submitted again under its name resumes from them; train.resume_from starts a new run from another "
            "checkpoint: give it another logging.run_name"
        )
    if stored.step >= cfg.train.max_steps:
        raise ConfigError(
            f"logging.run_name = {cfg.logging.run_name!r}: that run already trained to step {stored.step} "
            f"(train.max_steps = {cfg.train.max_steps}) in {stored.directory}; give a larger train.max_steps "
            "to train it on, or another logging.run_name for a new run (a job's name from train.resume_from = auto "
            "changes with its settings: set logging.run_name to this one to train it on)"
        )


def same_mlflow_run(stored: StoredRun | None, tracking_uri: str) -> str | None:
    """The MLflow run id a resumed run continues, when it was logged to this same store."""
    if stored is None or not stored.mlflow_run_id:
        return None
    if stored.tracking_uri != scrub(tracking_uri):  # kept without credentials
        log.warning(
            "run %r was logged to MLflow at %s; this time the store is %s: its steps from %d on go to a new MLflow run",
            stored.directory,
            stored.tracking_uri,
            tracking_uri,
            stored.step + 1,
        )
        return None
    return stored.mlflow_run_id


def record_run(cfg: RunConfig, mlflow_run_id: str, tracking_uri: str) -> None:
    """Keep the MLflow run's id beside the checkpoints, whole or not at all, so a resubmitted
    job finds it."""
    record = _run_dir(cfg).join(RECORD)
    text = json.dumps({"mlflow_run_id": mlflow_run_id, "tracking_uri": scrub(tracking_uri)}, indent=2)
    write_once(record, text.encode())


def lineage(cfg: RunConfig) -> dict[str, str]:
    """MLflow tags naming what a run starts from (`train.resume_from`, `--fork`): the parent run's
    name, its checkpoint and step, and its MLflow run id where the parent recorded one (`RECORD`,
    beside its checkpoints). Empty for a run that starts from step 0. The checkpoint was checked
    by preflight where this machine can see it; elsewhere only its path is known here."""
    given = cfg.train.resume_from
    if not given:
        return {}
    if is_url(given):  # preflight pinned it to one checkpoint directory
        return _remote_lineage(cfg, given)
    tags = {"kiln.parent.checkpoint": given}
    if not os.path.isdir(given):  # on a cluster's disk this machine does not share
        return tags
    directory, marker = find_checkpoint(given)
    return _parent_tags(directory, marker, resolve(os.path.dirname(directory.rstrip("/"))))


def _remote_lineage(cfg: RunConfig, checkpoint: str) -> dict[str, str]:
    """`lineage` of a checkpoint in object storage, read from its rank 0 marker."""
    loc = resolve(checkpoint, cfg.data.s3_endpoint, cfg.data.s3_region)
    marker = json.loads(loc.join(MARKER.format(rank=0)).read_bytes())
    return _parent_tags(
        checkpoint, marker, resolve(posixpath.dirname(loc.uri), cfg.data.s3_endpoint, cfg.data.s3_region)
    )


def _parent_tags(checkpoint: str, marker: dict, run_dir: Location) -> dict[str, str]:
    """The tags of a checkpoint (a checkpoint sits in its run's directory), with the MLflow run
    id its run's `RECORD` holds."""
    tags = {
        "kiln.parent.checkpoint": checkpoint,
        "kiln.parent.step": str(int(marker["step"])),
        "kiln.parent.run": posixpath.basename(run_dir.uri.rstrip("/")),
    }
    parent_id = _recorded(run_dir).get("mlflow_run_id")
    if parent_id:
        tags["kiln.parent.mlflow_run_id"] = parent_id
    return tags


def _recorded(run_dir: Location) -> dict:
    """What a run's `RECORD` holds; empty where it has none."""
    record = run_dir.join(RECORD)
    return json.loads(record.read_bytes()) if record.exists() else {}
