"""The host's cost of each engine's step, with the device's work taken out: what bounds a GPU
step that the host cannot keep ahead of.

On a lent H200, gpt2-124m at micro-batch 16 keeps the device busy 31 ms a step, and the plain
loop's host work is nearly as long (bench/results/gpu.md, 2026-11-29): every millisecond an
engine adds on the host costs throughput there. That host cost is Python and dispatch per
module, per parameter and per collective, and does not depend on the device. This bench
measures it on any machine: a model of gpt2-124m's depth and parameter count per block (12 blocks of
12 tensors each), at a width and batch so small that its arithmetic takes microseconds, so a
phase's wall time is its host time. Each engine is built through Kiln's own `build_engine`
(world size 1) and stepped through the `Engine` seam, in a process of its own, after a plain
loop (`plain_loop.plain_step`'s parts) measured in that process before the engine was built:
DeepSpeed's ZeRO-3 patches torch for the whole process (a plain model's forward beside it took
1.6x as long), and that cost belongs to the engine's row. The table shows per-phase medians over
blocks of steps, and each row's total against its own process's plain loop. Appends the table
to bench/results/throughput.md.

    python -m bench.host_overhead                                  # DeepSpeed ZeRO 0-3, FSDP2 2-3
    python -m bench.host_overhead --run 'FSDP2 ZeRO-3, a unit a block|parallel.engine=fsdp2 parallel.zero_stage=3 parallel.fsdp2_unit_params=0'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

from bench.common import machine, publish, results_file
from kiln.config import load_config
from kiln.core.optim import build_optimizer
from kiln.core.process import WorldInfo, apply_host_malloc
from kiln.launch.local import free_port
from kiln.model import GPT
from kiln.parallel.engine import build_engine

PHASES = ("forward", "backward", "step")
DEFAULT_RUNS = [
    "DeepSpeed ZeRO-0|parallel.zero_stage=0",
    "DeepSpeed ZeRO-1|parallel.zero_stage=1",
    "DeepSpeed ZeRO-2|parallel.zero_stage=2",
    "DeepSpeed ZeRO-3|parallel.zero_stage=3",
    "FSDP2 ZeRO-2|parallel.engine=fsdp2 parallel.zero_stage=2",
    "FSDP2 ZeRO-3|parallel.engine=fsdp2 parallel.zero_stage=3",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavour", default="debug", help="the width (debug: d_model 128)")
    p.add_argument("--depth", type=int, default=12, help="blocks (gpt2-124m's 12)")
    p.add_argument("--seq-len", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--run", action="append", help="'label|override override ...' (repeatable); default: six rows")
    p.add_argument("--results", default=results_file("throughput"))
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure one row, print its medians
    args = p.parse_args()
    if args.row is None:
        rows = {}
        for spec in args.run or DEFAULT_RUNS:
            cmd = [sys.executable, "-m", "bench.host_overhead", *sys.argv[1:], "--row", spec]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            failed = proc.returncode != 0  # the row says why; the others still measure
            rows[spec.partition("|")[0]] = (
                (proc.stderr.strip().splitlines() or ["?"])[-1]
                if failed
                else json.loads(proc.stdout.strip().splitlines()[-1])
            )
            print(f"{spec}: {'failed' if failed else 'done'}", flush=True)
        publish(table(rows, args), args.results)
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    base = [
        f"model.flavour={args.flavour}",
        f"model.n_layer={args.depth}",
        "model.vocab_size=2048",
        f"model.seq_len={args.seq_len}",
        "parallel.num_workers=1",
        "parallel.cpus_per_worker=1",
        f"train.micro_batch_size={args.batch}",
        "train.max_steps=100000",
        "parallel.pin_cpu_threads=false",
    ]
    overrides = args.row.partition("|")[2].split()
    batches = itertools.cycle([torch.randint(0, 2048, (args.batch, args.seq_len + 1)) for _ in range(4)])
    torch.set_num_threads(1)  # tiny ops: threads would only add their hand-off to the host time
    plain = load_config(None, base)
    apply_host_malloc(plain.parallel.host_malloc)  # as the engine's set-up does, for both
    # The plain loop first, before any engine is built: what an engine does to the process
    # (DeepSpeed's ZeRO-3 patches torch) lands in the engine's row, not in its baseline.
    medians = {"plain": timed(plain_phases(plain), batches, args.rounds, args.steps)}
    engine = engine_phases(load_config(None, base + overrides))
    torch.set_num_threads(1)  # (the engine's set-up pins the threads to the config's)
    medians["row"] = timed(engine, batches, args.rounds, args.steps)
    print(json.dumps(medians))  # read by the parent process


def timed(step, batches, rounds: int, steps: int) -> dict[str, float]:
    """{phase: median ms a step over `rounds` blocks of `steps` steps}, after a warm-up
    (allocator, optimizer state, lazy inits)."""
    for _ in range(5):
        step(next(batches))
    ms: dict[str, list[float]] = {ph: [] for ph in PHASES}
    for _ in range(rounds):
        total = dict.fromkeys(PHASES, 0.0)
        for _ in range(steps):
            for ph, s in step(next(batches)).items():
                total[ph] += s
        for ph in PHASES:
            ms[ph].append(total[ph] / steps * 1e3)
    return {ph: statistics.median(v) for ph, v in ms.items()}


def plain_phases(cfg):
    """The plain loop's step (`plain_loop.plain_step`), timed per phase."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model.shape())
    opt = build_optimizer(model, cfg.optim)

    def step(batch: torch.Tensor) -> dict[str, float]:
        t0 = time.perf_counter()
        _, loss = model(batch[:, :-1], batch[:, 1:])
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": time.perf_counter() - t2}

    return step


def engine_phases(cfg):
    """Kiln's engine for `cfg` (`build_engine`), stepped through the Engine seam, timed per phase."""
    engine, _ = build_engine(cfg, cfg.model.shape(), WorldInfo())

    def step(batch: torch.Tensor) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = engine.forward(batch[:, :-1], batch[:, 1:])
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        loss.item()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": time.perf_counter() - t2}

    return step


def table(rows: dict[str, dict[str, dict[str, float]] | str], args) -> str:
    """The rows' medians, each against the plain loop of its own process."""
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — host cost per step: {args.depth} blocks of the {args.flavour} "
        f"width, micro-batch {args.batch}, seq {args.seq_len}, 1 thread, {args.rounds} rounds x {args.steps} steps",
        "",
        f"Command: `python -m bench.host_overhead {shlex.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "Each row ran in a process of its own, after a plain loop measured there before the engine was "
        "built; its last columns compare it with that plain loop (whose medians are in parentheses).",
        "",
        "| row | forward ms | backward ms | step ms | total ms | over the plain loop, ms | x plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in rows.items():
        if isinstance(m, str):  # the row's run failed: its last line of stderr
            lines.append(f"| {name} | failed: {m[:200]} | | | | | |")
            continue
        row, plain = m["row"], m["plain"]
        total, base = sum(row.values()), sum(plain.values())
        cells = [f"{row[ph]:.2f} ({plain[ph]:.2f})" for ph in PHASES]
        lines.append(
            f"| {name} | {' | '.join(cells)} | {total:.2f} ({base:.2f}) | {total - base:+.2f} | {total / base:.2f} |"
        )
    return "\n".join(lines) + "\n\n"


if __name__ == "__main__":
    main()
