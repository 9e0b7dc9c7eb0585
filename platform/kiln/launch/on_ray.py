"""The driver side of `kiln train`: validate, open the MLflow run, start Ray Train, summarise.

Everything a user can get wrong (config, dataset, shard files, model/data mismatch, precision,
MLflow reachability) is checked here before any worker starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import IO

import yaml

import kiln
from kiln.config import RunConfig, flatten
from kiln.data.manifest import Manifest, check_shards, load_manifest
from kiln.errors import ConfigError, DataError, KilnError, user_error_in
from kiln.model import padded_vocab
from kiln.storage import resolve
from kiln.tracking.mlflow_run import (
    Run,
    check_reachable,
    git_commit,
    redact_tree,
    resolve_tracking_uri,
    ui_command,
)
from kiln.ui.progress import TerminalBar, is_terminal

log = logging.getLogger(__name__)


@dataclass
class Summary:
    run_name: str
    run_id: str
    tracking_uri: str
    experiment: str
    metrics: dict
    unigram_entropy_bits: float
    seconds_to_first_step: float
    checkpoint: str | None
    num_workers: int

    @classmethod
    def of_run(cls, cfg: RunConfig, manifest: Manifest, final: dict, run_id: str, tracking_uri: str,
               started: float, checkpoint: str | None) -> Summary:
        return cls(
            run_name=cfg.logging.run_name, run_id=run_id, tracking_uri=tracking_uri,
            experiment=cfg.logging.experiment, metrics=final,
            unigram_entropy_bits=float(manifest.raw["unigram_entropy_bits"]),
            seconds_to_first_step=final["time/first_step_unix"] - started,
            checkpoint=checkpoint, num_workers=cfg.parallel.num_workers,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)

    def render(self) -> str:
        m, ln2 = self.metrics, math.log(2)
        val_bits = m["loss/val"] / ln2
        lines = [
            f"Kiln run '{self.run_name}' finished: {m['step']} steps on {self.num_workers} worker(s), "
            f"{m['tokens/seen'] / 1e6:.2f}M tokens",
            f"  train loss        {m['loss/train']:.4f} nats/token  ({m['loss/train'] / ln2:.3f} bits/token)",
            f"  val loss          {m['loss/val']:.4f} nats/token  ({val_bits:.3f} bits/token)",
            f"  unigram entropy   {self.unigram_entropy_bits:.3f} bits/token  "
            f"(val loss is {abs(self.unigram_entropy_bits - val_bits):.3f} bits/token "
            f"{'below' if val_bits < self.unigram_entropy_bits else 'ABOVE'} it)",
            f"  throughput        {m['throughput/tokens_per_s']:,.0f} tokens/s steady state"
            + (f", MFU {100 * m['mfu']:.1f}%" if "mfu" in m else ""),
            f"  first step after  {self.seconds_to_first_step:.1f} s; data wait {100 * m['time/data_wait_share']:.1f}% of step time",
            f"  MLflow run        {self.run_id} (experiment '{self.experiment}')",
            f"  open the UI       {ui_command(self.tracking_uri)}",
        ]
        if self.checkpoint:
            lines.append(f"  checkpoint        {self.checkpoint}")
        return "\n".join(lines)


def resolve_against_data(cfg: RunConfig) -> tuple[RunConfig, Manifest]:
    """Load and check the dataset; fill in model.vocab_size/seq_len; refuse mismatches. A local
    data.path becomes absolute: workers read the shards themselves, from another directory."""
    if "://" not in cfg.data.path:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=os.path.abspath(cfg.data.path)))
    loc = resolve(cfg.data.path, cfg.data.s3_endpoint, cfg.data.s3_region)
    manifest = load_manifest(loc)
    check_shards(manifest)
    vocab, seq = manifest.vocab_size, manifest.seq_len
    m = cfg.model
    if m.vocab_size and m.vocab_size < vocab:
        raise DataError(
            f"model.vocab_size = {m.vocab_size} is smaller than the vocab of {loc.uri} ({vocab}): "
            f"expected model.vocab_size >= {vocab}, or 0 to take it from the data"
        )
    if m.seq_len and m.seq_len != seq:
        raise DataError(
            f"model.seq_len = {m.seq_len} does not match the seq_len of {loc.uri} ({seq}): "
            f"expected {seq}, or 0 to take it from the data"
        )
    model = dataclasses.replace(m, vocab_size=m.vocab_size or padded_vocab(vocab), seq_len=seq)
    cfg = dataclasses.replace(cfg, model=model)
    per_step = cfg.data_parallel_size * cfg.train.micro_batch_size
    for split in ("train", "val"):
        rows = manifest.split(split)["rows"]
        if rows < per_step:
            raise DataError(
                f"the {split} split of {loc.uri} has {rows} rows, fewer than one micro-batch on every "
                f"worker ({cfg.parallel.num_workers} x {cfg.train.micro_batch_size}); lower "
                "train.micro_batch_size or parallel.num_workers, or prepare more data"
            )
    return cfg, manifest


def check_precision(cfg: RunConfig) -> None:
    import torch

    prec = cfg.train.precision
    if not cfg.parallel.use_gpu and prec == "fp16":
        raise ConfigError(
            "train.precision = 'fp16' is not supported on CPU (DeepSpeed's CPU accelerator has no "
            "fp16); expected 'bf16' or 'fp32' for CPU workers"
        )
    if cfg.parallel.use_gpu and prec == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.precision = 'bf16' is not supported by {torch.cuda.get_device_name()}; use 'fp16' or 'fp32'"
        )


def device_memory(cfg: RunConfig, remote_cluster: bool) -> tuple[float, str] | None:
    """(GiB per device, where that figure came from), or None where it cannot be known here."""
    import psutil
    import torch

    p = cfg.parallel
    if p.device_memory_gib:
        return p.device_memory_gib, "parallel.device_memory_gib"
    if remote_cluster:
        return None  # the workers' devices are on other machines
    if p.use_gpu:
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / (1 << 30), props.name
    return psutil.virtual_memory().total / (1 << 30) / p.num_workers, f"this machine's RAM / {p.num_workers} workers"


def check_resources(cfg: RunConfig, remote_cluster: bool = False) -> None:
    """Before launch: the ops an offload needs, and the memory plan against the devices."""
    from kiln.parallel.engine import check_offload_ops
    from kiln.parallel.pipeline import check_partition
    from kiln.plan.memory import plan_input, refuse_if_too_big
    from kiln.train.loop import gpt_config

    check_partition(gpt_config(cfg).n_layer, cfg.parallel)
    check_offload_ops(cfg)
    mem = device_memory(cfg, remote_cluster)
    if mem is None:
        log.info("device memory unknown from here: set parallel.device_memory_gib to check the plan before launch")
        return
    est = refuse_if_too_big(plan_input(cfg, gpt_config(cfg), mem[0]), mem[1])
    log.info("memory plan: %.2f GiB per device estimated of %.2f GiB", est.total / (1 << 30), mem[0])


def check_storage(cfg: RunConfig) -> None:
    """An s3:// train.storage_path must be reachable and its bucket must exist before launch:
    otherwise the first checkpoint, minutes in, is where the run would fail."""
    if not cfg.train.storage_path.startswith("s3://"):
        return
    from kiln.errors import StorageError

    loc = resolve(cfg.train.storage_path, cfg.data.s3_endpoint, cfg.data.s3_region)
    bucket = loc.path.split("/", 1)[0]
    try:
        found = loc.fs.get_file_info(bucket).type
    except OSError as e:
        raise StorageError(f"train.storage_path: cannot reach {loc.uri} (S3 endpoint {loc.endpoint or 'AWS'}): {e}") from None
    if found.name == "NotFound":
        raise StorageError(f"train.storage_path: bucket '{bucket}' of {loc.uri} does not exist; create it first")


def connect_ray(cfg: RunConfig, address: str | None = None) -> None:
    import ray

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
    ray.init(num_cpus=max(os.cpu_count() or 1, need), dashboard_host="127.0.0.1", log_to_driver=True)


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
    import ray

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
    import ray
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


def open_run(cfg: RunConfig, manifest: Manifest, tracking_uri: str, cluster: dict,
             parent_run_id: str | None = None, tags: dict | None = None) -> Run:
    """Create the MLflow run with params (redacted), tags and artifacts; return its handle.

    A sweep's trial passes its parent and trial tags; its params carry the same names as a
    single run's, so trials and runs compare side by side."""
    run = Run(tracking_uri, cfg.logging.experiment, cfg.logging.run_name, parent_run_id=parent_run_id,
              tags=tags)
    run.log_params(flatten(cfg.to_dict()) | {
        "data.fingerprint": manifest.fingerprint, "data.tokenizer": manifest.raw["tokenizer"]["type"],
        "data.train_tokens": manifest.split("train")["tokens"],
    })
    run.set_tags({
        "kiln.version": kiln.__version__, "kiln.git_commit": git_commit(os.path.dirname(kiln.__file__)),
        "kiln.num_workers": cfg.parallel.num_workers, **{f"kiln.{k}": v for k, v in cluster.items()},
    })
    run.log_text(yaml.safe_dump(redact_tree(cfg.to_dict()), sort_keys=False), "config.yaml")
    run.log_text(json.dumps(manifest.raw, indent=2), "data/manifest.json")
    log_schedule_plot(run, cfg)
    return run


def log_schedule_plot(run: Run, cfg: RunConfig) -> None:
    """The LR schedule this run will follow, as a PNG artifact (schedule/lr.png)."""
    import tempfile

    from kiln.train.schedule import plot_schedule

    with tempfile.TemporaryDirectory(prefix="kiln-lr-") as tmp:
        path = plot_schedule(cfg.schedule, cfg.optim.lr, cfg.train.max_steps, f"{tmp}/lr.png",
                             title=f"{cfg.logging.run_name}: {cfg.schedule.name}, peak lr {cfg.optim.lr:g}")
        run.log_file(path, "schedule")


def with_run_name(cfg: RunConfig) -> RunConfig:
    """Fill in what the driver decides once for all workers: the run name and where it is stored."""
    name = cfg.logging.run_name or f"{cfg.model.flavour}-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = cfg.train.storage_path or os.environ.get("KILN_STORAGE_PATH") or "runs"
    return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, run_name=name),
                               train=dataclasses.replace(cfg.train, storage_path=storage))


def train(cfg: RunConfig, address: str | None = None, started: float | None = None,
          progress_stream: IO[str] | None = None) -> Summary:
    """Validate everything, then train on Ray Train (embedded local Ray or a cluster).

    On a terminal (`progress_stream`, stderr by default) the driver draws a live progress bar;
    elsewhere rank 0 logs a progress line every `logging.progress_every` steps."""
    started = started or time.time()
    cfg, manifest = resolve_against_data(cfg)
    check_precision(cfg)
    cfg = with_run_name(cfg)
    address = address or os.environ.get("RAY_ADDRESS")
    check_resources(cfg, remote_cluster=bool(address))
    tracking_uri = resolve_tracking_uri(cfg.logging.tracking_uri)
    check_reachable(tracking_uri)
    check_storage(cfg)  # after with_run_name, which fills in $KILN_STORAGE_PATH
    connect_ray(cfg, address)
    import ray

    from kiln.ray.progress import BoardWatcher, ProgressBoard
    from kiln.ray.trainer import build_trainer

    resources = ray.cluster_resources()
    run = open_run(cfg, manifest, tracking_uri, {
        "num_nodes": len([n for n in ray.nodes() if n["Alive"]]),
        "cluster_cpus": resources.get("CPU", 0), "cluster_gpus": resources.get("GPU", 0),
    })
    ok = False
    try:
        stream = progress_stream or sys.stderr
        board = ProgressBoard.remote() if is_terminal(stream) else None
        trainer = build_trainer(cfg, cfg.logging.run_name, tracking_uri, run.run_id,
                                progress_board=board)
        with BoardWatcher(board, TerminalBar(stream)) if board is not None else contextlib.nullcontext():
            try:
                result = trainer.fit()
            except Exception as e:
                cause = user_error_in(e)  # e.g. the health guard stopped it: one line, not Ray's dump
                if cause is None:
                    raise
                raise KilnError(f"run {cfg.logging.run_name!r} failed: {cause}") from None
        ok = True
    finally:
        run.finish(ok)
    checkpoint = result.checkpoint.path if result.checkpoint else None
    return Summary.of_run(cfg, manifest, result.metrics, run.run_id, tracking_uri, started, checkpoint)
