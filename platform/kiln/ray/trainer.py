"""Ray Train orchestration around the plain training loop (Train V2 API).

The driver hands each worker the resolved config; the worker streams its own rows of the
dataset through Ray Data (`kiln.ray.source.RayDataSource`), logs through MLflow on rank 0
only, and reports metrics and DeepSpeed checkpoints via `ray.train.report`.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import tempfile
import warnings
from typing import Any

import psutil
import ray
import ray.train
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from kiln import guard
from kiln.clock import process_start, startup_mark
from kiln.config import RunConfig, config_from_dict
from kiln.core.checkpoint import CHECKPOINT
from kiln.core.collectives import barrier
from kiln.core.meter import WORKERS
from kiln.core.process import WorldInfo
from kiln.core.sinks import NullLogger, Sinks
from kiln.data.mixture import run_datasets
from kiln.devices import dist_backend
from kiln.model import GPTConfig
from kiln.parallel.worker import run_worker
from kiln.ray.console import WORKER_FORMAT
from kiln.ray.live_metrics import RayLive, device_limit_bytes
from kiln.ray.private import without_dataset_sharding
from kiln.ray.process_group import ProcessGroupConfig
from kiln.ray.progress import BoardSink
from kiln.ray.source import RayDataSource
from kiln.redact import ScrubFilter
from kiln.storage import absolute, resolve
from kiln.tracking import client
from kiln.tracking.mlflow_run import ArtifactLogger, MLflowLogger

log = logging.getLogger(__name__)


class KilnTrainer(TorchTrainer):
    """Ray Train's TorchTrainer for workers that read their own rows: no `datasets` are given,
    so the worker group starts without Ray Train's dataset-sharding actor
    (`kiln.ray.private.without_dataset_sharding`)."""

    def _create_default_callbacks(self):
        assert not self.datasets, "KilnTrainer's workers read their own rows (kiln.ray.source)"
        return without_dataset_sharding(super()._create_default_callbacks())


def _worker_entry(loop_config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    startup = startup_mark("worker_process", process_start()) | startup_mark("worker_entry")
    import ray.train.torch

    _quiet_worker_logs()
    cfg = config_from_dict(loop_config["config"])
    mcfg = GPTConfig(**loop_config["model"])  # the shape preflight resolved: config.json is not read again
    ctx = ray.train.get_context()
    world = WorldInfo(
        rank=ctx.get_world_rank(),
        world_size=ctx.get_world_size(),
        device=ray.train.torch.get_device(),
        local_rank=ctx.get_local_rank(),
        local_world_size=ctx.get_local_world_size(),
    )
    run_id = loop_config.get("mlflow_run_id")
    placement = _placement(world)
    logging.getLogger("kiln.train").info(
        "rank %d of %d on node %s", world.rank, world.world_size, placement[world.rank]
    )
    restored = ray.train.get_checkpoint()  # set when Ray Train restarts the group after a failure
    logger = _logger(cfg, world, loop_config, restarted=restored is not None)
    discard_orphaned_copies()
    local_ckpt_root = str(guard.temp_dir(None, f"ckpt-{os.getpid()}"))
    resumed = restored is not None and os.path.basename(restored.path.rstrip("/")) == loop_config.get("resumed_from")
    if restored is not None and world.rank == 0 and run_id and not resumed:  # the driver recorded a resume
        _record_restart(loop_config["tracking_uri"], run_id, restored.path, world.world_size)
    if world.rank == 0 and run_id:
        client.record_placement(loop_config["tracking_uri"], run_id, placement)

    def report(metrics: dict, ckpt_dir: str | None):
        upload = Checkpoint.from_directory(ckpt_dir) if ckpt_dir else None
        ray.train.report(metrics, checkpoint=upload)
        if not ckpt_dir:
            return None
        guard.discard(ckpt_dir, CHECKPOINT)  # uploaded to storage_path by now (synchronous)
        return StoredCheckpoint(ray.train.get_checkpoint(), local_ckpt_root, world.world_size)

    board = loop_config.get("progress_board")  # set when the driver draws a bar on its terminal
    progress = BoardSink(board) if board is not None and world.rank == 0 else None
    live = RayLive(
        cfg.logging.run_name, cfg.logging.experiment, world.rank, cfg.train.max_steps, device_limit_bytes(world.device)
    )
    node_monitor = _node_system_metrics(world, placement, loop_config["tracking_uri"], run_id)
    try:
        # Every rank downloads the whole restored checkpoint (all ranks' shards: a ZeRO load
        # reads them) and loads its own part; the copy goes once loaded.
        stored = StoredCheckpoint(restored, local_ckpt_root, world.world_size) if restored is not None else None
        run_worker(
            cfg,
            mcfg,
            world,
            lambda dp_rank, dp_size: _source(cfg, dp_rank, dp_size),
            Sinks(logger=logger, live=live, progress=progress, report=report, restored=stored),
            local_ckpt_root,
            startup,
        )
    finally:
        if node_monitor is not None:
            node_monitor.finish()
        guard.discard(local_ckpt_root)


def _logger(cfg: RunConfig, world: WorldInfo, loop_config: dict[str, Any], restarted: bool):
    """Rank 0 logs to MLflow; a rank that profiles hands in its trace; the others log nothing.
    After a restart rank 0 skips the steps the run logged already: the group resumes from its
    checkpoint, before the failure, and would log them twice."""
    run_id, uri = loop_config.get("mlflow_run_id"), loop_config["tracking_uri"]
    if world.rank == 0 and run_id:
        # Metrics MLflow never took land beside local checkpoints, else in this node's temp dir.
        return MLflowLogger(
            uri,
            run_id,
            spill_dir=cfg.local_run_dir(),
            outage_wait_s=cfg.logging.outage_wait_s,
            skip_through=client.logged_through(uri, run_id) if restarted else 0,
        )
    if run_id and world.rank in cfg.train.profile.rank_set(world.world_size) and cfg.train.profile.start_step:
        return ArtifactLogger(uri, run_id)
    return NullLogger()


class StoredCheckpoint:
    """A checkpoint this rank reported, as Ray Train stored it (every rank's files together).

    A rollback reloads the whole checkpoint (DeepSpeed's ZeRO load reads every rank's optimizer
    shard), and only storage holds all of it: calling this, on all ranks together, downloads
    it to a local directory and returns that."""

    def __init__(self, checkpoint: Checkpoint, root: str, world_size: int):
        self.checkpoint, self.root, self.world_size = checkpoint, root, world_size

    def __call__(self) -> str:
        barrier(self.world_size)  # every rank's upload of it has returned
        target = os.path.join(self.root, "rollback", os.path.basename(self.checkpoint.path.rstrip("/")))
        self.release()  # an earlier rollback's copy
        os.makedirs(os.path.dirname(target))
        guard.mark(os.path.dirname(target), "temp")
        self.checkpoint.to_directory(target)
        return target

    def release(self) -> None:
        """Remove the local copy (the checkpoint stays in storage)."""
        guard.discard(os.path.join(self.root, "rollback"))

    def __str__(self) -> str:
        return self.checkpoint.path


def discard_orphaned_copies() -> None:
    """Remove the local checkpoint directories (`kiln-ckpt-<pid>-*`) of workers on this node that
    died without cleaning up: a worker killed by a failure or a resize never runs its `finally`,
    and each left copy holds a whole checkpoint."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "kiln-ckpt-*-*")):
        pid = os.path.basename(path).split("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            log.info("removing %s, left by a worker that died", path)
            guard.discard(path)


def _placement(world: WorldInfo) -> list[str]:
    """Every rank's Ray node id, gathered over the process group Ray Train has set up."""
    import torch.distributed as dist

    node = ray.get_runtime_context().get_node_id()
    if world.world_size == 1 or not dist.is_initialized():
        return [node]
    nodes: list = [None] * world.world_size
    dist.all_gather_object(nodes, node)
    return nodes


def _node_system_metrics(world: WorldInfo, placement: list[str], tracking_uri: str, run_id: str | None):
    """MLflow system metrics of every node, not just rank 0's: on a run that spans nodes, the
    first rank on each other node logs its node's CPU, memory, disk, network (and GPU) as
    `system/node-<id>/...` (rank 0's logger keeps `system/...` for its own node). Returns the
    started monitor, or None on the ranks that do not monitor."""
    if not run_id or not monitors_its_node(world.rank, placement):
        return None
    return client.node_monitor(tracking_uri, run_id, node_label(placement[world.rank]))


def monitors_its_node(rank: int, placement: list[str]) -> bool:
    """Whether `rank` is the first rank on a node other than rank 0's (`placement`: node per rank)."""
    node = placement[rank]
    return node != placement[0] and placement.index(node) == rank


def node_label(node_id: str) -> str:
    """How a Ray node appears in metric names: its id's first 8 hex digits, enough to tell apart."""
    return f"node-{node_id[:8]}"


def _record_restart(tracking_uri: str, run_id: str, checkpoint: str, workers: int) -> None:
    """The same MLflow run continues after a restart or a resize; say so on it."""
    logging.getLogger("kiln.train").warning(client.record_restart(tracking_uri, run_id, checkpoint, workers, WORKERS))


def _source(cfg: RunConfig, dp_rank: int, dp_size: int) -> RayDataSource:
    """This worker's rows in Kiln's order (kiln.data.order), by data-parallel rank (Ray Data's
    own split across all workers deadlocked the stages of a pipeline, which must read the same
    batches)."""
    # The manifests are read again on the worker (the driver checked them before launch).
    return RayDataSource(
        run_datasets(cfg),
        dp_rank,
        dp_size,
        cfg.train.micro_batch_size,
        cfg.data.prefetch_batches,
        cfg.train.eval_batches,
        read_task_cpus=cfg.data.read_task_cpus,
        seed=cfg.train.seed,
        reshuffle=cfg.data.reshuffle,
        documents=cfg.data.masks_documents,
    )


def _checkpoint_score(cfg: RunConfig) -> dict:
    """Ray Train keeps the best `num_to_keep` by this (and always the newest); every checkpoint's
    report carries a fresh `loss/val` when keep_checkpoints_by asks for it."""
    if cfg.train.keep_checkpoints_by == "newest":
        return {}
    return {"checkpoint_score_attribute": cfg.train.keep_checkpoints_by, "checkpoint_score_order": "min"}


def _quiet_worker_logs() -> None:
    """Kiln's own INFO lines on workers, with their level for the driver's console router
    (`kiln.ray.console`); Ray's and DeepSpeed's chatter only from WARNING."""
    kiln_log = logging.getLogger("kiln")
    if not kiln_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(WORKER_FORMAT))  # the driver's router parses it
        handler.addFilter(ScrubFilter())
        kiln_log.addHandler(handler)
        kiln_log.setLevel(logging.INFO)
        kiln_log.propagate = False
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("ray.train").setLevel(logging.WARNING)  # one "Reporting training result" per report


def build_trainer(
    cfg: RunConfig,
    mcfg: GPTConfig,
    run_name: str,
    tracking_uri: str,
    run_id: str | None,
    callbacks: list | None = None,
    storage_path: str | None = None,
    progress_board=None,
    resumed_from: str | None = None,
) -> TorchTrainer:
    """The TorchTrainer of one run. A sweep's trial adds Tune's report callback and keeps its
    checkpoints under the sweep's storage; `progress_board` (a `ProgressBoard` actor) is where
    rank 0 posts each step for the driver's progress bar; `resumed_from`: the checkpoint (its
    directory's name) a run submitted again resumes from, which is not a restart."""
    p = cfg.parallel
    # Ray Train gives a worker group 60 s to start. Workers that each import torch and
    # DeepSpeed on a busy small node (concurrent sweep trials) can take longer; the controller
    # passes this from the process that calls fit() on to itself.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(p.start_timeout_s)
    storage, filesystem = train_storage(storage_path or cfg.train.storage_path or "runs", cfg)
    return KilnTrainer(
        train_loop_per_worker=_worker_entry,
        train_loop_config={
            "config": cfg.to_dict(),
            "model": dataclasses.asdict(mcfg),
            "tracking_uri": tracking_uri,
            "mlflow_run_id": run_id,
            "progress_board": progress_board,
            "resumed_from": resumed_from,
        },
        scaling_config=ScalingConfig(
            num_workers=(p.min_workers, p.max_workers) if p.elastic else p.max_workers,
            use_gpu=p.use_gpu,
            resources_per_worker={"CPU": p.cpus_per_worker},
            placement_strategy=p.placement_strategy,
            elastic_resize_monitor_interval_s=p.resize_check_s,
        ),
        torch_config=ProcessGroupConfig(backend=dist_backend(p.use_gpu)),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=storage,
            storage_filesystem=filesystem,
            callbacks=callbacks or [],
            failure_config=FailureConfig(max_failures=failures_allowed(cfg)),
            checkpoint_config=CheckpointConfig(
                num_to_keep=cfg.train.keep_checkpoints or None, **_checkpoint_score(cfg)
            ),
        ),
    )


def failures_allowed(cfg: RunConfig) -> int:
    """Ray Train's max_failures: train.max_failures, except that an elastic run left at 0
    restarts without limit (a node lost is a worker failure, and shrinking is the point)."""
    return -1 if cfg.parallel.elastic and cfg.train.max_failures == 0 else cfg.train.max_failures


def train_storage(storage: str, cfg: RunConfig):
    """(storage_path, filesystem) for Ray Train's RunConfig. An s3:// path gets Kiln's own
    S3 filesystem, so a custom endpoint (MinIO, a loopback server) reaches the workers too;
    Ray then wants the path without its scheme."""
    if storage.startswith("s3://"):
        loc = resolve(storage, cfg.data.s3_endpoint, cfg.data.s3_region)
        return loc.path, loc.fs
    # another scheme pyarrow knows (gs://, hdfs://) Ray resolves itself
    return absolute(storage), None
