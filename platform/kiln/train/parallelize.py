"""Kiln config -> DeepSpeed config, and the DeepSpeed engine around a plain GPT.

The model stays a plain nn.Module; everything DeepSpeed-specific is here.
"""

from __future__ import annotations

import copy
from typing import Any

from kiln.config import RunConfig


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config(cfg: RunConfig, data_parallel_size: int) -> dict[str, Any]:
    t, p = cfg.train, cfg.parallel
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage >= 2:
        # Contiguous gradient buffers avoid fragmentation; overlapping the reduce with backward
        # only pays where communication runs on its own stream (GPUs).
        zero.update(contiguous_gradients=True, overlap_comm=p.use_gpu)
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * data_parallel_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        # Dynamic loss scaling (loss_scale 0): start at 2^16, halve on overflow and skip the step.
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Kiln passes a torch optimizer it built itself (param groups, fused/foreach impl).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,  # Kiln does its own logging
        "wall_clock_breakdown": False,
    }
    return deep_merge(ds, p.deepspeed)
