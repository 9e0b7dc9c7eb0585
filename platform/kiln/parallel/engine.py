"""Kiln config -> DeepSpeed: the config dict, and the engine around a plain GPT.

The model stays a plain nn.Module; everything DeepSpeed-specific is here (and the pipeline
wrapping in `kiln.parallel.pipeline`). ZeRO stages 0-3, CPU/NVMe offload, ZeRO-3's partitioned
construction and pipeline stages are all chosen from `parallel.*`.
"""

from __future__ import annotations

import copy
import logging
import shutil
from typing import Any

import torch
from torch import nn

from kiln import lora
from kiln.config import RunConfig
from kiln.core.collectives import ranks
from kiln.core.engine import Engine
from kiln.core.optim import StepGate, build_optimizer, build_scheduler, gate_optimizer, param_groups
from kiln.core.process import WorldInfo, prepare_process
from kiln.devices import name_deepspeed_accelerator
from kiln.errors import ConfigError
from kiln.hf_checkpoint import init_from_dir
from kiln.layout_rules import deepspeed_reduction
from kiln.model import GPT, GPTConfig
from kiln.model_size import num_params
from kiln.parallel.clipping import install_fp32_clipping
from kiln.parallel.comm_timer import CollectiveTimer
from kiln.parallel.deepspeed_engine import DeepSpeedEngine
from kiln.parallel.fsdp2_engine import FSDP2Engine, ensure_process_group, shard
from kiln.parallel.ops import init_distributed
from kiln.parallel.own_communication import own_communication_engine
from kiln.parallel.pipeline import check_coords, to_pipeline
from kiln.parallel.tensor_parallel import partition_config
from kiln.redact import redact_tree
from kiln.topology import ParallelDims

log = logging.getLogger(__name__)


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _offload(device: str, cfg: RunConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": cfg.parallel.use_gpu}  # pinned: faster H2D
    if device == "nvme":
        out["nvme_path"] = cfg.parallel.nvme_path
    return out


def deepspeed_config(cfg: RunConfig, data_parallel_size: int, mcfg: GPTConfig | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a run: Kiln's own (`kiln_deepspeed_config`), with
    `parallel.deepspeed` merged over it."""
    return deep_merge(kiln_deepspeed_config(cfg, data_parallel_size, mcfg), cfg.parallel.deepspeed)


def kiln_deepspeed_config(cfg: RunConfig, data_parallel_size: int, mcfg: GPTConfig | None = None) -> dict[str, Any]:
    """What Kiln's own fields say DeepSpeed should do (`mcfg`: the model's shape, which ZeRO-3's
    persistence threshold and tensor parallelism's partition specs read)."""
    t, p = cfg.train, cfg.parallel
    d_model = mcfg.d_model if mcfg else 0
    stage = p.deepspeed_stage  # 0 where Kiln moves the replicas' data
    zero: dict[str, Any] = {"stage": stage}
    params = num_params(mcfg, False) if mcfg is not None else 0
    adapters = lora.adapter_params(mcfg, cfg.model.lora) if mcfg is not None else 0
    # A bucket no larger than the gradients it holds (the passthrough's, where it sets one);
    # overlapping the reduction with the backward pays only on GPUs, and at ZeRO-2 only for
    # more than one bucket.
    bucket, overlap = deepspeed_reduction(
        stage, p.use_gpu, params, adapters, int(p.deepspeed_zero("reduce_bucket_size") or 0)
    )
    if stage >= 1 and mcfg is not None:
        zero["reduce_bucket_size"] = bucket
    if stage >= 2:  # contiguous gradient buffers avoid fragmentation
        zero.update(contiguous_gradients=True, overlap_comm=overlap)
    if stage == 3 and d_model:
        # Parameters smaller than this stay whole on every rank (gathering them costs more than
        # it saves). DeepSpeed's default (1e5 elements) would keep a small model entirely
        # unpartitioned; 10 x d_model keeps just norms and biases whole (as HF's "auto" does).
        zero["stage3_param_persistence_threshold"] = 10 * d_model
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(p.offload_optimizer, cfg)
    if p.offload_params != "none":
        zero["offload_param"] = _offload(p.offload_params, cfg)
    micro_batches = cfg.micro_batches_per_step
    autocast = cfg.autocast
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": t.micro_batch_size * micro_batches * data_parallel_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16" and not autocast},
        # fp32 weights, bf16 matmuls (DeepSpeed wraps the forward in torch.autocast).
        "torch_autocast": {"enabled": autocast, "dtype": "bfloat16"},
        # Dynamic loss scaling (loss_scale 0): start at 2^16, halve on overflow and skip the step.
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Kiln passes a torch optimizer it built itself (param groups, fused/foreach impl).
        "zero_allow_untested_optimizer": True,
        # Offload with an optimizer other than Adam(W) runs that torch optimizer on the host.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,  # Kiln does its own logging
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default, `synchronized: true`) waits for the device
        # at every forward and every step to time the steps Kiln's meter times already: two
        # drains of the GPU's queue a step. Off, the host queues the next work while the GPU runs.
        "timers": {"throughput": {"enabled": False}},
    }
    if p.grad_compression in ("bf16", "fp16"):  # (PowerSGD is Kiln's own: kiln.parallel.powersgd)
        ds["communication_data_type"] = p.grad_compression  # DeepSpeed names bf16 and fp16 alike
    if p.tensor_parallel > 1:
        ds["tensor_parallel"] = {"autotp_size": p.tensor_parallel}
        if mcfg is not None:
            ds["tensor_parallel"]["partition_config"] = partition_config(mcfg)
    return ds


# The DeepSpeed settings Kiln sets from its own fields: the passthrough may not say otherwise.
OWNED = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "train_batch_size": "train.micro_batch_size x train.grad_accum_steps x data-parallel size",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_param.device": "parallel.offload_params",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "torch_autocast.enabled": "train.mixed_precision",
    "tensor_parallel.autotp_size": "parallel.tensor_parallel",
    "communication_data_type": "parallel.grad_compression",
}
REFUSED = {"optimizer": "optim", "scheduler": "schedule"}  # Kiln builds these itself


def check_passthrough(cfg: RunConfig) -> None:
    """Before launch: `parallel.deepspeed` may add what Kiln does not model, never contradict
    what it does (the merge would win silently, and the planner and checkpoints would be wrong)."""
    from kiln.errors import ConfigError

    ours = _leaves(kiln_deepspeed_config(cfg, cfg.data_parallel_size))
    ours.setdefault("tensor_parallel.autotp_size", cfg.parallel.tensor_parallel)  # 1 writes no section
    for key, value in _leaves(cfg.parallel.deepspeed).items():
        top = key.split(".")[0]
        if top in REFUSED:
            raise ConfigError(
                f"parallel.deepspeed.{top}: Kiln builds the {top} itself; set the {REFUSED[top]} section instead"
            )
        if key in OWNED and key in ours and value != ours[key]:
            raise ConfigError(
                f"parallel.deepspeed.{key} contradicts {OWNED[key]}, which makes it {ours[key]!r}; "
                f"set {OWNED[key].split(' ')[0]} instead"
            )


def check_with_deepspeed(cfg: RunConfig) -> None:
    """Before launch: DeepSpeed's own parser reads the merged config (with a passthrough only),
    so a misspelt or out-of-range setting of one of its sections (`zero_optimization`,
    `flops_profiler`, ...) is refused here, not on every worker. Top-level keys DeepSpeed does
    not know it ignores, and so does this check."""
    if not cfg.parallel.deepspeed:
        return
    import logging

    from kiln.errors import ConfigError

    name_deepspeed_accelerator(cfg.parallel.use_gpu)
    from deepspeed.runtime.config import DeepSpeedConfig

    merged = deepspeed_config(cfg, cfg.data_parallel_size)
    merged.pop("train_batch_size")  # checked against the processes DeepSpeed sees: here, one
    ds_log = logging.getLogger("DeepSpeed")
    level = ds_log.level
    ds_log.setLevel(logging.WARNING)  # its INFO lines would reach the console
    try:
        DeepSpeedConfig(merged)
    except (ValueError, TypeError, KeyError, AssertionError) as e:  # pydantic's ValidationError is a ValueError
        said = " ".join(
            line.strip() for line in str(e).splitlines() if line.strip() and "errors.pydantic.dev" not in line
        )
        raise ConfigError(f"parallel.deepspeed: DeepSpeed's config parser refuses it: {said}") from None
    finally:
        ds_log.setLevel(level)


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---- ops that offload needs, checked before launch ---------------------------------------------
def check_offload_ops(cfg: RunConfig) -> None:
    """Refuse, naming the op, an offload whose DeepSpeed op cannot be built on this machine."""
    p = cfg.parallel
    needed = []
    if cfg.cpu_adam:
        needed.append(("cpu_adam", "parallel.offload_optimizer"))
    if "nvme" in (p.offload_optimizer, p.offload_params):
        needed.append(("async_io", "parallel.offload_* = 'nvme'"))
    for op, field in needed:
        problem = op_unavailable(op)
        if problem:
            raise ConfigError(f"{field} needs DeepSpeed's {op!r} op, which cannot be built here: {problem}")


def op_unavailable(op: str) -> str | None:
    """Why DeepSpeed's op cannot be built or loaded here, or None if it can."""
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    builder = {"cpu_adam": CPUAdamBuilder, "async_io": AsyncIOBuilder}[op]()
    try:
        if builder.is_compatible(verbose=False):
            pass
        else:
            extra = " (install libaio-dev: apt install libaio-dev)" if op == "async_io" else ""
            return f"DeepSpeed reports it incompatible with this system{extra}"
    except Exception as e:  # a builder probing for libraries can itself fail
        return f"{type(e).__name__}: {e}"
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.NAME):  # prebuilt into the wheel (DS_BUILD_*=1)
        return None
    if not shutil.which("ninja") and not _has_ninja_module():
        return "it is not prebuilt and JIT compiling needs ninja (pip install ninja)"
    if not (shutil.which("c++") or shutil.which("g++")):
        return "it is not prebuilt and JIT compiling needs a C++ compiler (apt install g++)"
    return None


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True


# ---- building the engine -------------------------------------------------------------------------
def build_model(cfg: RunConfig, mcfg: GPTConfig, ds_config: dict, device: torch.device) -> nn.Module:
    """The model with its initial weights, never held whole in host RAM on its way to `device`.

    ZeRO-3 constructs it partitioned (no rank ever holds all of it); otherwise it is built on the
    meta device (shapes only) and materialized on `device` (lazy initialization). Either way
    the RNG is re-seeded just before the init, so every build gives the same weights for a seed.
    With model.init_from, the checkpoint's weights then replace the random ones.
    """
    pretrained = _pretrained_weights(cfg, mcfg)
    if not _partitioned_build(cfg):
        return build_whole_model(cfg, mcfg, device, pretrained)
    import deepspeed

    remote = "cpu" if cfg.parallel.offload_params == "cpu" else None
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=remote):
        model = GPT(mcfg, init_weights=False)
    # Each weight is partitioned as soon as its module is built, so the init runs per module
    # on the gathered weight, on rank 0, and is scattered back. Same order as nn.Module.apply
    # (children first), so the RNG draws, hence the weights, equal an unpartitioned build.
    torch.manual_seed(cfg.train.seed)
    names = {m: n for n, m in model.named_modules()}
    for module in _post_order(model):
        own = list(module.named_parameters(recurse=False))
        with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
            if pretrained is None:
                model.init_module(module)
            elif _rank() == 0:
                prefix = names[module] + "." if names[module] else ""
                for name, p in own:
                    p.data.copy_(pretrained[prefix + name])
    return model


def build_whole_model(
    cfg: RunConfig, mcfg: GPTConfig, device: torch.device, pretrained: dict[str, torch.Tensor] | None
) -> nn.Module:
    """The whole model on `device`: built on the meta device (shapes only), materialized there,
    then given `pretrained`'s weights or the seeded init."""
    with torch.device("meta"):
        model = GPT(mcfg, init_weights=False)
    model.to_empty(device=device)  # uninitialized memory: every tensor is filled below
    model.tie()  # materializing makes new tensors: tie them again
    if pretrained is not None:
        model.load_state_dict(pretrained, strict=True)
        return model
    for module in model.modules():  # the modules' own defaults (norms' ones and zeros)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    torch.manual_seed(cfg.train.seed)
    model.apply(model.init_module)
    return model


def _partitioned_build(cfg: RunConfig) -> bool:
    """DeepSpeed's ZeRO-3 builds the model partitioned (`deepspeed.zero.Init`); every other
    layout, FSDP2's too (it shards a whole model), builds it whole on each rank."""
    return cfg.parallel.engine == "deepspeed" and cfg.parallel.zero_stage == 3


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _pretrained_weights(cfg: RunConfig, mcfg: GPTConfig) -> dict[str, torch.Tensor] | None:
    """model.init_from's weights in Kiln's names; under ZeRO-3 only rank 0 reads them (it
    scatters each weight as the partitioned model is filled)."""
    if not cfg.model.init_from or (_partitioned_build(cfg) and _rank() != 0):
        return None
    from kiln.hf_checkpoint import load

    return load(init_from_dir(cfg.model.init_from, cfg.data.s3_endpoint, cfg.data.s3_region), mcfg)


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def build_optimizer_for(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed steps: fused where torch has a fused kernel, and
    DeepSpeed's vectorised CPU Adam under optimizer offload."""
    o = cfg.optim
    if cfg.cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            param_groups(model, o.weight_decay, o.no_decay, _full_shape),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            adamw_mode=o.spec.decoupled,
        )
    return build_optimizer(model, o, shape_of=_full_shape)


def _full_shape(p: nn.Parameter) -> tuple:
    """A parameter's shape; a ZeRO-3 partitioned weight is a flat shard, its real shape `ds_shape`."""
    return getattr(p, "ds_shape", p.shape)


def build_engine(cfg: RunConfig, mcfg: GPTConfig, world: WorldInfo) -> tuple[Engine, object]:
    """(engine, scheduler) for `train_loop` on this rank: the process seeded first (the model's
    init draws from it), then a GPT of shape `mcfg` wrapped as `parallel.*` says."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # Kiln logs its own progress
    prepare_process(cfg.parallel, cfg.train.seed, world)
    gate = StepGate()  # the health guard's way to withhold a bad step from the optimizer
    dims = ParallelDims.of(cfg.parallel, world.world_size)
    problem = dims.node_problem(world.local_world_size, cfg.parallel.tp_within_node)
    if problem:
        raise ConfigError(problem)
    scheduler_fn = lambda opt: build_scheduler(gate_optimizer(opt, gate), cfg.schedule, cfg.train.max_steps, gate)  # noqa: E731
    if cfg.parallel.engine == "fsdp2":
        return initialize_fsdp2(cfg, mcfg, world.device, scheduler_fn)
    engine, scheduler = initialize(
        cfg, mcfg, dims.data_parallel_size, world.device, scheduler_fn, local_ranks=world.local_world_size
    )
    if dims.pipeline_stages > 1:
        check_coords(engine, world.rank, dims)
    timer = None
    if dims.tensor_parallel > 1:
        timer = CollectiveTimer(engine.mpu.get_tensor_model_parallel_group(), world.device.type == "cuda")
        timer.install()
    wrapped = DeepSpeedEngine(engine, pipeline=dims.pipeline_stages > 1, comm_timer=timer)
    return own_communication_engine(wrapped, cfg, gate), scheduler


def initialize_fsdp2(cfg: RunConfig, mcfg: GPTConfig, device: torch.device, scheduler_fn) -> tuple[FSDP2Engine, object]:
    """(engine, scheduler) under `parallel.engine: fsdp2`: the whole model built and seeded as
    for DeepSpeed's ZeRO 0-2 (so both engines start from the same weights), then sharded."""
    ensure_process_group(device.type == "cuda")
    model = build_whole_model(cfg, mcfg, device, _pretrained_weights(cfg, mcfg))
    p = cfg.parallel
    shard(model, p.zero_stage, cfg.train.precision, device, cfg.train.compile, p.grad_compression, p.fsdp2_unit_params)
    optimizer = build_optimizer(model, cfg.optim, sharded=True)
    scheduler = scheduler_fn(optimizer)
    return FSDP2Engine(model, optimizer, scheduler, cfg.micro_batches_per_step, cfg.train.grad_clip), scheduler


def initialize(
    cfg: RunConfig, mcfg: GPTConfig, data_parallel_size: int, device: torch.device, scheduler_fn, local_ranks: int = 1
):
    """(engine, scheduler): a DeepSpeedEngine, or a PipelineEngine when pipeline_stages > 1.
    `local_ranks`: the run's ranks on this host, which DeepSpeed's CPU accelerator is told."""
    name_deepspeed_accelerator(device.type == "cuda", local_ranks)
    init_distributed(device.type == "cuda")  # a PipelineModule needs the comm layer before deepspeed.initialize
    import deepspeed

    ds_config = deepspeed_config(cfg, data_parallel_size, mcfg)
    if cfg.parallel.pipeline_stages > 1:
        model = to_pipeline(
            build_model(cfg, mcfg, ds_config, torch.device("cpu")), cfg.parallel, mcfg.activation_checkpointing
        )
    else:
        model = build_model(cfg, mcfg, ds_config, device)
    if cfg.model.lora.on:  # ZeRO 0-2 only (the config says so): the model is whole here
        lora.apply(model, cfg.model.lora, cfg.train.seed)
    if cfg.train.compile:
        # In place (nn.Module.compile): the state dict keeps its names, so compiled and eager
        # runs share checkpoints. Compilation happens at the first forward, inside step 1.
        model.compile()
    optimizer = build_optimizer_for(model, cfg)
    scheduler = scheduler_fn(optimizer)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        mpu=tensor_parallel_groups(cfg.parallel.tensor_parallel),
    )
    # DeepSpeed has parsed its config by now, and keeps the raw dict only to save it into every
    # checkpoint (`ds_config`): masked, a secret in the passthrough never reaches a checkpoint.
    engine.config = redact_tree(engine.config)
    install_fp32_clipping(engine)
    skip_lone_allreduce(engine, cfg)
    return engine, scheduler


def tensor_parallel_groups(k: int):
    """None without tensor parallelism; else DeepSpeed's groups module with its (data, tensor)
    mesh made, passed to `deepspeed.initialize` as the mpu. That is what `tp_model_init` does
    inside DeepSpeed; passing it also makes DeepSpeed's config count the data-parallel ranks
    (world / k), not the world, in `train_batch_size`."""
    if k == 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=k)
    return groups


def skip_lone_allreduce(engine, cfg: RunConfig) -> None:
    """No gradient all-reduce in a one-process run at ZeRO-0.

    DeepSpeed's ZeRO-0 path all-reduces the gradients at every accumulation boundary even when
    the process group holds one rank: it flattens them into buckets, runs the collective,
    divides by 1 and copies them back (1.6 ms of a 100 ms step of the `debug` GPT on 2 CPU
    cores, measured with cProfile). Averaging over one rank is the identity, so the result is
    the same without it. ZeRO 1-3 reduce inside their own optimizer, and a pipeline reduces
    per stage; both are left alone.
    """
    if cfg.parallel.zero_stage == 0 and cfg.parallel.pipeline_stages == 1 and ranks() == 1:
        engine.enable_backward_allreduce = False
