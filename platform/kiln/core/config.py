"""The `train` and `logging` sections of a run: what the loop does (steps, batch sizes,
precision, validation, checkpoints) and what it records (the MLflow run, its cadence).

`train`'s nested sections live with their code: `train.profile` in `kiln.core.profiling`,
`train.health` in `kiln.core.health`. `logging` is read by the loop (log_every,
progress_every) and by `kiln.tracking`. Rules that involve other sections (precision against
the parallel layout) are `kiln.config`'s.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from kiln.core.health import HealthConfig
from kiln.core.profiling import ProfileConfig
from kiln.knobs import check_ranges, knob, span
from kiln.limits import MAX_STEPS


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
    micro-batch 16 on an H200: 0.97x the plain loop against 0.79x, bench/results/gpu.md). `auto`
    (default): autocast on GPUs at ZeRO-0 without a pipeline, where its model states are also
    the smaller (16 bytes per parameter against 20); weights where ZeRO shards the optimizer
    (the replicated part is then 4 bytes per parameter against autocast's 8), under a pipeline
    (which runs no autocast) and on CPUs (no speed difference measured there). A checkpoint
    resumes only under the same choice (fp32 runs resume under autocast)."""
    compile: bool = False
    """Run the model through torch.compile (inductor), fusing its elementwise kernels. Pays on
    GPUs (fewer launches, less memory traffic) after a compile of tens of seconds, which the run
    summary reports apart; on CPU it rarely pays (see bench/results/). ZeRO 0-2 only, no
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
    in cluster/ set it to the cluster's bucket), else ./runs. A relative path in a submitted
    job, which runs in Ray's temporary copy of its working dir, goes under $KILN_HOME (~/kiln)."""
    peak_flops: float = knob(0.0, *span(0, 1e21, "a number", note="0: measure or look up"))
    """Per-device peak FLOP/s for MFU. 0: looked up for known GPUs, measured on CPU."""
    resume_from: str = ""
    """A checkpoint to start from: a run's directory (runs/<name>: its newest complete checkpoint;
    or just <name>, a run under train.storage_path) or one checkpoint in it (Ray Train's
    checkpoint_<time>, the local launcher's step_N), local or s3:// (kiln.core.remote_checkpoint).
    'auto': an unnamed run is named by what it trains, so the same job resumes when submitted
    again (jobs/pretrain.py's default; kiln.launch.preflight.with_run_name). Weights, optimizer state, step, RNG states;
    data continues after the batches already used. The optimizer's settings and the schedule are
    this config's (`kiln train --fork RUN` sets this field: a new run with new settings, tagged
    with its parent in MLflow). Written by another number of data-parallel workers, it is
    resharded and the global batch kept (train.allow_batch_change)."""
    allow_batch_change: bool = False
    """A resume on another number of data-parallel replicas keeps the global batch by changing
    gradient accumulation; where the new replicas x micro-batch cannot divide it the resume is
    refused, unless this is true: then the run goes on with the nearest batch they make and logs
    the change. An elastic run (parallel.num_workers: [min, max]) needs it where some size in
    between cannot share its batch at max evenly."""
    max_failures: int = knob(0, *span(-1, 1_000_000, note="-1: no limit"))
    """Restarts Ray Train may make after a worker or its node dies (FailureConfig); each restart
    resumes from the newest reported checkpoint, losing only the steps since. -1: no limit
    (an elastic run's default: 0 there means no limit too, as a lost node is a failure).
    Set train.checkpoint_every (or _minutes) too, or a restart begins again from step 0."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """A torch.profiler window (start_step, steps, ranks): Chrome trace and top operators into
    the run's MLflow artifacts under profile/. Off unless start_step > 0."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """The training-health guard: what a non-finite or spiking loss does (stop, skip the
    micro-batch, or roll back to the last checkpoint); every event is tagged in MLflow."""

    def check(self, pipeline_stages: int, world_size: int) -> None:
        check_ranges(self, "train")
        self.profile.check(self.max_steps, world_size)
        self.health.check(pipeline_stages)


EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"  # MLflow's own: the experiment where a config names none
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")  # one directory name, never a path


@dataclass
class LoggingConfig:
    experiment: str = knob("kiln", lambda v: bool(v.strip()), "a non-empty name")
    """MLflow experiment name. Not given in the config or an override: $MLFLOW_EXPERIMENT_NAME,
    else kiln."""
    run_name: str = knob(
        "",
        lambda v: v == "" or (bool(RUN_NAME.fullmatch(v)) and v.strip(".") != ""),
        "letters, digits, '.', '_' and '-', not starting with '.' (it names the run's directory)",
    )
    """MLflow run name, and the name of the run's directory under train.storage_path; empty:
    generated from the flavour and a timestamp. On Ray, a run submitted again under a name
    whose directory holds a checkpoint resumes from it, into the same MLflow run."""
    tracking_uri: str = ""
    """MLflow tracking URI. Empty: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd (in
    a submitted job, under $KILN_HOME, default ~/kiln)."""
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

    def check(self) -> None:
        check_ranges(self, "logging")


def default_experiment() -> str:
    """The experiment where neither a config nor a flag names one: $MLFLOW_EXPERIMENT_NAME,
    else LoggingConfig's default (kiln)."""
    return os.environ.get(EXPERIMENT_ENV) or LoggingConfig.experiment
