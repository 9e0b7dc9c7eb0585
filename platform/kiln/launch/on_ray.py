"""`kiln train` on Ray: preflight, join or start Ray, open the MLflow run, fit, summarise.

The driver side of a Ray Train run. Everything a user can get wrong is checked by
`kiln.launch.preflight` before any worker starts; the workers run `kiln.ray.trainer`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import IO

import ray

from kiln.clock import startup_mark
from kiln.config import RunConfig
from kiln.errors import ConfigError, KilnError, user_error_in
from kiln.launch.preflight import preflight
from kiln.launch.resume import StoredRun, check_resumable, lineage, record_run, same_mlflow_run, stored_run
from kiln.launch.summary import Summary
from kiln.ports import free_port
from kiln.ray.address import check_ray_address
from kiln.ray.console import WorkerLogRouter
from kiln.ray.private import start_ray_helpers
from kiln.ray.progress import BoardWatcher, ProgressBoard
from kiln.ray.trainer import build_trainer
from kiln.storage import is_url
from kiln.tracking.mlflow_run import Run, open_run, reopen_run
from kiln.ui.progress import DriverBar, TerminalBar, is_terminal

log = logging.getLogger(__name__)


def train(
    cfg: RunConfig,
    address: str | None = None,
    started: float | None = None,
    progress_stream: IO[str] | None = None,
    verbose: bool = False,
    bar: DriverBar | None = None,
) -> Summary:
    """Validate everything, then train on Ray Train (embedded local Ray or a cluster).

    The driver draws `bar` (the Python API's tqdm bar) or, on a terminal (`progress_stream`,
    stderr by default), a live progress line; elsewhere rank 0 logs a progress line every
    `logging.progress_every` steps. The console shows Kiln's own lines; Ray's and DeepSpeed's
    output goes to the run's `workers.log` (`kiln.ray.console`), or to the console as well with
    `verbose`."""
    started = started or time.time()
    address = address or os.environ.get("RAY_ADDRESS")
    marks = startup_mark("command", started)
    checked = preflight(cfg, remote_cluster=bool(address))
    cfg, manifest, tracking_uri = checked.cfg, checked.manifest, checked.tracking_uri
    stored = stored_run(cfg)
    if stored is not None:
        check_resumable(cfg, stored)
        log.info(
            "resuming run %r from its checkpoint at step %d (%s)", cfg.logging.run_name, stored.step, stored.checkpoint
        )
    marks |= startup_mark("preflight")
    run = _open_run_while_ray_starts(cfg, checked.datasets, tracking_uri, address, verbose, stored)
    marks |= startup_mark("ray")  # the later of the two: the run opened meanwhile
    nodes = ray.nodes()
    check_tensor_parallel_nodes(cfg, nodes)
    cfg = reads_that_fit(cfg)
    resources = ray.cluster_resources()
    run.set_tags(
        {
            "kiln.num_nodes": len([n for n in nodes if n["Alive"]]),
            "kiln.cluster_cpus": resources.get("CPU", 0),
            "kiln.cluster_gpus": resources.get("GPU", 0),
        }
    )
    marks |= startup_mark("mlflow")
    worker_log = os.path.join(cfg.local_run_dir(), "workers.log")
    with run.finishing():
        stream = progress_stream or sys.stderr
        bar = bar or (TerminalBar(stream) if is_terminal(stream) else None)
        board = ProgressBoard.remote() if bar is not None else None  # type: ignore[attr-defined]  # a Ray actor
        trainer = build_trainer(
            cfg,
            checked.model,
            cfg.logging.run_name,
            tracking_uri,
            run.run_id,
            progress_board=board,
            resumed_from=stored.checkpoint if stored else None,
        )
        with (
            WorkerLogRouter(worker_log, bar.print_above if bar else None, verbose),
            BoardWatcher(board, bar) if bar is not None else contextlib.nullcontext(),
        ):
            marks |= startup_mark("fit")
            result = _fit(trainer, cfg.logging.run_name, worker_log)
        checkpoint = _checkpoint_uri(cfg, result.checkpoint)
        model = _log_model(cfg, run, checkpoint, result.metrics)
        summary = Summary.of_run(cfg, manifest, marks | result.metrics, run.run_id, tracking_uri, started, checkpoint)
        summary = dataclasses.replace(summary, worker_log=worker_log, model=model)
        summary.record(run)
    return summary


def _checkpoint_uri(cfg: RunConfig, checkpoint) -> str | None:
    """Where the run's final checkpoint is. Ray gives its path inside the storage filesystem,
    which for an s3:// storage_path has lost the scheme."""
    if checkpoint is None:
        return None
    storage = cfg.train.storage_path or ""
    if is_url(storage) and not is_url(checkpoint.path):
        return f"{storage.split('://')[0]}://{checkpoint.path.lstrip('/')}"
    return checkpoint.path


def _log_model(cfg: RunConfig, run, checkpoint: str | None, metrics: dict) -> str | None:
    """The final checkpoint exported (logging.export_to) and logged as the run's MLflow model
    (logging.log_model); the model's models:/ URI. A model that cannot be logged is a warning:
    the run itself completed, and its checkpoint is kept."""
    if not (cfg.logging.log_model or cfg.logging.export_to) or checkpoint is None:
        return None
    if is_url(checkpoint) or not os.path.isdir(checkpoint):
        where = f"on {checkpoint.split('://')[0]}" if is_url(checkpoint) else "not on this machine"
        log.warning(
            "the model is not exported or logged to MLflow: its checkpoint %s is %s, and kiln export "
            "reads local directories (use kiln export on a copy)",
            checkpoint,
            where,
        )
        return None
    if cfg.logging.export_to:
        from kiln.infer.commands import export

        export(checkpoint, cfg.logging.export_to, overwrite=True)
        log.info("exported the model to %s", cfg.logging.export_to)
    if not cfg.logging.log_model:
        return None
    from kiln.tracking.client import errors
    from kiln.tracking.model import log_model

    try:
        model_id, version = log_model(
            run.client, run.run_id, checkpoint, metrics, int(metrics.get("step", 0)), cfg.logging.register_as
        )
    except (KilnError, OSError, *errors()) as e:  # type: ignore[misc]  # errors() is a tuple of classes
        log.warning(
            "the model was not logged to MLflow (%s); kiln export %s --output DIR exports it",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
            checkpoint,
        )
        return None
    return f"models:/{cfg.logging.register_as}/{version}" if version else f"models:/{model_id}"


def _fit(trainer, run_name: str, worker_log: str):
    """trainer.fit(); a user error raised on a worker (the health guard's stop, a corrupt
    shard) becomes one line, not Ray's dump, which stays in the worker log."""
    try:
        return trainer.fit()
    except Exception as e:
        cause = user_error_in(e)
        if cause is None:
            log.error("run %r failed; the workers' output is in %s", run_name, worker_log)
            raise
        raise KilnError(f"run {run_name!r} failed: {cause} (the workers' output is in {worker_log})") from None


def _open_run_while_ray_starts(
    cfg: RunConfig,
    datasets,
    tracking_uri: str,
    address: str | None,
    verbose: bool = False,
    stored: StoredRun | None = None,
) -> Run:
    """Open the MLflow run on a thread while Ray starts (or connects): the two take seconds each
    and need nothing from each other. A cluster address that does not answer is refused first,
    so that mistake still leaves nothing behind; if Ray then fails to start, the run that opened
    meanwhile ends FAILED. A `stored` run reopens its MLflow run where it can."""
    if address:  # train() has resolved it from $RAY_ADDRESS already
        check_ray_address(address)
    run_id = same_mlflow_run(stored, tracking_uri)

    def opened() -> Run:
        run = (
            reopen_run(cfg, tracking_uri, run_id, stored.checkpoint)
            if run_id and stored
            else open_run(cfg, datasets, tracking_uri, {}, tags=lineage(cfg))
        )
        record_run(cfg, run.run_id, tracking_uri)
        return run

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kiln-open-run") as pool:
        opening = pool.submit(opened)
        try:
            connect_ray(cfg, address, verbose)
        except BaseException:
            with contextlib.suppress(Exception):
                opening.result().finish(False)
            raise
        return opening.result()


def connect_ray(cfg: RunConfig, address: str | None = None, verbose: bool = True) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS), else start an embedded Ray. Not
    `verbose`: Ray's own driver-side notices (token auth, where the dashboard is) are kept to
    errors, and Kiln says what matters of them itself."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    ray_logging = {"logging_level": logging.INFO if verbose else logging.ERROR}
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        check_ray_address(address)
        try:
            ray.init(address=address, log_to_driver=True, **ray_logging)
        except ConnectionError as e:
            raise KilnError(
                f"could not join the Ray cluster at {address}: {e}. A cluster started with `ray start "
                "--head` uses token auth: set RAY_AUTH_MODE=token (its token is in ~/.ray/auth_token)"
            ) from None
        reclaim_orphaned_placement_groups()
        return
    # Embedded local Ray. Logical CPUs: one per worker as configured, plus two for Ray Data's
    # read tasks, so data never waits behind training workers for a CPU slot.
    need = math.ceil(cfg.parallel.max_workers * cfg.parallel.cpus_per_worker) + 2
    log.info("starting an embedded local Ray (no cluster address given)")
    # The dashboard backs Ray's state API, which Ray Train's placement-group cleaner polls; it
    # binds to loopback only. The cleaner (an actor) finds it through $RAY_API_SERVER_ADDRESS,
    # which Ray's processes inherit from this one: without it the cleaner looks for a `ray start`
    # cluster, finds none or a stale one, and dies, and every Train run whose controller dies
    # with its owner (a Tune trial that PBT or ASHA stops) leaks its workers' CPUs for good.
    port = free_port()
    _point_state_api_at(port)
    # Ray's processes inherit this process's environment (where its user has not set it).
    os.environ.setdefault(_PREEMPTION_WATCHER, "0")
    # address="local": a new instance of its own, even where `ray start` left one running here.
    context = ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, need),
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        log_to_driver=True,
        _system_config=EMBEDDED_LEAN,
        **ray_logging,
    )
    start_ray_helpers()  # while the driver opens the run and builds the trainer
    log.info(
        "embedded Ray started: %d CPUs, dashboard at http://%s",
        ray.cluster_resources().get("CPU", 0),
        context.dashboard_url,
    )


# An embedded Ray is this one machine, started for one run, so two of Ray's processes start for
# nothing there: the idle workers Ray prestarts for a driver (no Kiln run uses them: Ray Train's
# actors and the reads each start their own), and Ray Train's preemption watcher, an actor that
# polls for the nodes a cloud drains (nothing drains this one). 0.6-1.9 CPU-s each at start-up
# (bench/results/startup.md). A cluster keeps Ray's defaults: there a watcher has work to do.
EMBEDDED_LEAN = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
_PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_STATE_API = "RAY_API_SERVER_ADDRESS"
_set_by_kiln: list[str] = []  # the value an earlier embedded Ray of this process set


def _point_state_api_at(port: int) -> None:
    """$RAY_API_SERVER_ADDRESS names this embedded Ray's dashboard, unless its user set it."""
    if os.environ.get(_STATE_API) not in (None, *_set_by_kiln):
        return
    os.environ[_STATE_API] = f"http://127.0.0.1:{port}"
    _set_by_kiln[:] = [os.environ[_STATE_API]]


def check_tensor_parallel_nodes(cfg: RunConfig, nodes: list[dict]) -> None:
    """Before any worker starts: refuse a tensor-parallel group that no node of the cluster can
    hold whole (`parallel.tp_within_node`). Each worker then checks its own node's share of
    ranks (`kiln.parallel.engine.build_engine`), as Ray placed them."""
    p = cfg.parallel
    if p.tensor_parallel == 1 or not p.tp_within_node:
        return
    per_worker = ("GPU", 1.0) if p.use_gpu else ("CPU", p.cpus_per_worker)
    most = max((int(n["Resources"].get(per_worker[0], 0) // per_worker[1]) for n in nodes if n.get("Alive")), default=0)
    if most < p.tensor_parallel:
        raise ConfigError(
            (cfg.dims.node_problem(most, True) or "") + f" (the largest node of the cluster holds {most} "
            f"worker(s) of {per_worker[1]:g} {per_worker[0]})"
        )


def reads_that_fit(cfg: RunConfig) -> RunConfig:
    """`cfg` with Ray Data's read tasks fitted to the cluster it joined. A read task reserves
    `data.read_task_cpus` that the training workers do not hold; on a cluster whose CPUs the
    workers take up, that reservation is never granted and the run waits for its first batch
    without end (a fixed cluster never grows, and an autoscaler adds nodes for the workers'
    group, not for reads). There the reads run with 0 CPUs reserved, beside the workers, and
    this says so."""
    need = cfg.data.read_task_cpus
    workers = cfg.parallel.max_workers * cfg.parallel.cpus_per_worker
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if not need or cpus - workers >= need:
        return cfg
    log.warning(
        "the cluster has %g CPU(s) and the %d training workers take %g, which leaves less than the "
        "%g a Ray Data read task reserves (data.read_task_cpus): reading with 0 CPUs reserved, "
        "beside the workers (add CPUs, or lower parallel.cpus_per_worker, to read on CPUs of "
        "its own; set data.read_task_cpus=0 to say so yourself)",
        cpus,
        cfg.parallel.max_workers,
        workers,
        need,
    )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, read_task_cpus=0.0))


def orphaned_placement_groups(groups: list, jobs: list) -> list[str]:
    """Ids of live, non-detached placement groups whose creating job has ended.

    Ray removes a job's placement groups when the job ends, except one whose creation raced
    with the job's end: a sweep interrupted while a trial's Ray Train controller was reserving
    its workers left such a group holding CPUs, and the resumed sweep's data tasks then waited
    for them forever. `groups` and `jobs` are rows of Ray's state API.
    """
    ended = {j.job_id for j in jobs if str(j.status).rsplit(".", 1)[-1] in ("SUCCEEDED", "FAILED", "STOPPED")}
    return [
        g.placement_group_id
        for g in groups
        if g.creator_job_id in ended and not g.is_detached and g.state in ("CREATED", "PENDING", "RESCHEDULING")
    ]


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
