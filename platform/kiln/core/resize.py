"""Resuming a checkpoint on another number of data-parallel replicas.

A checkpoint says how it was written: its marker holds the world size, its card (rank 0's
`kiln_model.json`) the pipeline and tensor-parallel layout and the batch. A run that resumes it
on another number of replicas (a resubmitted job on other nodes, an elastic group that grew or
shrank):

- keeps the global batch, the sequences per optimizer step, by changing gradient accumulation,
  where the new replicas x micro-batch divide it; where they do not it is refused, unless
  `train.allow_batch_change`, which goes on with the nearest batch they make and says so;
- continues the data where the checkpoint left it, counted in rows of the epoch, which every
  size shares (`kiln.data.sources.OrderedSource.rescaled_skip`);
- reloads ZeRO's optimizer partitions cut for the new size (the engine's `load(reshard=True)`:
  DeepSpeed's universal checkpoint).

A changed pipeline or tensor-parallel layout is refused: each rank's files hold its own stage's
layers or its own slices, and neither DeepSpeed nor Kiln re-cuts those here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.errors import ConfigError
from kiln.topology import ParallelDims

if TYPE_CHECKING:  # the config composes this package's sections: a type here, never an import
    from kiln.config import RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """The layout and batch a checkpoint was written with."""

    dims: ParallelDims
    micro_batch_size: int | None
    """None: a checkpoint from before Kiln recorded its batch."""
    micro_batches_per_step: int | None

    @classmethod
    def of(cls, marker: dict, card: dict) -> Written:
        parallel, batch = card.get("parallel") or {}, card.get("batch") or {}
        dims = ParallelDims(
            int(marker["world_size"]), int(parallel.get("pipeline_stages", 1)), int(parallel.get("tensor_parallel", 1))
        )
        return cls(dims, batch.get("micro_batch_size"), batch.get("micro_batches_per_step"))

    @property
    def sequences_per_step(self) -> int | None:
        if self.micro_batch_size is None or self.micro_batches_per_step is None:
            return None
        return self.micro_batch_size * self.micro_batches_per_step * self.dims.data_parallel_size


def batch_card(cfg: RunConfig) -> dict:
    """What a checkpoint records of its batch (the card's `batch`)."""
    return {"micro_batch_size": cfg.train.micro_batch_size, "micro_batches_per_step": cfg.micro_batches_per_step}


@dataclass(frozen=True)
class Regroup:
    """A resume on another number of data-parallel replicas, and the batch it runs with."""

    written: Written
    data_parallel_size: int
    micro_batch_size: int
    micro_batches_per_step: int
    """This run's micro-batches per step from the resume on (gradient accumulation)."""
    batch_changed: bool

    @property
    def reshard(self) -> bool:
        """Whether the optimizer state is cut anew (another number of replicas, not only
        another micro-batch size)."""
        return self.written.dims.data_parallel_size != self.data_parallel_size

    def describe(self) -> str:
        was, now = self.written, self.data_parallel_size
        text = (
            f"{was.dims.data_parallel_size} data-parallel replicas x {was.micro_batch_size} sequences "
            f"-> {now} x {self.micro_batch_size}: {self.micro_batches_per_step} micro-batches per step"
        )
        if self.batch_changed:
            text += (
                f"; the global batch changes from {was.sequences_per_step} to "
                f"{self.sequences(now)} sequences per step (train.allow_batch_change)"
            )
        return text

    def sequences(self, replicas: int) -> int:
        return self.micro_batch_size * self.micro_batches_per_step * replicas


def regroup(where: str, written: Written, run: Written, allow_batch_change: bool = False) -> Regroup | None:
    """How a run laid out as `run` continues a checkpoint `written` so; None where the
    data-parallel size and the micro-batch size are the same, and nothing changes. Refuses,
    naming `where` (the checkpoint) and the setting: another pipeline or tensor-parallel layout,
    another number of replicas under a pipeline or tensor parallelism, and a global batch that
    cannot be kept."""
    was, now = written.dims, run.dims
    if (was.pipeline_stages, was.tensor_parallel) != (now.pipeline_stages, now.tensor_parallel):
        raise ConfigError(
            f"train.resume_from = {where!r} was written with parallel.pipeline_stages = {was.pipeline_stages} and "
            f"parallel.tensor_parallel = {was.tensor_parallel}; this run has {now.pipeline_stages} and "
            f"{now.tensor_parallel}, and each rank's checkpoint files hold its own stage's layers or slices: set "
            "them as the checkpoint had them (or `kiln export` it and start a new run with model.init_from)"
        )
    if was.data_parallel_size == now.data_parallel_size and (
        written.micro_batch_size in (None, run.micro_batch_size) or now.pipeline_stages > 1
    ):
        return None  # (a pipeline's micro-batches are parallel.micro_batches, as the user set them)
    if was.data_parallel_size != now.data_parallel_size and (now.pipeline_stages > 1 or now.tensor_parallel > 1):
        raise ConfigError(
            f"train.resume_from = {where!r} was written by {was.data_parallel_size} data-parallel replicas; this run "
            f"has {now.data_parallel_size}, and a checkpoint of a pipeline or of tensor-parallel ranks resumes only on "
            f"as many replicas: set parallel.num_workers = {was.world_size}"
        )
    micro_batches, changed = _micro_batches(where, written, run, allow_batch_change)
    assert run.micro_batch_size is not None  # this run's own batch is always known
    return Regroup(written, now.data_parallel_size, run.micro_batch_size, micro_batches, changed)


def _micro_batches(where: str, written: Written, run: Written, allow_batch_change: bool) -> tuple[int, bool]:
    """(micro-batches per step, whether the global batch changed) for the run's replicas."""
    sequences, micro, replicas = written.sequences_per_step, run.micro_batch_size, run.dims.data_parallel_size
    if sequences is None or micro is None or run.micro_batches_per_step is None:
        raise ConfigError(
            f"train.resume_from = {where!r} was written by {written.dims.data_parallel_size} "
            f"data-parallel replicas, before Kiln recorded a checkpoint's batch; resume it on as many "
            f"(parallel.num_workers = {written.dims.world_size})"
        )
    if sequences % (micro * replicas) == 0:
        return sequences // (micro * replicas), False
    if allow_batch_change:  # the nearest batch these replicas can make
        return max(1, math.floor(sequences / (micro * replicas) + 0.5)), True
    raise ConfigError(
        f"train.resume_from = {where!r} trained on {sequences} sequences per step ({written.dims.data_parallel_size} "
        f"replicas x {written.micro_batches_per_step} micro-batches x {written.micro_batch_size}), which "
        f"{replicas} replicas x train.micro_batch_size = {micro} cannot divide: pick a micro-batch size and worker "
        "count that divide it, or set train.allow_batch_change: true to go on with the nearest batch they make"
    )


def with_micro_batches(cfg: RunConfig, n: int) -> RunConfig:
    """`cfg` accumulating `n` micro-batches per step (a regroup refuses pipelines, whose
    micro-batches are `parallel.micro_batches`)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=n))


def sized_for(cfg: RunConfig, now: ParallelDims) -> Regroup | None:
    """An elastic run on fewer workers than its most keeps the batch it has at its most: the
    micro-batches per step for `now`; None at the most (and for every fixed run)."""
    full = Written(ParallelDims.of(cfg.parallel), cfg.train.micro_batch_size, cfg.micro_batches_per_step)
    here = Written(now, cfg.train.micro_batch_size, cfg.micro_batches_per_step)
    return regroup("parallel.num_workers", full, here, cfg.train.allow_batch_change)


def elastic_batch_problem(cfg: RunConfig) -> str | None:
    """Why an elastic run's global batch (its batch at its most workers) cannot be kept at every
    size Ray Train may give it; None where it can, or where train.allow_batch_change lets it
    change."""
    p, t = cfg.parallel, cfg.train
    if not p.elastic or t.allow_batch_change:
        return None
    most, accum = p.max_workers, cfg.micro_batches_per_step
    bad = [n for n in range(p.min_workers, most) if (most * accum) % n]
    if not bad:
        return None
    fits = math.lcm(*(n // math.gcd(n, most) for n in range(p.min_workers, most + 1)))
    return (
        f"parallel.num_workers = {p.num_workers}: the run keeps the global batch it has at {most} workers "
        f"({most} x train.grad_accum_steps = {accum} micro-batches a step), which {bad[0]} workers cannot "
        f"share evenly; set train.grad_accum_steps to a multiple of {fits}, or train.allow_batch_change: true"
    )
