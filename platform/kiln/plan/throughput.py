"""Scaling on paper: tokens/s, time to a token budget and cost of a run on a cluster.

A roofline-style model with one step = compute + the communication that cannot hide + the
pipeline bubble. It is meant to rank setups and size a budget before renting hardware, not to
replace a measurement; bench/results/gpu.md holds measured MFU to calibrate `mfu` against (34.8% for
gpt2-124m ZeRO-2 bf16 on one H100).

Formulas and sources:
- Compute: flops_per_token(model) = 6N + 12·L·d·T (Kaplan et al. 2020; PaLM, Chowdhery et al.
  2022, appendix B) at `mfu` of the device's dense peak. Activation checkpointing reruns the
  forward: x(1 + 1/3) compute (Chen et al. 2016; Korthikanti et al. 2022).
- Data-parallel traffic per device and step: a ring all-reduce of Ψ gradients sends
  2(n-1)/n · Ψ elements (Patarasuk & Yuan 2009). The ZeRO paper's ZeRO-1/2 replace it with a
  reduce-scatter plus an all-gather of the weights, 2Ψ, and ZeRO-3 adds a gather in the
  backward, 3Ψ (Rajbhandari et al. 2020, section 7). DeepSpeed's ZeRO-1/2 all-reduce the
  gradients (3Ψ with the gather), FSDP2's follow the paper; `data_parallel_traffic` states each,
  as measured. Engines that shard gradients (ZeRO-2/3, FSDP2) reduce them at every micro-batch,
  ZeRO-0/1 once a step. With P pipeline stages each device holds Ψ/P. Gradient compression
  (`parallel.grad_compression`) sends the gradients in 2 bytes an element; the gathers of the
  weights keep theirs.
- Bandwidth: inside a node the NVLink/ICI bus bandwidth; across nodes the ring is bounded by the
  node's network bandwidth shared by its devices (NCCL's bus-bandwidth model).
- Overlap, as the engines schedule it (DeepSpeed 0.19's `engine.allreduce_gradients` and
  `stage_1_and_2.py`, torch's FSDP2): only a reduction issued during a micro-batch's backward
  hides, up to that backward's time (2/3 of its compute): DeepSpeed's ZeRO-2 with
  `overlap_comm` and ZeRO-3 bucket by bucket, FSDP2 unit by unit, each but the last. ZeRO-0/1
  reduce after the last backward, ZeRO-1/2 gather the stepped weights after the optimizer
  step, and ZeRO-2 without `overlap_comm` (one bucket, Kiln's choice for models that fit one)
  reduces after the backward: all exposed. So are ZeRO-3's and FSDP2's forward gathers,
  PowerSGD (at the accumulation boundary; its matmuls are not counted) and a local-SGD or
  DiLoCo sync (after its step, counted as 1/H of it a step).
- Tensor parallelism over t ranks (Megatron-LM, Shoeybi et al. 2019): each device computes 1/t of
  the blocks' flops (the output head, left whole, runs on every rank), and every block all-reduces its b·s·h activations twice in the forward and twice
  in the backward (three times forward under activation checkpointing, which reruns it), a ring
  all-reduce sending 2(t-1)/t of them, over NVLink (inside a node). Those all-reduces sit on the
  critical path, so none of it hides. Data-parallel gradients are then Ψ/t per device.
- Pipeline bubble (GPipe/1F1B): the step takes (m + P - 1)/m of its ideal time for m
  micro-batches (Huang et al. 2019; Narayanan et al. 2021).
- Token budget: 20 tokens per parameter by default, the compute-optimal ratio of Hoffmann et al.
  2022 (Chinchilla).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kiln.devices import DEVICES
from kiln.errors import ConfigError
from kiln.model import GPTConfig
from kiln.model_size import flops_per_token, num_params, param_shapes
from kiln.parallel.powersgd import elements_sent
from kiln.plan.memory import PlanInput, bytes_per_element, fsdp2_units, params_per_rank, reduction_of, state_bytes
from kiln.schemas import Launcher, type_problems
from kiln.yamlfile import read_mapping


@dataclass(frozen=True)
class NodeType:
    device: str
    devices: int
    network_gbps: float
    """The node's network bandwidth in Gb/s (EFA, GPUDirect-TCPX, InfiniBand)."""
    usd_per_hour: float
    """On-demand list price (us-east-1 / us-central1, 2024); pass your own with --usd-per-hour."""


INSTANCES = {
    "p4d.24xlarge": NodeType("A100-40GB", 8, 400, 32.77),
    "p4de.24xlarge": NodeType("A100-80GB", 8, 400, 40.97),
    "p5.48xlarge": NodeType("H100-80GB", 8, 3200, 98.32),
    "p5e.48xlarge": NodeType("H200-141GB", 8, 3200, 120.0),
    "g6.48xlarge": NodeType("L4-24GB", 8, 100, 13.35),
    "a2-highgpu-8g": NodeType("A100-40GB", 8, 100, 29.39),
    "a2-ultragpu-8g": NodeType("A100-80GB", 8, 100, 40.44),
    "a3-highgpu-8g": NodeType("H100-80GB", 8, 1000, 88.25),
}


@dataclass(frozen=True)
class Cluster:
    node: NodeType
    nodes: int
    source: str

    @property
    def world_size(self) -> int:
        return self.node.devices * self.nodes


def cluster_from_yaml(path: str | Path, nodes: int | None = None) -> Cluster:
    """The GPU node type of a Ray launcher YAML and its node count (max_workers unless given)."""
    path = Path(path)
    cfg = read_mapping(path, f"--cluster {path}")
    problems = type_problems(Launcher, cfg)
    if problems:
        raise ConfigError(f"--cluster {path}: " + "; ".join(problems))
    types = cfg.get("available_node_types") or {}
    if not isinstance(types, dict) or not all(isinstance(t, dict) for t in types.values()):
        raise ConfigError(f"--cluster {path}: available_node_types must map node type names to mappings")
    gpu = []
    for name, t in types.items():
        nc = t.get("node_config") or {}
        instance = nc.get("InstanceType") or nc.get("machineType")
        if instance in INSTANCES and (t.get("resources") or {}).get("GPU", 0):
            gpu.append((t.get("priority", 0), name, instance, t.get("max_workers", 0)))
    if not gpu:
        known = ", ".join(INSTANCES)
        raise ConfigError(
            f"--cluster {path}: no GPU node type with a known instance type ({known}); "
            "describe it with --device/--devices-per-node/--nodes instead"
        )
    _, name, instance, max_workers = max(gpu)  # the preferred group, as the autoscaler would pick
    count = nodes or max_workers
    if count < 1:
        raise ConfigError(f"--cluster {path}: node type {name!r} has max_workers {max_workers}; pass --nodes")
    return Cluster(INSTANCES[instance], count, f"{path.name}: {count} x {instance} ({name})")


@dataclass(frozen=True)
class Throughput:
    tokens_per_step: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    tp_comm_s: float = 0.0
    """The tensor-parallel all-reduces of one step (part of comm_s, all of it exposed)."""
    data_parallel_bytes: float = 0.0
    """What a device sends in the step's data-parallel collectives (`data_parallel_traffic`)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def throughput(p: PlanInput, cluster: Cluster, mfu: float = 0.40, grad_accum: int = 1) -> Throughput:
    """One optimizer step of `p` on `cluster`, in seconds; see the module docstring."""
    m: GPTConfig = p.model
    dev = DEVICES[cluster.node.device]
    dp, pp, tp = p.data_parallel, p.pipeline_stages, p.tensor_parallel
    micro_steps = p.micro_batches if pp > 1 else grad_accum
    tokens_per_device = p.micro_batch * m.seq_len * micro_steps  # per data-parallel replica's stage
    head = 6 * m.vocab_size * m.d_model  # the output head's matmul: whole on every tensor-parallel rank
    flops = ((flops_per_token(m) - head) / tp + head) * tokens_per_device / pp
    if p.activation_checkpointing:
        flops *= 4 / 3
    compute = flops / (dev.peak_tflops * 1e12 * mfu)
    tp_comm = tensor_parallel_bytes(p) * micro_steps / (dev.intra_node_gbps * 1e9)

    traffic = data_parallel_traffic(p, micro_steps)
    # A ring spanning nodes moves at the slower of NVLink and the node's network share per device.
    bw = dev.intra_node_gbps * 1e9
    if dp * pp * tp > cluster.node.devices:
        bw = min(bw, cluster.node.network_gbps / 8 * 1e9 / cluster.node.devices)
    comm = traffic.total / bw
    backward = 2 / 3 * compute / micro_steps  # one micro-batch's backward: the compute a reduction hides behind
    exposed = traffic.per_step + micro_steps * (traffic.forward + traffic.tail)
    exposed = exposed / bw + micro_steps * max(0.0, traffic.overlapped / bw - backward)
    bubble = compute * (pp - 1) / micro_steps if pp > 1 else 0.0
    return Throughput(
        p.micro_batch * m.seq_len * micro_steps * dp,
        compute,
        comm + tp_comm,
        exposed + tp_comm,
        bubble,
        tp_comm,
        traffic.total,
    )


@dataclass(frozen=True)
class Traffic:
    """The bytes a device sends in one step's data-parallel collectives, by when they travel
    (`data_parallel_traffic`)."""

    micro_steps: int
    per_step: float = 0.0
    """Once a step, after the last backward or the optimizer step: nothing computes beside them."""
    forward: float = 0.0
    """Each micro-batch's forward gathers of the weights (ZeRO-3, FSDP2): counted exposed."""
    overlapped: float = 0.0
    """Each micro-batch's, issued while its backward still computes: hidden up to that backward."""
    tail: float = 0.0
    """Each micro-batch's last reduction, issued after its backward's last gradient: exposed."""

    @property
    def total(self) -> float:
        return self.per_step + self.micro_steps * (self.forward + self.overlapped + self.tail)


def data_parallel_bytes(p: PlanInput, micro_steps: int = 1) -> float:
    """The bytes a device sends in the data-parallel collectives of one step of `micro_steps`
    micro-batches (what `comm/bytes_per_step` counts; tests/unit/parallel checks the two agree)."""
    return data_parallel_traffic(p, micro_steps).total


def data_parallel_traffic(p: PlanInput, micro_steps: int = 1) -> Traffic:
    """A step's data-parallel bytes per device, a ring's share ((n-1)/n) of each collective, in
    the collectives each engine makes and when it makes them. Ψ elements with gradients (LoRA's
    adapters alone), in `parallel.grad_compression`'s dtype:
    - ZeRO-0: all-reduced, 2Ψ, once a step after the last backward (DeepSpeed's
      `allreduce_gradients` at the accumulation boundary; no overlap);
    - DeepSpeed ZeRO-1: the same, then the updated weights gathered, Ψ;
    - DeepSpeed ZeRO-2: all-reduced too (DeepSpeed's default `use_multi_rank_bucket_allreduce`;
      each rank then keeps its partition) at every micro-batch, since a rank keeps only its
      partition of the gradients; with `overlap_comm` (`reduction_of`) bucket by bucket
      during the backward but for the last bucket, without it all after the backward; the
      weights gathered once a step;
    - ZeRO-3 and FSDP2: reduce-scattered, Ψ, at every micro-batch, with the weights gathered for
      each forward and again for each backward, 2Ψ (DeepSpeed keeps them between the two where
      they fit its reuse distance, as a small model does: then Ψ), or once under FSDP2 at
      zero_stage 2. DeepSpeed's last bucket, and FSDP2's last reduce-scatters (block 0's unit and
      the root, whose gradients come last), wait for nothing;
    - `parallel.sync` local_sgd or diloco: the trainable weights (fp32, or diloco's
      pseudo-gradient in the compression dtype) all-reduced once per H steps, 2Ψ/H;
    - PowerSGD: each compressed n x m gradient as (n + m) r numbers, the rest whole, 2 of each
      (`kiln.parallel.powersgd.elements_sent`); at zero_stage 1 the stepped weights gathered
      too, Ψ (`kiln.parallel.optimizer_shards`)."""
    dp = p.data_parallel
    if dp == 1:
        return Traffic(micro_steps)
    ring = (dp - 1) / dp
    elements = params_per_rank(p.model, p.tensor_parallel) / p.pipeline_stages * ring
    weight = state_bytes(p)
    grad = weight if p.grad_compression == "none" else bytes_per_element(p.grad_compression)
    trained = p.adapters or params_per_rank(p.model, 1)  # Kiln's own communication: no pipeline, no TP
    if p.sync != "every_step":  # one all-reduce of the trainable weights per H steps
        sent = grad if p.sync == "diloco" else weight  # local SGD averages the weights themselves
        return Traffic(micro_steps, per_step=trained * 2 * ring * sent / p.sync_every)
    if p.grad_compression == "powersgd":  # each matrix's factors P and Q, every other gradient whole, fp32
        sent = p.adapters or elements_sent(param_shapes(p.model), p.powersgd_rank)
        gathered = trained if p.zero_stage == 1 else 0
        return Traffic(micro_steps, per_step=(sent * 2 + gathered) * ring * weight)
    if p.adapters:  # only the adapters have gradients and optimizer steps
        elements = p.adapters * ring
    if p.zero_stage <= 1:
        return Traffic(micro_steps, per_step=elements * (2 * grad + (weight if p.zero_stage == 1 else 0)))
    last = _last_reduced_share(p)
    if p.engine == "fsdp2" or p.zero_stage == 3:  # reduce-scattered, the weights gathered for each micro-batch
        reduced = elements * grad
        again = elements * weight if p.zero_stage == 3 else 0.0  # the backward's gathers, ahead of their blocks
        return Traffic(
            micro_steps, forward=elements * weight, overlapped=reduced * (1 - last) + again, tail=reduced * last
        )
    reduced = elements * 2 * grad  # DeepSpeed's ZeRO-2 all-reduces
    return Traffic(micro_steps, per_step=elements * weight, overlapped=reduced * (1 - last), tail=reduced * last)


def _last_reduced_share(p: PlanInput) -> float:
    """The share of a micro-batch's gradients whose reduction starts after its backward's last
    gradient. FSDP2: block 0's unit and the root's (`fsdp2_units`). DeepSpeed: the last bucket
    (`reduction_of`), or all of them where its reduction does not overlap."""
    if p.engine == "fsdp2":
        root, unit = fsdp2_units(p)
        return min(1.0, (root + unit) / num_params(p.model, non_embedding=False))
    bucket, overlaps = reduction_of(p)
    trained = p.adapters or num_params(p.model, non_embedding=False)
    if not overlaps or bucket >= trained:
        return 1.0
    return (trained - (-(-trained // bucket) - 1) * bucket) / trained


def tensor_parallel_bytes(p: PlanInput) -> float:
    """Bytes one device sends in the tensor-parallel all-reduces of one micro-batch: per block on
    its stage, 2 forward (3 when checkpointing reruns it) + 2 backward all-reduces of b·s·h
    activations, a ring sending 2(t-1)/t of each. 0 without tensor parallelism."""
    t = p.tensor_parallel
    if t == 1:
        return 0.0
    m = p.model
    per_all_reduce = p.micro_batch * m.seq_len * m.d_model * state_bytes(p) * 2 * (t - 1) / t
    count = (3 if p.activation_checkpointing else 2) + 2
    return p.dims.most_layers_per_stage(m.n_layer) * count * per_all_reduce


def duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


# Seconds from a lost node to the first step after it, for an elastic run on the local two-node
# cluster (`python -m bench.resize`, bench/results/resize.md): Ray's detection and restart, the
# new group's set-up, the checkpoint's reshard and load, the first step. A large model adds its
# checkpoint's download and conversion (gpt2-124m: 5-8 s more on an H100, bench/results/gpu.md).
# Measured 89.5 s on 2 cores (2026-11-27), 67 of them Ray's until the new group started: its
# elastic policy still counted the lost node and waited out parallel.start_timeout_s (60 s).
RESIZE_S = 89.5


@dataclass(frozen=True)
class Preemptions:
    """What spot preemptions are expected to add to a run: `kiln plan --cluster`'s last line."""

    per_node_hour: float
    """The rate a node is lost at (--preemptions-per-hour)."""
    every_steps: int = 0
    """train.checkpoint_every (0: not by steps)."""
    every_minutes: float = 0.0
    """train.checkpoint_every_minutes (0: not by time)."""

    def format(self, run_s: float, step_s: float, nodes: int, usd_per_hour: float) -> str:
        """Expected losses over the run and the time each costs: RESIZE_S, and on average half a
        checkpoint interval of steps done again (a resume repeats the steps since its checkpoint;
        without checkpoints, half the run)."""
        intervals = [s for s in (self.every_steps * step_s, self.every_minutes * 60) if s > 0]
        redo = min(intervals) / 2 if intervals else run_s / 2
        expected = self.per_node_hour * nodes * run_s / 3600
        added = expected * (RESIZE_S + redo)
        return (
            f"  preemptions at {self.per_node_hour:g} per node-hour (--preemptions-per-hour): {expected:.2g} over "
            f"the run, each {RESIZE_S:.0f} s to the next step (bench/results/resize.md) + {duration(redo)} of "
            f"steps since the last checkpoint{'' if intervals else ' (none is written: back to step 0)'}: "
            f"+{duration(added)} ({added / run_s:.1%}), ${usd_per_hour * added / 3600:,.0f}"
        )


def format_estimate(
    p: PlanInput,
    cluster: Cluster,
    mfu: float,
    target_tokens: float | None,
    usd_per_hour: float | None,
    grad_accum: int = 1,
    preemptions: Preemptions | None = None,
) -> str:
    t = throughput(p, cluster, mfu, grad_accum)
    n = num_params(p.model, non_embedding=False)
    target = target_tokens or 20 * n
    seconds = target / t.tokens_per_s
    price = usd_per_hour if usd_per_hour is not None else cluster.node.usd_per_hour * cluster.nodes
    dev = DEVICES[cluster.node.device]
    lines = [
        f"throughput on {cluster.source}: {cluster.world_size} x {dev.name} "
        f"({dev.peak_tflops:g} TFLOP/s peak at {mfu:.0%} MFU), {cluster.node.network_gbps:g} Gb/s per node",
        f"  step: {t.tokens_per_step:,} tokens in {t.step_s * 1e3:.1f} ms = compute {t.compute_s * 1e3:.1f} ms"
        f" + exposed comm {t.exposed_comm_s * 1e3:.1f} ms (of {t.comm_s * 1e3:.1f} ms"
        f", {t.data_parallel_bytes / 1e9:.2f} GB data-parallel a device"
        f"{f', tensor-parallel all-reduces {t.tp_comm_s * 1e3:.1f} ms' if p.tensor_parallel > 1 else ''})"
        f" + pipeline bubble {t.bubble_s * 1e3:.1f} ms",
        f"  tokens/s: {t.tokens_per_s:,.0f} ({t.tokens_per_s / p.world_size:,.0f} per device)",
        f"  {target:.3g} tokens{' (20 per parameter, Chinchilla)' if not target_tokens else ''}: "
        f"{duration(seconds)}, ${price * seconds / 3600:,.0f} at ${price:,.2f}/h",
    ]
    if preemptions is not None:
        lines.append(preemptions.format(seconds, t.step_s, cluster.nodes, price))
    return "\n".join(lines)
