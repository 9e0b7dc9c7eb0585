"""The few collectives the loop needs, over the default process group (a no-op without one).

Every rank must call each of these the same number of times, in the same order: the loop's
save decisions, evaluations and reports are placed so that they do.
"""

from __future__ import annotations

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


def barrier(world_size: int) -> None:
    """Wait for every rank (a no-op for one rank or without a process group)."""
    if world_size > 1 and dist.is_initialized():
        dist.barrier()
