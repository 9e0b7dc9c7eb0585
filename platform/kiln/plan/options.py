"""`kiln plan`'s choices: every ZeRO stage x offload x checkpointing option at a run's scale
that its layout allows, ranked by a rough cost, the cheapest that fits, the table, and the
trainer's pre-launch refusal naming the first option that fits. Each option's memory is
`kiln.plan.memory.estimate`'s."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from kiln.layout_rules import deepspeed_refusal, offloads, own_communication, sync_layout_refusal
from kiln.lora import layout_problem
from kiln.model_size import num_params
from kiln.plan.memory import GIB, Estimate, PlanInput, estimate
from kiln.topology import ParallelDims
from kiln.ui import table

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
    allows (`kiln.layout_rules.deepspeed_refusal`: a pipeline keeps ZeRO 0-1 and no offload),
    cheapest first."""
    out = []
    choices = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"))
    for stage, ckpt, (opt_off, par_off) in itertools.product((0, 1, 2, 3), (False, True), choices):
        if (
            deepspeed_refusal(stage, opt_off, par_off, base.pipeline_stages, base.tensor_parallel, engine=base.engine)
            is None
            and not _lora_refuses(base, stage, base.tensor_parallel)
            and not _sync_refuses(base, stage, base.tensor_parallel, offloads(opt_off, par_off))
        ):
            p = dataclasses.replace(
                base, zero_stage=stage, activation_checkpointing=ckpt, offload_optimizer=opt_off, offload_params=par_off
            )
            out.append(Option(p, estimate(p)))
    # Equal cost: least memory first, since headroom buys a larger micro-batch.
    return sorted(out, key=lambda o: (o.cost, o.estimate.total))


def _sync_refuses(base: PlanInput, stage: int, tensor_parallel: int, offload: bool = False) -> bool:
    """A local-SGD, DiLoCo or PowerSGD run's options keep to the layouts Kiln communicates in
    itself (`kiln.layout_rules.sync_layout_refusal`)."""
    refusal = sync_layout_refusal(
        base.sync, base.grad_compression, base.engine, stage, base.pipeline_stages, tensor_parallel, offload
    )
    return refusal is not None


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
            and not _sync_refuses(base, 0, t)
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
        "buckets",
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
                gib(est.buckets),
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
        own = own_communication(base.sync, base.grad_compression)
        more = "pipeline stages or tensor parallelism" if own is None else f"or leave {own} (ZeRO shards)"
        lines.append(f"nothing fits: lower the micro-batch, add devices, {more}")
    lines += tensor_parallel_lines(base, per_node)
    lines.append(
        "cost: rough relative step time (checkpointing x1.33, ZeRO-3 x1.15, offload x1.5 / x2.5, "
        "tensor parallelism x1.1 per doubling)"
    )
    return "\n".join(lines)


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
            ("gradient buckets", est.buckets),
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
