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

import dataclasses
import itertools
from dataclasses import dataclass

from kiln.config import RunConfig, bf16_autocast
from kiln.core.optim import OPTIMIZERS
from kiln.lora import adapter_params, layout_problem
from kiln.model import GPTConfig
from kiln.model_size import block_params, largest_layer_params, num_params, split_params
from kiln.topology import ParallelDims, deepspeed_refusal
from kiln.ui import table

GIB = 1 << 30

# Rough relative step cost of each memory technique, to rank options that fit ("cheapest
# first"). Orderings, not predictions: recomputation adds one forward (~1/3 of a step);
# ZeRO-3 moves 1.5x the data-parallel traffic (ZeRO paper, section 7); offload puts the
# optimizer step on the CPU behind PCIe (ZeRO-Offload reports 1.1-2x on GPT-2); each doubling of
# tensor parallelism inside a node x1.1 (Megatron-LM keeps 77% of linear scaling at 8-way over
# NVLink, 1/0.77 = 1.1^3: Shoeybi et al. 2019, figure 1).
COST = {
    "zero3": 1.15,
    "checkpointing": 1.33,
    "offload_optimizer": 1.5,
    "offload_params": 2.5,
    "tensor_parallel_doubling": 1.1,
}


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
    adapters: int = 0
    """LoRA's trainable parameters (`kiln.lora.adapter_params`), 0 without LoRA: then the
    gradients, master weights and optimizer state are theirs alone, and the base is weights only."""

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.world_size, self.pipeline_stages, self.tensor_parallel)

    @property
    def data_parallel(self) -> int:
        return self.dims.data_parallel_size

    @property
    def autocast(self) -> bool:
        return bf16_autocast(
            self.precision, self.mixed_precision, self.use_gpu, self.zero_stage, self.pipeline_stages, self.engine
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

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states + self.gathered

    @property
    def total(self) -> int:
        return self.model_states + self.activations

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
    master = 4 * trained / shard if (mixed or s >= 1) else 0
    fp32_grads = 4 * trained / shard if (mixed or s >= 1) else 0
    states = 4 * k * trained / shard
    gathered = 2 * e * largest_layer_params(m) // p.tensor_parallel if s == 3 else 0
    if s == 3:  # the 16-bit gradients are reduce-scattered straight into fp32 partitions
        grads = 0

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
    )


def fsdp2_states(p: PlanInput, psi: int, k: int) -> Estimate:
    """FSDP2 (`kiln.parallel.fsdp2_engine`) over N ranks: the fp32 weights, their fp32
    gradients and the optimizer state sharded (4 + 4 + 4k bytes per parameter / N; the weights
    are what the optimizer steps, so no master copy), plus what is gathered in the compute
    precision (c bytes: 2 in bf16): the root's weights (embeddings, head, final norm) for the
    whole step, and at ZeRO-3 two blocks (the one computing and the next, prefetched), at ZeRO-2
    every block from its forward to its backward; and one block's gradients before their
    reduce-scatter, in c bytes and again in fp32 (the reduce precision)."""
    m, n = p.model, max(1, p.data_parallel)
    c = bytes_per_element(p.precision)
    block = block_params(m)
    root = num_params(m, non_embedding=False) - m.n_layer * block  # embeddings, head, final norm
    held = (2 if p.zero_stage == 3 else m.n_layer) * block
    return Estimate(
        params=int(4 * psi / n),
        grads=int(4 * psi / n),
        master=0,
        optimizer_states=int(4 * k * psi / n),
        gathered=int(c * (root + held) + (c + 4) * block),
        activations=activation_bytes(p),
        host=0,
        device_memory=int(p.device_memory_gib * GIB),
    )


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


@dataclass(frozen=True)
class Option:
    plan: PlanInput
    estimate: Estimate

    @property
    def cost(self) -> float:
        c = COST["tensor_parallel_doubling"] ** (self.plan.tensor_parallel.bit_length() - 1)
        if self.plan.zero_stage == 3:
            c *= COST["zero3"]
        if self.plan.activation_checkpointing:
            c *= COST["checkpointing"]
        if self.plan.offload_optimizer != "none":
            c *= COST["offload_optimizer"]
        if self.plan.offload_params != "none":
            c *= COST["offload_params"]
        return c

    def describe(self) -> str:
        p = self.plan
        parts = [f"tensor_parallel={p.tensor_parallel}"] if p.tensor_parallel > 1 else []
        parts.append(f"zero_stage={p.zero_stage}")
        if p.offload_optimizer != "none":
            parts.append(f"offload_optimizer={p.offload_optimizer}")
        if p.offload_params != "none":
            parts.append(f"offload_params={p.offload_params}")
        parts.append(f"activation_checkpointing={'true' if p.activation_checkpointing else 'false'}")
        return ", ".join(parts)


def options(base: PlanInput) -> list[Option]:
    """Every ZeRO stage x CPU offload x checkpointing choice at the base's scale that DeepSpeed
    allows (`kiln.topology.deepspeed_refusal`: a pipeline keeps ZeRO 0-1 and no offload),
    cheapest first."""
    out = []
    offloads = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
    for stage, ckpt, (opt_off, par_off) in itertools.product((0, 1, 2, 3), (False, True), offloads):
        if deepspeed_refusal(
            stage, opt_off, par_off, base.pipeline_stages, base.tensor_parallel, engine=base.engine
        ) is None and not _lora_refuses(base, stage, base.tensor_parallel):
            p = dataclasses.replace(
                base, zero_stage=stage, activation_checkpointing=ckpt, offload_optimizer=opt_off, offload_params=par_off
            )
            out.append(Option(p, estimate(p)))
    # Equal cost: least memory first, since headroom buys a larger micro-batch.
    return sorted(out, key=lambda o: (o.cost, o.estimate.total))


def _lora_refuses(base: PlanInput, stage: int, tensor_parallel: int) -> bool:
    """A LoRA run's options keep to the layouts LoRA trains in (`kiln.lora.layout_problem`)."""
    return bool(base.adapters) and layout_problem(base.engine, stage, base.pipeline_stages, tensor_parallel) is not None


def first_fit(base: PlanInput) -> Option | None:
    return next((o for o in options(base) if o.estimate.fits), None)


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 4 else f"{n / (1 << 20):.1f} MiB"


def tensor_parallel_sizes(base: PlanInput, per_node: int) -> list[int]:
    """Tensor-parallel sizes worth a row: powers of two up to the devices of one node (its
    all-reduces need NVLink) that divide the world and the model's heads and hidden units, in a
    layout DeepSpeed serves (no pipeline)."""
    m, out, t = base.model, [], 1
    while t <= per_node:
        dims = ParallelDims(base.world_size, base.pipeline_stages, t)
        if (
            dims.problem() is None
            and dims.model_problem(m.n_head, m.kv_heads, m.hidden) is None
            and deepspeed_refusal(0, "none", "none", base.pipeline_stages, t) is None
            and not _lora_refuses(base, 0, t)
        ):
            out.append(t)
        t *= 2
    return out


def tensor_parallel_lines(base: PlanInput, per_node: int) -> list[str]:
    """One line per tensor-parallel size: the cheapest option that fits at it."""
    lines = [f"tensor parallelism inside a node ({per_node} devices per node), cheapest option that fits:"]
    for t in tensor_parallel_sizes(base, per_node):
        best = first_fit(dataclasses.replace(base, tensor_parallel=t))
        shown = (
            f"{best.describe().replace(f'tensor_parallel={t}, ', '')} -> {gib(best.estimate.total)} GiB, "
            f"cost {best.cost:.2f}"
            if best
            else "nothing fits"
        )
        lines.append(
            f"  tensor_parallel={t} ({ParallelDims(base.world_size, base.pipeline_stages, t).describe()}): {shown}"
        )
    return lines if len(lines) > 2 else []


def first_fit_any(base: PlanInput, per_node: int) -> Option | None:
    """The cheapest option that fits at any tensor-parallel size inside a node (the base's own
    included); equal costs go to less splitting, then less memory."""
    sizes = sorted({base.tensor_parallel, *tensor_parallel_sizes(base, per_node)})
    fits = [o for t in sizes if (o := first_fit(dataclasses.replace(base, tensor_parallel=t)))]
    return min(fits, key=lambda o: (round(o.cost, 6), o.plan.tensor_parallel, o.estimate.total), default=None)


def format_table(base: PlanInput, per_node: int = 8) -> str:
    """The planner's table: every option, the chosen one marked, the cheapest that fits named."""
    m = base.model
    head = (
        f"model {m.n_layer} layers x d_model {m.d_model}, {num_params(m, non_embedding=False) / 1e9:.3g}B params; "
        f"{base.world_size} devices x {base.device_memory_gib:g} GiB "
        f"({base.dims.describe()}); micro-batch "
        f"{base.micro_batch} x seq {m.seq_len}; {base.precision}; {base.optimizer}"
    )
    cols = (
        "",
        "zero",
        "offload",
        "ckpt",
        "params",
        "grads",
        "master+fp32g",
        "optim",
        "gathered",
        "activ",
        "total GiB",
        "host GiB",
        "fits",
        "cost",
    )
    rows = []
    chosen = estimate(base)
    for o in options(base):
        p, est = o.plan, o.estimate
        offload = "params+opt" if p.offload_params != "none" else ("opt" if p.offload_optimizer != "none" else "-")
        mark = (
            "*"
            if (p.zero_stage, p.offload_optimizer != "none", p.offload_params != "none", p.activation_checkpointing)
            == (
                base.zero_stage,
                base.offload_optimizer != "none",
                base.offload_params != "none",
                base.activation_checkpointing,
            )
            else ""
        )
        rows.append(
            (
                mark,
                str(p.zero_stage),
                offload,
                "on" if p.activation_checkpointing else "off",
                gib(est.params),
                gib(est.grads),
                gib(est.master),
                gib(est.optimizer_states),
                gib(est.gathered),
                gib(est.activations),
                gib(est.total),
                gib(est.host),
                "yes" if est.fits else "NO",
                f"{o.cost:.2f}",
            )
        )
    lines = [head, "", table.format_table(cols, rows, right=True, rule=False)]
    best = first_fit_any(base, per_node)
    lines.append("")
    lines.append(
        f"your configuration (*): {gib(chosen.total)} GiB per device, "
        f"{'fits' if chosen.fits else 'does NOT fit'} in {base.device_memory_gib:g} GiB"
    )
    if best:
        lines.append(f"recommended (cheapest that fits): {best.describe()} -> {gib(best.estimate.total)} GiB")
    else:
        lines.append("nothing fits: lower the micro-batch, add devices, pipeline stages or tensor parallelism")
    lines += tensor_parallel_lines(base, per_node)
    lines.append(
        "cost: rough relative step time (checkpointing x1.33, ZeRO-3 x1.15, offload x1.5 / x2.5, "
        "tensor parallelism x1.1 per doubling)"
    )
    return "\n".join(lines)


# ---- the trainer's pre-launch check ---------------------------------------------------------------
def plan_input(cfg: RunConfig, mcfg: GPTConfig, device_memory_gib: float) -> PlanInput:
    """The planner's view of a run config."""
    p, t = cfg.parallel, cfg.train
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
        adapters=adapter_params(mcfg, cfg.model.lora),
    )


def refuse_if_too_big(base: PlanInput, source: str) -> Estimate:
    """Raise ConfigError naming the overflow and the first option that fits; else the estimate."""
    from kiln.errors import ConfigError

    est = estimate(base)
    if est.fits:
        return est
    parts = ", ".join(
        f"{name} {human(v)}"
        for name, v in (
            ("params", est.params),
            ("grads", est.grads),
            ("fp32 master+grads", est.master),
            ("optimizer", est.optimizer_states),
            ("gathered", est.gathered),
            ("activations", est.activations),
        )
        if v
    )
    best = first_fit(base)
    hint = (
        f"the first option that fits: parallel.{best.describe().replace(', ', ', parallel.')} "
        f"({human(best.estimate.total)})".replace("parallel.activation_checkpointing", "model.activation_checkpointing")
        if best
        else "no ZeRO/offload/checkpointing option fits: lower train.micro_batch_size or add workers"
    )
    raise ConfigError(
        f"the run needs an estimated {human(est.total)} per device ({parts}) but {source} gives "
        f"{human(est.device_memory)}: {human(est.total - est.device_memory)} over; {hint}. "
        f"See `kiln plan` for the table"
    )
