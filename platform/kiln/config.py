"""One typed config for a whole run, loaded from YAML with `--set a.b=c` overrides.

Every section lives here as a dataclass, and each field carries its type, its default, its range
(`knob(default, ok, allowed)`) and the docstring under it (litgpt style), on one screen;
`field_docs` reads the docstrings back for generated YAML and error messages. Rules that span
fields follow the sections, among them `deepspeed_refusal`, the one statement of which ZeRO,
offload and pipeline combinations DeepSpeed allows. Loading is strict: an unknown key names
itself and the closest valid key, a bad value names its field and the allowed range, and every
check runs before Ray, DeepSpeed or MLflow start.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import difflib
import inspect
import math
import os
import re
import tempfile
import textwrap
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml

from kiln import yamlfile
from kiln.errors import ConfigError, KilnError
from kiln.limits import MAX_INT, MAX_SEQ_LEN
from kiln.model import FLAVOURS, GPTConfig, config_for

RANGE = "kiln.range"  # dataclass field metadata: (predicate, what is allowed)


def knob(default: Any, ok: typing.Callable[[Any], bool], allowed: str) -> Any:
    """A field's default and its allowed range, declared on the field itself: `validate` checks
    `ok(value)` and names the field and `allowed` when it fails."""
    return field(default=default, metadata={RANGE: (ok, allowed)})


MAX_STEPS = 1_000_000_000  # a billion optimizer steps: far past any run, short of an absurd typo


def span(lo: float, hi: float, what: str = "an integer", note: str = "", *, lo_open: bool = False,
         ) -> tuple[typing.Callable[[Any], bool], str]:
    """`knob`'s (ok, allowed) for a number in [lo, hi] ((lo, hi] with lo_open): every numeric
    field states its sane maximum, and the check and its message come from the same numbers."""
    def ok(v: float) -> bool:
        return (lo < v if lo_open else lo <= v) and v <= hi

    allowed = f"{what} in {'(' if lo_open else '['}{_readable(lo)}, {_readable(hi)}]"
    return ok, allowed + (f" ({note})" if note else "")


def _readable(x: float) -> str:
    """1e9 rather than 1000000000 where that is exact; every digit otherwise."""
    short = f"{x:.0e}".replace("e+0", "e").replace("e+", "e")
    if abs(x) >= 1e6 and float(short) == x:
        return short
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass
class MixSource:
    path: str = ""
    """A dataset written by `kiln data prepare`: a local directory or s3://bucket/prefix."""
    weight: float = 1.0
    """Its share of the training rows, relative to the others' (1, 1, 2 draws a quarter, a
    quarter and a half)."""
    name: str = ""
    """What metrics call it (`data/mix/<name>_frac`). Empty: the path's last part."""


@dataclass
class DataConfig:
    path: str = "data/stdlib-bpe"
    """Dataset written by `kiln data prepare`: a local directory or s3://bucket/prefix. With
    `mix`, the first dataset of the mixture (set for you)."""
    mix: list[MixSource] = field(default_factory=list)
    """Several datasets to train on at once, each at its weight: `[{path: data/code, weight: 1},
    {path: data/prose, weight: 3}]`. They must share a tokenizer and seq_len. Validation runs
    over every dataset's val split. Empty: `path` alone."""
    reshuffle: bool = False
    """Reshuffle the train rows every epoch, by train.seed (shards, then blocks within windows of
    shards, then the rows of each block; see the README's data order). False: every epoch in
    the order the dataset was written, which `kiln data prepare` already shuffled."""
    s3_endpoint: str = ""
    """S3-compatible endpoint URL (MinIO, moto, ...). Empty: $AWS_ENDPOINT_URL, else AWS."""
    s3_region: str = "us-east-1"
    """Region passed to the S3 client; most S3-compatible servers ignore it."""
    prefetch_batches: int = knob(2, *span(0, 64))
    """Batches read ahead of the training step, hiding read and decode time: Ray Data's blocks
    ahead, and the depth of the loop's prefetch queue (pinned host memory on a GPU; at least 1)."""
    read_task_cpus: float = knob(0.5, *span(0, 1024, "a number"))
    """CPUs each Ray Data read task reserves. Decoding token Parquet is light next to training,
    so half a CPU; 0 lets reads run even where the training workers hold every CPU."""


@dataclass
class ModelConfig:
    flavour: str = knob("debug", lambda v: v in FLAVOURS, f"one of {sorted(FLAVOURS)}")
    """Model family and shape: one of kiln.model.FLAVOURS. GPT-2 architecture: debug, gpt2-124m,
    350m, 1.3b, 2.7b, 6.7b, 13b; Llama architecture (RoPE, RMSNorm, SwiGLU, grouped-query
    attention): llama-debug, llama-1b, llama-7b."""
    vocab_size: int = knob(0, *span(0, 10_000_000, note="0: from the data"))
    """0: the dataset's vocab padded to a multiple of 64. Must be >= the dataset's vocab."""
    seq_len: int = knob(0, *span(0, MAX_SEQ_LEN, note="0: from the data"))
    """0: the dataset's sequence length. Otherwise it must equal it."""
    dropout: float = knob(0.0, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Dropout on attention, MLP and embeddings; 0 is right for single-pass pretraining."""
    activation_checkpointing: bool = False
    """Recompute each block's activations during backward to save memory."""
    n_layer: int = knob(0, *span(0, 1024, note="0: the flavour's depth"))
    """0: the flavour's depth. Otherwise that many blocks of the flavour's width (a deeper debug
    model gives a pipeline's stages something to split)."""
    init_from: str = ""
    """A Hugging Face checkpoint directory or s3:// prefix (config.json and safetensors, GPT-2 or
    Llama architecture; S3 through data.s3_endpoint) to start from, e.g. a model to fine-tune or a `kiln export`. Its shape replaces
    the flavour's and its weights the random init; the data must be tokenized with its tokenizer
    (`kiln data prepare --tokenizer <the directory>`), which is checked before launch."""


@dataclass
class ParallelConfig:
    num_workers: int = knob(2, *span(1, 100_000))
    """Ray Train workers (data-parallel ranks)."""
    use_gpu: bool = False
    """One GPU per worker, NCCL backend. False: CPU workers with gloo."""
    cpus_per_worker: float = knob(1.0, *span(0, 1024, "a number", lo_open=True))
    """Logical CPUs Ray reserves per worker; also the worker's torch thread count."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers' bundles on nodes. PACK (Ray's default) fills few nodes, so
    ranks talk over shared memory; STRICT_SPREAD puts every worker on its own node, and waits
    until the cluster has that many nodes."""
    zero_stage: int = knob(2, lambda v: v in (0, 1, 2, 3), "one of 0, 1, 2, 3")
    """DeepSpeed ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also weights."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-Offload (stages 1-3): optimizer state and fp32 master weights live in CPU RAM (or on
    NVMe) and the optimizer step runs on the CPU (DeepSpeedCPUAdam for adam/adamw)."""
    offload_params: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-Infinity (stage 3 only): parameters live in CPU RAM (or on NVMe) between uses."""
    nvme_path: str = ""
    """Directory on fast local disk for 'nvme' offload; must exist on every worker."""
    pipeline_stages: int = knob(1, *span(1, 1024))
    """Pipeline-parallel stages (DeepSpeed PipelineModule). num_workers must be a multiple of it;
    data-parallel replicas = num_workers / pipeline_stages."""
    micro_batches: int = knob(4, *span(1, 100_000))
    """Micro-batches per optimizer step through the pipeline. The idle bubble is (P-1)/(M+P-1) of
    the step, so more micro-batches waste less."""
    partition_method: Literal["parameters", "uniform"] = "parameters"
    """How pipeline stages split the layers: balance parameter counts, or layer counts."""
    device_memory_gib: float = knob(0.0, *span(0, 100_000, "a number", note="0: detect"))
    """Memory per device that the planner checks the run against before launch. 0: detected
    (the GPU's memory; on CPU workers, RAM divided by the workers on this node)."""
    cuda_alloc_conf: str = "expandable_segments:True"
    """PyTorch's CUDA caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF syntax), applied on
    each GPU worker before its first allocation. Expandable segments grow one mapping instead of
    caching blocks of fixed sizes, which avoids fragmentation when activation sizes vary;
    empty: torch's defaults. An explicit $PYTORCH_CUDA_ALLOC_CONF on the worker wins."""
    host_malloc: Literal["keep", "default"] = "keep"
    """The host's malloc (glibc) in each worker, set before the model is built. keep: memory a
    step frees stays in the process for the next step (blocks up to 32 MiB from the heap, no
    trimming), instead of being handed back and faulted in again every step: 93% fewer page
    faults and about 1.1x the tokens/s for the `debug` GPT on 2 CPU cores (bench/RESULTS.md), at
    the same peak RSS, which then stays at its high-water mark.
    default: glibc's own settings. Logged at start; no effect outside glibc."""
    pin_cpu_threads: bool = True
    """Pin each worker's threads to cores of its own (within one NUMA node where the host has
    several), so two workers on one host do not trade caches and cores; the affinity is logged.
    Applies where the worker is given whole cores (cpus_per_worker >= 1) and they exist."""
    deepspeed: dict = field(default_factory=dict)
    """Raw DeepSpeed config merged over the generated one, for anything Kiln does not model."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "adam", "sgd", "rmsprop", "lamb"] = "adamw"
    """Optimizer. AdamW and LAMB decouple weight decay from the gradient; Adam, SGD and RMSprop
    add it to the gradient as L2, as each defines it. LAMB is Kiln's own (kiln.core.lamb)."""
    lr: float = knob(1e-3, lambda v: 0.0 < v < 10.0, "a number in (0, 10)")
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = knob(0.1, *span(0, 10, "a number"))
    """Weight decay (decoupled for adamw and lamb, L2 for the others), on the groups no_decay leaves."""
    no_decay: str = knob(
        "norms,biases,embeddings", lambda v: _no_decay_ok(v), "a comma list of norms, biases, embeddings (or '')")
    """Comma list of parameter kinds exempt from weight decay: norms, biases, embeddings ('' decays
    all). Decaying norm gains, biases and embeddings hurts: they are not over-parameterised."""
    beta1: float = knob(0.9, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """First-moment decay (Adam, AdamW, LAMB)."""
    beta2: float = knob(0.95, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Second-moment decay (Adam, AdamW, LAMB); 0.95 rather than 0.999 is steadier for LLMs."""
    eps: float = knob(1e-8, *span(0, 1, "a number", lo_open=True))
    """Denominator epsilon (Adam, AdamW, LAMB, RMSprop)."""
    momentum: float = knob(0.9, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Momentum for SGD and RMSprop (0 disables it)."""
    nesterov: bool = False
    """Nesterov momentum for SGD (needs momentum > 0)."""
    rmsprop_alpha: float = knob(0.99, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """RMSprop's decay of the squared-gradient average (torch's default)."""


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "linear", "constant", "exponential", "inverse_sqrt", "cosine_restarts"] = "cosine"
    """Shape of the learning rate after warmup (kiln.core.schedule has each formula)."""
    warmup_steps: int = knob(20, *span(0, MAX_STEPS))
    """Linear warmup from lr/warmup_steps to optim.lr over this many optimizer steps."""
    min_lr_ratio: float = knob(0.1, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
    """Floor of the LR as a fraction of optim.lr: cosine and linear end there, the others never
    go below it."""
    decay_rate: float = knob(0.01, *span(0, 10, "a number", note="per step"))
    """exponential: lambda in lr_t = lr * exp(-lambda * t), t counted in steps after warmup."""
    restart_period: int = knob(100, *span(1, MAX_STEPS))
    """cosine_restarts (SGDR): steps in the first cosine cycle, T_0."""
    restart_mult: int = knob(2, *span(1, 1000))
    """cosine_restarts (SGDR): each cycle is this many times longer than the last, T_mult."""


@dataclass
class ProfileConfig:
    start_step: int = 0
    """First profiled step; 0 turns profiling off. Pick a step after warm-up (allocator, JIT,
    Ray Data start-up) unless start-up is what you are after."""
    steps: int = 3
    """Steps in the window: a few, since traces grow by megabytes a step."""
    ranks: str = "0"
    """Ranks that profile: comma-separated ("0,3") or "all". One is usually enough; all of them
    find a straggler."""

    def rank_set(self, world_size: int) -> set[int]:
        if self.ranks.strip() == "all":
            return set(range(world_size))
        return {int(r) for r in self.ranks.split(",") if r.strip()}


@dataclass
class HealthConfig:
    policy: Literal["stop", "skip", "rollback", "off"] = "stop"
    """What a bad loss does: `stop` the run (the default: never train on garbage), `skip` the
    step (its gradients never reach the optimizer; it runs again on the next data), `rollback`
    to the newest complete checkpoint, or `off` (no check, no per-step read of the device)."""
    spike_factor: float = 0.0
    """A loss above this many times the running median of recent good losses is bad too; 0: only
    a non-finite loss is. 3 is a sensible value once a run's loss has settled."""
    spike_window: int = 50
    """How many recent good steps' mean losses the running median covers."""
    max_in_a_row: int = 10
    """Stop after this many bad steps in a row under skip or rollback: that is divergence, not a
    bad batch."""
    max_rollbacks: int = 5
    """Stop once the run has rolled back this many times in all: a run that keeps meeting bad
    losses needs a lower LR or cleaner data, not more rollbacks."""
    inject: str = ""
    """For testing the guard: comma-separated `nan@S` or `spike@S` make rank 0's first
    micro-batch loss of step S NaN, or 100 times larger."""

    def injections(self) -> dict[int, str]:
        """{step: 'nan' | 'spike'}; raises ValueError on anything else."""
        out: dict[int, str] = {}
        for item in filter(None, (s.strip() for s in self.inject.split(","))):
            kind, _, step = item.partition("@")
            if kind not in ("nan", "spike") or not step.isdigit() or int(step) < 1:
                raise ValueError(item)
            out[int(step)] = kind
        return out


@dataclass
class TrainConfig:
    max_steps: int = knob(300, *span(1, MAX_STEPS))
    """Optimizer steps to run."""
    micro_batch_size: int = knob(16, *span(1, 100_000))
    """Sequences per worker per forward/backward."""
    grad_accum_steps: int = knob(1, *span(1, 100_000))
    """Micro-batches accumulated per optimizer step. Global batch = micro * accum * workers."""
    grad_clip: float = knob(1.0, *span(0, 1e6, "a number", note="0 disables clipping"))
    """Clip the global gradient norm to this; 0 disables clipping."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision. bf16/fp16 keep fp32 master weights; fp16 uses dynamic loss scaling."""
    mixed_precision: Literal["auto", "weights", "autocast"] = "auto"
    """How bf16 is applied. `weights`: DeepSpeed's bf16, weights and gradients in 16 bits with an
    fp32 master copy in the optimizer. `autocast`: fp32 weights, with torch.autocast running
    matmuls in bf16 and the torch optimizer stepping the weights directly: fewer host-side ops per
    step, which pays where small micro-batches leave the GPU waiting on launches (gpt2-124m at
    micro-batch 16 on an H200: 0.97x the plain loop against 0.79x, bench/RESULTS.md). `auto`
    (default): autocast on GPUs at ZeRO-0 without a pipeline, where its model states are also
    the smaller (16 bytes per parameter against 20); weights where ZeRO shards the optimizer
    (the replicated part is then 4 bytes per parameter against autocast's 8), under a pipeline
    (which runs no autocast) and on CPUs (no speed difference measured there). A checkpoint
    resumes only under the same choice (fp32 runs resume under autocast)."""
    compile: bool = False
    """Run the model through torch.compile (inductor), fusing its elementwise kernels. Pays on
    GPUs (fewer launches, less memory traffic) after a compile of tens of seconds, which the run
    summary reports apart; on CPU it rarely pays (see bench/RESULTS.md). ZeRO 0-2 only, no
    pipeline: ZeRO-3's parameter hooks and DeepSpeed's pipeline schedule break the graph."""
    eval_every: int = knob(100, *span(0, MAX_STEPS))
    """Validate every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = knob(16, *span(0, 1_000_000))
    """Validation micro-batches per worker per evaluation; 0: the whole validation split."""
    checkpoint_every: int = knob(0, *span(0, MAX_STEPS))
    """Save a DeepSpeed checkpoint every this many steps; 0: only at the end."""
    checkpoint_every_minutes: float = knob(0.0, *span(0, 60 * 24 * 365, "a number of minutes", note="0: off"))
    """Also save once this many minutes have passed since the last save (0: off): bounds the work
    a failure can cost when step times vary. Ranks decide together, on their mean clock."""
    keep_checkpoints: int = knob(0, *span(0, 1_000_000, note="0: keep all"))
    """Keep only this many complete checkpoints (0: keep all), chosen by keep_checkpoints_by. Ray
    Train deletes the others from storage_path (CheckpointConfig.num_to_keep); the local launcher
    prunes its own."""
    keep_checkpoints_by: Literal["newest", "loss/val"] = "newest"
    """Which to keep: the `newest`, or the best by `loss/val` (lowest). With `loss/val` every save
    evaluates first, so each checkpoint carries its own score, and the newest is kept as well,
    since a resume starts there."""
    seed: int = 1337
    """Seeds model init and any randomness in training."""
    storage_path: str = ""
    """Where Ray Train keeps checkpoints and results: a local dir, or s3://bucket/prefix (through
    data.s3_endpoint and data.s3_region). On a multi-node cluster it must be shared storage, so a
    worker restarted on another node finds the checkpoint. Empty: $KILN_STORAGE_PATH (the files
    in cluster/ set it to the cluster's bucket), else ./runs."""
    peak_flops: float = knob(0.0, *span(0, 1e21, "a number", note="0: measure or look up"))
    """Per-device peak FLOP/s for MFU. 0: looked up for known GPUs, measured on CPU."""
    resume_from: str = ""
    """A checkpoint to start from: a run's directory (runs/<name>: its newest complete checkpoint)
    or one checkpoint in it (Ray Train's checkpoint_<time>, the local launcher's step_N). Weights,
    optimizer, LR schedule, step, RNG states; data continues after the batches already used."""
    max_failures: int = knob(0, *span(-1, 1_000_000, note="-1: no limit"))
    """Restarts Ray Train may make after a worker or its node dies (FailureConfig); each restart
    resumes from the newest reported checkpoint, losing only the steps since. -1: no limit.
    Set train.checkpoint_every (or _minutes) too, or a restart begins again from step 0."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """A torch.profiler window (start_step, steps, ranks): Chrome trace and top operators into
    the run's MLflow artifacts under profile/. Off unless start_step > 0."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """The training-health guard: what a non-finite or spiking loss does (stop, skip the
    micro-batch, or roll back to the last checkpoint); every event is tagged in MLflow."""


RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")  # one directory name, never a path


@dataclass
class LoggingConfig:
    experiment: str = knob("kiln", lambda v: bool(v.strip()), "a non-empty name")
    """MLflow experiment name."""
    run_name: str = knob("", lambda v: v == "" or (bool(RUN_NAME.fullmatch(v)) and v.strip(".") != ""),
                         "letters, digits, '.', '_' and '-', not starting with '.' (it names the run's directory)")
    """MLflow run name, and the name of the run's directory under train.storage_path; empty:
    generated from the flavour and a timestamp."""
    tracking_uri: str = ""
    """MLflow tracking URI. Empty: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd."""
    log_every: int = knob(1, *span(1, MAX_STEPS))
    """Log per-step metrics every this many steps (buffered, sent in batches)."""
    progress_every: int = knob(10, *span(1, MAX_STEPS))
    """Print a progress line every this many steps."""
    outage_wait_s: float = knob(300.0, *span(0, 7 * 24 * 3600, "a number of seconds"))
    """How long a finished run waits for an unreachable MLflow server to answer again before it
    writes the metrics it still holds to `undelivered-metrics-<run id>.jsonl` beside its
    checkpoints. Training itself never waits for MLflow."""
    log_model: bool = True
    """Log the final checkpoint as an MLflow model of the run (a pyfunc that generates text, with
    the Hugging Face export inside), linked to the run's final metrics. Needs a local
    train.storage_path; sweep trials log none."""
    register_as: str = ""
    """Also register the logged model in MLflow's Model Registry under this name (a new version
    each run); empty: not registered."""
    export_to: str = ""
    """A directory the final model is exported to when the run ends (`kiln export`'s Hugging Face
    format; an earlier export there is replaced); empty: none."""


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Where the tokenized Parquet shards are and how they are streamed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Workers and DeepSpeed parallelism."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, precision, validation and checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """MLflow and console output."""

    def validate(self) -> RunConfig:
        """Check every value against its allowed range; raise ConfigError naming the field."""
        _check_ranges(self)
        _check_parallel(self)
        _check_profile(self)
        _check_health(self)
        _check_mix(self)
        return self

    @property
    def data_parallel_size(self) -> int:
        return self.parallel.num_workers // self.parallel.pipeline_stages

    def tokens_per_step(self, data_parallel_size: int | None = None) -> int:
        """Tokens one optimizer step trains on over all replicas (model.seq_len resolved):
        `data_parallel_size` of them, by default as many as the config's workers make."""
        replicas = data_parallel_size or self.data_parallel_size
        return self.train.micro_batch_size * self.micro_batches_per_step * replicas * self.model.seq_len

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        return self.parallel.micro_batches if self.parallel.pipeline_stages > 1 else self.train.grad_accum_steps

    def local_run_dir(self) -> str:
        """This run's directory on this machine, for what is not a checkpoint (worker logs,
        metrics MLflow never took): beside the checkpoints when `train.storage_path` is local,
        else in the temp dir (checkpoints on S3)."""
        from kiln.storage import absolute, is_url

        storage = self.train.storage_path or "runs"
        root = tempfile.gettempdir() if is_url(storage) else absolute(storage)
        return os.path.join(root, self.logging.run_name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


NO_DECAY_KINDS = ("norms", "biases", "embeddings")


def no_decay_kinds(text: str) -> set[str]:
    return {k.strip() for k in text.split(",") if k.strip()}


def _no_decay_ok(text: str) -> bool:
    return no_decay_kinds(text) <= set(NO_DECAY_KINDS)


def field_range(dotted: str) -> tuple[typing.Callable[[Any], bool], str]:
    """The (ok, allowed) a RunConfig field declares with `knob`, for a flag elsewhere that sets
    the same quantity (`kiln plan --seq-len` and model.seq_len share one limit)."""
    cls: Any = RunConfig
    *sections, name = dotted.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata[RANGE]


def _check_ranges(cfg: RunConfig) -> None:
    """Every field declared with `knob(..., ok, allowed)` against its range."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for f in dataclasses.fields(values):
            if RANGE in f.metadata:
                ok, allowed = f.metadata[RANGE]
                value = getattr(values, f.name)
                if not ok(value):
                    raise ConfigError(f"{section.name}.{f.name} = {value!r} is out of range: expected {allowed}")


MAX_MIX_WEIGHT = 1e6  # a million to one between two datasets: past any real mixture, short of a typo


def _check_mix(cfg: RunConfig) -> None:
    """data.mix: each entry names a dataset and a positive weight, and metric names are distinct."""
    names = []
    for i, m in enumerate(cfg.data.mix):
        where = f"data.mix[{i}]"
        if not m.path.strip():
            raise ConfigError(f"{where}.path is empty: expected a dataset directory or s3:// prefix")
        if not 0 < m.weight <= MAX_MIX_WEIGHT:
            raise ConfigError(f"{where}.weight = {m.weight!r} is out of range: expected a number in "
                              f"(0, {_readable(MAX_MIX_WEIGHT)}]")
        name = mix_name(m)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"{where}.name = {name!r}: expected letters, digits, '_', '.' or '-' "
                              "(it names metrics)")
        if name in names:
            raise ConfigError(f"{where}: the name {name!r} is taken by data.mix[{names.index(name)}]; "
                              "give one of them a name")
        names.append(name)


def mix_name(m: MixSource) -> str:
    """A mixture dataset's name in metrics: its own, else its path's last part."""
    return m.name or m.path.rstrip("/").rsplit("/", 1)[-1]


def _check_profile(cfg: RunConfig) -> None:
    p = cfg.train.profile
    if p.start_step < 0 or p.steps < 1:
        raise ConfigError(f"train.profile: start_step = {p.start_step}, steps = {p.steps}: expected "
                          "start_step >= 0 (0: off) and steps >= 1")
    if p.start_step and p.start_step + p.steps - 1 > cfg.train.max_steps:
        raise ConfigError(f"train.profile: steps {p.start_step}-{p.start_step + p.steps - 1} run past "
                          f"train.max_steps = {cfg.train.max_steps}")
    try:
        ranks = p.rank_set(cfg.parallel.num_workers)
    except ValueError:
        raise ConfigError(f"train.profile.ranks = {p.ranks!r}: expected comma-separated ranks or 'all'") from None
    if any(r < 0 or r >= cfg.parallel.num_workers for r in ranks):
        raise ConfigError(f"train.profile.ranks = {p.ranks!r}: ranks run 0..{cfg.parallel.num_workers - 1}")


def _check_health(cfg: RunConfig) -> None:
    h = cfg.train.health
    if h.spike_factor < 0 or (h.spike_factor and h.spike_factor <= 1):
        raise ConfigError(f"train.health.spike_factor = {h.spike_factor}: expected 0 (off) or a number > 1")
    if h.spike_window < 1 or h.max_in_a_row < 1 or h.max_rollbacks < 1:
        raise ConfigError(f"train.health: spike_window = {h.spike_window}, max_in_a_row = {h.max_in_a_row}, "
                          f"max_rollbacks = {h.max_rollbacks}: expected integers >= 1")
    try:
        h.injections()
    except ValueError as e:
        raise ConfigError(f"train.health.inject = {h.inject!r}: {e} is not nan@STEP or spike@STEP") from None
    if h.policy == "skip" and cfg.parallel.pipeline_stages > 1:
        raise ConfigError("train.health.policy = 'skip' with parallel.pipeline_stages > 1: DeepSpeed's pipeline "
                          "engine runs forward, backward and the step in one call, so a micro-batch cannot be "
                          "left out; expected 'stop' or 'rollback'")


def deepspeed_refusal(zero_stage: int, offload_optimizer: str, offload_params: str, pipeline_stages: int,
                      name: typing.Callable[[str], str] = lambda f: f"parallel.{f}") -> str | None:
    """Why DeepSpeed would reject (or silently mishandle) this ZeRO / offload / pipeline
    combination, naming each setting through `name`; None where it is legal. The one statement of
    these limits: `kiln train` validates with it, `kiln plan` checks its flags and lists only the
    options it allows."""
    if pipeline_stages > 1 and zero_stage > 1:
        return (f"{name('zero_stage')} = {zero_stage} with {name('pipeline_stages')} = {pipeline_stages}: "
                "DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; expected 0 or 1")
    if pipeline_stages > 1 and (offload_optimizer != "none" or offload_params != "none"):
        return (f"{name('offload_*')} with {name('pipeline_stages')} > 1: DeepSpeed's pipeline engine does "
                "not offload; expected offload 'none'")
    if offload_optimizer != "none" and zero_stage == 0:
        return (f"{name('offload_optimizer')} = {offload_optimizer!r} needs {name('zero_stage')} >= 1 (ZeRO "
                "partitions what it offloads); expected zero_stage 1, 2 or 3")
    if offload_params != "none" and zero_stage != 3:
        return (f"{name('offload_params')} = {offload_params!r} needs {name('zero_stage')} = 3 (only stage 3 "
                "partitions parameters)")
    return None


def _check_parallel(cfg: RunConfig) -> None:
    """Combinations DeepSpeed would reject (or silently mishandle), named before launch."""
    p, t = cfg.parallel, cfg.train
    if cfg.optim.nesterov and (cfg.optim.name != "sgd" or cfg.optim.momentum == 0):
        raise ConfigError(f"optim.nesterov = true with optim.name = {cfg.optim.name!r} and optim.momentum = "
                          f"{cfg.optim.momentum}: Nesterov needs optim.name = 'sgd' and optim.momentum > 0")
    if p.num_workers % p.pipeline_stages:
        raise ConfigError(
            f"parallel.num_workers = {p.num_workers} is not a multiple of parallel.pipeline_stages = "
            f"{p.pipeline_stages}: expected workers = stages x data-parallel replicas"
        )
    if p.pipeline_stages > 1 and t.grad_accum_steps != 1:
        raise ConfigError(
            f"train.grad_accum_steps = {t.grad_accum_steps} with pipeline parallelism: a pipeline "
            "accumulates over parallel.micro_batches; expected train.grad_accum_steps = 1"
        )
    refusal = deepspeed_refusal(p.zero_stage, p.offload_optimizer, p.offload_params, p.pipeline_stages)
    if refusal:
        raise ConfigError(refusal)
    if t.mixed_precision == "autocast" and (t.precision != "bf16" or p.pipeline_stages > 1):  # explicit only
        raise ConfigError(f"train.mixed_precision = 'autocast' with train.precision = {t.precision!r} and "
                          f"parallel.pipeline_stages = {p.pipeline_stages}: autocast is for bf16 without a pipeline")
    if t.compile and (p.zero_stage == 3 or p.pipeline_stages > 1):
        raise ConfigError(f"train.compile = true with parallel.zero_stage = {p.zero_stage} and parallel.pipeline_stages "
                          f"= {p.pipeline_stages}: compile works with ZeRO 0-2 and no pipeline (ZeRO-3's "
                          "parameter gathering and the pipeline's schedule break the compiled graph)")
    if "nvme" in (p.offload_optimizer, p.offload_params) and not p.nvme_path:
        raise ConfigError("parallel.offload_* = 'nvme' needs parallel.nvme_path: a directory on fast local disk")


def bf16_autocast(precision: str, mixed_precision: str, use_gpu: bool, zero_stage: int, pipeline_stages: int) -> bool:
    """Whether a run computes in bf16 through torch.autocast over fp32 weights (else, in bf16,
    through DeepSpeed's bf16 weights): `train.mixed_precision`, with `auto` resolved."""
    if precision != "bf16":
        return False
    if mixed_precision == "auto":
        return use_gpu and zero_stage == 0 and pipeline_stages == 1
    return mixed_precision == "autocast"


def uses_autocast(cfg: RunConfig) -> bool:
    t, p = cfg.train, cfg.parallel
    return bf16_autocast(t.precision, t.mixed_precision, p.use_gpu, p.zero_stage, p.pipeline_stages)


def uses_cpu_adam(cfg: RunConfig) -> bool:
    """Optimizer offload with Adam or AdamW steps on the host with DeepSpeed's vectorised
    `cpu_adam` op (5-7x torch's Adam on CPU); other optimizers run their torch step there."""
    return cfg.parallel.offload_optimizer != "none" and cfg.optim.name in ("adam", "adamw")


def gpt_config(cfg: RunConfig) -> GPTConfig:
    """The model's shape; vocab_size and seq_len must be resolved (non-zero) by now. With
    model.init_from, the checkpoint's shape (its context may be longer than the data's rows)."""
    m = cfg.model
    assert m.vocab_size > 0 and m.seq_len > 0, "resolve model.vocab_size/seq_len from the data first"
    if m.init_from:
        return dataclasses.replace(pretrained_shape(cfg), dropout=m.dropout,
                                   activation_checkpointing=m.activation_checkpointing)
    depth = {"n_layer": m.n_layer} if m.n_layer else {}
    return config_for(
        m.flavour, vocab_size=m.vocab_size, seq_len=m.seq_len, dropout=m.dropout,
        activation_checkpointing=m.activation_checkpointing, **depth,
    )


def model_base(cfg: RunConfig) -> str:
    """The model's short name: its flavour, or the name of the checkpoint it starts from."""
    return Path(cfg.model.init_from).name if cfg.model.init_from else cfg.model.flavour


def model_name(cfg: RunConfig) -> str:
    """What the console calls the model: its flavour, or the checkpoint it starts from."""
    return f"{model_base(cfg)} (init_from)" if cfg.model.init_from else cfg.model.flavour


def pretrained_dir(cfg: RunConfig) -> Path:
    """model.init_from as a local directory (an s3:// prefix is copied into a local cache once
    per machine, with data.s3_endpoint's S3)."""
    from kiln.hf_checkpoint import local_copy

    try:
        return local_copy(cfg.model.init_from, cfg.data.s3_endpoint, cfg.data.s3_region)
    except KilnError as e:
        raise ConfigError(f"model.init_from = {cfg.model.init_from!r}: {e}") from None


def pretrained_shape(cfg: RunConfig) -> GPTConfig:
    """The shape of model.init_from's checkpoint, its config.json's errors named by the field."""
    from kiln.hf_checkpoint import read_config

    path = pretrained_dir(cfg)
    try:
        return read_config(path)
    except ConfigError as e:
        raise ConfigError(f"model.init_from = {cfg.model.init_from!r}: {e}") from None


# ---- loading ----------------------------------------------------------------------------------
@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where} = {value!r} is not allowed: expected one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where} = {value!r} is not a boolean: expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} is not an integer")
        number = None
        if isinstance(value, int):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = int(value)
        if number is None:
            raise ConfigError(f"{where} = {value!r} is not an integer")
        if abs(number) > MAX_INT:
            raise ConfigError(f"{where} = {value!r} is too large: expected an integer of at most 2**53")
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{where} = {value!r} is not a number")
        if not math.isfinite(number):
            raise ConfigError(f"{where} = {value!r} is not a finite number")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where} = {value!r} is not a string")
        return "" if value is None else str(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} = {value!r} is not a list")
        (item,) = typing.get_args(tp)
        return [build_section(item, v, f"{where}[{i}]") if dataclasses.is_dataclass(item)
                else _coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} = {value!r} is not a mapping")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    path = f"{where}.{key}" if where else key
    return ConfigError(f"unknown config key {path!r}{hint}")


def build_section(cls: type, raw: dict[str, Any], where: str = ""):
    """A config dataclass from a raw mapping, every key and value checked (`where`: its dotted name)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown_key(str(key), list(fields), where)
        dotted = f"{where}.{key}" if where else key
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_section(tp, {} if value is None else value, dotted)
        else:
            kwargs[key] = _coerce(value, tp, dotted)
    return cls(**kwargs)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply `a.b.c=value` to a nested dict, checking each key against RunConfig's fields."""
    keys = dotted.split(".")
    cls: Any = RunConfig
    node = tree
    for i, key in enumerate(keys):
        where = ".".join(keys[:i])
        if cls is dict:  # free-form (parallel.deepspeed): any key goes
            if i == len(keys) - 1:
                node[key] = value
            else:
                node = _child(node, key)
            continue
        names = [f.name for f in dataclasses.fields(cls)]
        if key not in names:
            raise _unknown_key(key, names, where)
        tp = typing.get_type_hints(cls)[key]
        if i == len(keys) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"--set {dotted}: {dotted!r} is a section; set one of its fields")
            node[key] = value
        else:
            if not (dataclasses.is_dataclass(tp) or tp is dict):
                raise ConfigError(f"--set {dotted}: {'.'.join(keys[: i + 1])!r} is not a section")
            node = _child(node, key)
            cls = tp


def _child(node: dict[str, Any], key: str) -> dict[str, Any]:
    if not isinstance(node.get(key), dict):
        node[key] = {}
    return node[key]


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set optim.lr=3e-4")
    key, raw = text.split("=", 1)
    if not key.strip() or "" in key.strip().split("."):
        raise ConfigError(f"--set {text!r}: {key.strip()!r} is not a field name; expected KEY=VALUE, "
                          "e.g. --set optim.lr=3e-4")
    try:
        value = yamlfile.load_text(raw, f"--set {key.strip()}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def read_yaml_mapping(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping, read safe, strict and bounded (`kiln.yamlfile`)."""
    return yamlfile.read_mapping(path, what)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (or the defaults), apply `a.b=c` overrides, validate."""
    tree = read_yaml_mapping(path, f"config file {str(path)!r}") if path is not None else {}
    return config_from_dict(tree, overrides)


def config_from_dict(tree: dict[str, Any], overrides: Iterable[str] = ()) -> RunConfig:
    """A validated config from a tree shaped like the YAML (left as it was), with `a.b=c`
    overrides applied as `--set` applies them."""
    tree = copy.deepcopy(tree)
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    return build_section(RunConfig, tree).validate()


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1e-3}} -> {'optim.lr': 1e-3}; used for MLflow params."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def annotated_yaml(cfg: RunConfig | None = None) -> str:
    """The config as YAML with each field's docstring, and its allowed range, as a comment above it."""
    cfg = cfg or RunConfig()
    lines: list[str] = []
    for section in dataclasses.fields(RunConfig):
        value = getattr(cfg, section.name)
        lines.append(f"# {field_docs(RunConfig).get(section.name, '')}")
        lines.append(f"{section.name}:")
        docs = field_docs(type(value))
        for f in dataclasses.fields(value):
            doc = docs.get(f.name, "")
            if RANGE in f.metadata:
                doc += f" Allowed: {f.metadata[RANGE][1]}."
            lines.extend(f"  # {line}" for line in textwrap.wrap(doc.strip(), 94))
            v = getattr(value, f.name)
            v = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
            dumped = yaml.safe_dump({f.name: v}, default_flow_style=True)
            lines.append("  " + dumped.strip()[1:-1])
        lines.append("")
    return "\n".join(lines)
