"""The per-worker training loop: a plain function of (config, model shape, world, engine,
batches, sinks).

It knows nothing about Ray, DeepSpeed or MLflow: it talks to the model through the `Engine`
seam (`kiln.core.engine`), and a launcher builds the engine, the batch source and the sinks
and calls `train_loop` through the one worker set-up, `kiln.parallel.worker.run_worker`; Ray
Train does so from `kiln.ray.trainer`, a single process or torchrun from `kiln.launch.local`. The loop trains for `train.max_steps` optimizer steps, validates,
checkpoints and returns the final metrics. Its jobs live beside it: `StepMeter` (timing, MFU),
`CheckpointPolicy` (when to save and evaluate), `HealthGuard` (bad losses) and `Sinks` (where
the output goes).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from kiln.clock import RESTART_ENGINE, RESTART_FIRST_STEP, RESTART_LOAD, RESTART_WORKER_START, STARTUP, startup_mark
from kiln.core.checkpoint import CheckpointPolicy, model_card
from kiln.core.collectives import mean_over_ranks
from kiln.core.engine import Engine
from kiln.core.health import BadLoss, HealthGuard
from kiln.core.leaks import LeakWatch
from kiln.core.meter import StepMeter, memory_in_use, memory_metrics
from kiln.core.optim import Settings, StepGate
from kiln.core.prefetch import DevicePrefetcher
from kiln.core.process import WorldInfo
from kiln.core.profiling import StepProfiler
from kiln.core.remote_checkpoint import copy_to
from kiln.core.resize import Regroup, sized_for, with_micro_batches
from kiln.core.sinks import Fetch, MetricLogger, Sinks
from kiln.core.step import PhaseTimer, StepResult, model_inputs, train_step
from kiln.data.indices import DROPPED, SKIPPED, TRAINED, IndexLog
from kiln.data.sources import BatchSource
from kiln.errors import KilnError
from kiln.guard import discard
from kiln.lora import describe
from kiln.model import GPTConfig
from kiln.model_size import num_params
from kiln.topology import ParallelDims
from kiln.ui.progress import LogLines, Progress, ProgressSink, console

if TYPE_CHECKING:  # the config composes the core's sections: a type here, never an import
    from kiln.config import RunConfig

log = logging.getLogger("kiln.train")


class TrainingUnhealthy(KilnError):
    """The health guard ended the run (policy stop, nothing to roll back to, or divergence)."""


@torch.no_grad()
def evaluate(engine: Engine, source: BatchSource, max_batches: int, device: torch.device) -> float:
    engine.set_training(False)
    total, count = torch.zeros((), device=device), 0  # summed on the device, read once
    for i, batch in enumerate(source.val_batches()):
        if max_batches and i >= max_batches:
            break
        batch = batch.to(device, non_blocking=True)
        loss = engine.eval_loss(*model_inputs(batch, source.documents))
        total, count = total + loss.detach().float(), count + 1
    engine.set_training(True)
    (mean_total, mean_count) = mean_over_ranks([total.item(), float(count)], device)
    return mean_total / max(mean_count, 1e-9)


def train_loop(
    cfg: RunConfig,
    mcfg: GPTConfig,
    world: WorldInfo,
    engine: Engine,
    scheduler,
    source: BatchSource,
    sinks: Sinks,
    checkpoint_root: str | None = None,
    startup: dict[str, float] | None = None,
) -> dict[str, float]:
    """Train `engine` (a model of shape `mcfg`) to `train.max_steps`; return the final metrics
    (with the launcher's `startup` marks, kiln.clock, and the first step's).

    Rules that keep ranks in step: every rank runs the same steps, takes the same save and eval
    decisions (from step counts and a clock averaged over ranks), saves between the barriers
    inside `checkpoint.save`, and calls `sinks.report` the same number of times.
    """
    run = _Training(cfg, mcfg, world, engine, scheduler, source, sinks, checkpoint_root, startup or {})
    try:
        return run.train()
    except Exception:
        sinks.close()  # what the run logged before it failed still reaches MLflow
        raise
    finally:
        run.prefetcher.close()


class _Training:
    """One rank's training run: its parts, built once, and the loop over steps."""

    def __init__(
        self,
        cfg: RunConfig,
        mcfg: GPTConfig,
        world: WorldInfo,
        engine: Engine,
        scheduler,
        source: BatchSource,
        sinks: Sinks,
        checkpoint_root: str | None,
        startup: dict[str, float],
    ):
        t, device = cfg.train, world.device
        self.cfg, self.world, self.engine, self.scheduler, self.source, self.sinks = (
            cfg,
            world,
            engine,
            scheduler,
            source,
            sinks,
        )
        self.progress: ProgressSink = sinks.progress or LogLines(cfg.logging.progress_every)  # rank 0's view
        self.policy = CheckpointPolicy(
            t,
            checkpoint_root,
            world.rank,
            world.world_size,
            model_card(cfg, mcfg),
            functools.partial(copy_to, endpoint=cfg.data.s3_endpoint, region=cfg.data.s3_region),
        )
        settings, loading = Settings.of(scheduler), time.time()
        resumed = self.policy.resume(engine, sinks.restored)
        if resumed.done:  # a load brings back the checkpoint's LR and hyperparameters: this config's win
            settings.restore(scheduler)
        # A restarted group's way back, logged after its first step (rank 0).
        self.restart = (
            _restart_marks(startup, time.time() - loading) if sinks.restored is not None and world.rank == 0 else None
        )
        self.done, consumed = resumed.done, resumed.consumed
        dims = ParallelDims.of(cfg.parallel, world.world_size)
        if resumed.regroup is not None:  # written by another number of replicas: the same row, in this run's terms
            written = resumed.regroup.written
            assert written.micro_batch_size is not None  # a regroup needs the batch it was written with
            consumed = source.rescaled_skip(consumed, written.dims.data_parallel_size, written.micro_batch_size)
        regroup = resumed.regroup or sized_for(cfg, dims)  # (an elastic run below its most workers)
        if regroup is not None:
            cfg = self._regroup(regroup, mcfg, consumed)
            t = cfg.train
        # Start reading now so the pipeline's start-up overlaps the first step; skip what the
        # resumed steps consumed.
        source.prefetch()
        self.indices = _index_log(cfg, world, dims)
        batches = (
            source.train_batches(skip=consumed)
            if self.indices is None
            else self.indices.tap(source.numbered_samples(skip=consumed), consumed)
        )
        self.prefetcher = DevicePrefetcher(batches, device, cfg.data.prefetch_batches)
        self.batches = _Counted(self.prefetcher, consumed)
        self.tokens_per_step = cfg.tokens_per_step(dims.data_parallel_size)
        self.meter = StepMeter(cfg, mcfg, world.world_size, device, self.tokens_per_step, self.done)
        if world.rank == 0:
            _log_start(cfg, mcfg, dims, self.tokens_per_step)
        self.profiler = StepProfiler(t.profile, world.rank, world.world_size, device)
        self.guard = HealthGuard(t.health, world.rank, device)
        self.gate = getattr(scheduler, "gate", None) or StepGate()  # build_engine gates the optimizer
        self.timer = PhaseTimer(device)
        self.startup = startup
        self.leaks = LeakWatch(self.meter.warmup_end)

    def _regroup(self, regroup: Regroup, mcfg: GPTConfig, consumed: int) -> RunConfig:
        """This run's config with the micro-batches per step `regroup` keeps the global batch
        with, set on the engine too."""
        cfg = with_micro_batches(self.cfg, regroup.micro_batches_per_step)
        self.engine.set_micro_batches(regroup.micro_batches_per_step)
        self.policy.card = model_card(cfg, mcfg)  # the next checkpoints record the batch this run keeps
        if self.world.rank == 0:
            log.info("%s; the data goes on at this replica's micro-batch %d", regroup.describe(), consumed)
        self.cfg = cfg
        return cfg

    def train(self) -> dict[str, float]:
        t, last, ckpt, step = self.cfg.train, {}, None, self.done
        while step < t.max_steps:
            step += 1
            self.profiler.begin(step)
            self.meter.begin()
            lr = self.scheduler.get_last_lr()[0]
            self.timer.on = read = _reads_metrics(step, self.cfg, self.meter, self.policy)
            self.engine.measure_comm(read)
            try:
                result = train_step(
                    self.engine,
                    self.batches,
                    self.cfg.micro_batches_per_step,
                    self.guard,
                    self.gate,
                    self.timer,
                    step,
                    documents=self.source.documents,
                )
            except BadLoss as bad:
                self.engine.measure_comm(False)
                self._record_indices(bad.step, DROPPED)
                step = _after_bad_loss(
                    bad, self.guard, self.engine, self.policy.last_good, self.world.rank, self.sinks.logger
                )
                continue
            self.engine.measure_comm(False)  # validation and the metrics' own reductions are not the step's
            if self.guard.events:
                _record_health(self.guard, self.sinks.logger, step, self.world.rank)
            self._record_indices(step, TRAINED if result.skipped is None else SKIPPED)
            if result.skipped is not None:
                step -= 1  # the same step again, on the next micro-batches
                continue
            _hand_in_profile(self.profiler.end(step), self.sinks.logger)
            if self.restart is not None:  # the restarted group's first step is done
                self.sinks.logger.log(self.restart | {RESTART_FIRST_STEP: time.time()}, step=step)
                self.restart = None
            if not read:  # nothing read back from the device: the step's time on the host clock
                self._end_step(step, result.data_wait_s)
                continue
            metrics, save = self._metrics(step, result, lr)
            last.update(metrics)
            ckpt = self._save_and_report(step, metrics, save)
        self.sinks.close()
        if self.indices is not None:
            self.indices.close()
        final = last | self.meter.summary() | {"step": t.max_steps} | self.meter.held | self.startup
        final |= startup_mark("first_step", self.meter.first_step_unix)
        if self.guard.active:
            final.update(self.guard.metrics())
        if self.sinks.report is not None:  # the last report carries the final checkpoint and the summary
            self.sinks.report(final, ckpt)
        return final

    def _metrics(self, step: int, result: StepResult, lr: float) -> tuple[dict[str, float], bool]:
        """The step's metrics, published (with validation where due), and whether to save now."""
        device, meter = self.world.device, self.meter
        step_s = meter.step_time(step)
        # One all-reduce per metrics step. The time since the last save rides along, so every
        # rank takes the same save decision.
        assert result.loss is not None  # a skipped step publishes nothing
        loss_train, wait, since_save = mean_over_ranks(
            [result.loss.item(), result.data_wait_s, self.policy.seconds_since_save()], device
        )
        phases = self.timer.read() | self.engine.comm_metrics()
        metrics = meter.metrics(step, step_s, loss_train, lr, phases, wait, self.engine, self.world.rank)
        if not math.isfinite(loss_train):
            log.warning("step %d: non-finite training loss %s", step, loss_train)
        save = self.policy.wants_save(step, since_save)
        if self.policy.wants_eval(step, save):
            metrics["loss/val"] = _timed_eval(meter, self.engine, self.source, self.cfg.train.eval_batches, device)
        metrics.update(memory_metrics(device))
        # this replica's bytes read so far; a mixture's realised shares, from the order itself
        metrics.update(self.source.data_metrics(self.batches.count))
        metrics.update(self.leaks.sample(step, memory_in_use(device)))
        _publish(self.sinks, self.progress, metrics, step, self.cfg, self.world.rank, meter.mean_step_s)
        self._end_step(step, result.data_wait_s)
        return metrics, save

    def _record_indices(self, step: int, status: str) -> None:
        if self.indices is not None:
            self.indices.record(step, self.batches.count, status)

    def _end_step(self, step: int, data_wait_s: float) -> None:
        """Every step's own time goes to the live step-time histogram (its p99 shows stalls
        that the logged metrics steps alone would miss)."""
        self.sinks.live.step_seconds(self.meter.end(step, data_wait_s))

    def _save_and_report(self, step: int, metrics: dict[str, float], save: bool) -> str | None:
        """Save a checkpoint if due and report to Ray Train at evaluations and saves; the checkpoint."""
        ckpt, sinks = None, self.sinks
        if save:
            client = {"step": step, "tokens_seen": step * self.tokens_per_step, "batches_consumed": self.batches.count}
            ckpt, save_s = self.policy.save(self.engine, step, client, metrics.get("loss/val"))
            if ckpt is not None:
                sinks.live.checkpointed(save_s)
                self.meter.saved(step, save_s)
        if sinks.report is not None and step != self.cfg.train.max_steps and ("loss/val" in metrics or save):
            sinks.logger.flush()  # first: a scheduler (ASHA) may stop this run once it sees the report
            fetch = sinks.report(metrics | {"step": step}, ckpt)
            if ckpt is not None and fetch is not None:
                self.policy.last_good = fetch
        return ckpt


def _index_log(cfg: RunConfig, world: WorldInfo, dims: ParallelDims) -> IndexLog | None:
    """This replica's `data.index_log` (on its first pipeline stage and tensor-parallel rank,
    which read what the others read), named by the group's start as rank 0 saw it."""
    directory = cfg.data.index_log
    if not directory:
        return None
    start = mean_over_ranks([time.time() if world.rank == 0 else 0.0], world.device)[0] * world.world_size
    where = dims.coords(world.rank)
    if where.pipeline_stage or where.tensor_parallel_rank:
        return None
    return IndexLog(os.path.join(cfg.local_run_dir(), directory), round(start * 1e6), where.data_parallel_rank)


def _restart_marks(startup: dict[str, float], load_s: float) -> dict[str, float]:
    """kiln.clock's RESTART_* known before the first step (the MLflow logger keeps them where it
    drops the steps the old group logged already)."""
    marks = {
        RESTART_WORKER_START: startup.get(f"{STARTUP}worker_process_unix"),
        RESTART_ENGINE: startup.get(f"{STARTUP}engine_unix"),
        RESTART_LOAD: load_s,
    }
    return {k: v for k, v in marks.items() if v is not None}


def _reads_metrics(step: int, cfg: RunConfig, meter: StepMeter, policy: CheckpointPolicy) -> bool:
    """Whether this step's metrics are built, which reads the device (loss, phase times) and
    all-reduces: steps logged or shown, evaluated or saved, the first (memory held) and the
    last warm-up step (a CPU's peak is measured there). Every rank answers alike. A time-based
    save (checkpoint_every_minutes) is decided on these steps too."""
    t, lg = cfg.train, cfg.logging
    return bool(
        step % lg.log_every == 0
        or step % lg.progress_every == 0
        or step == t.max_steps
        or step in (meter.done + 1, meter.warmup_end)
        or policy.wants_save(step, 0.0)
        or policy.wants_eval(step, False)
    )


def _log_start(cfg: RunConfig, mcfg: GPTConfig, dims: ParallelDims, tokens_per_step: int) -> None:
    total = num_params(mcfg, non_embedding=False)
    console.info(
        "training %s (%.2fM params%s) for %d steps, %d tokens/step on %d worker(s)%s",
        cfg.model.display_name,
        total / 1e6,
        describe(cfg.model.lora, mcfg, total),
        cfg.train.max_steps,
        tokens_per_step,
        dims.world_size,
        f" ({dims.describe()})" if dims.data_parallel_size < dims.world_size else "",
    )


def _timed_eval(meter: StepMeter, engine: Engine, source: BatchSource, max_batches: int, device: torch.device) -> float:
    start = time.perf_counter()
    loss = evaluate(engine, source, max_batches, device)
    meter.evaluated(time.perf_counter() - start)
    return loss


def _publish(
    sinks: Sinks,
    progress: ProgressSink,
    metrics: dict[str, float],
    step: int,
    cfg: RunConfig,
    rank: int,
    mean_step_s: float,
) -> None:
    """The step's metrics to Prometheus, MLflow (every `log_every` steps, at evaluations and at
    the end) and, on rank 0, the progress display (no ETA until steady steps are timed)."""
    sinks.live.observe(metrics, step)
    is_last = step == cfg.train.max_steps
    if step % cfg.logging.log_every == 0 or is_last or "loss/val" in metrics:
        sinks.logger.log(metrics, step)
    if rank == 0:
        progress.update(
            Progress(
                step,
                cfg.train.max_steps,
                metrics["loss/train"],
                metrics["throughput/tokens_per_s"],
                metrics["lr"],
                mean_step_s,
                metrics.get("loss/val"),
            )
        )


def _hand_in_profile(window, logger: MetricLogger) -> None:
    """A finished profiler window goes to the run's artifacts (profile/), then off local disk."""
    if window is not None:
        logger.log_artifacts(str(window), "profile")
        discard(window)


def _after_bad_loss(
    bad: BadLoss, guard: HealthGuard, engine: Engine, last_good: str | Fetch | None, rank: int, logger: MetricLogger
) -> int:
    """Roll back to `last_good` (a directory, or under Ray a function that downloads one) and
    return its step, or end the run with the reason."""
    if bad.undone and guard.cfg.policy == "skip":
        guard.events.append(f"step {bad.step}: skipped: {bad.reason}")
        _record_health(guard, logger, bad.step, rank)
        return bad.step
    capped = guard.rollbacks >= guard.cfg.max_rollbacks
    if guard.cfg.policy == "rollback" and not bad.fatal and last_good is not None and not capped:
        if callable(last_good):
            last_good = last_good()
        client = engine.load(last_good)
        back_to = int(client["step"])
        guard.rollbacks += 1
        guard.events.append(
            f"step {bad.step}: rolled back to {os.path.basename(last_good)}, skipping the "
            f"data of steps {back_to + 1}-{bad.step}: {bad.reason}"
        )
        _record_health(guard, logger, bad.step, rank)
        return back_to
    if bad.fatal:
        why = "divergence"
    elif guard.cfg.policy == "stop":
        why = "train.health.policy = stop"
    elif guard.cfg.policy == "skip":
        why = "a step that cannot be withheld once taken; train.health.policy = rollback undoes it"
    elif capped and last_good is not None:
        why = f"{guard.rollbacks} rollback(s) already, train.health.max_rollbacks = {guard.cfg.max_rollbacks}"
    else:
        why = "no checkpoint to roll back to yet"
    guard.events.append(f"step {bad.step}: stopped: {bad.reason}")
    _record_health(guard, logger, bad.step, rank)
    logger.flush()
    raise TrainingUnhealthy(
        f"training stopped at step {bad.step}: {bad.reason} ({why}); "
        f"the newest complete checkpoint is {last_good or 'none'}"
    )


def _record_health(guard: HealthGuard, logger: MetricLogger, step: int, rank: int) -> None:
    """Each event as a warning, an MLflow tag (kiln.health.<n>) and the running counts (rank 0)."""
    if rank == 0:
        for event in guard.events:
            guard.recorded += 1
            log.warning("train.health: %s", event)
            logger.set_tag(f"kiln.health.{guard.recorded}", event)
        logger.log(guard.metrics(), step)
    guard.events.clear()


class _Counted:
    """An iterator that counts what was drawn from it: the data position a checkpoint records."""

    def __init__(self, it: Iterator[torch.Tensor], start: int):
        self.it, self.count = it, start

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        item = next(self.it)
        self.count += 1
        return item
