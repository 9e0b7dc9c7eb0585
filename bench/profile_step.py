"""Where a Kiln training step spends its time: torch.profiler over a few steps of the same
DeepSpeed engine Kiln builds, printed as a top-N operator table.

    python bench/profile_step.py --flavour debug --zero-stage 2               # CPU
    python bench/profile_step.py --flavour gpt2-124m --device cuda --precision bf16
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.config import gpt_config, load_config
from kiln.model import GPT
from kiln.parallel.engine import deepspeed_config
from kiln.train.optim import build_optimizer, build_scheduler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavour", default="debug")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    cfg = load_config(None, [f"model.flavour={args.flavour}", f"model.vocab_size={args.vocab}",
                             f"model.seq_len={args.seq_len}", f"parallel.zero_stage={args.zero_stage}",
                             f"train.micro_batch_size={args.batch}", f"train.precision={args.precision}",
                             f"parallel.use_gpu={args.device == 'cuda'}", "parallel.num_workers=1"])
    device = torch.device(args.device)
    model = GPT(gpt_config(cfg))
    opt = build_optimizer(model, cfg.optim, on_cuda=device.type == "cuda")
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=build_scheduler(opt, cfg.schedule, 100),
                                      config=deepspeed_config(cfg, 1))
    batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=device)

    def step():
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss.item()

    for _ in range(5):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=60))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
