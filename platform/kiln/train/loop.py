"""The per-worker training loop: a plain function of (config, world, batches, logger).

It knows nothing about Ray: Ray Train calls it from `kiln.ray.trainer`, torchrun or a
single process calls it from `kiln.launch.local`. It builds the GPT, wraps it in a DeepSpeed
engine, trains for `train.max_steps` optimizer steps, validates, checkpoints, and returns the
final metrics. Only rank 0 logs; every rank calls `report` the same number of times (Ray Train
requires that).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kiln.config import RunConfig
from kiln.data.sources import BatchSource
from kiln.errors import KilnError
from kiln.model import GPTConfig, config_for, flops_per_token, num_params
from kiln.parallel.engine import engine_memory, initialize
from kiln.parallel.pipeline import check_coords
from kiln.tracking.mlflow_run import MetricLogger
from kiln.train import checkpoint
from kiln.train.health import BadLoss, HealthGuard
from kiln.train.live_metrics import LiveMetrics, NullLive
from kiln.train.metrics import (
    datasheet_peak_flops,
    mean_over_ranks,
    measured_peak_flops,
    memory_metrics,
)
from kiln.train.optim import build_scheduler
from kiln.train.profiling import StepProfiler
from kiln.ui.progress import LogLines, Progress, ProgressSink

log = logging.getLogger("kiln.train")

# Ray Train's report: metrics and a local checkpoint directory in; back, for a checkpoint the
# directory is gone from, a function that fetches it again (what a rollback reloads).
Fetch = Callable[[], str]
Report = Callable[[dict, "str | None"], "Fetch | None"]
WARMUP_STEPS_EXCLUDED = 5  # steady-state throughput ignores the first steps (allocator, JIT, caches)


class TrainingUnhealthy(KilnError):
    """The health guard ended the run (policy stop, nothing to roll back to, or divergence)."""


@dataclass(frozen=True)
class WorldInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")


def gpt_config(cfg: RunConfig) -> GPTConfig:
    """The model's shape; vocab_size and seq_len must be resolved (non-zero) by now."""
    m = cfg.model
    assert m.vocab_size > 0 and m.seq_len > 0, "resolve model.vocab_size/seq_len from the data first"
    depth = {"n_layer": m.n_layer} if m.n_layer else {}
    return config_for(
        m.flavour, vocab_size=m.vocab_size, seq_len=m.seq_len, dropout=m.dropout,
        activation_checkpointing=m.activation_checkpointing, **depth,
    )


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


def train_loop(
    cfg: RunConfig,
    world: WorldInfo,
    source: BatchSource,
    logger: MetricLogger,
    report: Report | None = None,
    checkpoint_root: str | None = None,
    live: LiveMetrics | None = None,
    progress: ProgressSink | None = None,
) -> dict[str, float]:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    t, device = cfg.train, world.device
    live = live or NullLive()
    progress = progress or LogLines(cfg.logging.progress_every)  # what rank 0 shows of each step
    torch.manual_seed(t.seed)
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(cfg.parallel.cpus_per_worker)))
    else:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True

    pipeline = cfg.parallel.pipeline_stages > 1
    dp_size = world.world_size // cfg.parallel.pipeline_stages
    micro_batches = cfg.micro_batches_per_step
    mcfg = gpt_config(cfg)
    engine, scheduler = initialize(
        cfg, mcfg, dp_size, on_cuda=device.type == "cuda",
        scheduler_fn=lambda opt: build_scheduler(opt, cfg.schedule, t.max_steps),
    )
    if pipeline:
        check_coords(engine, world.rank, world.world_size, cfg.parallel.pipeline_stages)
    done = consumed = 0
    if t.resume_from:
        resume_dir, _ = checkpoint.resolve_resume(t.resume_from, world.world_size)
        _, client = engine.load_checkpoint(resume_dir, tag=checkpoint.TAG)
        done = int(client["step"])
        # The data position: micro-batches drawn so far, the ones the health guard left out
        # included (older checkpoints lack it: steps x micro-batches).
        consumed = int(client.get("batches_consumed", done * micro_batches))
        checkpoint.restore_rng(resume_dir, world.rank)
        if world.rank == 0:
            log.info("resumed from %s at step %d (micro-batch %d of the data)", resume_dir, done, consumed)
    # Start reading now so the pipeline's start-up overlaps the first step; skip what the
    # resumed steps consumed.
    source.prefetch()
    batches = _Counted(_prefetch_first(source.train_batches(skip=consumed)), consumed)

    tokens_per_step = t.micro_batch_size * micro_batches * dp_size * mcfg.seq_len
    flops_tok = flops_per_token(mcfg)
    peak = datasheet_peak_flops(device, t.precision, t.peak_flops)
    steady_time = steady_wait = 0.0
    steady_save_time = 0.0  # checkpoint saves within the steady-state steps, the last one excluded
    steady_steps = 0
    last: dict[str, float] = {}
    first_step_unix = 0.0
    held: dict[str, float] = {}
    skipped_before = 0
    last_save = time.monotonic()
    if world.rank == 0:
        log.info("training %s (%.2fM params) for %d steps, %d tokens/step on %d worker(s)%s",
                 cfg.model.flavour, num_params(mcfg, non_embedding=False) / 1e6, t.max_steps,
                 tokens_per_step, world.world_size,
                 f" ({dp_size} data-parallel x {cfg.parallel.pipeline_stages} pipeline stages)" if pipeline else "")

    profiler = StepProfiler(t.profile, world.rank, world.world_size, device)
    guard = HealthGuard(t.health, world.rank, device)
    last_good = resume_dir if t.resume_from else None  # what a rollback reloads
    step = done
    while step < t.max_steps:
        step += 1
        profiler.begin(step)
        start = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        try:
            loss_mean, phase_times = _train_step(engine, batches, micro_batches, device, pipeline, guard, step)
        except BadLoss as bad:
            step = _after_bad_loss(bad, guard, engine, last_good, world.rank, logger)
            continue
        if guard.events:
            _record_health(guard, logger, step, world.rank)
        data_wait = phase_times["time/data_wait_s"]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time = time.perf_counter() - start
        window = profiler.end(step)
        if window is not None:
            logger.log_artifacts(str(window), "profile")
            shutil.rmtree(window, ignore_errors=True)
        if step == done + 1:
            first_step_unix = time.time()
            held = engine_memory(engine)  # optimizer state exists after the first step

        # The time since the last save rides along, so every rank takes the same save decision.
        loss_train, wait, since_save = mean_over_ranks(
            [loss_mean.item(), data_wait, time.monotonic() - last_save], device)
        tok_s = tokens_per_step / step_time
        grad_norm = engine.get_global_grad_norm()
        metrics = {
            "loss/train": loss_train,
            "lr": lr,
            "throughput/tokens_per_s": tok_s,
            "throughput/tokens_per_s_per_device": tok_s / world.world_size,
            "time/step_s": step_time,
            **phase_times,
            "time/data_wait_s": wait,
            "tokens/seen": float(step * tokens_per_step),
        }
        if peak is None and step == done + WARMUP_STEPS_EXCLUDED:
            peak = measured_peak_flops(device, t.precision)
        if peak is not None:
            metrics["mfu"] = flops_tok * tok_s / (peak * world.world_size)
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        if t.precision == "fp16":  # dynamic loss scaling skips the steps whose gradients overflowed
            skipped = int(getattr(engine, "skipped_steps", 0))
            metrics["train/skipped_steps_total"] = float(skipped)
            metrics["train/loss_scale"] = float(getattr(engine.optimizer, "cur_scale", 0.0) or 0.0)
            if skipped > skipped_before and world.rank == 0:
                log.warning("step %d: fp16 gradient overflow, step skipped and loss scale lowered "
                            "(%d skipped so far)", step, skipped)
            skipped_before = skipped
        if step == done + 1:
            metrics.update(held)
        if not math.isfinite(loss_train):
            log.warning("step %d: non-finite training loss %s", step, loss_train)

        is_last = step == t.max_steps
        save = ((t.checkpoint_every and step % t.checkpoint_every == 0) or is_last
                or (t.checkpoint_every_minutes and since_save >= 60 * t.checkpoint_every_minutes))
        eval_time = 0.0
        scored_save = save and t.keep_checkpoints_by == "loss/val"  # each checkpoint gets its score
        if (t.eval_every and step % t.eval_every == 0) or is_last or scored_save:
            eval_start = time.perf_counter()
            metrics["loss/val"] = evaluate(engine, source, t.eval_batches, device, pipeline)
            eval_time = time.perf_counter() - eval_start
        metrics.update(memory_metrics(device))
        live.observe(metrics, step)
        if step % cfg.logging.log_every == 0 or is_last or "loss/val" in metrics:
            logger.log(metrics, step)
        if world.rank == 0:
            # No ETA until steady-state steps are timed: the first step carries the start-up.
            per_step = steady_time / steady_steps if steady_steps else 0.0
            progress.update(Progress(step, t.max_steps, metrics["loss/train"],
                                     metrics["throughput/tokens_per_s"], metrics["lr"], per_step,
                                     metrics.get("loss/val")))
        last.update(metrics)
        # Steady-state throughput counts every second of the iteration (metric reduction and
        # logging included) except validation and checkpointing, and skips the first steps.
        if step > done + WARMUP_STEPS_EXCLUDED or t.max_steps - done <= WARMUP_STEPS_EXCLUDED:
            steady_time += time.perf_counter() - start - eval_time
            steady_wait += data_wait
            steady_steps += 1

        ckpt = None
        if save and checkpoint_root is not None:
            save_start = time.perf_counter()
            ckpt = checkpoint.save(engine, checkpoint_root, step, world.rank, world.world_size,
                                   client_state={"step": step, "tokens_seen": step * tokens_per_step,
                                                 "batches_consumed": batches.count},
                                   score=metrics.get("loss/val"))
            save_time = time.perf_counter() - save_start
            live.checkpointed(save_time)
            if not is_last and step > done + WARMUP_STEPS_EXCLUDED:
                steady_save_time += save_time
            if world.rank == 0:  # after save's final barrier: every rank is done with the old ones
                checkpoint.prune(checkpoint_root, t.keep_checkpoints, t.keep_checkpoints_by)
            last_save = time.monotonic()
            last_good = ckpt
        if report is not None and not is_last and ("loss/val" in metrics or save):
            # Flush first: a scheduler (ASHA) may stop this run as soon as it sees the report.
            logger.flush()
            fetch = report(metrics | {"step": step}, ckpt)
            if ckpt is not None and fetch is not None:
                last_good = fetch

    logger.close()
    live.close()
    progress.close()
    final = dict(last)
    final["throughput/tokens_per_s"] = tokens_per_step * steady_steps / max(steady_time, 1e-9)
    # What checkpointing costs: the same steps with the time their saves took counted in.
    final["throughput/tokens_per_s_with_checkpoints"] = (
        tokens_per_step * steady_steps / max(steady_time + steady_save_time, 1e-9))
    if peak is not None:
        final["mfu"] = flops_tok * final["throughput/tokens_per_s"] / (peak * world.world_size)
    final["time/data_wait_share"] = steady_wait / max(steady_time, 1e-9)
    final["time/first_step_unix"] = first_step_unix
    final["step"] = t.max_steps
    final.update(held)
    if guard.active:
        final.update(guard.metrics())
    if report is not None:  # the last report carries the final checkpoint and the summary metrics
        report(final, ckpt)
    return final


def _after_bad_loss(bad: BadLoss, guard: HealthGuard, engine, last_good: str | Fetch | None, rank: int,
                    logger: MetricLogger) -> int:
    """Roll back to `last_good` (a directory, or under Ray a function that downloads one) and
    return its step, or end the run with the reason."""
    capped = guard.rollbacks >= guard.cfg.max_rollbacks
    if guard.cfg.policy == "rollback" and not bad.fatal and last_good is not None and not capped:
        if callable(last_good):
            last_good = last_good()
        _, client = engine.load_checkpoint(last_good, tag=checkpoint.TAG)
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
