"""The parallel layout of a run: the `parallel` section, and the one place that splits a world
of ranks into pipeline stages, tensor-parallel groups and data-parallel replicas.

Every place that needs the data-parallel size, or a rank's replica, asks `ParallelDims`; the
formula is written here and nowhere else (a test greps for other spellings).
`ParallelConfig.check` judges a layout with the rules of `kiln.layout_rules` (the one statement
of which ZeRO, offload and pipeline combinations each engine allows) and `sync_refusal`.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.errors import ConfigError
from kiln.knobs import check_ranges, knob, span
from kiln.layout_rules import (
    FSDP2_UNIT_PARAMS,
    deepspeed_refusal,
    deepspeed_zero_stage,
    offloads,
    own_communication,
    parallel_field,
    sharding_of,
    sync_layout_refusal,
)

MAX_WORKERS = 100_000


def _pair(workers: int | list[int]) -> list[int]:
    """[min, max] of `parallel.num_workers` ([n] for a fixed run)."""
    return list(workers) if isinstance(workers, list) else [workers]


@dataclass
class ParallelConfig:
    num_workers: int | list[int] = knob(
        2,
        lambda v: all(1 <= n <= MAX_WORKERS for n in _pair(v)),
        f"an integer in [1, {MAX_WORKERS}], or [min, max] of them",
    )
    """Ray Train workers (ranks): pipeline stages x tensor-parallel ranks x data-parallel replicas.
    [min, max] makes the run elastic: it starts with what the cluster fits (not below min), grows
    when nodes join and shrinks when they die, each time resuming its newest checkpoint on the
    new number of workers, with the global batch (at max) kept by gradient accumulation."""
    start_timeout_s: float = knob(300.0, *span(10, 86_400, "a number"))
    """Seconds Ray Train waits for a worker group to start before it tries again (workers that
    import torch and DeepSpeed on a busy node can take minutes). An elastic run that lost a
    node may first wait for a group of the old size: lower it where nodes vanish (spot)."""
    resize_check_s: float = knob(60.0, *span(1, 86_400, "a number"))
    """An elastic run looks this often for room to grow (Ray Train's
    elastic_resize_monitor_interval_s); a dead worker is seen at once. Checkpoint at least as
    often, or each resize repeats the steps since the last one."""
    use_gpu: bool = False
    """One GPU per worker, NCCL backend. False: CPU workers with gloo."""
    cpus_per_worker: float = knob(1.0, *span(0, 1024, "a number", lo_open=True))
    """Logical CPUs Ray reserves per worker; also the worker's torch thread count."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers' bundles on nodes. PACK (Ray's default) fills few nodes, so
    ranks talk over shared memory; STRICT_SPREAD puts every worker on its own node, and waits
    until the cluster has that many nodes."""
    engine: Literal["deepspeed", "fsdp2"] = "deepspeed"
    """What shards and steps the model. deepspeed: DeepSpeed's engine, every ZeRO stage, offload,
    pipelines and tensor parallelism. fsdp2: torch's `fully_shard`, a unit per transformer
    block or per group of them (`fsdp2_unit_params`, `kiln.parallel.fsdp2_engine`), for ZeRO-2/3-style sharding with far less host work
    per step than DeepSpeed's ZeRO-3 hooks, and `train.compile` at ZeRO-3; zero_stage 2 or 3,
    no offload, pipeline or tensor parallelism, bf16 or fp32. A checkpoint resumes in the
    engine that wrote it."""
    fsdp2_unit_params: int = knob(FSDP2_UNIT_PARAMS, *span(0, 1_000_000_000_000, note="0: one block a unit"))
    """Under engine fsdp2: consecutive transformer blocks share one FSDP2 unit (one gather, one
    reduce-scatter, one set of hooks) until the unit holds at least this many parameters
    (`kiln.layout_rules.fsdp2_blocks_per_unit`). FSDP2's host work is paid per unit and per
    parameter every step, and on a GPU a step is host-bound where a unit's compute is short: a
    gpt2-124m block is 7M parameters. The default is torch FSDP's own size-based wrap default
    (`size_based_auto_wrap_policy`'s min_num_params); 0 gives each block its unit (torchtitan's
    layout), the least gathered memory at ZeRO-3."""
    zero_stage: int = knob(2, lambda v: v in (0, 1, 2, 3), "one of 0, 1, 2, 3")
    """DeepSpeed ZeRO stage 0-3: 1 shards optimizer state, 2 also gradients, 3 also weights.
    Under engine fsdp2: 2 keeps a block's weights gathered from its forward to its backward
    (FSDP2's reshard_after_forward=False), 3 frees them after the forward and gathers again."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-Offload (stages 1-3): optimizer state and fp32 master weights live in CPU RAM (or on
    NVMe) and the optimizer step runs on the CPU (DeepSpeedCPUAdam for adam/adamw)."""
    offload_params: Literal["none", "cpu", "nvme"] = "none"
    """ZeRO-Infinity (stage 3 only): parameters live in CPU RAM (or on NVMe) between uses."""
    nvme_path: str = ""
    """Directory on fast local disk for 'nvme' offload; must exist on every worker."""
    pipeline_stages: int = knob(1, *span(1, 1024))
    """Pipeline-parallel stages (DeepSpeed PipelineModule). num_workers must be a multiple of it;
    data-parallel replicas = num_workers / pipeline_stages."""
    tensor_parallel: int = knob(1, *span(1, 1024))
    """Ranks that split each layer's matmuls (DeepSpeed AutoTP): q/k/v and the MLP's up (and
    gate) projections column-wise, the output projections row-wise, so each rank holds 1/k of
    those weights, their gradients and optimizer state, and every layer all-reduces its
    activations twice forward and twice backward. Every rank of a group reads the same rows;
    data-parallel replicas = num_workers / (pipeline_stages x tensor_parallel). Worth it inside
    a node (NVLink), where those all-reduces are cheap; 1: off."""
    tp_within_node: bool = True
    """Refuse a tensor-parallel group that would span nodes: its per-layer all-reduces over a
    network link cost more than the split saves. False allows it (for testing, or fast fabrics)."""
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    """How gradients travel between data-parallel replicas. none: in the training's own dtype
    (fp32 for fp32 weights and for `train.mixed_precision` autocast; bf16 or fp16 weights
    send their own dtype). bf16 or fp16 halves the bytes of an fp32 run's gradient reduce
    (DeepSpeed's `communication_data_type`, FSDP2's `reduce_dtype`), every ZeRO stage; fp16
    keeps more mantissa and may overflow a gradient above 65,504, bf16 keeps fp32's range.
    powersgd: each weight matrix's gradient as rank-`powersgd_rank` factors with error
    feedback (Vogels et al. 2019), vectors whole; DeepSpeed at zero_stage 0, or 1 (each replica
    steps and keeps the optimizer state of its share of the weights, then all gather the
    weights), with fp32 weights, no offload, pipeline, tensor parallelism or elastic workers. The bytes a rank sends per step are
    logged as `comm/bytes_per_step`."""
    powersgd_rank: int = knob(4, *span(1, 1024))
    """PowerSGD's rank r: a n x m gradient travels as (n + m) r numbers. Higher is closer to the
    full gradient; torch's hook defaults to 1, the paper trains at 2-4."""
    powersgd_start_step: int = knob(10, *span(0, 100_000_000))
    """Optimizer steps whose gradients go whole before PowerSGD starts compressing (torch's
    start_powerSGD_iter): the first steps' gradients change too fast for its warm start."""
    sync: Literal["every_step", "local_sgd", "diloco"] = "every_step"
    """How often the data-parallel replicas agree. every_step: gradients averaged at every step
    (synchronous training). local_sgd: each replica steps its own optimizer on its own rows for
    `sync_every` steps, then the replicas' weights are averaged. diloco: the same inner steps,
    then the change since the last sync (the pseudo-gradient) is averaged and an outer Nesterov
    SGD (`outer_lr`, `outer_momentum`) steps the synchronized weights (Douillard et al. 2023);
    the pseudo-gradient travels in `grad_compression`'s dtype. Both send the weights' size once
    per `sync_every` steps instead of the gradients' every step: for slow links. DeepSpeed at
    zero_stage 0 with fp32 weights (fp32, or bf16 autocast), no pipeline, tensor parallelism or
    elastic workers; the last step syncs, and validation runs on synchronized weights only. The
    health guard judges every replica's loss each step (one bad replica withholds the step on
    all) and the synchronized weights at each sync: not finite, they go to `train.health.policy`
    (DiLoCo withholds the outer step and returns every replica to the last sync, which skip keeps)."""
    sync_every: int = knob(50, *span(1, 1_000_000))
    """H: optimizer steps each replica takes on its own between syncs (local_sgd, diloco). The
    DiLoCo paper runs H = 500 on large models; tens suit small ones. 1: a sync every step."""
    outer_lr: float = knob(0.7, *span(0, 10, "a number", lo_open=True))
    """DiLoCo's outer learning rate on the averaged pseudo-gradient (the paper's 0.7). 1 with
    outer_momentum 0 is local SGD: the replicas' average."""
    outer_momentum: float = knob(0.9, lambda v: 0 <= v < 1, "a number in [0, 1)")
    """DiLoCo's outer Nesterov momentum (the paper's 0.9); 0: plain outer SGD."""
    micro_batches: int = knob(4, *span(1, 100_000))
    """Micro-batches per optimizer step through the pipeline. The idle bubble is (P-1)/(M+P-1) of
    the step, so more micro-batches waste less."""
    partition_method: Literal["parameters", "uniform"] = "parameters"
    """How pipeline stages split the layers: balance parameter counts, or layer counts."""
    device_memory_gib: float = knob(0.0, *span(0, 100_000, "a number", note="0: detect"))
    """Memory per device that the planner checks the run against before launch. 0: detected
    (the GPU's memory; on CPU workers, RAM divided by the workers on this node)."""
    cuda_alloc_conf: str = "expandable_segments:True"
    """PyTorch's CUDA caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF syntax), applied on
    each GPU worker before its first allocation. Expandable segments grow one mapping instead of
    caching blocks of fixed sizes, which avoids fragmentation when activation sizes vary;
    empty: torch's defaults. An explicit $PYTORCH_CUDA_ALLOC_CONF on the worker wins."""
    host_malloc: Literal["keep", "default"] = "keep"
    """The host's malloc (glibc) in each worker, set before the model is built. keep: memory a
    step frees stays in the process for the next step (blocks up to 32 MiB from the heap, no
    trimming), instead of being handed back and faulted in again every step: 93% fewer page
    faults and about 1.1x the tokens/s for the `debug` GPT on 2 CPU cores (bench/results/throughput.md),
    at the same peak RSS, which then stays at its high-water mark.
    default: glibc's own settings. Logged at start; no effect outside glibc."""
    pin_cpu_threads: bool = True
    """Pin each worker's threads to cores of its own (within one NUMA node where the host has
    several), so two workers on one host do not trade caches and cores; the affinity is logged.
    Applies where the worker is given whole cores (cpus_per_worker >= 1) and they exist."""
    deepspeed: dict = field(default_factory=dict)
    """Raw DeepSpeed config merged over the generated one, for anything Kiln does not model: a
    mapping, or the path of a JSON (or YAML) file holding one. Checked before launch by
    DeepSpeed's own parser; the keys Kiln sets from its fields (batch sizes, ZeRO stage,
    offload, precision, clipping, the optimizer and scheduler) are refused there."""

    @property
    def max_workers(self) -> int:
        """The workers of a fixed run; an elastic run's most."""
        return _pair(self.num_workers)[-1]

    @property
    def min_workers(self) -> int:
        return _pair(self.num_workers)[0]

    @property
    def deepspeed_stage(self) -> int:
        """The ZeRO stage DeepSpeed runs at (`kiln.layout_rules.deepspeed_zero_stage`)."""
        return deepspeed_zero_stage(self.zero_stage, self.sync, self.grad_compression)

    def deepspeed_zero(self, key: str) -> Any:
        """The passthrough's `zero_optimization.<key>` (`deepspeed`), None where the run leaves
        it to Kiln: what Kiln's DeepSpeed config and the planner both read."""
        return self.deepspeed.get("zero_optimization", {}).get(key)

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    def check(self) -> None:
        """This section's own rules: ranges, a layout that divides the workers, and what
        DeepSpeed allows."""
        if isinstance(self.num_workers, list) and (len(self.num_workers) != 2 or self.min_workers > self.max_workers):
            raise ConfigError(
                f"parallel.num_workers = {self.num_workers}: expected [min, max] with min <= max "
                "(an elastic run), or one number"
            )
        check_ranges(self, "parallel")
        if self.elastic and (self.pipeline_stages > 1 or self.tensor_parallel > 1):
            raise ConfigError(
                f"parallel.num_workers = {self.num_workers} (elastic) needs parallel.pipeline_stages = 1 "
                "and parallel.tensor_parallel = 1: a pipeline's or tensor-parallel ranks' checkpoint "
                "resumes only on as many replicas"
            )
        problem = ParallelDims.of(self).problem()
        if problem:
            raise ConfigError(problem)
        refusal = deepspeed_refusal(
            self.zero_stage,
            self.offload_optimizer,
            self.offload_params,
            self.pipeline_stages,
            self.tensor_parallel,
            engine=self.engine,
        )
        if refusal:
            raise ConfigError(refusal)
        refusal = sync_refusal(self)
        if refusal:
            raise ConfigError(refusal)
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ConfigError("parallel.offload_* = 'nvme' needs parallel.nvme_path: a directory on fast local disk")


def sync_refusal(p: ParallelConfig) -> str | None:
    """Why `parallel.sync` or PowerSGD cannot run with this section's settings; None where they
    can (the layout's rule: `sync_layout_refusal`)."""
    own = own_communication(p.sync, p.grad_compression)
    if own is None:
        return None
    if p.sync != "every_step" and p.grad_compression == "powersgd":
        return (
            f"parallel.grad_compression = 'powersgd' with {own}: between syncs no gradient travels, and "
            "a sync sends weights or their change; expected grad_compression 'none', 'bf16' or 'fp16'"
        )
    refusal = sync_layout_refusal(
        p.sync,
        p.grad_compression,
        p.engine,
        p.zero_stage,
        p.pipeline_stages,
        p.tensor_parallel,
        offloads(p.offload_optimizer, p.offload_params),
    )
    if refusal:
        return refusal
    if p.elastic:
        return (
            f"{own} with parallel.num_workers = {p.num_workers} (elastic): each replica's own state "
            "(its weights between syncs, PowerSGD's error buffers) resumes only on as many replicas; "
            "expected one number"
        )
    if p.sync == "local_sgd" and p.grad_compression != "none":
        return (
            f"{own} with parallel.grad_compression = {p.grad_compression!r}: local SGD averages the "
            "weights themselves, which 2 bytes would round; expected 'none', or parallel.sync = "
            "'diloco' with outer_lr 1 and outer_momentum 0 (local SGD through a pseudo-gradient, "
            "which does travel compressed)"
        )
    return None


@dataclass(frozen=True)
class Coords:
    """One rank's place in the layout."""

    data_parallel_rank: int
    pipeline_stage: int
    tensor_parallel_rank: int = 0


@dataclass(frozen=True)
class ParallelDims:
    """How `world_size` ranks divide: pipeline stages x tensor-parallel ranks x replicas."""

    world_size: int
    pipeline_stages: int = 1
    tensor_parallel: int = 1  # ranks splitting one layer's matmuls

    @classmethod
    def of(cls, p: ParallelConfig, world_size: int | None = None) -> ParallelDims:
        """The layout of `p` over `world_size` ranks (default: its workers, an elastic run's most)."""
        return cls(world_size or p.max_workers, p.pipeline_stages, p.tensor_parallel)

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the whole model, each reading its own rows."""
        return self.world_size // (self.pipeline_stages * self.tensor_parallel)

    def coords(self, rank: int) -> Coords:
        """Where `rank` sits. Axes in DeepSpeed's order (pipe, data, tensor), tensor varying
        fastest: a tensor-parallel group is k consecutive ranks (DeepSpeed's (data, tensor) mesh
        for AutoTP), which a launcher that numbers ranks node by node keeps on one node; with a
        pipeline, ranks 0..D-1 are stage 0 of replicas 0..D-1 (PipeDataParallelTopology;
        `kiln.parallel.pipeline.check_coords` checks this against the engine's own grid)."""
        tp, dp = self.tensor_parallel, self.data_parallel_size
        return Coords(
            data_parallel_rank=(rank // tp) % dp, pipeline_stage=rank // (tp * dp), tensor_parallel_rank=rank % tp
        )

    def most_layers_per_stage(self, n_layer: int) -> int:
        """Transformer blocks on the fullest pipeline stage (the planner's activation memory)."""
        return -(-n_layer // self.pipeline_stages)

    def problem(self, workers: str = "parallel.num_workers", name: Callable[[str], str] = parallel_field) -> str | None:
        """Why the ranks do not divide into this layout, naming the settings through `workers`
        and `name` (as `deepspeed_refusal` does); None where they do."""
        if self.world_size % (self.pipeline_stages * self.tensor_parallel):
            if self.tensor_parallel == 1:
                return (
                    f"{workers} = {self.world_size} is not a multiple of {name('pipeline_stages')} = "
                    f"{self.pipeline_stages}: expected workers = stages x data-parallel replicas"
                )
            return (
                f"{workers} = {self.world_size} is not a multiple of {name('pipeline_stages')} x "
                f"{name('tensor_parallel')} = {self.pipeline_stages} x {self.tensor_parallel}: expected "
                "workers = stages x tensor-parallel ranks x data-parallel replicas"
            )
        return None

    def model_problem(
        self, n_head: int, kv_heads: int, ffn_hidden: int, name: Callable[[str], str] = parallel_field
    ) -> str | None:
        """Why this model's layers do not split over the tensor-parallel ranks: each rank takes
        whole attention heads (and whole key/value heads under GQA) and an equal share of the
        MLP's hidden units. None where they split."""
        k = self.tensor_parallel
        for what, n in (
            ("n_head", n_head),
            ("n_kv_head (key/value heads)", kv_heads),
            ("the MLP's hidden width", ffn_hidden),
        ):
            if n % k:
                return (
                    f"{name('tensor_parallel')} = {k} does not divide model {what} = {n}: each "
                    "tensor-parallel rank takes an equal share of whole heads and hidden units; "
                    f"expected a divisor of {n}"
                )
        return None

    def node_problem(self, ranks_per_node: int, tp_within_node: bool = True) -> str | None:
        """Why a tensor-parallel group would span nodes when `ranks_per_node` ranks share each
        node (consecutive ranks, as Ray Train and torchrun number them); None where it fits. A node
        that holds no rank holds no group either."""
        k = self.tensor_parallel
        if not tp_within_node or k == 1 or (ranks_per_node >= k and ranks_per_node % k == 0):
            return None
        return (
            f"parallel.tensor_parallel = {self.tensor_parallel} with {ranks_per_node} rank(s) per node: "
            "a tensor-parallel group would span nodes, and its per-layer all-reduces would cross the "
            f"network; expected a divisor of {ranks_per_node} (or parallel.tp_within_node = false)"
        )

    def describe(self) -> str:
        """The layout in words, for logs and the pre-launch summary: data x pipeline x tensor."""
        parts = [f"{self.data_parallel_size} data-parallel"]
        if self.pipeline_stages > 1:
            parts.append(f"{self.pipeline_stages} pipeline stages")
        if self.tensor_parallel > 1:
            parts.append(f"{self.tensor_parallel} tensor-parallel")
        return " x ".join(parts)


def sharding(p: ParallelConfig) -> str:
    """The engine and stage in a few words, for logs and dry runs: 'ZeRO-2', 'FSDP2 (ZeRO-3)'."""
    return sharding_of(p.engine, p.zero_stage)
