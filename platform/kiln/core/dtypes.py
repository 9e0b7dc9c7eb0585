"""The one map from Kiln's names for a 16-bit format (`train.precision`,
`parallel.grad_compression`) to torch's dtype."""

from __future__ import annotations

import torch

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """bf16 or fp16 as torch names it; any other name (fp32, none, powersgd): float32."""
    return HALF.get(name, torch.float32)
