"""Optimizer and learning-rate schedule.

The schedule is a pure function of the optimizer step, so a resumed run gets exactly the LR it
would have had. Weight decay applies to matmul weights only: decaying norms, biases and
embeddings hurts (they are not over-parameterised in the way matmuls are).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.config import OptimConfig, ScheduleConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        # A ZeRO-3 partitioned weight is a flat shard; its real shape is `ds_shape`.
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # A pipeline stage can hold no matmul at all (say ln_f + tied head); ZeRO drops an empty
    # group after the LR scheduler has counted it, so never hand one over.
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig, on_cuda: bool) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    # fused kernels on CUDA (one launch for all params); foreach on CPU.
    impl = {"fused": True} if on_cuda else {"foreach": True}
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    if cfg.name == "adam":
        # Adam's weight decay is L2 added to the gradient, not decoupled.
        return torch.optim.Adam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, **impl)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_multiplier(step: int, sched: ScheduleConfig, max_steps: int) -> float:
    """LR at `step` as a fraction of the peak: linear warmup, then the named decay."""
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.name == "constant":
        return 1.0
    span = max(1, max_steps - sched.warmup_steps)
    progress = min(1.0, (step - sched.warmup_steps) / span)
    floor = sched.min_lr_ratio
    if sched.name == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if sched.name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {sched.name!r}")


def build_scheduler(opt: torch.optim.Optimizer, sched: ScheduleConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_multiplier(step, sched, max_steps))
