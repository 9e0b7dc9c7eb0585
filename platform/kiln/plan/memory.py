"""Per-device memory of a training configuration, from the model's shapes alone.

No hardware needed: this is how a run on 64 x 80 GB GPUs is planned from a laptop, and how the
trainer refuses, before launch, a configuration that cannot fit.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3 and 5), for Psi parameters, ZeRO over
N data-parallel ranks, e bytes per working (compute-precision) element:

    working params   e*Psi           ZeRO-3: / N
    working grads    e*Psi           ZeRO-2 and 3: / N
    fp32 master      4*Psi           ZeRO-1+: / N   (fp32 runs keep none at stage 0)
    fp32 grads       4*Psi           ZeRO-1+: / N   (mixed precision, or any ZeRO stage)
    optimizer state  4*k*Psi         ZeRO-1+: / N   (k tensors per parameter: Adam 2, SGD 1)

The paper's K = 12 for mixed-precision Adam is master + momentum + variance; DeepSpeed also keeps
the fp32 gradient partition, so its estimators count 16 bytes per parameter (18 with the
partitioned 16-bit gradients). For mixed-precision Adam this module reproduces
`estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs` exactly (see
tests). One subtlety measured on DeepSpeed 0.19: at ZeRO-1/2 it keeps an fp32 partition of the
weights even when training in fp32, so `fp32 master` is there too.

ZeRO-3 also holds the layer being computed gathered: 4 bytes per parameter of the largest layer
(weight and gradient in the working precision; DeepSpeed's `largest_layer_memory` for 16-bit).

DeepSpeed's ZeRO stages also stage gradients in buckets of `reduce_bucket_size` elements in the
working precision: one during each backward at ZeRO-1/2, two where the reduction overlaps it (on
GPUs at ZeRO-2, for more than one bucket's gradients), one for the whole run at ZeRO-3
(`kiln.layout_rules.deepspeed_grad_buckets`).
Kiln sizes the bucket to the trained parameters where DeepSpeed's default of 500M elements is
larger (`kiln.layout_rules.reduce_bucket_elements`).

Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021) moves master,
fp32 grads and optimizer state to host RAM (and with param offload the working params too): the
device keeps what the forward and backward need.

Activations per micro-batch of b sequences of s tokens, width h, in e-byte elements (Korthikanti
et al. 2022, "Reducing Activation Recomputation", section 4, with fused attention that never
stores the s x s scores, no dropout, no tensor parallelism):

    per block   17*b*s*h*e   (ln_1 in, qkv in, q k v, attention out, proj in, ln_2 in, fc in,
                              GELU in 4bsh, proj in 4bsh)
    checkpointed: b*s*h*e per block kept, plus one block's 17*b*s*h*e while it is recomputed
    logits      b*s*V*(e + 8)  (the logits, their fp32 copy and the saved log-softmax)

Under bf16 autocast (`train.mixed_precision`) the weights, gradients and the residual stream (the
LayerNorms' inputs, each block's input) stay fp32: those count 4 bytes, the rest 2.

A pipeline stage holds 1/P of the layers, and its first stage holds up to min(P, M) micro-batches
in flight under DeepSpeed's 1F1B schedule.

Tensor parallelism over t ranks (Megatron-LM, Shoeybi et al. 2019) divides the blocks'
projections (`kiln.model_size.split_params`) and so their gradients and optimizer state by t; ZeRO
then shards over the N = world / (P x t) data-parallel replicas. Of a block's activations the
ones inside the split (q k v, attention out, proj in, GELU in, proj in: 13 of 15 e-byte terms)
divide by t; the norms' inputs and the projections' inputs stay whole (no sequence parallelism;
Korthikanti et al. 2022, table 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.config import RunConfig, bf16_autocast
from kiln.core.optim import OPTIMIZERS
from kiln.layout_rules import (
    FSDP2_UNIT_PARAMS,
    deepspeed_grad_buckets,
    deepspeed_reduction,
    deepspeed_zero_stage,
    fsdp2_blocks_per_unit,
)
from kiln.lora import adapter_params
from kiln.model import GPTConfig
from kiln.model_size import block_params, largest_layer_params, num_params, param_shapes, split_params
from kiln.parallel.powersgd import held_elements
from kiln.topology import ParallelDims

GIB = 1 << 30


@dataclass(frozen=True)
class PlanInput:
    model: GPTConfig
    world_size: int = 1
    """Devices in the run (data-parallel x pipeline x tensor-parallel)."""
    device_memory_gib: float = 80.0
    micro_batch: int = 1
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_params: str = "none"
    activation_checkpointing: bool = False
    precision: str = "bf16"
    pipeline_stages: int = 1
    micro_batches: int = 1
    """Micro-batches per step in the pipeline (in flight on the first stage, up to P)."""
    tensor_parallel: int = 1
    """Ranks splitting each block's matmuls (parallel.tensor_parallel)."""
    optimizer: str = "adamw"
    mixed_precision: str = "weights"
    """train.mixed_precision; `plan_input` passes the run's (whose default is `auto`)."""
    use_gpu: bool = True
    engine: str = "deepspeed"
    """parallel.engine: DeepSpeed's ZeRO (above), or FSDP2 (`fsdp2_states`)."""
    grad_compression: str = "none"
    """parallel.grad_compression: the dtype gradients travel in (throughput only)."""
    sync: str = "every_step"
    """parallel.sync: local_sgd and diloco send the weights' size once per `sync_every` steps."""
    sync_every: int = 1
    """parallel.sync_every (H)."""
    powersgd_rank: int = 4
    """parallel.powersgd_rank, under grad_compression powersgd."""
    adapters: int = 0
    """LoRA's trainable parameters (`kiln.lora.adapter_params`), 0 without LoRA: then the
    gradients, master weights and optimizer state are theirs alone, and the base is weights only."""
    fsdp2_unit_params: int = FSDP2_UNIT_PARAMS
    """parallel.fsdp2_unit_params: the blocks FSDP2 gathers together (`fsdp2_blocks_per_unit`)."""
    reduce_bucket: int = 0
    """DeepSpeed's `reduce_bucket_size` where the run's `parallel.deepspeed` sets it; 0: Kiln's
    (`kiln.layout_rules.reduce_bucket_elements`)."""
    overlap_comm: bool | None = None
    """DeepSpeed's `overlap_comm` where the run's `parallel.deepspeed` sets it; None: Kiln's
    (`kiln.layout_rules.deepspeed_overlaps_comm`)."""

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.world_size, self.pipeline_stages, self.tensor_parallel)

    @property
    def data_parallel(self) -> int:
        return self.dims.data_parallel_size

    @property
    def autocast(self) -> bool:
        stage = deepspeed_zero_stage(self.zero_stage, self.sync, self.grad_compression)
        return bf16_autocast(
            self.precision, self.mixed_precision, self.use_gpu, stage, self.pipeline_stages, self.engine
        )


@dataclass(frozen=True)
class Estimate:
    params: int
    grads: int
    master: int
    optimizer_states: int
    gathered: int
    activations: int
    host: int
    """Offloaded bytes per device, held in host RAM (or on NVMe)."""
    device_memory: int
    buckets: int = 0
    """DeepSpeed's gradient buckets (`deepspeed_grad_buckets`): working memory beside the model
    states, which DeepSpeed's own estimators count alone. FSDP2 counts its own in `gathered`."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states + self.gathered

    @property
    def total(self) -> int:
        return self.model_states + self.buckets + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory


def bytes_per_element(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def state_bytes(p: PlanInput) -> int:
    """Bytes per element of the weights, gradients and residual stream: fp32 under autocast,
    else the compute precision's."""
    return 4 if p.autocast else bytes_per_element(p.precision)


def estimate(p: PlanInput) -> Estimate:
    m, e = p.model, state_bytes(p)
    n, P = max(1, p.data_parallel), p.pipeline_stages
    psi = params_per_rank(m, p.tensor_parallel) // P  # one stage's share (the embedding split is approximate)
    s = p.zero_stage
    k = OPTIMIZERS[p.optimizer].states  # optimizer state tensors per parameter (fp32 each)
    if p.engine == "fsdp2":
        return fsdp2_states(p, psi, k)

    trained = p.adapters or psi  # what has gradients and optimizer state
    params = e * (psi + p.adapters) / (n if s == 3 else 1)
    grads = e * trained / (n if s >= 2 else 1)
    mixed = e == 2
    shard = n if s >= 1 else 1
    # DeepSpeed's ZeRO 1-2 steps fp32 partitions apart from the model; Kiln's ZeRO-1 under
    # PowerSGD (DeepSpeed at stage 0) steps the model's own fp32 weights.
    apart = mixed or deepspeed_zero_stage(s, p.sync, p.grad_compression) >= 1
    master = 4 * trained / shard if apart else 0
    fp32_grads = 4 * trained / shard if apart else 0
    states = 4 * k * trained / shard
    if p.sync == "diloco":  # the fp32 anchor and its outer momentum (kiln.parallel.periodic_sync)
        states += 2 * 4 * trained
    if p.grad_compression == "powersgd" and not p.adapters:  # each rank's error buffers and factors
        states += 4 * held_elements(param_shapes(m), p.powersgd_rank)
    gathered = 2 * e * largest_layer_params(m) // p.tensor_parallel if s == 3 else 0
    if s == 3:  # the 16-bit gradients are reduce-scattered straight into fp32 partitions
        grads = 0

    bucket, overlaps = reduction_of(p)
    buckets = deepspeed_grad_buckets(deepspeed_zero_stage(s, p.sync, p.grad_compression), overlaps) * e * bucket

    host = 0.0
    if p.offload_optimizer != "none":
        host += master + fp32_grads + states
        master = fp32_grads = states = 0
        if s < 3:  # ZeRO-Offload streams gradients to host buckets; the device keeps the params
            grads = 0
    if p.offload_params != "none":
        host += params
        params = 0

    return Estimate(
        params=int(params),
        grads=int(grads),
        master=int(master + fp32_grads),
        optimizer_states=int(states),
        gathered=int(gathered),
        activations=activation_bytes(p),
        host=int(host),
        device_memory=int(p.device_memory_gib * GIB),
        buckets=int(buckets),
    )


def fsdp2_states(p: PlanInput, psi: int, k: int) -> Estimate:
    """FSDP2 (`kiln.parallel.fsdp2_engine`) over N ranks: the fp32 weights, their fp32
    gradients and the optimizer state sharded (4 + 4 + 4k bytes per parameter / N; the weights
    are what the optimizer steps, so no master copy), plus what is gathered in the compute
    precision (c bytes: 2 in bf16): the root's weights (embeddings, head, final norm) for the
    whole step, and at ZeRO-3 two units of blocks (the one computing and the next, prefetched),
    at ZeRO-2 every block from its forward to its backward; and one unit's gradients before
    their reduce-scatter, in c bytes and again in fp32 (the reduce precision)."""
    m, n = p.model, max(1, p.data_parallel)
    c = bytes_per_element(p.precision)
    block = block_params(m)
    root, unit = fsdp2_units(p)
    held = min(2 * unit, m.n_layer * block) if p.zero_stage == 3 else m.n_layer * block
    return Estimate(
        params=int(4 * psi / n),
        grads=int(4 * psi / n),
        master=0,
        optimizer_states=int(4 * k * psi / n),
        gathered=int(c * (root + held) + (c + 4) * unit),
        activations=activation_bytes(p),
        host=0,
        device_memory=int(p.device_memory_gib * GIB),
    )


def reduction_of(p: PlanInput) -> tuple[int, bool]:
    """DeepSpeed's gradient bucket for `p` in elements, and whether its reduction overlaps the
    backward (`kiln.layout_rules.deepspeed_reduction`, the rule Kiln's DeepSpeed config
    follows), for the memory and the throughput planners alike."""
    stage = deepspeed_zero_stage(p.zero_stage, p.sync, p.grad_compression)
    total = num_params(p.model, non_embedding=False)
    return deepspeed_reduction(stage, p.use_gpu, total, p.adapters, p.reduce_bucket, p.overlap_comm)


def fsdp2_units(p: PlanInput) -> tuple[int, int]:
    """(root, unit): the parameters of FSDP2's root (embeddings, head, final norm) and of one
    unit of consecutive blocks (`kiln.layout_rules.fsdp2_blocks_per_unit`; the first unit, block
    0's, is always whole)."""
    m, block = p.model, block_params(p.model)
    root = num_params(m, non_embedding=False) - m.n_layer * block
    return root, fsdp2_blocks_per_unit(block, m.n_layer, p.fsdp2_unit_params) * block


def params_per_rank(m: GPTConfig, tensor_parallel: int) -> int:
    """The model's parameters one tensor-parallel rank holds: the blocks' projections split
    `tensor_parallel` ways, the rest whole."""
    return num_params(m, non_embedding=False) - split_params(m) * (tensor_parallel - 1) // tensor_parallel


def activation_bytes(p: PlanInput) -> int:
    m, e = p.model, bytes_per_element(p.precision)
    r = state_bytes(p)  # the residual stream: fp32 under autocast (its adds and LayerNorms run in fp32)
    b, s, h, V = p.micro_batch, m.seq_len, m.d_model, m.vocab_size
    layers = p.dims.most_layers_per_stage(m.n_layer)
    t = p.tensor_parallel
    # ln_1 and ln_2 inputs are the residual stream; the projections' inputs stay whole under tensor
    # parallelism, the 13 other terms are split
    block = (2 * e + 13 * e / t + 2 * r) * b * s * h
    # Checkpointed: each block keeps only its input, and one block is live while recomputed.
    per_mb = layers * b * s * h * r + block if p.activation_checkpointing else layers * block
    per_mb += b * s * h * r  # embedding output
    in_flight = min(p.pipeline_stages, p.micro_batches) if p.pipeline_stages > 1 else 1
    logits = b * s * V * (e + 8)  # on the last stage; with one stage, that stage
    return int(per_mb * in_flight + logits)


# ---- the trainer's pre-launch check ---------------------------------------------------------------
def plan_input(cfg: RunConfig, mcfg: GPTConfig, device_memory_gib: float) -> PlanInput:
    """The planner's view of a run config."""
    p, t = cfg.parallel, cfg.train
    overlap = p.deepspeed_zero("overlap_comm")
    return PlanInput(
        model=mcfg,
        world_size=p.min_workers,
        device_memory_gib=device_memory_gib,  # an elastic run's smallest group holds the most each
        micro_batch=t.micro_batch_size,
        zero_stage=p.zero_stage,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
        activation_checkpointing=mcfg.activation_checkpointing,
        precision=t.precision,
        pipeline_stages=p.pipeline_stages,
        micro_batches=p.micro_batches,
        tensor_parallel=p.tensor_parallel,
        optimizer=cfg.optim.name,
        mixed_precision=t.mixed_precision,
        use_gpu=p.use_gpu,
        engine=p.engine,
        grad_compression=p.grad_compression,
        sync=p.sync,
        sync_every=p.sync_every,
        powersgd_rank=p.powersgd_rank,
        adapters=adapter_params(mcfg, cfg.model.lora),
        fsdp2_unit_params=p.fsdp2_unit_params,
        reduce_bucket=int(p.deepspeed_zero("reduce_bucket_size") or 0),
        overlap_comm=None if overlap is None else bool(overlap),
    )
