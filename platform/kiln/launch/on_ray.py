"""`kiln train` on Ray: preflight, join or start Ray, open the MLflow run, fit, summarise.

The driver side of a Ray Train run. Everything a user can get wrong is checked by
`kiln.launch.preflight` before any worker starts; the workers run `kiln.ray.trainer`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import os
import socket
import sys
import time
from typing import IO

import ray

from kiln.clock import startup_mark
from kiln.config import RunConfig
from kiln.errors import KilnError, user_error_in
from kiln.launch.preflight import preflight
from kiln.launch.summary import Summary
from kiln.ray.progress import BoardWatcher, ProgressBoard
from kiln.ray.trainer import build_trainer
from kiln.tracking.mlflow_run import Run, open_run
from kiln.ui.progress import TerminalBar, is_terminal

log = logging.getLogger(__name__)


def train(cfg: RunConfig, address: str | None = None, started: float | None = None,
          progress_stream: IO[str] | None = None) -> Summary:
    """Validate everything, then train on Ray Train (embedded local Ray or a cluster).

    On a terminal (`progress_stream`, stderr by default) the driver draws a live progress bar;
    elsewhere rank 0 logs a progress line every `logging.progress_every` steps."""
    started = started or time.time()
    address = address or os.environ.get("RAY_ADDRESS")
    marks = startup_mark("command", started)
    checked = preflight(cfg, remote_cluster=bool(address))
    cfg, manifest, tracking_uri = checked.cfg, checked.manifest, checked.tracking_uri
    marks |= startup_mark("preflight")
    run = _open_run_while_ray_starts(cfg, manifest, tracking_uri, address)
    marks |= startup_mark("ray")  # the later of the two: the run opened meanwhile
    resources = ray.cluster_resources()
    run.set_tags({"kiln.num_nodes": len([n for n in ray.nodes() if n["Alive"]]),
                  "kiln.cluster_cpus": resources.get("CPU", 0), "kiln.cluster_gpus": resources.get("GPU", 0)})
    marks |= startup_mark("mlflow")
    with run.finishing():
        stream = progress_stream or sys.stderr
        board = ProgressBoard.remote() if is_terminal(stream) else None
        trainer = build_trainer(cfg, cfg.logging.run_name, tracking_uri, run.run_id,
                                progress_board=board)
        with BoardWatcher(board, TerminalBar(stream)) if board is not None else contextlib.nullcontext():
            marks |= startup_mark("fit")
            try:
                result = trainer.fit()
            except Exception as e:
                cause = user_error_in(e)  # e.g. the health guard stopped it: one line, not Ray's dump
                if cause is None:
                    raise
                raise KilnError(f"run {cfg.logging.run_name!r} failed: {cause}") from None
    checkpoint = result.checkpoint.path if result.checkpoint else None
    return Summary.of_run(cfg, manifest, marks | result.metrics, run.run_id, tracking_uri, started, checkpoint)


def _open_run_while_ray_starts(cfg: RunConfig, manifest, tracking_uri: str, address: str | None) -> Run:
    """Open the MLflow run on a thread while Ray starts (or connects): the two take seconds each
    and need nothing from each other. A cluster address that does not answer is refused first,
    so that mistake still leaves nothing behind; if Ray then fails to start, the run that opened
    meanwhile ends FAILED."""
    if address:  # train() has resolved it from $RAY_ADDRESS already
        check_ray_address(address)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-open-run") as pool:
        opening = pool.submit(open_run, cfg, manifest, tracking_uri, {})
        try:
            connect_ray(cfg, address)
        except BaseException:
            with contextlib.suppress(Exception):
                opening.result().finish(False)
            raise
        return opening.result()


def connect_ray(cfg: RunConfig, address: str | None = None) -> None:
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        check_ray_address(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except ConnectionError as e:
            raise KilnError(
                f"could not join the Ray cluster at {address}: {e}. A cluster started with `ray start "
                "--head` uses token auth: set RAY_AUTH_MODE=token (its token is in ~/.ray/auth_token)") from None
        reclaim_orphaned_placement_groups()
        warn_if_no_cpu_left_for_data(cfg)
        return
    # Embedded local Ray. Logical CPUs: one per worker as configured, plus two for Ray Data's
    # read tasks, so data never waits behind training workers for a CPU slot.
    need = math.ceil(cfg.parallel.num_workers * cfg.parallel.cpus_per_worker) + 2
    log.info("starting an embedded local Ray (no cluster address given)")
    # The dashboard backs Ray's state API, which Ray Train's placement-group cleaner polls; it
    # binds to loopback only.
    # address="local": a new instance of its own, even where `ray start` left one running here.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need), dashboard_host="127.0.0.1",
             log_to_driver=True)


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Refuse an address where nothing listens: `ray.init` would wait for it without end."""
    if address == "auto" or address.startswith("local"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not port.isdigit():
        raise KilnError(f"Ray address {address!r}: expected host:port (the head's GCS port, 6379 by "
                        "default) or ray://host:port")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise KilnError(f"no Ray cluster answers at {address} ({e.strerror or e}): start one with "
                        "`ray start --head`, or correct --address / $RAY_ADDRESS") from None


def warn_if_no_cpu_left_for_data(cfg: RunConfig) -> None:
    """Ray Data's read tasks need `data.read_task_cpus` the training workers do not hold. On a
    cluster whose CPUs the workers take up, the run waits forever for its first batch (an
    autoscaling cluster may still add a node, so this warns rather than refuses)."""
    need = cfg.data.read_task_cpus
    workers = cfg.parallel.num_workers * cfg.parallel.cpus_per_worker
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if need and cpus - workers < need:
        log.warning("the cluster has %g CPU(s) and the %d training workers take %g: less than the %g that "
                    "a Ray Data read task reserves is left, so the run will wait for its first batch until "
                    "the cluster grows. Lower parallel.cpus_per_worker or data.read_task_cpus (0 is "
                    "allowed), or add CPUs (ray start --num-cpus)",
                    cpus, cfg.parallel.num_workers, workers, need)


def orphaned_placement_groups(groups: list, jobs: list) -> list[str]:
    """Ids of live, non-detached placement groups whose creating job has ended.

    Ray removes a job's placement groups when the job ends, except one whose creation raced
    with the job's end: a sweep interrupted while a trial's Ray Train controller was reserving
    its workers left such a group holding CPUs, and the resumed sweep's data tasks then waited
    for them forever. `groups` and `jobs` are rows of Ray's state API.
    """
    ended = {j.job_id for j in jobs if str(j.status).rsplit(".", 1)[-1] in ("SUCCEEDED", "FAILED", "STOPPED")}
    return [g.placement_group_id for g in groups
            if g.creator_job_id in ended and not g.is_detached and g.state in ("CREATED", "PENDING", "RESCHEDULING")]


def reclaim_orphaned_placement_groups() -> None:
    """Give back the CPUs that a dead driver's leaked placement groups still hold."""
    from ray.util.placement_group import PlacementGroup
    from ray.util.state import list_jobs, list_placement_groups

    try:
        ids = orphaned_placement_groups(list_placement_groups(detail=True, limit=10_000), list_jobs())
    except Exception as e:  # noqa: BLE001 - the state API needs the dashboard; this is best effort
        log.debug("could not list placement groups: %s", e)
        return
    for pg_id in ids:
        log.warning("removing placement group %s: the job that created it has ended", pg_id)
        ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
