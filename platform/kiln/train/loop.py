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
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kiln.config import RunConfig, gpt_config
from kiln.data.sources import BatchSource
from kiln.errors import KilnError
from kiln.model import num_params
from kiln.train.checkpoint import TAG, CheckpointPolicy
from kiln.train.collectives import mean_over_ranks
from kiln.train.health import BadLoss, HealthGuard
from kiln.train.meter import StepMeter, memory_metrics
from kiln.train.profiling import StepProfiler
from kiln.train.sinks import Fetch, MetricLogger, Sinks
from kiln.ui.progress import LogLines, Progress, ProgressSink

log = logging.getLogger("kiln.train")


class TrainingUnhealthy(KilnError):
    """The health guard ended the run (policy stop, nothing to roll back to, or divergence)."""


@dataclass(frozen=True)
class WorldInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")


def prepare_process(cfg: RunConfig, device: torch.device) -> None:
    """Seed and set up this process's torch before the model is built (its init draws)."""
    torch.manual_seed(cfg.train.seed)
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(cfg.parallel.cpus_per_worker)))
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True


@torch.no_grad()
def evaluate(engine, source: BatchSource, max_batches: int, device: torch.device, pipeline: bool) -> float:
    engine.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(source.val_batches()):
        if max_batches and i >= max_batches:
            break
        batch = batch.to(device, non_blocking=True)
        if pipeline:  # every stage takes part; the loss is broadcast from the last
            loss = engine.eval_batch(iter([(batch[:, :-1], batch[:, 1:])]), num_micro_batches=1)
        else:
            _, loss = engine(batch[:, :-1], batch[:, 1:])
        total, count = total + loss.item(), count + 1
    engine.train()
    (mean_total, mean_count) = mean_over_ranks([total, float(count)], device)
    return mean_total / max(mean_count, 1e-9)


def _train_step(engine, batches: Iterator[torch.Tensor], micro_batches: int, device: torch.device,
                pipeline: bool, guard: HealthGuard, step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """One optimizer step over `micro_batches` micro-batches: (mean loss, seconds spent per phase).

    The phases are data wait, forward, backward (gradient all-reduce included) and optimizer.
    On a GPU each phase ends in a synchronize so its kernels are counted in it; a pipeline runs
    all of them inside DeepSpeed's schedule, so only the data wait is split out there.
    The guard sees each micro-batch's loss before its backward pass (a pipeline's, after the
    step): a bad one is left out and replaced by the next, and under rollback or stop the step
    ends in BadLoss once it is complete, so DeepSpeed's accumulation count stays whole.
    """
    times = {"time/data_wait_s": 0.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter

    def next_batch() -> torch.Tensor:
        wait_start = clock()
        batch = next(batches).to(device, non_blocking=True)
        times["time/data_wait_s"] += clock() - wait_start
        return batch

    if pipeline:  # DeepSpeed runs the whole 1F1B schedule (and the step) in train_batch
        pairs = [(b[:, :-1], b[:, 1:]) for b in (next_batch() for _ in range(micro_batches))]
        loss = guard.inject(engine.train_batch(data_iter=iter(pairs)).detach().float(), step)
        reason = guard.check(loss, step)
        if reason is not None:
            raise BadLoss(step, reason)
        return loss, times
    times.update({"time/forward_s": 0.0, "time/backward_s": 0.0, "time/optimizer_s": 0.0})
    loss_sum = torch.zeros((), device=device)
    done, bad = 0, None
    while done < micro_batches:
        batch = next_batch()
        t0 = clock()
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        loss = guard.inject(loss, step)
        reason = guard.check(loss, step)
        if reason is not None:
            if guard.cfg.policy == "stop":
                raise BadLoss(step, reason)
            if guard.cfg.policy == "skip":
                guard.skip(step, reason)
            bad = bad or reason
            del loss  # no backward: its graph is freed and the next micro-batch takes its place
            continue
        sync()
        t1 = clock()
        engine.backward(loss)
        sync()
        t2 = clock()
        engine.step()  # steps the optimizer at the accumulation boundary only
        sync()
        times["time/forward_s"] += t1 - t0
        times["time/backward_s"] += t2 - t1
        times["time/optimizer_s"] += clock() - t2
        loss_sum += loss.detach()
        done += 1
    if bad is not None and guard.cfg.policy == "rollback":
        raise BadLoss(step, bad)
    return loss_sum / micro_batches, times


def train_loop(cfg: RunConfig, world: WorldInfo, engine, scheduler, source: BatchSource, sinks: Sinks,
               checkpoint_root: str | None = None) -> dict[str, float]:
    """Train `engine` to `train.max_steps`; return the final metrics.

    Rules that keep ranks in step: every rank runs the same steps, takes the same save and eval
    decisions (from step counts and a clock averaged over ranks), saves between the barriers
    inside `checkpoint.save`, and calls `sinks.report` the same number of times.
    """
    t, device = cfg.train, world.device
    pipeline = cfg.parallel.pipeline_stages > 1
    micro_batches = cfg.micro_batches_per_step
    dp_size = world.world_size // cfg.parallel.pipeline_stages
    mcfg = gpt_config(cfg)
    progress: ProgressSink = sinks.progress or LogLines(cfg.logging.progress_every)  # rank 0's view
    policy = CheckpointPolicy(t, checkpoint_root, world.rank, world.world_size)
    done, consumed = policy.resume(engine, micro_batches)
    # Start reading now so the pipeline's start-up overlaps the first step; skip what the
    # resumed steps consumed.
    source.prefetch()
    batches = _Counted(_prefetch_first(source.train_batches(skip=consumed)), consumed)
    tokens_per_step = cfg.tokens_per_step(dp_size)
    meter = StepMeter(cfg, mcfg, world.world_size, device, tokens_per_step, done)
    if world.rank == 0:
        _log_start(cfg, mcfg, world.world_size, tokens_per_step)
    profiler = StepProfiler(t.profile, world.rank, world.world_size, device)
    guard = HealthGuard(t.health, world.rank, device)
    last: dict[str, float] = {}
    ckpt = None
    step = done
    while step < t.max_steps:
        step += 1
        profiler.begin(step)
        meter.begin()
        lr = scheduler.get_last_lr()[0]
        try:
            loss_mean, phases = _train_step(engine, batches, micro_batches, device, pipeline, guard, step)
        except BadLoss as bad:
            step = _after_bad_loss(bad, guard, engine, policy.last_good, world.rank, sinks.logger)
            continue
        if guard.events:
            _record_health(guard, sinks.logger, step, world.rank)
        step_s = meter.step_time(step)
        _hand_in_profile(profiler.end(step), sinks.logger)
        # One all-reduce per step. The time since the last save rides along, so every rank
        # takes the same save decision.
        loss_train, wait, since_save = mean_over_ranks(
            [loss_mean.item(), phases["time/data_wait_s"], policy.seconds_since_save()], device)
        metrics = meter.metrics(step, step_s, loss_train, lr, phases, wait, engine, world.rank)
        if not math.isfinite(loss_train):
            log.warning("step %d: non-finite training loss %s", step, loss_train)
        save = policy.wants_save(step, since_save)
        if policy.wants_eval(step, save):
            metrics["loss/val"] = _timed_eval(meter, engine, source, t.eval_batches, device, pipeline)
        metrics.update(memory_metrics(device))
        _publish(sinks, progress, metrics, step, cfg, world.rank, meter.mean_step_s)
        last.update(metrics)
        meter.end(step, phases["time/data_wait_s"])
        ckpt = None
        if save:
            ckpt, save_s = policy.save(engine, step, {"step": step, "tokens_seen": step * tokens_per_step,
                                                      "batches_consumed": batches.count}, metrics.get("loss/val"))
            if ckpt is not None:
                sinks.live.checkpointed(save_s)
                meter.saved(step, save_s)
        if sinks.report is not None and step != t.max_steps and ("loss/val" in metrics or save):
            sinks.logger.flush()  # first: a scheduler (ASHA) may stop this run once it sees the report
            fetch = sinks.report(metrics | {"step": step}, ckpt)
            if ckpt is not None and fetch is not None:
                policy.last_good = fetch
    sinks.close()
    final = last | meter.summary() | {"step": t.max_steps} | meter.held
    if guard.active:
        final.update(guard.metrics())
    if sinks.report is not None:  # the last report carries the final checkpoint and the summary metrics
        sinks.report(final, ckpt)
    return final


def _log_start(cfg: RunConfig, mcfg, world_size: int, tokens_per_step: int) -> None:
    stages = cfg.parallel.pipeline_stages
    log.info("training %s (%.2fM params) for %d steps, %d tokens/step on %d worker(s)%s",
             cfg.model.flavour, num_params(mcfg, non_embedding=False) / 1e6, cfg.train.max_steps,
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
        shutil.rmtree(window, ignore_errors=True)


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


def _prefetch_first(it: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Fetch the first item on a thread at once; yield it, then the rest as usual.

    Whatever the fetch raises (a Ray Data error, an exhausted shard) is re-raised to the
    consumer, so the run fails with its real cause rather than a missing item.
    """
    box: dict = {}

    def fetch():
        try:
            box["item"] = next(it)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer thread
            box["error"] = e

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()

    def gen():
        thread.join()
        if isinstance(box.get("error"), StopIteration):
            return
        if "error" in box:
            raise box["error"]
        yield box["item"]
        yield from it

    return gen()
