"""The optimizer's step alone on CPU, torch's foreach against its fused implementation, over
Kiln's parameter groups of a model (`kiln.core.optim.build_optimizer` takes fused on both
devices): what each step of a CPU run spends stepping the weights. Appends a table to
bench/results/throughput.md.

    python -m bench.optimizer_step                       # debug, 12 blocks of it, gpt2-124m
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from bench.common import machine, publish, results_file
from kiln.core.optim import OPTIMIZERS, OptimConfig, param_groups
from kiln.model import GPT, config_for

MODELS = {"debug": ("debug", 0), "debug, 12 blocks": ("debug", 12), "gpt2-124m": ("gpt2-124m", 0)}


def step_ms(model: torch.nn.Module, name: str, impl: str, rounds: int) -> float:
    """Median ms of one `impl` step of optimizer `name` over `model`'s parameter groups."""
    cfg = OptimConfig(name=name)
    opt = OPTIMIZERS[name].build(param_groups(model, cfg.weight_decay, cfg.no_decay), cfg, {impl: True})
    for _ in range(3):  # the state is made at the first step
        opt.step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", default="adamw,sgd")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — the optimizer's step on CPU, foreach against fused, {args.threads} threads",
        "",
        f"Command: `python -m bench.optimizer_step {shlex.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "| model | params | optimizer | foreach ms | fused ms | foreach / fused |",
        "|---|---|---|---|---|---|",
    ]
    for label, (flavour, depth) in MODELS.items():
        model = GPT(config_for(flavour, vocab_size=2048, **({"n_layer": depth} if depth else {})))
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        n = sum(param.numel() for param in model.parameters())
        for name in args.optimizers.split(","):
            foreach, fused = (step_ms(model, name, impl, args.rounds) for impl in ("foreach", "fused"))
            lines.append(f"| {label} | {n / 1e6:.1f}M | {name} | {foreach:.2f} | {fused:.2f} | {foreach / fused:.2f} |")
    publish("\n".join(lines) + "\n\n", args.results)


if __name__ == "__main__":
    main()
