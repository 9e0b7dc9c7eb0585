"""torch's FSDP2 (`fully_shard`) behind Kiln's `Engine` seam: `parallel.engine: fsdp2`.

Why a second engine: DeepSpeed's ZeRO-3 gathers and frees each module's weights from Python
hooks around every submodule, and on one H200 those hooks cost 81.6 ms of host time per
gpt2-124m step against 34.4 ms of GPU kernels (bench/results/gpu.md, 2026-11-25). FSDP2 shards
each parameter as a DTensor and gathers a unit's weights (one transformer block's, or a group's)
in one collective, on a stream of its own that overlaps the previous unit's compute (with a unit
a block, torchtitan's layout, which reaches 33-39% MFU on H100s).

The layout:
- one FSDP unit per group of consecutive transformer blocks of at least
  `parallel.fsdp2_unit_params` parameters (one block a unit where a block is that large, and
  with 0), and the root (embeddings, final norm, head: a tied head is the embedding) one more.
  FSDP2's host work is per unit and per parameter: on one H200, gpt2-124m's 13 units took the
  step from the plain loop's 32.6 ms to 48-50 ms (bench/results/gpu.md, 2026-11-27), and on
  any machine `bench/host_overhead.py` measures that work apart from the device's;
- `parallel.zero_stage` 3 frees a block's gathered weights after its forward and gathers them
  again for the backward (ZeRO-3's memory); 2 keeps them from forward to backward (ZeRO-2's
  traffic, with the weights sharded at rest);
- bf16: fp32 weights, gradients and optimizer state, sharded; each block computes on a bf16
  copy made at the gather, and gradients are reduced in fp32 (`MixedPrecisionPolicy`). fp32:
  no casts;
- `train.compile` compiles each block's forward, leaving FSDP2's hooks outside the graph;
- checkpoints are torch's distributed checkpoint (DCP): every rank writes its own shards and
  rank 0 the metadata; a load reads the slices this rank needs, so a run resumes on any number
  of ranks with no conversion step.

The model stays a plain `kiln.model.GPT`; nothing here changes its code.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from kiln.core.checkpoint import TAG
from kiln.core.dtypes import torch_dtype
from kiln.devices import dist_backend
from kiln.layout_rules import fsdp2_blocks_per_unit
from kiln.parallel.comm_bytes import COUNTER

log = logging.getLogger(__name__)

CLIENT = "kiln_client.pt"
"""Rank 0's file beside the shards: the loop's client state and the LR schedule's position."""
MODEL_KEY = "model"  # the model's entries in the checkpoint are "model.<name>"


class FSDP2Engine:
    """A GPT sharded by `fully_shard`, its optimizer and LR schedule, as the loop's `Engine`."""

    pipeline = False

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, micro_batches: int, grad_clip: float
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.micro_batches, self.grad_clip = micro_batches, grad_clip
        self._micro = 0  # micro-batches since the last optimizer step
        self._norm: torch.Tensor | None = None

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        _, loss = self.model(inputs, targets, documents)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        # The step's gradient is the mean over its micro-batches (as DeepSpeed scales it). Each
        # micro-batch's gradients are reduce-scattered into the fp32 shards as they come, so
        # the accumulation is in fp32 and no rank holds a whole gradient.
        (loss / self.micro_batches).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro < self.micro_batches:
            return
        self._micro = 0
        shards = local_grads(self.model)
        self._norm = grad_norm(shards)
        if self.grad_clip > 0 and shards:  # torch's clip_grads_with_norm_ on the shards themselves
            torch._foreach_mul_(shards, (self.grad_clip / (self._norm + 1e-6)).clamp(max=1.0))
        self.optimizer.step()  # a no-op while the health guard's gate is shut
        self.scheduler.step()  # stands still with it (GatedLambdaLR)
        self.optimizer.zero_grad(set_to_none=True)

    def train_batch(self, pairs):
        raise NotImplementedError("the FSDP2 engine runs no pipeline")

    def eval_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.forward(inputs, targets, documents)

    def set_training(self, on: bool) -> None:
        self.model.train(on)

    def save(self, directory: str, client_state: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = os.path.join(directory, TAG)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({MODEL_KEY: model_state, "optim": optim_state}, checkpoint_id=path)
        if dist.get_rank() == 0:
            torch.save(
                {"client_state": client_state, "lr_scheduler": self.scheduler.state_dict()}, os.path.join(path, CLIENT)
            )

    def load(self, directory: str, reshard: bool = False) -> dict:
        """DCP plans each rank's reads from the saved shards' metadata, so a checkpoint of any
        number of ranks loads as it is (`reshard` needs nothing more)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = os.path.join(directory, TAG)
        # Templates of this run's shards (a fresh optimizer's state is made for them, at lr 0).
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {MODEL_KEY: model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state["optim"])
        extra = torch.load(os.path.join(path, CLIENT), map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(extra["lr_scheduler"])
        self._micro = 0
        return extra["client_state"]

    def set_micro_batches(self, n: int) -> None:
        self.micro_batches = n

    def grad_norm(self) -> torch.Tensor | float | None:
        return self._norm

    def overflow(self) -> tuple[int, float]:
        return 0, 0.0  # no loss scaling: fp16 is refused under this engine

    def measure_comm(self, on: bool) -> None:
        COUNTER.on = on  # FSDP2's collectives overlap compute on their own streams: not timed apart

    def comm_metrics(self) -> dict[str, float]:
        return COUNTER.metrics()

    def memory(self) -> dict[str, float]:
        """This rank's shards, measured from the tensors: the fp32 weights are what the
        optimizer steps (no separate master copy); the bf16 compute copies live only while a
        block runs."""
        params = sum(_local_bytes(p) for p in self.model.parameters())
        state = sum(
            _local_bytes(v)
            for s in self.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
        return {
            "memory/params_bytes": float(params),
            "memory/master_params_bytes": 0.0,
            "memory/optimizer_state_bytes": float(state),
        }


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shards of the model's gradients, as plain tensors that share the DTensors'
    storage: the step's norm and clipping run on them with no DTensor dispatch, which costs
    more host time than the arithmetic (bench/host_overhead.py)."""
    with torch.no_grad():  # `to_local` is then the shard itself, not an autograd view
        return [g.to_local() if hasattr(g, "to_local") else g for p in model.parameters() if (g := p.grad) is not None]


def grad_norm(shards: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of sharded gradients, on the device: the root of the ranks' summed
    squared shard norms (one all-reduce), as DTensor's `full_tensor` of the shards' norm gives
    it and torchtitan clips with."""
    if not shards:
        return torch.zeros(())
    squared = torch.nn.utils.get_total_norm(shards, 2.0).float().square()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squared)
    return squared.sqrt()


def shard(
    model: nn.Module,
    zero_stage: int,
    precision: str,
    device: torch.device,
    compile_blocks: bool,
    grad_compression: str = "none",
    unit_params: int = 0,
) -> None:
    """Apply FSDP2 to a GPT in place: consecutive blocks grouped into units of at least
    `unit_params` parameters (`parallel.fsdp2_unit_params`; 0: each block a unit), each block
    compiled first where asked, then the root. Every rank must hold the same whole weights when
    this is called. Gradients are reduced in fp32, or in the dtype `parallel.grad_compression`
    names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    reduce = torch_dtype(grad_compression)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None, reduce_dtype=reduce)
    blocks = list(model.blocks)
    if compile_blocks:
        for block in blocks:
            # The forward alone: FSDP2's gather and free run as hooks around it, outside the
            # graph, and the block keeps its module names (checkpoints match eager runs').
            block.forward = torch.compile(block.forward)
    per_unit = fsdp2_blocks_per_unit(sum(p.numel() for p in blocks[0].parameters()), len(blocks), unit_params)
    for i in range(0, len(blocks), per_unit):
        # A list is one unit whose modules keep their own places (and names) in the model.
        unit = blocks[i : i + per_unit]
        fully_shard(
            unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy, reshard_after_forward=zero_stage == 3
        )
    # The root is gathered again at once for the backward (the head is last in the forward):
    # freeing it after the forward would only add a gather.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def ensure_process_group(on_cuda: bool) -> None:
    """The default process group FSDP2's mesh is made over: the launcher's (Ray Train's, or
    the local launcher's env:// rendezvous)."""
    COUNTER.install()  # before the first collective: `comm/bytes_per_step`
    COUNTER.timed = not on_cuda
    if not dist.is_initialized():
        dist.init_process_group(backend=dist_backend(on_cuda))


def merged_state(state_dir: str) -> dict[str, torch.Tensor]:
    """The whole model's weights from an FSDP2 checkpoint's shards, in this one process (for
    export and generation): DCP reads every shard of each weight into a whole tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(state_dir).read_metadata()
    prefix = MODEL_KEY + "."
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=state_dir, no_dist=True)
    return {k[len(prefix) :]: v for k, v in state.items()}


def is_fsdp2_checkpoint(state_dir: str) -> bool:
    """Whether a checkpoint's state directory is DCP's (FSDP2's) rather than DeepSpeed's."""
    return os.path.exists(os.path.join(state_dir, ".metadata"))


def gathered_state(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 weight and optimizer state, whole on every rank (a collective), by
    `<name>/<state>`: the same record as `kiln.parallel.zero_checkpoint.gathered_state`, for the
    tests' and benchmarks' comparisons of a reshard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(
        engine.model, engine.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    full = {f"{name}/fp32": t.detach().float().clone() for name, t in model_state.items()}
    for name, state in optim_state["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            if torch.is_tensor(state.get(key)):
                full[f"{name}/{key}"] = state[key].clone()
    return full
