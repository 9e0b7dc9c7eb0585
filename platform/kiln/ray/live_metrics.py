"""Live training metrics for Prometheus, exported through Ray's metrics endpoint.

Every rank exports its own series, labelled run, experiment and rank, through
`ray.util.metrics`; Ray's per-node metrics agent serves them to Prometheus (Ray prefixes each
name with `ray_`, so `kiln_train_loss` is scraped as `ray_kiln_train_loss`). Names follow
Prometheus conventions: base units (seconds, bytes, ratios) and `_total` on counters.

The training loop only sees `observe(metrics, step)`, `step_seconds(seconds)` (every step),
`checkpointed(seconds)` and `close()` (`kiln.core.sinks.LiveMetrics`); `NullLive` stands in where no Ray runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import psutil

GIB = 1024**3
PREFIX = "ray_"  # what Ray puts in front of application metric names on its endpoint


@dataclass(frozen=True)
class Series:
    name: str
    kind: str  # "gauge" or "counter"
    help: str
    source: str = ""  # the loop's metric key it is read from; "" for the ones set directly
    scale: float = 1.0  # multiplies the loop's value into base units (GiB -> bytes)


# The loop's per-step metrics, renamed into base units.
SERIES: tuple[Series, ...] = (
    Series("kiln_train_loss", "gauge", "Training loss of the last step (mean over ranks).", "loss/train"),
    Series("kiln_val_loss", "gauge", "Validation loss of the last evaluation.", "loss/val"),
    Series("kiln_train_learning_rate", "gauge", "Learning rate of the last step.", "lr"),
    Series("kiln_train_grad_norm", "gauge", "Global gradient norm of the last step.", "grad_norm"),
    Series(
        "kiln_train_tokens_per_second",
        "gauge",
        "Tokens per second over all workers, last step.",
        "throughput/tokens_per_s",
    ),
    Series("kiln_train_mfu_ratio", "gauge", "Model FLOPs utilisation of the last step (0-1).", "mfu"),
    Series("kiln_train_step_seconds", "gauge", "Wall time of the last optimizer step.", "time/step_s"),
    Series("kiln_train_data_wait_seconds", "gauge", "Time the last step waited for its batches.", "time/data_wait_s"),
    Series(
        "kiln_train_forward_seconds", "gauge", "Forward time of the last step (all micro-batches).", "time/forward_s"
    ),
    Series(
        "kiln_train_backward_seconds",
        "gauge",
        "Backward time of the last step, gradient all-reduce included.",
        "time/backward_s",
    ),
    Series("kiln_train_optimizer_seconds", "gauge", "Optimizer-step time of the last step.", "time/optimizer_s"),
    Series("kiln_train_loss_scale", "gauge", "fp16 dynamic loss scale.", "train/loss_scale"),
    Series("kiln_memory_rss_bytes", "gauge", "Resident memory of this worker process.", "memory/rss_gib", GIB),
    Series(
        "kiln_memory_leak_bytes_per_step",
        "gauge",
        "Steady memory growth after warm-up (host or device, the faster), in bytes per step; 0 when memory is flat.",
        "memory/leak_bytes_per_step",
    ),
    Series(
        "kiln_memory_cuda_allocated_bytes",
        "gauge",
        "Peak CUDA memory allocated by tensors.",
        "memory/max_allocated_gib",
        GIB,
    ),
    Series(
        "kiln_memory_cuda_reserved_bytes",
        "gauge",
        "Peak CUDA memory reserved by the allocator.",
        "memory/max_reserved_gib",
        GIB,
    ),
)
# Set directly by the exporter.
DIRECT: tuple[Series, ...] = (
    Series("kiln_train_step", "gauge", "The last completed optimizer step."),
    Series("kiln_train_max_steps", "gauge", "The step the run ends at."),
    Series("kiln_train_last_step_timestamp_seconds", "gauge", "Unix time the last step completed."),
    Series(
        "kiln_memory_device_used_bytes",
        "gauge",
        "Memory this worker holds on its device: CUDA reserved on a GPU, RSS on a CPU.",
    ),
    Series("kiln_memory_device_limit_bytes", "gauge", "That device's capacity: GPU memory, or the node's RAM."),
    Series("kiln_checkpoint_duration_seconds", "gauge", "Time the last checkpoint save took on this rank."),
    Series(
        "kiln_checkpoint_last_timestamp_seconds",
        "gauge",
        "Unix time of the last completed checkpoint (the run's start until the first).",
    ),
    # Health events as gauges of the count so far: a Ray counter cannot be exported at zero,
    # and a dashboard or alert needs the zero.
    Series("kiln_train_nonfinite_loss_steps", "gauge", "Steps so far whose training loss was NaN or infinite."),
    Series("kiln_train_skipped_steps", "gauge", "fp16 steps skipped so far on gradient overflow."),
    Series("kiln_train_steps_total", "counter", "Optimizer steps completed."),
    Series("kiln_train_tokens_total", "counter", "Tokens trained on, over all workers."),
    Series("kiln_checkpoints_total", "counter", "Checkpoints completed."),
)
# Every step's own wall time, as a histogram: its p50 and p99 over any window, which the
# last-value gauge above cannot give (a stall between two observed steps never shows there).
# Buckets from 5 ms (a tiny model) to 2 min (a large one's step on a slow interconnect).
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_HISTOGRAM = Series(
    "kiln_train_step_duration_seconds",
    "histogram",
    "Wall time of each optimizer step on this rank (validation and saves excluded).",
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")  # what Prometheus scrapes of one histogram
LABELS = ("run", "experiment", "rank")


def device_limit_bytes(device) -> float:
    """GPU memory, or the node's RAM for a CPU worker."""
    if device.type == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(psutil.virtual_memory().total)


def exported_names() -> set[str]:
    """Every name as Prometheus sees it on Ray's endpoint."""
    histogram = {PREFIX + STEP_HISTOGRAM.name + suffix for suffix in HISTOGRAM_SUFFIXES}
    return {PREFIX + s.name for s in SERIES + DIRECT} | histogram


class RayLive:
    """Exports through `ray.util.metrics`; must be built inside a Ray worker."""

    def __init__(self, run: str, experiment: str, rank: int, max_steps: int, device_limit_bytes: float):
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = {"run": run, "experiment": experiment, "rank": str(rank)}
        self._m = {}
        for s in SERIES + DIRECT:
            cls = Gauge if s.kind == "gauge" else Counter
            metric = cls(s.name, description=s.help, tag_keys=LABELS)
            metric.set_default_tags(tags)
            self._m[s.name] = metric
        self._steps = Histogram(
            STEP_HISTOGRAM.name, description=STEP_HISTOGRAM.help, boundaries=list(STEP_SECONDS_BUCKETS), tag_keys=LABELS
        )
        self._steps.set_default_tags(tags)
        self._nonfinite = 0
        self._last_step = 0  # counters advance by the steps since the last observed one (the
        # loop observes only the steps whose metrics it reads: every logging.log_every)
        self._m["kiln_train_max_steps"].set(max_steps)
        self._m["kiln_memory_device_limit_bytes"].set(device_limit_bytes)
        # Until the first checkpoint its age counts from the run's start.
        self._m["kiln_checkpoint_last_timestamp_seconds"].set(time.time())

    def observe(self, metrics: dict[str, float], step: int) -> None:
        for s in SERIES:
            value = metrics.get(s.source)
            if value is not None:
                self._m[s.name].set(float(value) * s.scale)
        self._m["kiln_train_step"].set(step)
        self._m["kiln_train_last_step_timestamp_seconds"].set(time.time())
        # The first observed step (step 1, or the first after a resume) counts one; a rollback
        # observes an earlier step again, which counts one too.
        steps = max(step - self._last_step, 1) if self._last_step else 1
        self._last_step = step
        self._m["kiln_train_steps_total"].inc(float(steps))
        self._m["kiln_train_tokens_total"].inc(steps * metrics["tokens/seen"] / step)  # tokens per step
        used = metrics.get("memory/max_reserved_gib")
        used = used * GIB if used is not None else psutil.Process().memory_info().rss
        self._m["kiln_memory_device_used_bytes"].set(float(used))
        self._nonfinite += not math.isfinite(metrics.get("loss/train", 0.0))
        self._m["kiln_train_nonfinite_loss_steps"].set(self._nonfinite)
        self._m["kiln_train_skipped_steps"].set(metrics.get("train/skipped_steps_total", 0.0))

    def step_seconds(self, seconds: float) -> None:
        self._steps.observe(seconds)

    def checkpointed(self, seconds: float) -> None:
        self._m["kiln_checkpoint_duration_seconds"].set(seconds)
        self._m["kiln_checkpoint_last_timestamp_seconds"].set(time.time())
        self._m["kiln_checkpoints_total"].inc(1.0)

    def close(self) -> None:
        pass
