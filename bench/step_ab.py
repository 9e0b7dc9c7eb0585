"""Kiln's optimizer step against the plain loop's, alternated in one process: the per-step cost
of Kiln's step path, resolved below this VM's run-to-run noise.

Separate runs of `bench/throughput.py` move by 10-20% from one minute to the next here, more
than the 1-3% a step's overhead amounts to. This script builds, in one process and from one
seed, the plain model and optimizer (`plain_loop.plain_step`: forward, backward, clip, AdamW),
DeepSpeed's bare engine (what `deepspeed.initialize` gives, stepped by hand), Kiln's engine
stepped through Kiln's `train_step` (health guard, step gate, phase timer, clipping, and the
one-process all-reduce skip of `kiln.parallel.engine`), and the same with that all-reduce kept.
It times short blocks of steps of each in turn, rotating which goes first, on the same batches
and threads. A ratio is a block's steps/s over the plain block's of the same round; the table
shows the medians over rounds. One process has one malloc: every row runs with Kiln's
`parallel.host_malloc` (keep), set when Kiln's engine is built, so the malloc's effect is not in
these ratios (`bench/throughput.py --plain-host-malloc` measures it).

    python -m bench.step_ab                       # the debug GPT, micro-batch 16, 2 threads
    python -m bench.step_ab --flavour small --rounds 9
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

from bench.common import machine, publish, results_file
from bench.plain_loop import plain_step
from kiln.config import load_config
from kiln.core.health import HealthGuard
from kiln.core.optim import build_optimizer, build_scheduler
from kiln.core.process import WorldInfo
from kiln.core.step import PhaseTimer, train_step
from kiln.launch.local import free_port
from kiln.model import GPT
from kiln.parallel.engine import build_engine, deepspeed_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavour", default="debug")
    p.add_argument("--vocab", type=int, default=2048, help="the demo corpus's BPE")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cfg = load_config(
        None,
        [
            f"model.flavour={args.flavour}",
            f"model.vocab_size={args.vocab}",
            f"model.seq_len={args.seq_len}",
            "parallel.zero_stage=0",
            "parallel.num_workers=1",
            f"parallel.cpus_per_worker={args.threads}",
            f"train.micro_batch_size={args.batch}",
            "train.max_steps=100000",
            "parallel.pin_cpu_threads=false",
        ],
    )
    steps = {
        "plain": plain_stepper(cfg),
        "DeepSpeed engine, bare": bare_stepper(cfg),
        "Kiln train_step": kiln_stepper(cfg),
        "Kiln train_step, all-reduce kept": kiln_stepper(cfg, allreduce=True),
    }
    torch.set_num_threads(args.threads)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1)) for _ in range(8)]
    feed = itertools.cycle(batches)
    for step in steps.values():  # warm-up: allocator, optimizer state
        for _ in range(5):
            step(next(feed))
    names = list(steps)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    ms: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        rate = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name](next(feed))
            seconds = (time.perf_counter() - start) / args.steps
            rate[name], ms[name] = 1 / seconds, ms[name] + [seconds * 1e3]
        for name in names:
            ratios[name].append(rate[name] / rate["plain"])
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — step A/B in one process: {args.flavour}, micro-batch "
        f"{args.batch}, seq {args.seq_len}, {args.threads} threads, {args.rounds} rounds x {args.steps} steps",
        "",
        f"Command: `python -m bench.step_ab {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "| step | ms/step (median) | ratio vs plain (median) | range |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {statistics.median(ms[name]):.1f} | {statistics.median(ratios[name]):.3f} "
        f"| {min(ratios[name]):.3f}-{max(ratios[name]):.3f} |"
        for name in names
    ]
    publish("\n".join(lines) + "\n\n", args.results)  # a blank line after the section, on both


def plain_stepper(cfg):
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model.shape())
    opt = build_optimizer(model, cfg.optim)
    autocast = torch.autocast("cpu", enabled=False)
    return lambda batch: plain_step(model, opt, batch, autocast).item()


def bare_stepper(cfg):
    import deepspeed

    from kiln.parallel.ops import init_distributed

    init_distributed(on_cuda=False)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model.shape())
    opt = build_optimizer(model, cfg.optim)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=opt,
        config=deepspeed_config(cfg, 1),
        lr_scheduler=build_scheduler(opt, cfg.schedule, cfg.train.max_steps),
    )

    def step(batch):
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step


def kiln_stepper(cfg, allreduce: bool = False):
    """Kiln's step; `allreduce` puts back the gradient all-reduce that a one-process run skips."""
    world = WorldInfo()
    engine, scheduler = build_engine(cfg, cfg.model.shape(), world)
    if allreduce:
        engine.enable_backward_allreduce = True
    guard, gate, timer = HealthGuard(cfg.train.health, 0, world.device), scheduler.gate, PhaseTimer(world.device)
    timer.on = False  # as on the steps whose metrics nobody reads
    count = itertools.count(1)

    def step(batch):
        return train_step(engine, iter([batch]), 1, guard, gate, timer, next(count)).loss.item()

    return step


if __name__ == "__main__":
    main()
