"""Throughput, MFU and memory numbers for the training loop. Names carry a namespace and unit."""

from __future__ import annotations

import time

import psutil
import torch
import torch.distributed as dist


def ranks() -> int:
    """Processes in the default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value averaged over all ranks (one all-reduce); every rank gets the same numbers."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if ranks() > 1:
        dist.all_reduce(t)
        t /= ranks()
    return t.tolist()


# Dense peak FLOP/s per GPU from vendor datasheets (SXM parts; no sparsity).
_GPU_PEAK = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},  # fp32 counts TF32 matmuls
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 62e12},
}


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """Achieved FLOP/s of square matmuls: the practical peak where no datasheet applies (CPUs)."""
    n = 512 if device.type == "cpu" else 4096
    # Values do not matter; a generator of its own leaves the training RNG untouched (a resumed
    # run measures at another step, and must draw the same dropout masks as the first).
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    a @ b  # warm-up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def datasheet_peak_flops(device: torch.device, precision: str, configured: float = 0.0) -> float | None:
    """The configured or datasheet peak; None where there is none (CPUs, unknown GPUs)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _GPU_PEAK.items():
            if key in name:
                return peaks[precision]
    return None


def measured_peak_flops(device: torch.device, precision: str) -> float:
    """Where no datasheet applies, MFU is relative to the matmul rate this worker achieves,
    measured once training is in steady state (so under the same load as the steps)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    rate = measured_matmul_flops(device, dtype)
    if device.type == "cpu" and dtype != torch.float32:
        # CPUs without bf16 matmul units emulate it slower than fp32, while the model's kernels
        # may not: take the faster rate as the peak, so MFU cannot exceed 100% from that alone.
        rate = max(rate, measured_matmul_flops(device, torch.float32))
    return rate


def memory_metrics(device: torch.device) -> dict[str, float]:
    gib = 1024**3
    out = {"memory/rss_gib": psutil.Process().memory_info().rss / gib}
    if device.type == "cuda":
        out["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["memory/max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
    return out
