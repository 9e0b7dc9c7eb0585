"""`kiln plan`: flags (or a run config) -> the planner's table."""

from __future__ import annotations

import argparse
import dataclasses
import math

from kiln.config import RunConfig, field_range, load_config
from kiln.errors import ConfigError
from kiln.knobs import span
from kiln.layout_rules import deepspeed_refusal
from kiln.model import FLAVOURS, GPTConfig, config_for
from kiln.plan.memory import PlanInput, plan_input
from kiln.plan.options import format_table

DEFAULT_VOCAB = 50304  # GPT-2's 50257, padded to a multiple of 64


def plan_from_args(args: argparse.Namespace) -> str:
    _check_flags(args)
    cfg: RunConfig = load_config(args.config, args.overrides)
    if args.config and not (args.vocab_size and args.seq_len):
        cfg = _with_data_shapes(cfg)
    flavour = args.model or cfg.model.flavour
    if flavour not in FLAVOURS:
        raise ConfigError(f"--model {flavour!r} is not a flavour: expected one of {list(FLAVOURS)}")
    shape = {
        "vocab_size": args.vocab_size or cfg.model.vocab_size or DEFAULT_VOCAB,
        "activation_checkpointing": cfg.model.activation_checkpointing,
    }
    seq = args.seq_len or cfg.model.seq_len
    if seq:
        shape["seq_len"] = seq
    model: GPTConfig = config_for(flavour, **shape)
    cluster = None
    if args.cluster:
        from kiln.devices import DEVICES
        from kiln.plan.throughput import cluster_from_yaml

        cluster = cluster_from_yaml(args.cluster, args.nodes)
        args.world_size = args.world_size or cluster.world_size
        args.device_memory_gib = args.device_memory_gib or DEVICES[cluster.node.device].memory_gib
    base = plan_input(cfg, model, cfg.parallel.device_memory_gib or 80.0)
    if not args.config and not any(o.startswith("parallel.use_gpu=") for o in args.overrides):
        # A plan is per device of --device-memory-gib: a GPU's, unless a config's workers are
        # CPUs. (Kiln's DeepSpeed layout differs on GPUs: autocast at ZeRO-0, overlapped buckets.)
        base = dataclasses.replace(base, use_gpu=True)
    offload = {"none": ("none", "none"), "optimizer": ("cpu", "none"), "optimizer+params": ("cpu", "cpu")}
    changes = {
        "world_size": args.world_size,
        "device_memory_gib": args.device_memory_gib,
        "micro_batch": args.micro_batch,
        "precision": args.precision,
        "zero_stage": args.zero_stage,
        "activation_checkpointing": args.activation_checkpointing,
        "pipeline_stages": args.pipeline_stages,
        "micro_batches": args.micro_batches,
        "optimizer": args.optimizer,
        "tensor_parallel": args.tensor_parallel,
    }
    if args.offload:
        changes["offload_optimizer"], changes["offload_params"] = offload[args.offload]
    base = dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
    _check(base)
    per_node = cluster.node.devices if cluster else 8  # the usual 8-GPU node
    if cluster is None:
        return format_table(base, per_node) + elastic_advice(cfg)
    from kiln.plan.throughput import Preemptions, format_estimate

    if base.world_size > cluster.world_size:
        raise ConfigError(
            f"--world-size {base.world_size} is more than the {cluster.world_size} devices of {cluster.source}"
        )
    t = cfg.train
    preemptions = Preemptions(args.preemptions_per_hour, t.checkpoint_every, t.checkpoint_every_minutes)
    return (
        format_table(base, per_node)
        + "\n\n"
        + format_estimate(
            base, cluster, args.mfu, args.target_tokens, args.usd_per_hour, t.grad_accum_steps, preemptions
        )
        + elastic_advice(cfg)
    )


def elastic_advice(cfg: RunConfig) -> str:
    """For an elastic run: where its memory was planned, and how often to checkpoint. Every
    resize resumes the newest checkpoint, so it repeats the steps since; Ray looks for room to
    grow every parallel.resize_check_s, and a spot node can go at any time."""
    p, t = cfg.parallel, cfg.train
    if not p.elastic:
        return ""
    every = [f"every {t.checkpoint_every} steps"] if t.checkpoint_every else []
    if t.checkpoint_every_minutes:
        every.append(f"every {t.checkpoint_every_minutes:g} min")
    return (
        f"\n\nelastic: parallel.num_workers = {p.num_workers}; memory is planned for {p.min_workers} worker(s), "
        f"the most each holds. Each resize resumes the newest checkpoint and repeats the steps since: checkpoint "
        f"at least every {p.resize_check_s:g} s (parallel.resize_check_s), e.g. train.checkpoint_every_minutes = "
        f"{p.resize_check_s / 60:.2g}; now {' and '.join(every) or 'never (each resize starts again at step 0)'}."
    )


def _with_data_shapes(cfg: RunConfig) -> RunConfig:
    """The config's vocab and seq len from its dataset where that is readable from here."""
    from kiln.data.check import resolve_against_data
    from kiln.errors import KilnError

    try:
        return resolve_against_data(cfg)[0]
    except KilnError:  # planning ahead of the data: the flavour's defaults
        return cfg


# Flags that set a run-config field take that field's range (kiln.config); the rest their own.
_FIELD_OF_FLAG = {
    "seq_len": "model.seq_len",
    "vocab_size": "model.vocab_size",
    "world_size": "parallel.num_workers",
    "micro_batch": "train.micro_batch_size",
    "pipeline_stages": "parallel.pipeline_stages",
    "micro_batches": "parallel.micro_batches",
    "device_memory_gib": "parallel.device_memory_gib",
    "tensor_parallel": "parallel.tensor_parallel",
}
_OWN_RANGE = {
    "nodes": span(1, 100_000),
    "target_tokens": span(0, 1e18, "a number", lo_open=True),
    "usd_per_hour": span(0, 1e9, "a number", lo_open=True),
    "mfu": span(0, 1, "a fraction", lo_open=True),
    "preemptions_per_hour": span(0, 100, "a number", lo_open=True),
}


def _check_flags(args: argparse.Namespace) -> None:
    """Numbers given on the command line: finite, positive, and within their field's range."""
    for name in [*_FIELD_OF_FLAG, *_OWN_RANGE]:
        value = getattr(args, name, None)
        if value is None:
            continue
        ok, allowed = _OWN_RANGE[name] if name in _OWN_RANGE else field_range(_FIELD_OF_FLAG[name])
        if not (math.isfinite(value) and value > 0 and ok(value)):
            raise ConfigError(f"--{name.replace('_', '-')} = {value}: expected {allowed}, and > 0")


def _check(p: PlanInput) -> None:
    for name in ("world_size", "micro_batch", "pipeline_stages", "micro_batches", "tensor_parallel"):
        if getattr(p, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} = {getattr(p, name)}: expected an integer >= 1")
    if p.device_memory_gib <= 0:
        raise ConfigError(f"--device-memory-gib = {p.device_memory_gib}: expected a number > 0")
    m = p.model
    refusal = (
        p.dims.problem("--world-size", _flag)
        or p.dims.model_problem(m.n_head, m.kv_heads, m.hidden, _flag)
        or deepspeed_refusal(
            p.zero_stage, p.offload_optimizer, p.offload_params, p.pipeline_stages, p.tensor_parallel, _flag
        )
    )
    if refusal:
        raise ConfigError(refusal)


def _flag(setting: str) -> str:
    """How `kiln plan` spells a parallel setting: its flag (both offloads are --offload)."""
    return "--offload" if setting.startswith("offload") else "--" + setting.replace("_", "-")
