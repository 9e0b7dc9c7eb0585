"""Ray Train's torch backend for Kiln's runs, in a module the Train controller imports without torch.

Ray's own `TorchConfig` lives in `ray.train.torch`, which imports torch at its top. The Train
controller unpickles the backend config it is handed (and the backend its callbacks hold), so
with Ray's it imported torch: 1.0-1.2 CPU-s on the chain of process starts before any worker
starts (bench/results/startup.md). Ray has no torch-free form of it. This backend takes the same
steps as Ray's `_TorchBackend` for CPU and GPU workers: rank 0's address and a free port there,
then the environment and `init_process_group("env://")` on every worker. Each step that needs
torch is Ray's own function, which runs on the workers (`kiln.ray.private`), and they import
torch anyway. Ray's TPU and XLA branches are left out: Kiln trains on CPUs and GPUs.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ray
from ray.exceptions import GetTimeoutError
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

from kiln.ray import private

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ProcessGroupConfig(BackendConfig):
    """What Ray's `TorchConfig` says, for a process group initialised from the environment."""

    backend: str = "gloo"
    """torch.distributed's backend (`kiln.devices.dist_backend`: gloo on CPUs, NCCL on GPUs)."""
    timeout_s: int = 1800
    """Seconds a collective waits before it fails: Ray's default, and torch's."""

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def train_func_context(self):
        # Ray's, which sets each GPU worker's CUDA device. Read on the driver; the workers
        # unpickle it with the training function (the controller only passes that on).
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self):
        return private.torch_framework()  # Ray's state export names the run's framework

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class ProcessGroupBackend(Backend):
    """Runs on the Train controller as each worker group starts and stops."""

    # As Ray's: the GPU workers of a node see each other's devices, which NCCL needs.
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        addr, port = private.rank0_address(worker_group)
        worker_group.execute(private.set_process_group_env, addr=addr, port=port)
        size = len(worker_group)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    private.init_process_group,
                    backend=backend_config.backend,
                    world_rank=rank,
                    world_size=size,
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(size)
            ]
        )

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        # As Ray's: a group of one has no peers to wait for, so it keeps its process group.
        futures = worker_group.execute_async(private.shutdown_process_group, destroy=len(worker_group) > 1)
        timeout = int(
            os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        )
        try:
            ray.get(futures, timeout=timeout)
        except GetTimeoutError:
            log.warning("the workers' process group did not shut down within %d s", timeout)
