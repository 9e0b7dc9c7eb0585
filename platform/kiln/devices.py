"""Accelerators Kiln knows by name: dense peak FLOP/s, memory and bus bandwidth.

One table for the two places that need a datasheet: MFU on a GPU (`kiln.core.meter`) and the
throughput planner (`kiln.plan.throughput`). Peaks are vendor datasheet figures for SXM parts
without sparsity; fp32 counts TF32 tensor-core matmuls, which is what torch runs with
`allow_tf32`. A CPU has no datasheet peak here: MFU there is relative to a measured matmul rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    """The planner's name for it, with the memory size (cluster YAMLs refer to it)."""
    match: str
    """Substring of `torch.cuda.get_device_name()` that identifies the part."""
    peak_tflops: float
    """Dense bf16/fp16 tensor-core peak."""
    fp32_tflops: float
    """Dense TF32 tensor-core peak (what fp32 matmuls run at with allow_tf32)."""
    memory_gib: float
    intra_node_gbps: float
    """Per-device bus bandwidth inside a node in GB/s (NVLink; PCIe where there is none)."""

    def peak_flops(self, precision: str) -> float:
        return 1e12 * (self.fp32_tflops if precision == "fp32" else self.peak_tflops)


# Order matters for `by_cuda_name`: "A100" must be tried before "A10".
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("H200-141GB", "H200", 989, 494, 141, 450),
        Device("H100-80GB", "H100", 989, 494, 80, 450),  # NVLink 4: 900 GB/s bidirectional
        Device("A100-40GB", "A100", 312, 156, 40, 300),  # NVLink 3: 600 GB/s bidirectional
        Device("A100-80GB", "A100", 312, 156, 80, 300),
        Device("L4-24GB", "L4", 121, 60, 24, 32),  # PCIe 4 x16, no NVLink
        Device("A10-24GB", "A10", 125, 62, 24, 32),  # PCIe 4 x16, no NVLink
    )
}


def by_cuda_name(cuda_name: str) -> Device | None:
    """The table's entry for a device torch reports by this name, or None for an unknown part."""
    return next((d for d in DEVICES.values() if d.match in cuda_name), None)


def dist_backend(on_gpu: bool) -> str:
    """torch.distributed's backend for a run's devices: NCCL between GPUs, gloo between CPUs."""
    return "nccl" if on_gpu else "gloo"


def name_deepspeed_accelerator(use_gpu: bool, local_ranks: int | None = None) -> None:
    """Tell DeepSpeed a CPU run is one, before its first import: it picks its accelerator then,
    and without `DS_ACCELERATOR` it warns on the console that it guessed. A user's own setting
    stands; a GPU run leaves DeepSpeed to find its device.

    With `local_ranks` (a worker's, once its world is known), also how many of the run's ranks
    share this host, as DeepSpeed's own launcher says it (`LOCAL_SIZE`) and Ray Train and
    torchrun do not. Without it DeepSpeed's CPU accelerator counts the host's devices by running
    `numactl --hardware` each time it is asked, and ZeRO-3 asks at every gradient
    reduce-scatter: a process spawned per bucket per micro-batch. Each spawn also resets
    Python's warning registry (`os.get_exec_path`), so a deprecation warning DeepSpeed's step
    sets off printed again at every step."""
    if not use_gpu:
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if local_ranks:
            os.environ.setdefault("LOCAL_SIZE", str(local_ranks))
