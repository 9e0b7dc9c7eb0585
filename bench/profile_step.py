"""Where a Kiln training step spends its time: torch.profiler over a few steps of the engine
Kiln builds (`kiln.parallel.engine.initialize`: Kiln's clipping, the one-process all-reduce
skip), printed as a top-N operator table.

    python -m bench.profile_step --flavour debug --zero-stage 2               # CPU
    python -m bench.profile_step --flavour gpt2-124m --device cuda --precision bf16
    python -m bench.profile_step --flavour gpt2-124m --device cuda --precision bf16 --plain   # the plain loop
    python -m bench.profile_step --flavour gpt2-124m --device cuda --precision bf16 --engine fsdp2 --zero-stage 3

Prints, per step, the wall time and the device's busy time (the sum of its kernels): where the
wall time exceeds the busy time, the GPU waits on the host.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.config import load_config
from kiln.core.optim import build_optimizer, build_scheduler
from kiln.model import GPT
from kiln.parallel.engine import initialize, initialize_fsdp2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavour", default="debug")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--engine", default="deepspeed", choices=["deepspeed", "fsdp2"], help="parallel.engine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument(
        "--mixed-precision",
        default="weights",
        choices=["weights", "autocast"],
        help="DeepSpeed's bf16 layout (FSDP2 takes its own: auto)",
    )
    p.add_argument("--plain", action="store_true", help="the plain loop's step instead (autocast, fused AdamW)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    from kiln.parallel.ops import init_distributed

    init_distributed(on_cuda=args.device == "cuda")
    mixed = "auto" if args.engine == "fsdp2" else args.mixed_precision
    cfg = load_config(
        None,
        [
            f"model.flavour={args.flavour}",
            f"model.vocab_size={args.vocab}",
            f"model.seq_len={args.seq_len}",
            f"parallel.zero_stage={args.zero_stage}",
            f"train.micro_batch_size={args.batch}",
            f"train.precision={args.precision}",
            f"parallel.use_gpu={args.device == 'cuda'}",
            "parallel.num_workers=1",
            f"train.mixed_precision={mixed}",
            f"train.compile={args.compile}",
            f"parallel.engine={args.engine}",
        ],
    )
    device = torch.device(args.device)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=device)
    if args.plain:
        from bench.plain_loop import plain_step

        model = GPT(cfg.model.shape()).to(device)
        if args.compile:
            model.compile()
        opt = build_optimizer(model, cfg.optim)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

        def step():
            return plain_step(model, opt, batch, autocast)
    elif args.engine == "fsdp2":  # through the Engine seam, as the loop steps it
        engine, _ = initialize_fsdp2(
            cfg, cfg.model.shape(), device, lambda opt: build_scheduler(opt, cfg.schedule, 100)
        )

        def step():
            loss = engine.forward(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss
    else:
        engine, _ = initialize(cfg, cfg.model.shape(), 1, device, lambda opt: build_scheduler(opt, cfg.schedule, 100))

        def step():
            _, loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss

    for _ in range(5):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        step()
    sync()
    wall_ms = (time.perf_counter() - start) / 10 * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
        sync()
    events = prof.key_averages()
    # Kernels are events of their own; an op's self device time repeats its kernels', so count kernels only.
    busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 5e3
    host = events.self_cpu_time_total / 5e3
    print(
        f"RESULT {'plain' if args.plain else f'{args.engine} zero-{args.zero_stage} {mixed}'} {args.flavour} "
        f"mb{args.batch}: wall {wall_ms:.1f} ms/step, device busy {busy:.1f} ms/step, host ops {host:.1f} ms/step "
        "(the last two under the profiler)"
    )
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
