"""DeepSpeed's engine behind Kiln's `Engine` seam (`kiln.core.engine`).

The loop calls `forward`, `backward`, `step`, `save`, ...; this class turns them into
DeepSpeed's calls, and is the one place that reads DeepSpeed's own attributes (its optimizer
wrappers' fp32 partitions, ZeRO-3's `ds_tensor`, fp16's loss scale). `ds` is the DeepSpeed
engine itself, for code in `kiln.parallel` and for tests that inspect it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from kiln.core.checkpoint import TAG
from kiln.parallel.comm_bytes import COUNTER
from kiln.parallel.comm_timer import METRIC as COMM_METRIC
from kiln.parallel.comm_timer import CollectiveTimer
from kiln.parallel.zero_checkpoint import is_zero_sharded, universal_copy


class DeepSpeedEngine:
    """A DeepSpeedEngine or PipelineEngine, as the loop's `Engine`."""

    def __init__(self, ds, pipeline: bool, comm_timer: CollectiveTimer | None = None):
        self.ds, self.pipeline, self.comm_timer = ds, pipeline, comm_timer

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        _, loss = self.ds(inputs, targets, documents)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> None:
        self.ds.step()  # steps the optimizer at the accumulation boundary only

    def train_batch(self, pairs: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.ds.train_batch(data_iter=pairs)

    def eval_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.pipeline:  # every stage takes part; the loss is broadcast from the last (no documents: config)
            return self.ds.eval_batch(iter([(inputs, targets)]), num_micro_batches=1)
        return self.forward(inputs, targets, documents)

    def set_training(self, on: bool) -> None:
        self.ds.train() if on else self.ds.eval()

    @property
    def frozen(self) -> bool:
        """Whether part of the model is frozen (LoRA's base): its checkpoints leave it out, as
        it is rebuilt from `model.init_from`."""
        return any(not p.requires_grad for p in self.ds.module.parameters())

    def save(self, directory: str, client_state: dict) -> None:
        self.ds.save_checkpoint(directory, tag=TAG, client_state=client_state, exclude_frozen_parameters=self.frozen)

    def load(self, directory: str, reshard: bool = False) -> dict:
        if not (reshard and is_zero_sharded(os.path.join(directory, TAG))):
            # Unsharded optimizer state (ZeRO-0 in fp32) is whole in every data-parallel
            # rank's model file, so it loads at any number of them as it is.
            _, client = self.ds.load_checkpoint(directory, tag=TAG, load_module_strict=not self.frozen)
            return client
        with universal_copy(directory, TAG) as (root, tag):
            # DeepSpeed reads the switch at load time only; it is left as the config had it.
            self.ds._config.load_universal_checkpoint = True
            try:
                _, client = self.ds.load_checkpoint(root, tag=tag)
            finally:
                self.ds._config.load_universal_checkpoint = False
            _fix_universal_load(inner_optimizer(self.ds), os.path.join(root, tag))
        return client

    def set_micro_batches(self, n: int) -> None:
        self.ds.set_train_batch_size(n * self.ds.train_micro_batch_size_per_gpu() * self.ds.dp_world_size)

    def grad_norm(self) -> torch.Tensor | float | None:
        return self.ds.get_global_grad_norm()

    def overflow(self) -> tuple[int, float]:
        return (int(getattr(self.ds, "skipped_steps", 0)), float(getattr(self.ds.optimizer, "cur_scale", 0.0) or 0.0))

    def measure_comm(self, on: bool) -> None:
        COUNTER.on = on
        if self.comm_timer is not None:
            self.comm_timer.on = on

    def comm_metrics(self) -> dict[str, float]:
        timed = {} if self.comm_timer is None else {COMM_METRIC: self.comm_timer.read()}
        return timed | COUNTER.metrics()

    def memory(self) -> dict[str, float]:
        return engine_memory(self.ds)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fix_universal_load(opt: torch.optim.Optimizer, universal: str) -> None:
    """Undo two faults of DeepSpeed 0.19's ZeRO-3 universal load (found by
    tests/unit/parallel/test_reshard.py; both are no-ops after a ZeRO-1/2 load):

    - it sets every param group's hyperparameters to the first group's, so the group Kiln
      keeps free of weight decay (norms, biases) decays; each group gets its own back from
      the converted optimizer state;
    - it sets one `step` tensor into every sub-group's state, and torch's Adam adds 1 to it once
      per sub-group per step, so from the second step on bias correction ran as if more steps
      had passed; each state gets its own count.

    And one of every stage's (found on a GPU by bench/gpu_reshard.py): the loaded `step` is a CPU
    tensor, where torch's fused (and capturable) Adam keeps it on the parameter's device and
    refuses a CPU one at the next step; it goes where torch would have put it.
    """
    saved = torch.load(os.path.join(universal, "zero", "optimizer_state.pt"), weights_only=False)
    groups = saved.get("param_groups") or []
    if len(groups) == len(opt.param_groups):
        for group, was in zip(opt.param_groups, groups):
            group.update({k: v for k, v in was.items() if k != "params"})
    # By state, not by group: ZeRO-3 swaps each sub-group's partition in and out of its group.
    on_device = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
    seen: set[int] = set()
    for p, state in opt.state.items():
        step = state.get("step")
        if not torch.is_tensor(step):
            continue
        if id(step) in seen:
            state["step"] = step = step.clone()
        if on_device and step.device != p.device:
            state["step"] = step.to(device=p.device, dtype=torch.float32)
        seen.add(id(state["step"]))


def inner_optimizer(ds) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, bf16, fp16)."""
    opt = ds.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and getattr(opt, "optimizer", None) is not None:
        opt = opt.optimizer
    return opt


# Where DeepSpeed's optimizer wrappers keep the fp32 copies they step on (ZeRO-1/2, ZeRO-3 and
# bf16 name them differently). Checked against DeepSpeed 0.19.
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def engine_memory(ds) -> dict[str, float]:
    """Bytes this rank holds, from the tensors themselves (not a formula).

    params: the model's weights (ZeRO-3: this rank's partition); master: fp32 copies the
    optimizer steps on when they are not the model's own tensors; optimizer_state: the optimizer's
    moments and buffers.
    """
    model_params = {id(p): p for p in ds.module.parameters()}
    params = sum(_nbytes(p.ds_tensor) if hasattr(p, "ds_tensor") else _nbytes(p) for p in model_params.values())
    opt = inner_optimizer(ds)
    # ZeRO-3 also empties the torch optimizer's param groups between steps: read the wrapper's.
    flat = next((getattr(ds.optimizer, a) for a in MASTER_ATTRS if hasattr(ds.optimizer, a)), None)
    if flat is not None:
        master = sum(_nbytes(t) for t in flat if torch.is_tensor(t))
    else:
        stepped = {id(p): p for g in opt.param_groups for p in g["params"]}
        master = sum(_nbytes(p) for i, p in stepped.items() if i not in model_params)
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {
        "memory/params_bytes": float(params),
        "memory/master_params_bytes": float(master),
        "memory/optimizer_state_bytes": float(state),
    }
