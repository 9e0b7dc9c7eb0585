"""Where each engine's step makes the host wait for the device: the census of a step's host reads
and device synchronizations, with the code that makes them.

On a GPU the host keeps ahead of the device only while nothing makes it wait: a host read of a
device value (`.item()`, `bool()`, `float()`) or a synchronize drains the queue, and the GPU then
idles while the host works through whatever Python comes next. This bench steps each engine
through Kiln's `train_step` (the health guard and the step gate included, as in a run's steps
whose metrics nobody reads) and counts, per step:
- host reads: `aten._local_scalar_dense` at torch's dispatcher, and `tolist` (of a device
  tensor; on CPU, of any);
- synchronizations: DeepSpeed's `get_accelerator().synchronize()`, `torch.cuda.synchronize()`,
  and CUDA streams' and events' `synchronize`;
- on CUDA, what torch's sync debug mode reports too (device-to-host copies, `tolist`).
Each count names the first frame outside torch, so a wait is DeepSpeed's, torch's or Kiln's.
The counts are the code's, not the machine's: a CPU finds every wait that does not depend on the
device; DeepSpeed's CUDA-only ones (`overlap_comm`'s synchronizes) show on a GPU only.

    python -m bench.host_syncs                      # CPU: DeepSpeed ZeRO 0-3, FSDP2 2-3
    python -m bench.host_syncs --device cuda        # a lent GPU, bf16 autocast
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import shlex
import sys
import time
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import machine, publish, results_file
from kiln.config import load_config
from kiln.core.health import HealthGuard
from kiln.core.process import WorldInfo
from kiln.core.step import PhaseTimer, train_step
from kiln.launch.local import free_port
from kiln.parallel.engine import build_engine

# DeepSpeed's ZeRO-3 patches torch for the whole process: it comes after the others.
DEFAULT_RUNS = [
    "DeepSpeed ZeRO-0|parallel.zero_stage=0",
    "DeepSpeed ZeRO-1|parallel.zero_stage=1",
    "DeepSpeed ZeRO-2|parallel.zero_stage=2",
    # DeepSpeed's default, which Kiln's config turned off on 2026-12-02.
    "DeepSpeed ZeRO-0, its throughput timer on|parallel.zero_stage=0 parallel.deepspeed.timers.throughput.enabled=true",
    "FSDP2 ZeRO-2|parallel.engine=fsdp2 parallel.zero_stage=2",
    "FSDP2 ZeRO-3|parallel.engine=fsdp2 parallel.zero_stage=3",
    "DeepSpeed ZeRO-3|parallel.zero_stage=3",
]
WARMUP = 4  # steps before counting: DeepSpeed's own timers and lazy state start within them


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=4, help="steps counted per row")
    p.add_argument("--run", action="append", help="'label|override override ...' (repeatable); default: seven rows")
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rows = {}
    for spec in args.run or DEFAULT_RUNS:
        label, _, overrides = spec.partition("|")
        rows[label] = census(overrides.split(), args.device, args.steps)
        print(f"{label}: {sum(rows[label].values()) / args.steps:g} waits a step", flush=True)
    publish(table(rows, args), args.results)


def census(overrides: list[str], device: str, steps: int) -> collections.Counter:
    """{'kind site': count} over `steps` steps of the engine `overrides` make (after warm-up)."""
    cuda = device == "cuda"
    more = ["parallel.use_gpu=true", "train.precision=bf16", "train.mixed_precision=autocast"] if cuda else []
    cfg = load_config(
        None,
        [
            "model.flavour=debug",
            "model.vocab_size=256",
            "model.seq_len=32",
            "parallel.num_workers=1",
            "train.micro_batch_size=2",
            "train.grad_clip=1.0",
            "parallel.pin_cpu_threads=false",
            *more,
            *overrides,
        ],
    )
    world = WorldInfo(device=torch.device("cuda", 0) if cuda else torch.device("cpu"))
    engine, scheduler = build_engine(cfg, cfg.model.shape(), world)
    guard, timer = HealthGuard(cfg.train.health, 0, world.device), PhaseTimer(world.device)
    timer.on = False  # as on the steps whose metrics nobody reads
    rows = [torch.randint(0, 256, (2, 33), device=world.device) for _ in range(4)]
    batches, counts = itertools.cycle(rows), collections.Counter()
    for step in range(1, WARMUP + steps + 1):
        with Waits(counts, cuda) if step > WARMUP else contextlib.nullcontext():
            train_step(engine, batches, cfg.micro_batches_per_step, guard, scheduler.gate, timer, step)
    return counts


def _site() -> str:
    """The innermost caller outside torch and this file: whose wait it is."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if "site-packages/torch/" in name or name == __file__:
            continue
        return f"{name.split('site-packages/')[-1].split('platform/')[-1]}:{frame.lineno} ({frame.name})"
    return "?"


class Waits(TorchDispatchMode):
    """Counts the host's waits for the device while active, by kind and site."""

    def __init__(self, counts: collections.Counter, cuda: bool):
        super().__init__()
        self.counts, self.cuda, self._undo = counts, cuda, contextlib.ExitStack()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts[f"host read, {_site()}"] += 1
        return func(*args, **(kwargs or {}))

    def _spy(self, owner, name: str, kind: str) -> None:
        real = getattr(owner, name)

        def spy(*a, **k):
            self.counts[f"{kind}, {_site()}"] += 1
            return real(*a, **k)

        setattr(owner, name, spy)
        self._undo.callback(setattr, owner, name, real)

    def __enter__(self):
        from deepspeed.accelerator import get_accelerator

        self._spy(get_accelerator(), "synchronize", "DeepSpeed accelerator synchronize")
        real_tolist = torch.Tensor.tolist  # not a dispatched op; a pinned host copy's read waits for nothing

        def tolist(t):
            if t.is_cuda or not self.cuda:
                self.counts[f"host read (tolist), {_site()}"] += 1
            return real_tolist(t)

        torch.Tensor.tolist = tolist
        self._undo.callback(setattr, torch.Tensor, "tolist", real_tolist)
        if self.cuda:
            self._spy(torch.cuda, "synchronize", "torch.cuda.synchronize")
            self._spy(torch.cuda.Stream, "synchronize", "stream synchronize")
            self._spy(torch.cuda.Event, "synchronize", "event synchronize")
            torch.cuda.set_sync_debug_mode("warn")
            self._undo.callback(torch.cuda.set_sync_debug_mode, "default")
            caught = self._undo.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            self._undo.callback(self._count_debug_warnings, caught)
        return super().__enter__()

    def _count_debug_warnings(self, caught) -> None:
        for w in caught:
            if "synchronizing" in str(w.message):
                self.counts[f"sync debug mode, {os.path.basename(w.filename)}:{w.lineno}"] += 1

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._undo.close()


def table(rows: dict[str, collections.Counter], args) -> str:
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — the host's waits for the device in a step: {args.device}, "
        f"{args.steps} steps after {WARMUP}",
        "",
        f"Command: `python -m bench.host_syncs {shlex.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "| row | waits a step | what and where (count a step) |",
        "|---|---|---|",
    ]
    for name, counts in rows.items():
        sites = "; ".join(f"{k}: {v / args.steps:g}" for k, v in counts.most_common()) or "none"
        lines.append(f"| {name} | {sum(counts.values()) / args.steps:g} | {sites} |")
    return "\n".join(lines) + "\n\n"


if __name__ == "__main__":
    main()
