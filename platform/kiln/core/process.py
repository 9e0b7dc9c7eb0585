"""Who this worker is, and its process set up before the model is built.

Every launcher (the Ray Train worker, the local launcher) describes its rank as a `WorldInfo`;
`prepare_process` seeds torch and sets threads, cores, malloc and the CUDA allocator, so that
the model's initial weights, which draw from the seed, are the same under every launcher.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kiln.core.affinity import pin_worker
from kiln.core.host_memory import apply_host_malloc
from kiln.topology import ParallelConfig

log = logging.getLogger("kiln.train")


@dataclass(frozen=True)
class WorldInfo:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    local_rank: int = 0  # this worker's index among the workers on its host
    local_world_size: int = 1  # workers on this host


def prepare_process(p: ParallelConfig, seed: int, world: WorldInfo) -> None:
    """Seed and set up this process's torch before the model is built (its init draws): threads
    and their cores on CPU, TF32 and the caching allocator's settings on GPU; the host's malloc
    on both."""
    torch.manual_seed(seed)
    apply_host_malloc(p.host_malloc)
    if world.device.type == "cpu":
        torch.set_num_threads(max(1, int(p.cpus_per_worker)))
        if p.pin_cpu_threads:
            pin_worker(world.local_rank, world.local_world_size, p.cpus_per_worker)
        return
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores
    torch.backends.cudnn.allow_tf32 = True
    if p.cuda_alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        torch.cuda.memory._set_allocator_settings(p.cuda_alloc_conf)
    log.info("cuda allocator settings: %s", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", p.cuda_alloc_conf) or "defaults")
