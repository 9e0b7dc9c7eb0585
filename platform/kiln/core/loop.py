"""The per-worker training loop: a plain function of (config, world, engine, batches, sinks).

It knows nothing about Ray, DeepSpeed's set-up or MLflow: a launcher builds the engine
(`kiln.parallel.engine.build_engine`), the batch source and the sinks, and calls `train_loop`;
Ray Train does so from `kiln.ray.trainer`, a single process or torchrun from
`kiln.launch.local`. The loop trains for `train.max_steps` optimizer steps, validates,
checkpoints and returns the final metrics. Its jobs live beside it: `StepMeter` (timing, MFU),
`CheckpointPolicy` (when to save and evaluate), `HealthGuard` (bad losses) and `Sinks` (where
the output goes).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kiln.clock import startup_mark
from kiln.config import RunConfig, gpt_config, model_name
from kiln.core.affinity import pin_worker
from kiln.core.checkpoint import TAG, CheckpointPolicy, model_card
from kiln.core.collectives import mean_over_ranks
from kiln.core.health import BadLoss, HealthGuard
from kiln.core.host_memory import apply_host_malloc
from kiln.core.leaks import LeakWatch
from kiln.core.meter import StepMeter, memory_in_use, memory_metrics
from kiln.core.optim import StepGate
from kiln.core.prefetch import DevicePrefetcher
from kiln.core.profiling import StepProfiler
from kiln.core.sinks import Fetch, MetricLogger, Sinks
from kiln.core.step import PhaseTimer, StepResult, train_step
from kiln.data.sources import BatchSource
from kiln.errors import KilnError
from kiln.guard import discard
from kiln.model import inputs_and_targets, num_params
from kiln.ui.progress import LogLines, Progress, ProgressSink, console

log = logging.getLogger("kiln.train")


class TrainingUnhealthy(KilnError):
    """The health guard ended the run (policy stop, nothing to roll back to, or divergence)."""


@dataclass(frozen=True)
class WorldInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    local_rank: int = 0  # this worker's index among the workers on its host
    local_world_size: int = 1  # workers on this host


def prepare_process(cfg: RunConfig, world: WorldInfo) -> None:
    """Seed and set up this process's torch before the model is built (its init draws): threads
    and their cores on CPU, TF32 and the caching allocator's settings on GPU; the host's malloc
    on both."""
    torch.manual_seed(cfg.train.seed)
    p = cfg.parallel
    apply_host_malloc(p.host_malloc)
    if world.device.type == "cpu":
        torch.set_num_threads(max(1, int(p.cpus_per_worker)))
        if p.pin_cpu_threads:
            pin_worker(world.local_rank, world.local_world_size, p.cpus_per_worker)
        return
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores
    torch.backends.cudnn.allow_tf32 = True
    if p.cuda_alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        torch.cuda.memory._set_allocator_settings(p.cuda_alloc_conf)
    log.info("cuda allocator settings: %s", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", p.cuda_alloc_conf) or "defaults")


@torch.no_grad()
def evaluate(engine, source: BatchSource, max_batches: int, device: torch.device, pipeline: bool) -> float:
    engine.eval()
    total, count = torch.zeros((), device=device), 0  # summed on the device, read once
    for i, batch in enumerate(source.val_batches()):
        if max_batches and i >= max_batches:
            break
        batch = batch.to(device, non_blocking=True)
        if pipeline:  # every stage takes part; the loss is broadcast from the last
            loss = engine.eval_batch(iter([inputs_and_targets(batch)]), num_micro_batches=1)
        else:
            _, loss = engine(*inputs_and_targets(batch))
        total, count = total + loss.detach().float(), count + 1
    engine.train()
    (mean_total, mean_count) = mean_over_ranks([total.item(), float(count)], device)
    return mean_total / max(mean_count, 1e-9)


def train_loop(cfg: RunConfig, world: WorldInfo, engine, scheduler, source: BatchSource, sinks: Sinks,
               checkpoint_root: str | None = None, startup: dict[str, float] | None = None) -> dict[str, float]:
    """Train `engine` to `train.max_steps`; return the final metrics (with the launcher's
    `startup` marks, kiln.clock, and the first step's).

    Rules that keep ranks in step: every rank runs the same steps, takes the same save and eval
    decisions (from step counts and a clock averaged over ranks), saves between the barriers
    inside `checkpoint.save`, and calls `sinks.report` the same number of times.
    """
    run = _Training(cfg, world, engine, scheduler, source, sinks, checkpoint_root, startup or {})
    try:
        return run.train()
    except Exception:
        sinks.close()  # what the run logged before it failed still reaches MLflow
        raise
    finally:
        run.prefetcher.close()


class _Training:
    """One rank's training run: its parts, built once, and the loop over steps."""

    def __init__(self, cfg: RunConfig, world: WorldInfo, engine, scheduler, source: BatchSource, sinks: Sinks,
                 checkpoint_root: str | None, startup: dict[str, float]):
        t, device = cfg.train, world.device
        self.cfg, self.world, self.engine, self.scheduler, self.source, self.sinks = (
            cfg, world, engine, scheduler, source, sinks)
        self.pipeline = cfg.parallel.pipeline_stages > 1
        self.progress: ProgressSink = sinks.progress or LogLines(cfg.logging.progress_every)  # rank 0's view
        self.policy = CheckpointPolicy(t, checkpoint_root, world.rank, world.world_size, model_card(cfg))
        self.done, consumed = self.policy.resume(engine, cfg.micro_batches_per_step)
        # Start reading now so the pipeline's start-up overlaps the first step; skip what the
        # resumed steps consumed.
        source.prefetch()
        self.prefetcher = DevicePrefetcher(source.train_batches(skip=consumed), device, cfg.data.prefetch_batches)
        self.batches = _Counted(self.prefetcher, consumed)
        self.tokens_per_step = cfg.tokens_per_step(world.world_size // cfg.parallel.pipeline_stages)
        mcfg = gpt_config(cfg)
        self.meter = StepMeter(cfg, mcfg, world.world_size, device, self.tokens_per_step, self.done)
        if world.rank == 0:
            _log_start(cfg, mcfg, world.world_size, self.tokens_per_step)
        self.profiler = StepProfiler(t.profile, world.rank, world.world_size, device)
        self.guard = HealthGuard(t.health, world.rank, device)
        self.gate = getattr(scheduler, "gate", None) or StepGate()  # build_engine gates the optimizer
        self.timer = PhaseTimer(device)
        self.startup = startup
        self.leaks = LeakWatch(self.meter.warmup_end)

    def train(self) -> dict[str, float]:
        t, last, ckpt, step = self.cfg.train, {}, None, self.done
        while step < t.max_steps:
            step += 1
            self.profiler.begin(step)
            self.meter.begin()
            lr = self.scheduler.get_last_lr()[0]
            self.timer.on = read = _reads_metrics(step, self.cfg, self.meter, self.policy)
            try:
                result = train_step(self.engine, self.batches, self.cfg.micro_batches_per_step, self.pipeline,
                                    self.guard, self.gate, self.timer, step)
            except BadLoss as bad:
                step = _after_bad_loss(bad, self.guard, self.engine, self.policy.last_good, self.world.rank,
                                       self.sinks.logger)
                continue
            if self.guard.events:
                _record_health(self.guard, self.sinks.logger, step, self.world.rank)
            if result.skipped is not None:
                step -= 1  # the same step again, on the next micro-batches
                continue
            _hand_in_profile(self.profiler.end(step), self.sinks.logger)
            if not read:  # nothing read back from the device: the step's time on the host clock
                self._end_step(step, result.data_wait_s)
                continue
            metrics, save = self._metrics(step, result, lr)
            last.update(metrics)
            ckpt = self._save_and_report(step, metrics, save)
        self.sinks.close()
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
        loss_train, wait, since_save = mean_over_ranks(
            [result.loss.item(), result.data_wait_s, self.policy.seconds_since_save()], device)
        metrics = meter.metrics(step, step_s, loss_train, lr, self.timer.read(), wait, self.engine, self.world.rank)
        if not math.isfinite(loss_train):
            log.warning("step %d: non-finite training loss %s", step, loss_train)
        save = self.policy.wants_save(step, since_save)
        if self.policy.wants_eval(step, save):
            metrics["loss/val"] = _timed_eval(meter, self.engine, self.source, self.cfg.train.eval_batches, device,
                                              self.pipeline)
        metrics.update(memory_metrics(device))
        # this replica's bytes read so far; a mixture's realised shares, from the order itself
        metrics.update(self.source.data_metrics(self.batches.count))
        metrics.update(self.leaks.sample(step, memory_in_use(device)))
        _publish(self.sinks, self.progress, metrics, step, self.cfg, self.world.rank, meter.mean_step_s)
        self._end_step(step, result.data_wait_s)
        return metrics, save

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


def _reads_metrics(step: int, cfg: RunConfig, meter: StepMeter, policy: CheckpointPolicy) -> bool:
    """Whether this step's metrics are built, which reads the device (loss, phase times) and
    all-reduces: steps logged or shown, evaluated or saved, the first (memory held) and the
    last warm-up step (a CPU's peak is measured there). Every rank answers alike. A time-based
    save (checkpoint_every_minutes) is decided on these steps too."""
    t, lg = cfg.train, cfg.logging
    return bool(step % lg.log_every == 0 or step % lg.progress_every == 0 or step == t.max_steps
                or step in (meter.done + 1, meter.warmup_end)
                or policy.wants_save(step, 0.0) or policy.wants_eval(step, False))


def _log_start(cfg: RunConfig, mcfg, world_size: int, tokens_per_step: int) -> None:
    stages = cfg.parallel.pipeline_stages
    console.info("training %s (%.2fM params) for %d steps, %d tokens/step on %d worker(s)%s",
             model_name(cfg), num_params(mcfg, non_embedding=False) / 1e6, cfg.train.max_steps,
             tokens_per_step, world_size,
             f" ({world_size // stages} data-parallel x {stages} pipeline stages)" if stages > 1 else "")


def _timed_eval(meter: StepMeter, engine, source: BatchSource, max_batches: int, device: torch.device,
                pipeline: bool) -> float:
    start = time.perf_counter()
    loss = evaluate(engine, source, max_batches, device, pipeline)
    meter.evaluated(time.perf_counter() - start)
    return loss


def _publish(sinks: Sinks, progress: ProgressSink, metrics: dict[str, float], step: int, cfg: RunConfig,
             rank: int, mean_step_s: float) -> None:
    """The step's metrics to Prometheus, MLflow (every `log_every` steps, at evaluations and at
    the end) and, on rank 0, the progress display (no ETA until steady steps are timed)."""
    sinks.live.observe(metrics, step)
    is_last = step == cfg.train.max_steps
    if step % cfg.logging.log_every == 0 or is_last or "loss/val" in metrics:
        sinks.logger.log(metrics, step)
    if rank == 0:
        progress.update(Progress(step, cfg.train.max_steps, metrics["loss/train"],
                                 metrics["throughput/tokens_per_s"], metrics["lr"], mean_step_s,
                                 metrics.get("loss/val")))


def _hand_in_profile(window, logger: MetricLogger) -> None:
    """A finished profiler window goes to the run's artifacts (profile/), then off local disk."""
    if window is not None:
        logger.log_artifacts(str(window), "profile")
        discard(window)


def _after_bad_loss(bad: BadLoss, guard: HealthGuard, engine, last_good: str | Fetch | None, rank: int,
                    logger: MetricLogger) -> int:
    """Roll back to `last_good` (a directory, or under Ray a function that downloads one) and
    return its step, or end the run with the reason."""
    capped = guard.rollbacks >= guard.cfg.max_rollbacks
    if guard.cfg.policy == "rollback" and not bad.fatal and last_good is not None and not capped:
        if callable(last_good):
            last_good = last_good()
        _, client = engine.load_checkpoint(last_good, tag=TAG)
        back_to = int(client["step"])
        guard.rollbacks += 1
        guard.events.append(f"step {bad.step}: rolled back to {os.path.basename(last_good)}, skipping the "
                            f"data of steps {back_to + 1}-{bad.step}: {bad.reason}")
        _record_health(guard, logger, bad.step, rank)
        return back_to
    if bad.fatal:
        why = "divergence"
    elif guard.cfg.policy == "stop":
        why = "train.health.policy = stop"
    elif capped and last_good is not None:
        why = f"{guard.rollbacks} rollback(s) already, train.health.max_rollbacks = {guard.cfg.max_rollbacks}"
    else:
        why = "no checkpoint to roll back to yet"
    guard.events.append(f"step {bad.step}: stopped: {bad.reason}")
    _record_health(guard, logger, bad.step, rank)
    logger.flush()
    raise TrainingUnhealthy(f"training stopped at step {bad.step}: {bad.reason} ({why}); "
                            f"the newest complete checkpoint is {last_good or 'none'}")


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
