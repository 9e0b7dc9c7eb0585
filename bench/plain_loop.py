"""The baseline for `make bench`: a plain single-process PyTorch loop, no Ray, no DeepSpeed.

Same GPT, same Parquet shards, same optimizer and LR schedule as the Kiln run it is compared
with; one process that uses all the cores (CPU) or the one GPU.

    python -m bench.plain_loop --data data/stdlib-bpe --flavour debug --batch 32 --steps 100
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import psutil
import torch

from kiln.clock import process_start
from kiln.core.host_memory import keep_freed_memory
from kiln.core.meter import datasheet_peak_flops
from kiln.core.optim import OptimConfig, build_optimizer, lr_multiplier
from kiln.core.schedule import ScheduleConfig
from kiln.data.manifest import load_manifest
from kiln.data.sources import ParquetSource
from kiln.model import GPT, config_for, padded_vocab
from kiln.model_size import flops_per_token
from kiln.storage import resolve

STARTED = process_start()
WARMUP = 5


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--flavour", default="debug")
    p.add_argument("--batch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU; 0: all cores")
    p.add_argument(
        "--host-malloc",
        choices=["default", "keep"],
        default="default",
        help="keep: glibc's malloc set as Kiln's parallel.host_malloc=keep sets it (a user's loop "
        "leaves it at its defaults)",
    )
    args = p.parse_args()
    if args.host_malloc == "keep":
        applied, how = keep_freed_memory()
        if not applied:  # the bench labels this run with Kiln's malloc settings: it must have them
            sys.exit(f"--host-malloc keep: {how}")

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or psutil.cpu_count(logical=False) or 1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    manifest = load_manifest(resolve(args.data))
    torch.manual_seed(1337)
    cfg = config_for(args.flavour, vocab_size=padded_vocab(manifest.vocab_size), seq_len=manifest.seq_len)
    model = GPT(cfg).to(device)
    if args.compile:
        model.compile()
    opt = build_optimizer(model, OptimConfig(lr=args.lr))
    sched = ScheduleConfig(warmup_steps=20)
    batches = ParquetSource(manifest, 0, 1, args.batch).train_batches()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    first_step = steady_time = 0.0
    for step in range(args.steps):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_multiplier(step, sched, args.steps)
        batch = next(batches).to(device, non_blocking=True)
        loss = plain_step(model, opt, batch, autocast)
        loss_value = loss.item()  # synchronises, as Kiln's loop does for logging
        if step == 0:
            first_step = time.time()
            first_step_s = time.perf_counter() - start
        if step >= WARMUP:
            steady_time += time.perf_counter() - start
    tok_s = (args.steps - WARMUP) * args.batch * cfg.seq_len / steady_time
    peak = datasheet_peak_flops(device, args.precision)
    out = {
        "tokens_per_s": tok_s,
        "seconds_to_first_step": first_step - STARTED,
        "first_step_s": first_step_s,
        "final_loss": loss_value,
        "mfu": flops_per_token(cfg) * tok_s / peak if peak else None,
    }
    if device.type == "cuda":
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30  # reserved less the cache's slack
    assert math.isfinite(loss_value)
    print(json.dumps(out))


def plain_step(model, opt, batch: torch.Tensor, autocast) -> torch.Tensor:
    """One optimizer step as a user writes it: autocast forward, backward, clip, fused AdamW."""
    with autocast:
        _, loss = model(batch[:, :-1], batch[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


if __name__ == "__main__":
    main()
