"""The rules that judge a parallel layout, torch-free: which ZeRO, offload, pipeline and
tensor-parallel combinations each engine serves (`deepspeed_refusal`), and where Kiln's own
data-parallel communication runs (`sync_layout_refusal`). `kiln.topology.ParallelConfig.check`
applies them to a run; `kiln plan` lists only the options they allow."""

from __future__ import annotations

from collections.abc import Callable


def parallel_field(setting: str) -> str:
    """How a run config names a parallel setting (`kiln plan` names its flags instead)."""
    return f"parallel.{setting}"


def sharding_of(engine: str, zero_stage: int) -> str:
    return f"ZeRO-{zero_stage}" if engine == "deepspeed" else f"FSDP2 (ZeRO-{zero_stage})"


def offloads(offload_optimizer: str, offload_params: str) -> bool:
    """Whether a layout moves anything off the device (`parallel.offload_*` other than 'none')."""
    return (offload_optimizer, offload_params) != ("none", "none")


def own_communication(sync: str, grad_compression: str) -> str | None:
    """The setting under which Kiln, not the engine, moves the replicas' data
    (`kiln.parallel.replica_engine`), as a config names it; None: the engine does."""
    if sync != "every_step":
        return f"parallel.sync = {sync!r}"
    if grad_compression == "powersgd":
        return "parallel.grad_compression = 'powersgd'"
    return None


def own_zero_stages(sync: str, grad_compression: str) -> tuple[int, ...]:
    """The ZeRO stages Kiln's own communication serves. PowerSGD leaves every replica the same
    averaged gradients, so ZeRO-1's optimizer-state sharding composes with it
    (`kiln.parallel.optimizer_shards`); a sync's replicas step their own optimizers on their own
    gradients, which leaves nothing to shard."""
    return (0, 1) if sync == "every_step" and grad_compression == "powersgd" else (0,)


def deepspeed_zero_stage(zero_stage: int, sync: str, grad_compression: str) -> int:
    """The stage DeepSpeed runs at: 0 under Kiln's own communication (Kiln shards the optimizer
    at `parallel.zero_stage` 1 itself), else `parallel.zero_stage`."""
    return 0 if own_communication(sync, grad_compression) else zero_stage


DEEPSPEED_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default `reduce_bucket_size` in elements (0.19: `ZeroConfig.reduce_bucket_size`)."""


def reduce_bucket_elements(params: int, adapters: int = 0, configured: int = 0) -> int:
    """The gradient bucket DeepSpeed's ZeRO runs with, in elements, for a model of `params`
    parameters (`adapters`: LoRA's, which alone train where there are any): `configured` where
    the run's `parallel.deepspeed` sets `reduce_bucket_size`, else DeepSpeed's default or all the
    trained gradients, whichever is fewer. A bucket is reduced when the next gradient would overflow it, so one that holds every
    gradient already reduces once per step, as DeepSpeed's default does for any model under 500M
    parameters; more only holds memory, which ZeRO-1/2 allocate at every backward and ZeRO-3
    keeps for the run (`deepspeed_grad_buckets`): 3.7 GiB for gpt2-124m at ZeRO-2 on a GPU."""
    return configured or min(DEEPSPEED_REDUCE_BUCKET, adapters or params)


def deepspeed_overlaps_comm(
    deepspeed_stage: int, use_gpu: bool, trained_params: int, bucket_elements: int, configured: bool | None = None
) -> bool:
    """Whether DeepSpeed runs ZeRO-2/3 with `overlap_comm` under Kiln's config (`configured`: the
    run's `parallel.deepspeed` setting, which wins). Only on GPUs, where communication has a
    stream of its own. ZeRO-3: on, as DeepSpeed's default, since it also gathers the weights on a
    stream of their own ahead of the modules that need them. ZeRO-2: only where the trained
    gradients fill more than one bucket (`reduce_bucket_elements`). One bucket is reduced after
    the backward's last gradient, with nothing left to overlap, while `overlap_comm` still doubles
    the bucket and synchronizes the device at each reduction (DeepSpeed 0.19's
    `stage_1_and_2.py`: `allreduce_and_copy` and the backward's epilogue)."""
    if configured is not None:
        return configured
    if not use_gpu or deepspeed_stage < 2:
        return False
    return deepspeed_stage == 3 or trained_params > bucket_elements


def deepspeed_reduction(
    deepspeed_stage: int,
    use_gpu: bool,
    params: int,
    adapters: int = 0,
    configured_bucket: int = 0,
    configured_overlap: bool | None = None,
) -> tuple[int, bool]:
    """DeepSpeed's gradient bucket in elements and whether its reduction overlaps the backward,
    for a model of `params` parameters (`adapters`: LoRA's, which alone train), as Kiln's
    DeepSpeed config sets them and the planners count them (`reduce_bucket_elements`,
    `deepspeed_overlaps_comm`; the configured values are the run's `parallel.deepspeed`)."""
    bucket = reduce_bucket_elements(params, adapters, configured_bucket)
    return bucket, deepspeed_overlaps_comm(deepspeed_stage, use_gpu, adapters or params, bucket, configured_overlap)


def deepspeed_grad_buckets(deepspeed_stage: int, overlaps_comm: bool) -> int:
    """How many gradient buckets (`reduce_bucket_elements` each, in the gradients' dtype) DeepSpeed
    holds on a device: none at ZeRO-0; at ZeRO-1/2 one during each backward, two where it
    overlaps the reduction (`deepspeed_overlaps_comm`: a double buffer); at ZeRO-3 one, for the
    whole run (`stage_1_and_2.py`'s `setup_buckets` and `stage3.py`'s IPG buffer in DeepSpeed
    0.19, both under `contiguous_gradients`, which Kiln keeps on)."""
    if deepspeed_stage == 0:
        return 0
    return 2 if deepspeed_stage < 3 and overlaps_comm else 1


FSDP2_UNIT_PARAMS = 100_000_000
"""`parallel.fsdp2_unit_params`' default: torch FSDP's `size_based_auto_wrap_policy` min_num_params."""


def fsdp2_blocks_per_unit(block_params: int, n_blocks: int, min_unit_params: int) -> int:
    """How many consecutive transformer blocks make one FSDP2 unit: the fewest that hold
    `min_unit_params` parameters (`parallel.fsdp2_unit_params`; 0: one), at most all of them.
    The last unit may hold fewer."""
    if min_unit_params <= 0 or block_params <= 0:
        return 1
    return max(1, min(n_blocks, -(-min_unit_params // block_params)))


def sync_layout_refusal(
    sync: str,
    grad_compression: str,
    engine: str,
    zero_stage: int,
    pipeline_stages: int,
    tensor_parallel: int,
    offload: bool = False,
) -> str | None:
    """Why Kiln's own communication (local SGD, DiLoCo, PowerSGD) cannot run on this layout, for
    `kiln train` and the options `kiln plan` lists; None where it can. Each replica holds whole
    gradients and weights under DeepSpeed's ZeRO-0 engine, which ZeRO 2-3 and FSDP2 shard over
    the replicas and reduce themselves; PowerSGD also runs at ZeRO-1 (`own_zero_stages`); a
    pipeline or tensor-parallel group would have to move its parts in step."""
    own = own_communication(sync, grad_compression)
    if own is None:
        return None
    stages = own_zero_stages(sync, grad_compression)
    if engine != "deepspeed" or zero_stage not in stages:
        served = " or ".join(str(s) for s in stages)
        return (
            f"{own} with {sharding_of(engine, zero_stage)}: Kiln moves whole replicas' gradients or "
            f"weights, which {'ZeRO 2-3' if 1 in stages else 'ZeRO 1-3'} and FSDP2 shard over the replicas "
            f"and reduce themselves; expected parallel.engine 'deepspeed' with parallel.zero_stage {served}"
        )
    if pipeline_stages > 1 or tensor_parallel > 1:
        return (
            f"{own} with parallel.pipeline_stages = {pipeline_stages} and parallel.tensor_parallel = "
            f"{tensor_parallel}: Kiln moves whole replicas only; expected both 1"
        )
    if offload:
        return (
            f"{own} with parallel.offload_*: the optimizer steps on the device, over the model's own "
            "fp32 weights; expected offload 'none'"
        )
    return None


def deepspeed_refusal(
    zero_stage: int,
    offload_optimizer: str,
    offload_params: str,
    pipeline_stages: int,
    tensor_parallel: int = 1,
    name: Callable[[str], str] = parallel_field,
    engine: str = "deepspeed",
) -> str | None:
    """Why the engine (DeepSpeed, or FSDP2) would reject (or silently mishandle) this ZeRO /
    offload / pipeline / tensor-parallel combination, naming each setting through `name`; None
    where it is legal. The one statement of these limits: `kiln train` validates with it, `kiln
    plan` checks its flags and lists only the options it allows."""
    if engine == "fsdp2":
        return _fsdp2_refusal(zero_stage, offload_optimizer, offload_params, pipeline_stages, tensor_parallel, name)
    if tensor_parallel > 1:
        refusal = _tensor_parallel_refusal(zero_stage, offload_optimizer, offload_params, pipeline_stages, name)
        if refusal:
            return refusal
    if pipeline_stages > 1 and zero_stage > 1:
        return (
            f"{name('zero_stage')} = {zero_stage} with {name('pipeline_stages')} = {pipeline_stages}: "
            "DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; expected 0 or 1"
        )
    if pipeline_stages > 1 and offloads(offload_optimizer, offload_params):
        return (
            f"{name('offload_*')} with {name('pipeline_stages')} > 1: DeepSpeed's pipeline engine does "
            "not offload; expected offload 'none'"
        )
    if offload_optimizer != "none" and zero_stage == 0:
        return (
            f"{name('offload_optimizer')} = {offload_optimizer!r} needs {name('zero_stage')} >= 1 (ZeRO "
            "partitions what it offloads); expected zero_stage 1, 2 or 3"
        )
    if offload_params != "none" and zero_stage != 3:
        return (
            f"{name('offload_params')} = {offload_params!r} needs {name('zero_stage')} = 3 (only stage 3 "
            "partitions parameters)"
        )
    return None


def _fsdp2_refusal(
    zero_stage: int,
    offload_optimizer: str,
    offload_params: str,
    pipeline_stages: int,
    tensor_parallel: int,
    name: Callable[[str], str],
) -> str | None:
    """What Kiln's FSDP2 engine serves: sharded weights, gradients and optimizer state, nothing
    layered on them yet."""
    engine = f"{name('engine')} = 'fsdp2'"
    if zero_stage not in (2, 3):
        return (
            f"{engine} with {name('zero_stage')} = {zero_stage}: FSDP2 shards gradients and optimizer state "
            "always; expected zero_stage 2 (weights kept gathered from forward to backward) or 3 (freed after "
            "the forward), or engine 'deepspeed' for ZeRO 0-1"
        )
    if pipeline_stages > 1 or tensor_parallel > 1:
        return (
            f"{engine} with {name('pipeline_stages')} = {pipeline_stages} and {name('tensor_parallel')} = "
            f"{tensor_parallel}: Kiln's FSDP2 engine is data-parallel only; expected both 1, or engine 'deepspeed'"
        )
    if offloads(offload_optimizer, offload_params):
        return (
            f"{engine} with {name('offload_*')}: Kiln's FSDP2 engine does not offload; expected offload "
            "'none', or engine 'deepspeed'"
        )
    return None


def _tensor_parallel_refusal(
    zero_stage: int, offload_optimizer: str, offload_params: str, pipeline_stages: int, name: Callable[[str], str]
) -> str | None:
    """AutoTP's limits as Kiln serves them (DeepSpeed 0.19, measured on CPU/gloo)."""
    tp = name("tensor_parallel")
    if pipeline_stages > 1:
        return (
            f"{tp} > 1 with {name('pipeline_stages')} = {pipeline_stages}: DeepSpeed's pipeline engine "
            "does not apply AutoTP; expected one of them to be 1"
        )
    if zero_stage == 3:
        return (
            f"{tp} > 1 with {name('zero_stage')} = 3: a tensor-parallel ZeRO-3 checkpoint cannot be "
            "consolidated for export yet; expected zero_stage 0, 1 or 2 (tensor parallelism already "
            "divides the weights)"
        )
    if offloads(offload_optimizer, offload_params):
        return (
            f"{tp} > 1 with {name('offload_*')}: Kiln does not run AutoTP with ZeRO-Offload (an untested "
            "combination); expected offload 'none'"
        )
    return None
