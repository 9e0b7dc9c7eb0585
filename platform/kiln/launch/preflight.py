"""Every check a launcher runs before it starts anything, in one place.

`kiln train` on Ray, the local launcher and `kiln sweep` all call `preflight`, so a new check
goes here once and stops every driver. Everything a user can get wrong (dataset and shards,
model/data mismatch, precision, pipeline partition, offload ops, the memory plan, checkpoint
storage, MLflow reachability) fails here, with one line naming the field, before Ray,
DeepSpeed or MLflow start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kiln import lora
from kiln.config import RunConfig
from kiln.core.checkpoint import layout_card, resolve_resume
from kiln.core.config import RUN_NAME
from kiln.data.check import resolve_against_data
from kiln.data.manifest import Manifest
from kiln.data.mixture import Dataset
from kiln.errors import ConfigError, StorageError
from kiln.guard import writable_ancestor
from kiln.hf_checkpoint import check_weights, init_from_dir, pretrained_shape
from kiln.model import GPTConfig
from kiln.model_size import num_params
from kiln.parallel.engine import check_offload_ops, check_passthrough, check_with_deepspeed
from kiln.parallel.pipeline import check_partition
from kiln.plan.memory import plan_input
from kiln.plan.options import refuse_if_too_big
from kiln.redact import scrub
from kiln.storage import absolute, durable, is_url, resolve
from kiln.topology import sharding
from kiln.tracking.server import check_store, resolve_tracking_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """What preflight resolved: the config with its data shapes, run name and absolute paths
    filled in, the dataset's manifest, and the tracking URI."""

    cfg: RunConfig
    model: GPTConfig
    """The model's shape, resolved once here and handed to every worker with the config."""
    datasets: list[Dataset]
    """The run's datasets: `data.path`, or each of `data.mix`."""
    tracking_uri: str
    memory: str
    """The memory plan's verdict per device, or why it could not be checked from here."""

    @property
    def manifest(self) -> Manifest:
        """The (first) dataset's manifest: its tokenizer and seq_len are every dataset's."""
        return self.datasets[0].manifest

    def describe(self) -> str:
        """The resolved plan, as `kiln train --dry-run` prints it."""
        c, m = self.cfg, self.manifest
        mcfg, p, t = self.model, c.parallel, c.train
        total = num_params(mcfg, non_embedding=False)
        rows = [
            ("run", f"{c.logging.run_name} (experiment {c.logging.experiment!r})"),
            *[
                (
                    "data" if i == 0 else "",
                    f"{d.manifest.location.uri}: {d.manifest.split('train')['rows']:,} train / "
                    f"{d.manifest.split('val')['rows']:,} val rows of {m.seq_len} tokens, vocab {m.vocab_size} "
                    f"(fingerprint {d.manifest.fingerprint})" + (f", weight {d.weight:g}" if c.data.mix else ""),
                )
                for i, d in enumerate(self.datasets)
            ],
            ("", "attention within each document (data.document_mask)" if c.data.masks_documents else "whole rows"),
            (
                "model",
                f"{c.model.display_name}: {mcfg.n_layer} layers x d_model {mcfg.d_model}, "
                f"{total / 1e6:.2f}M params, vocab {mcfg.vocab_size}, "
                f"{'GPT-2' if mcfg.arch == 'gpt' else 'Llama'} architecture" + lora.describe(c.model.lora, mcfg, total),
            ),
            (
                "parallel",
                f"{p.num_workers} worker(s) ({c.dims.describe()}), {sharding(p)}, offload {p.offload_optimizer}/{p.offload_params}, "
                f"{t.precision}{precision_flavour(c)}, {'GPU' if p.use_gpu else 'CPU'}",
            ),
            (
                "steps",
                f"{t.max_steps} x {c.tokens_per_step():,} tokens (micro-batch {t.micro_batch_size} x "
                f"{c.micro_batches_per_step} per replica), {c.optim.name} lr {c.optim.lr:g}, {c.schedule.name}",
            ),
            ("memory", self.memory),
            ("checkpoints", absolute(c.train.storage_path)),
            ("MLflow", scrub(self.tracking_uri)),
        ]
        return "\n".join(f"  {k:<12} {v}" for k, v in rows)


def preflight(
    cfg: RunConfig,
    remote_cluster: bool = False,
    storage_field: str = "train.storage_path",
    local_storage: bool = False,
    world_size: int | None = None,
) -> Checked:
    """Run every pre-launch check on `cfg`; raise a KilnError naming the first problem.

    `remote_cluster`: the workers run on other machines, so their memory and disks are not
    known here. `storage_field`: how the user set `train.storage_path` (a sweep sets it from its
    own). `local_storage`: the launcher writes checkpoints itself, to a local directory.
    `world_size`: the ranks the run will have, where the launcher knows better than
    `parallel.num_workers` (torchrun)."""
    pretrained = check_init_from(cfg)  # the weights' own problems first: the data's fit to them is next
    cfg, datasets = resolve_against_data(cfg, pretrained)
    model = cfg.model.shape(pretrained)
    problem = cfg.dims.model_problem(model.n_head, model.kv_heads, model.hidden)
    if problem:
        raise ConfigError(problem)
    cfg = with_run_name(cfg, datasets, local_storage)  # first: train.resume_from may name a run under the storage path
    cfg = check_resume(cfg, world_size or cfg.parallel.max_workers, remote_cluster)
    check_precision(cfg)
    memory = check_resources(cfg, model, remote_cluster)
    tracking_uri = resolve_tracking_uri(cfg.logging.tracking_uri)
    check_store(tracking_uri)
    check_storage(cfg, storage_field, local_storage)  # after with_run_name: $KILN_STORAGE_PATH
    if cfg.logging.export_to:
        from kiln.infer.commands import check_target

        cfg = dataclasses.replace(
            cfg, logging=dataclasses.replace(cfg.logging, export_to=durable(cfg.logging.export_to, "logging.export_to"))
        )

        check_target(
            cfg.logging.export_to,
            "logging.export_to =",
            overwrite=True,
            inputs=(cfg.data.path, cfg.model.init_from, cfg.train.resume_from),
        )
    return Checked(cfg, model, datasets, tracking_uri, memory)


def check_init_from(cfg: RunConfig) -> GPTConfig | None:
    """model.init_from's shape (its config.json, read here once for the whole run) and its
    weights, from their headers: complete safetensors files whose names and shapes fit the
    shape (what the first step would find out minutes later). None without init_from."""
    m, d = cfg.model, cfg.data
    if not m.init_from:
        return None
    shape = pretrained_shape(m.init_from, d.s3_endpoint, d.s3_region)  # its errors name the field already
    try:
        check_weights(init_from_dir(m.init_from, d.s3_endpoint, d.s3_region), shape)
    except ConfigError as e:
        raise ConfigError(f"model.init_from = {m.init_from!r}: {e}") from None
    problem = lora.problem(m.lora, shape) if m.lora.on else None
    if problem:
        raise ConfigError(problem)
    return shape


def precision_flavour(cfg: RunConfig) -> str:
    """How bf16 runs, for the pre-launch table (`train.mixed_precision`'s `auto` resolved)."""
    if cfg.train.precision != "bf16":
        return ""
    if cfg.parallel.engine == "fsdp2":
        return " (FSDP2 mixed precision: fp32 weights, bf16 compute)"
    return " (autocast, fp32 weights)" if cfg.autocast else " (DeepSpeed bf16 weights)"


AUTO = "auto"  # train.resume_from: an unnamed run is named by what it trains, so it resumes when submitted again
RESUME_ENV = "KILN_RESUME_FROM"  # train.resume_from where the config leaves it empty (jobs/pretrain.py: auto)


def with_run_name(cfg: RunConfig, datasets: Sequence[Dataset] = (), local: bool = False) -> RunConfig:
    """Fill in what the driver decides once for all workers: the run name and where it is stored.
    A run without a `logging.run_name` is named `<model>-<time>`, a new run each time; under
    `train.resume_from: auto`, `<model>-<digest>` of what it trains (`training_digest`), so the
    same job submitted again finds its checkpoints and resumes (`kiln.launch.resume`)."""
    resume = cfg.train.resume_from or os.environ.get(RESUME_ENV, "")
    if resume == AUTO and local:
        raise ConfigError(
            "train.resume_from = 'auto' resumes a run submitted again on Ray (kiln train, "
            "jobs/pretrain.py); the local launcher does not: give a checkpoint or run directory"
        )
    name = cfg.logging.run_name or (
        f"{cfg.model.base_name}-{training_digest(cfg, datasets)}"
        if resume == AUTO
        else f"{cfg.model.base_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    storage = durable(
        cfg.train.storage_path or os.environ.get("KILN_STORAGE_PATH") or "runs",
        "train.storage_path",
        "KILN_STORAGE_PATH",
    )
    return dataclasses.replace(
        cfg,
        logging=dataclasses.replace(cfg.logging, run_name=name),
        train=dataclasses.replace(cfg.train, storage_path=storage, resume_from="" if resume == AUTO else resume),
    )


def training_digest(cfg: RunConfig, datasets: Sequence[Dataset]) -> str:
    """Ten hex digits naming what a run trains: every setting of its model, data, optimizer,
    schedule and loop, and its data by content (the manifests' fingerprints, not where the files
    are: a job reads them from a new temporary copy each time). Not where it runs or logs
    (`parallel.*`, `logging.*`: a resubmission on another cluster shape resumes, resharded), nor
    where it starts or is kept (`train.resume_from`, `train.storage_path`)."""
    import hashlib
    import json

    tree = cfg.to_dict()
    for section in ("parallel", "logging"):
        tree.pop(section)
    for key in ("resume_from", "storage_path"):
        tree["train"].pop(key)
    # what data, not where it is or how it is read
    tree["data"] = {k: v for k, v in tree["data"].items() if k in ("reshuffle",)}
    if cfg.data.masks_documents:  # only when on: the runs of earlier versions keep their names
        tree["data"]["document_mask"] = True
    tree["data"]["fingerprints"] = [(d.weight, d.manifest.fingerprint) for d in datasets]
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:10]


def check_resume(cfg: RunConfig, world_size: int, remote_cluster: bool) -> RunConfig:
    """`train.resume_from` made absolute (workers run in other directories) and, where its disk
    is this machine's, checked now: a complete checkpoint this run's layout can continue."""
    if not cfg.train.resume_from:
        return cfg
    named = run_named(cfg)
    if is_url(named or cfg.train.resume_from):
        return _check_remote_resume(cfg, named or cfg.train.resume_from, world_size)
    path = absolute(named or cfg.train.resume_from)
    if not remote_cluster or os.path.exists(path):  # on a cluster's shared disk it may be visible here too
        resolve_resume(path, world_size, layout_card(cfg), cfg.train.allow_batch_change)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume_from=path))


def _check_remote_resume(cfg: RunConfig, uri: str, world_size: int) -> RunConfig:
    """An s3:// `train.resume_from`: the checkpoint it names found by its markers and checked
    like a local one, and pinned, so every worker loads the one checked here."""
    import tempfile

    from kiln.core.remote_checkpoint import locate

    d = cfg.data
    with tempfile.TemporaryDirectory(prefix="kiln-resume-") as shadow:
        located = locate(uri, d.s3_endpoint, d.s3_region, shadow)
        try:
            resolve_resume(located.shadow, world_size, layout_card(cfg), cfg.train.allow_batch_change)
        except ConfigError as e:  # named as the user knows it, not by the local shadow
            raise ConfigError(str(e).replace(located.shadow, located.uri)) from None
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume_from=located.uri))


def run_named(cfg: RunConfig) -> str | None:
    """The directory of the run that `train.resume_from` names by its name alone (not a path
    that exists here): `train.storage_path/<name>`, local or s3://; None where it is a path."""
    given, storage = cfg.train.resume_from, cfg.train.storage_path
    if "/" in given or os.path.exists(given) or not RUN_NAME.fullmatch(given):
        return None
    if is_url(storage):
        return f"{storage.rstrip('/')}/{given}"
    under = os.path.join(storage, given)
    if not os.path.isdir(under):
        raise ConfigError(
            f"train.resume_from = {given!r}: no such directory, and no run of that name under "
            f"train.storage_path = {storage!r}"
        )
    return under


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
    return psutil.virtual_memory().total / (1 << 30) / p.max_workers, f"this machine's RAM / {p.max_workers} workers"


def check_resources(cfg: RunConfig, model: GPTConfig, remote_cluster: bool = False) -> str:
    """Before launch: the ops an offload needs, and the memory plan of a `model` against the
    devices; returns the plan's verdict in words."""
    check_partition(model.n_layer, cfg.parallel)
    check_passthrough(cfg)
    check_with_deepspeed(cfg)
    check_offload_ops(cfg)
    mem = device_memory(cfg, remote_cluster)
    if mem is None:
        verdict = "device memory unknown from here: set parallel.device_memory_gib to check the plan before launch"
        log.info("%s", verdict)
        return verdict
    p = cfg.parallel
    try:
        est = refuse_if_too_big(plan_input(cfg, model, mem[0]), mem[1])
    except ConfigError as e:
        if not p.elastic:
            raise
        raise ConfigError(
            f"parallel.num_workers = {p.num_workers}: an elastic run must fit on its minimum, "
            f"{p.min_workers} worker(s), where ZeRO shards the state the least; at that size {e}; "
            "or raise the minimum"
        ) from None
    verdict = f"{est.total / (1 << 30):.2f} GiB per device estimated of {mem[0]:.2f} GiB ({mem[1]})"
    log.info("memory plan: %s", verdict)
    return verdict


def check_storage(cfg: RunConfig, field: str = "train.storage_path", local_only: bool = False) -> None:
    """Where checkpoints go (`cfg.train.storage_path`, set by `field`) must be usable before
    launch: otherwise the first checkpoint, minutes in, is where the run would fail. An s3://
    path must be reachable and its bucket must exist; a launcher that writes checkpoints itself
    (`local_only`) needs a local directory."""
    path = cfg.train.storage_path
    if local_only and is_url(path):
        raise ConfigError(
            f"{field} = {path!r}: the local launcher writes checkpoints to a local directory; "
            "expected a local path (an s3:// storage path is for `kiln train` on Ray)"
        )
    if not path.startswith("s3://"):
        writable_ancestor(path, f"{field} = {path!r}", StorageError)  # checkpoints are written there
        return
    loc = resolve(path, cfg.data.s3_endpoint, cfg.data.s3_region)
    bucket = loc.path.split("/", 1)[0]
    try:
        found = loc.fs.get_file_info(bucket).type
    except OSError as e:
        raise StorageError(f"{field}: cannot reach {loc.uri} (S3 endpoint {loc.endpoint or 'AWS'}): {e}") from None
    if found.name == "NotFound":
        raise StorageError(f"{field}: bucket '{bucket}' of {loc.uri} does not exist; create it first")
