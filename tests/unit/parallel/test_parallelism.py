"""ZeRO 0-3, offload, pipeline stages, bf16 and FSDP2 compute the same thing, and save the memory
they promise. Real DeepSpeed and FSDP2 engines on CPU/gloo with the debug flavour, fp32, fixed seeds and data
order; no Ray (tests/integration runs a pipeline on a Ray cluster).

All configurations run in one torchrun process group (tests/unit/parallel/parallel_harness.py), so
torch, DeepSpeed and gloo start once; the single-worker reference runs in its own process.
"""

import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import launch as _harness  # noqa: E402

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

STEPS = 20

# Every optimizer under every ZeRO stage, 8 steps each (lr per optimizer: what trains the debug GPT).
OPTIMIZER_STEPS = 8
OPTIMIZERS = {
    "sgd": ["optim.name=sgd", "optim.lr=0.3", "optim.nesterov=true"],
    "adam": ["optim.name=adam", "optim.lr=3e-3"],
    "rmsprop": ["optim.name=rmsprop", "optim.lr=1e-3"],
    "lamb": ["optim.name=lamb", "optim.lr=2e-2"],
}
OPTIMIZER_RUNS = [
    {"name": f"{opt}-zero{stage}", "set": [*sets, f"parallel.zero_stage={stage}", f"train.max_steps={OPTIMIZER_STEPS}"]}
    for opt, sets in OPTIMIZERS.items()
    for stage in (0, 1, 2, 3)
] + [
    {
        "name": f"{opt}-fsdp2",
        "set": [*sets, "parallel.engine=fsdp2", "parallel.zero_stage=3", f"train.max_steps={OPTIMIZER_STEPS}"],
    }
    for opt, sets in OPTIMIZERS.items()
]
FSDP2 = ["parallel.engine=fsdp2", "parallel.zero_stage=3"]
LORA = ["model.lora.rank=4", "optim.lr=1e-2"]  # every projection of every block

SGD_UNCLIPPED = ["parallel.zero_stage=0", "optim.name=sgd", "optim.lr=0.03", "optim.nesterov=true", "train.grad_clip=0"]
DILOCO = ["parallel.zero_stage=0", "parallel.sync=diloco"]
PLAIN_OUTER = ["parallel.outer_lr=1", "parallel.outer_momentum=0"]
POWERSGD = [
    "parallel.zero_stage=0",
    "parallel.grad_compression=powersgd",
    "parallel.powersgd_rank=2",
    "parallel.powersgd_start_step=3",
]

ACCUMULATED = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]
# Same global batch everywhere: 8 sequences per step, as 2 ranks x 4, or 2 micro-batches x 4.
REFERENCE = [{"name": "reference", "set": ["parallel.zero_stage=0", "train.grad_accum_steps=2"]}]
TWO_RANKS = [
    {"name": "zero0", "set": ["parallel.zero_stage=0"]},
    {"name": "zero1", "set": ["parallel.zero_stage=1"]},
    {"name": "zero2", "set": ["parallel.zero_stage=2"]},
    {"name": "zero3", "set": ["parallel.zero_stage=3"]},
    {"name": "zero2-offload", "set": ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"]},
    # The same 8 sequences a step as 2 micro-batches of 2 a rank: what is sent per micro-batch
    {"name": "zero1-accum", "set": ["parallel.zero_stage=1", *ACCUMULATED]},
    {"name": "zero2-accum", "set": ["parallel.zero_stage=2", *ACCUMULATED]},
    {"name": "fsdp2-zero3-accum", "set": ["parallel.engine=fsdp2", "parallel.zero_stage=3", *ACCUMULATED]},
    {
        "name": "zero3-offload",
        "set": ["parallel.zero_stage=3", "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"],
    },
    {"name": "zero2-ckpt", "set": ["parallel.zero_stage=2", "model.activation_checkpointing=true"]},
    {"name": "bf16-zero2", "set": ["parallel.zero_stage=2", "train.precision=bf16"]},
    # parallel.grad_compression: the gradients' reduce in bf16 or fp16, fp32 everything else
    {"name": "zero0-bf16-comm", "set": ["parallel.zero_stage=0", "parallel.grad_compression=bf16"]},
    {"name": "zero2-fp16-comm", "set": ["parallel.zero_stage=2", "parallel.grad_compression=fp16"]},
    {"name": "fsdp2-bf16-comm", "set": [*FSDP2, "parallel.grad_compression=bf16"]},
    # parallel.sync: replicas on their own between syncs. Inner SGD without clipping is linear in
    # the gradients, so a sync every step equals synchronous training; DiLoCo (AdamW inside)
    # resumes between syncs from each replica's own state.
    {"name": "sgd-every-step", "set": SGD_UNCLIPPED},
    {"name": "local-sgd-h1", "set": [*SGD_UNCLIPPED, "parallel.sync=local_sgd", "parallel.sync_every=1"]},
    {"name": "diloco-h1-plain", "set": [*SGD_UNCLIPPED, *DILOCO, "parallel.sync_every=1", *PLAIN_OUTER]},
    {"name": "diloco-h5", "set": [*DILOCO, "parallel.sync_every=5", "train.checkpoint_every=7"]},
    {
        "name": "diloco-h5-resumed",
        "set": [*DILOCO, "parallel.sync_every=5", "train.resume_from={root}/diloco-h5/step_00000007"],
    },
    {"name": "local-sgd-h4", "set": ["parallel.zero_stage=0", "parallel.sync=local_sgd", "parallel.sync_every=4"]},
    # PowerSGD at rank 2 from step 3; at ZeRO-1 too, saved at step 7 and resumed from there.
    {"name": "powersgd", "set": POWERSGD},
    {"name": "powersgd-zero1", "set": [*POWERSGD, "parallel.zero_stage=1", "train.checkpoint_every=7"]},
    {
        "name": "powersgd-zero1-resumed",
        "set": [*POWERSGD, "parallel.zero_stage=1", "train.resume_from={root}/powersgd-zero1/step_00000007"],
    },
    {"name": "bf16-zero0-dtypes", "set": ["parallel.zero_stage=0", "train.precision=bf16"], "dtypes": True},
    {"name": "bf16-zero2-dtypes", "set": ["parallel.zero_stage=2", "train.precision=bf16"], "dtypes": True},
    *OPTIMIZER_RUNS,
    # torch's FSDP2 behind the same seam (parallel.engine: fsdp2): the same losses, memory, resume
    # and export as DeepSpeed's stages.
    {"name": "fsdp2-zero2", "set": ["parallel.engine=fsdp2", "parallel.zero_stage=2"]},
    {"name": "fsdp2-zero3", "set": [*FSDP2, "train.checkpoint_every=10"]},
    {"name": "fsdp2-zero3-per-block", "set": [*FSDP2, "parallel.fsdp2_unit_params=0"]},  # the default groups all
    {"name": "fsdp2-resumed", "set": [*FSDP2, "train.resume_from={root}/fsdp2-zero3/step_00000010"]},
    {"name": "fsdp2-bf16", "set": [*FSDP2, "train.precision=bf16"]},
    {"name": "fsdp2-bf16-dtypes", "set": [*FSDP2, "train.precision=bf16"], "dtypes": True},
    {"name": "llama-fsdp2-ckpt", "set": ["model.flavour=llama-debug", *FSDP2, "model.activation_checkpointing=true"]},
    # The Llama family (RoPE, RMSNorm, SwiGLU, GQA, untied head) under the same machinery.
    {
        "name": "llama-zero2-ckpt",
        "set": ["model.flavour=llama-debug", "parallel.zero_stage=2", "model.activation_checkpointing=true"],
    },
    {"name": "llama-zero3", "set": ["model.flavour=llama-debug", "parallel.zero_stage=3"]},
    # LoRA (model.lora) on a Hugging Face Llama checkpoint (`pretrained_base`): ZeRO-2 over two
    # ranks against ZeRO-0, a resume, and the full fine-tune its checkpoint is compared with.
    {"name": "lora-zero2", "base": "llama-debug", "set": [*LORA, "parallel.zero_stage=2", "train.checkpoint_every=10"]},
    {
        "name": "lora-zero2-resumed",
        "base": "llama-debug",
        "set": [*LORA, "parallel.zero_stage=2", "train.resume_from={root}/lora-zero2/step_00000010"],
    },
    {"name": "lora-zero0", "base": "llama-debug", "set": [*LORA, "parallel.zero_stage=0"]},
    {
        "name": "full-zero2",
        "base": "llama-debug",
        "set": ["parallel.zero_stage=2", "train.checkpoint_every=10", "train.max_steps=10"],
    },
    # Pipelines last: a PipelineEngine leaves DeepSpeed's process-global topology set.
    {
        "name": "pp2",
        "set": [
            "parallel.zero_stage=0",
            "parallel.pipeline_stages=2",
            "parallel.micro_batches=2",
            "train.checkpoint_every=10",
        ],
    },
    {
        "name": "pp2-resumed",
        "set": [
            "parallel.zero_stage=0",
            "parallel.pipeline_stages=2",
            "parallel.micro_batches=2",
            "train.resume_from={root}/pp2/step_00000010",
        ],
    },
    {
        "name": "llama-pp2",
        "set": [
            "model.flavour=llama-debug",
            "parallel.zero_stage=0",
            "parallel.pipeline_stages=2",
            "parallel.micro_batches=2",
        ],
    },
]
# The two-rank LoRA checkpoint resumed on one rank (the same global batch by accumulation): its
# ZeRO-2 partitions of the adapters' state resharded (DeepSpeed's universal checkpoint).
LORA_ON_ONE_RANK = [
    {
        "name": "lora-one-rank",
        "base": "llama-debug",
        "set": [
            *LORA,
            "parallel.zero_stage=2",
            "train.grad_accum_steps=2",
            "train.resume_from={root}/lora-zero2/step_00000010",
        ],
    }
]
# Tensor parallelism (DeepSpeed AutoTP) in a process group of its own: its (data, tensor) mesh is
# process-global in DeepSpeed, like a pipeline's topology. 2 ranks x TP=2 is one replica, so 2
# micro-batches of 4 make the reference's 8 sequences per step, read in the same order.
TP = ["parallel.tensor_parallel=2", "train.grad_accum_steps=2"]
TENSOR_PARALLEL = [
    {"name": "tp2-zero0", "set": [*TP, "parallel.zero_stage=0", "train.checkpoint_every=10"]},
    {"name": "tp2-zero1", "set": [*TP, "parallel.zero_stage=1"]},
    {"name": "tp2-zero2", "set": [*TP, "parallel.zero_stage=2"]},
    {"name": "tp2-resumed", "set": [*TP, "parallel.zero_stage=0", "train.resume_from={root}/tp2-zero0/step_00000010"]},
    {"name": "llama-tp2-zero0", "set": [*TP, "model.flavour=llama-debug", "parallel.zero_stage=0"]},
    {"name": "llama-tp2-zero1", "set": [*TP, "model.flavour=llama-debug", "parallel.zero_stage=1"]},
]
# 4 ranks = 2 replicas x TP=2: each replica one micro-batch of 4, 8 sequences per step again.
DP_TP = [{"name": "dp2-tp2", "set": ["parallel.tensor_parallel=2", "parallel.zero_stage=1"]}]
# 4 ranks = 2 data-parallel replicas x 2 stages, on 2 cores: oversubscribed on purpose. Layers
# split uniformly here (the runs above balance parameters, the default), over 4 blocks so that
# each stage gets some: [embedding, 3 blocks | 1 block, norm, head].
HYBRID = [
    {
        "name": "pp2-dp2",
        "set": [
            "parallel.zero_stage=1",
            "parallel.pipeline_stages=2",
            "parallel.micro_batches=2",
            "parallel.partition_method=uniform",
            "model.n_layer=4",
            "train.max_steps=30",
        ],
    }
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def runs(byte_dataset, tmp) -> dict:
    results = _harness(tmp, "reference", REFERENCE, 1, byte_dataset, timeout=300)
    results |= _harness(tmp, "two", TWO_RANKS, 2, byte_dataset, timeout=900)
    results |= _harness(tmp, "tp", TENSOR_PARALLEL, 2, byte_dataset, timeout=600)
    results |= _harness(tmp, "lora-one", LORA_ON_ONE_RANK, 1, byte_dataset, timeout=300)
    return results


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "name",
    [
        "zero0",
        "zero1",
        "zero2",
        "zero3",
        "pp2",
        "zero2-offload",
        "zero3-offload",
        "zero2-ckpt",
        "fsdp2-zero2",
        "fsdp2-zero3",
        "fsdp2-zero3-per-block",
        "zero1-accum",
        "zero2-accum",
        "fsdp2-zero3-accum",
    ],
)
def test_matches_single_worker_reference(runs, name):
    ref, run = runs["reference"]["loss"], runs[name]["loss"]
    assert len(run) == STEPS
    assert _max_rel(run, ref) <= 1e-4, (run, ref)
    assert sum(run[-5:]) < sum(run[:5]) - 2.5  # and it learns


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_every_optimizer_under_every_zero_stage(runs, opt):
    base = runs[f"{opt}-zero0"]["loss"]
    assert len(base) == OPTIMIZER_STEPS and base[-1] < base[0] - 0.5, base  # it learns
    for stage in (1, 2, 3):
        loss = runs[f"{opt}-zero{stage}"]["loss"]
        assert len(loss) == OPTIMIZER_STEPS and loss[-1] < loss[0] - 0.5, (stage, loss)
        if opt != "lamb":  # element-wise rules: ZeRO's partitioning changes nothing
            assert _max_rel(loss, base) <= 1e-4, (stage, loss, base)
        # LAMB's trust ratio is per tensor; under ZeRO it sees flat partitions (kiln.core.lamb).
    # FSDP2 shards each tensor as a DTensor, whose norms are the whole tensor's: even LAMB's
    # layer-wise trust ratio is exactly ZeRO-0's.
    assert _max_rel(runs[f"{opt}-fsdp2"]["loss"], base) <= 1e-4, (runs[f"{opt}-fsdp2"]["loss"], base)


def test_gradient_compression_sends_what_the_planner_says_and_trains_alike(runs):
    """`parallel.grad_compression`: the gradients travel in 2 bytes a parameter instead of 4.
    Each run's `comm/bytes_per_step` (counted at torch.distributed's collectives) is what the
    planner says that layout sends (`kiln.plan.throughput.data_parallel_bytes`, a ring's share
    over 2 ranks), and the losses stay within 1e-3 of the fp32 reduce's."""
    params = runs["zero0"]["params"]

    def sent(name: str) -> float:
        counted = runs[name]["comm_bytes"]
        assert len(counted) == STEPS and None not in counted, name
        return statistics.median(counted)

    # DeepSpeed: ZeRO-0 all-reduces the gradients (4 bytes a parameter over 2 ranks); ZeRO-2 too,
    # then gathers the updated fp32 weights (2 more). Exact, but for the norm's few scalars.
    for name, bytes_per_param in (("zero0", 4), ("zero0-bf16-comm", 2), ("zero2", 6), ("zero2-fp16-comm", 4)):
        assert sent(name) == pytest.approx(bytes_per_param * params, abs=64), name
        assert runs[name]["planned"]["comm_bytes"] == bytes_per_param * params, name
    # FSDP2 at ZeRO-3 reduce-scatters the gradients and gathers each block's weights twice; the
    # root's (embeddings, head) once, which the planner does not single out.
    for name in ("fsdp2-zero3", "fsdp2-bf16-comm", "fsdp2-zero3-accum"):
        assert sent(name) == pytest.approx(runs[name]["planned"]["comm_bytes"], rel=0.06), name
    # Accumulating, ZeRO-1 reduces once a step; ZeRO-2 and FSDP2, which keep only their shard of
    # the gradients, reduce each micro-batch's (FSDP2 gathers the weights for each too).
    for name, bytes_per_param in (("zero1-accum", 6), ("zero2-accum", 2 * 4 + 2)):
        assert sent(name) == pytest.approx(bytes_per_param * params, abs=64), name
        assert runs[name]["planned"]["comm_bytes"] == bytes_per_param * params, name
    assert sent("fsdp2-zero3-accum") == pytest.approx(2 * sent("fsdp2-zero3"), rel=1e-3)
    # Under LoRA only the adapters' gradients travel, and their stepped weights
    lora = runs["lora-zero2"]
    assert sent("lora-zero2") == pytest.approx(6 * lora["trainable"], abs=64)
    assert lora["planned"]["comm_bytes"] == pytest.approx(6 * lora["trainable"], rel=0.01)
    assert sent("fsdp2-zero3") - sent("fsdp2-bf16-comm") == pytest.approx(params, abs=64)  # half of 4P, sent
    for plain, compressed in (
        ("zero0", "zero0-bf16-comm"),
        ("zero2", "zero2-fp16-comm"),
        ("fsdp2-zero3", "fsdp2-bf16-comm"),
    ):
        assert _max_rel(runs[compressed]["loss"], runs[plain]["loss"]) <= 1e-3, compressed


def test_local_sgd_and_diloco_sync_as_their_formulas_say_and_resume_between_syncs(runs):
    """`parallel.sync`. With a sync every step, local SGD and DiLoCo at outer lr 1 without momentum
    equal synchronous training (1e-6: the float sums' order differs). DiLoCo every 5 steps sends
    nothing between syncs (DeepSpeed's gradient all-reduce is off), 1/5 of the weights' all-reduce
    a step overall, as the planner says; it learns; and a resume from step 7, between syncs,
    continues exactly from each replica's own weights and optimizer state."""
    sync = runs["sgd-every-step"]
    assert sum(sync["loss"][-5:]) < sum(sync["loss"][:5]) - 1.0  # inner SGD learns
    for name in ("local-sgd-h1", "diloco-h1-plain"):
        assert _max_rel(runs[name]["loss"], sync["loss"]) <= 1e-6, name
        assert runs[name]["final"]["loss/val"] == pytest.approx(sync["final"]["loss/val"], rel=1e-6), name
    params = runs["zero0"]["params"]
    assert runs["local-sgd-h1"]["comm_bytes"][-1] == pytest.approx(4 * params, abs=64)  # fp32 weights, n=2
    diloco = runs["diloco-h5"]
    assert max(diloco["comm_bytes"][:4]) <= 64  # before the first sync: Kiln's few scalars, no gradients
    assert diloco["comm_bytes"][-1] == pytest.approx(4 * params / 5, abs=64)
    assert diloco["planned"]["comm_bytes"] == pytest.approx(4 * params / 5)
    assert runs["local-sgd-h4"]["planned"]["comm_bytes"] == pytest.approx(4 * params / 4)
    for name in ("diloco-h5", "local-sgd-h4"):
        loss = runs[name]["loss"]
        assert sum(loss[-5:]) < sum(loss[:5]) - 2.0, (name, loss)
    # DiLoCo's anchor and outer momentum: two more fp32 copies of the weights, as planned.
    held = diloco["final"]["memory/optimizer_state_bytes"]
    assert held == pytest.approx(runs["zero0"]["final"]["memory/optimizer_state_bytes"] + 8 * params, rel=1e-6)
    assert held == pytest.approx(diloco["planned"]["optimizer_states"], rel=0.10)
    resumed = runs["diloco-h5-resumed"]
    assert resumed["steps"] == list(range(8, STEPS + 1))
    assert _max_rel(resumed["loss"], diloco["loss"][7:]) <= 1e-6
    assert resumed["final"]["loss/val"] == pytest.approx(diloco["final"]["loss/val"], rel=1e-6)


def test_powersgd_sends_its_factors_trains_and_resumes_exactly(runs):
    """PowerSGD at rank 2: the first two steps send every gradient whole (4 bytes a parameter
    over 2 ranks, as ZeRO-0), then the factors, as the planner counts them; the run learns
    close to ZeRO-0's uncompressed one; each rank holds its error buffers and factors as planned.
    At ZeRO-1 each rank steps half the weights (the same losses, 1e-6), holds half the optimizer
    state, and gathers the stepped weights, all as planned; a resume from step 7 continues
    exactly from every rank's own buffers and optimizer shard."""
    run, params = runs["powersgd"], runs["zero0"]["params"]
    assert run["comm_bytes"][:2] == pytest.approx([4 * params] * 2, abs=64)
    assert run["comm_bytes"][-1] == pytest.approx(run["planned"]["comm_bytes"], abs=64)
    assert run["planned"]["comm_bytes"] < 0.3 * 4 * params
    loss, plain = run["loss"], runs["zero0"]["loss"]
    assert sum(loss[-5:]) < sum(loss[:5]) - 2.0, loss
    assert sum(loss[-5:]) == pytest.approx(sum(plain[-5:]), rel=0.1), (loss, plain)
    held = run["final"]["memory/optimizer_state_bytes"]
    assert held == pytest.approx(run["planned"]["optimizer_states"], rel=0.10)
    assert held > runs["zero0"]["final"]["memory/optimizer_state_bytes"]

    sharded = runs["powersgd-zero1"]
    assert _max_rel(sharded["loss"], loss) <= 1e-6
    adam = runs["zero0"]["final"]["memory/optimizer_state_bytes"]
    assert sharded["final"]["memory/optimizer_state_bytes"] == pytest.approx(held - adam / 2, rel=0.05)
    assert sharded["final"]["memory/optimizer_state_bytes"] == pytest.approx(
        sharded["planned"]["optimizer_states"], rel=0.10
    )
    gathered = sharded["comm_bytes"][-1] - run["comm_bytes"][-1]
    assert gathered == pytest.approx(4 * params / 2, rel=0.05)  # each rank's half of the fp32 weights
    assert sharded["comm_bytes"][-1] == pytest.approx(sharded["planned"]["comm_bytes"], rel=0.05)
    resumed = runs["powersgd-zero1-resumed"]
    assert resumed["steps"] == list(range(8, STEPS + 1))
    assert _max_rel(resumed["loss"], sharded["loss"][7:]) <= 1e-6


def test_zero_saves_the_memory_it_promises(runs):
    def held(name, what):
        return runs[name]["final"][f"memory/{what}_bytes"]

    base_state, base_params = held("zero0", "optimizer_state"), held("zero0", "params")
    assert held("zero1", "optimizer_state") <= 0.55 * base_state
    assert held("zero2", "optimizer_state") <= 0.55 * base_state
    assert held("zero3", "optimizer_state") <= 0.55 * base_state
    assert held("zero3", "params") <= 0.55 * base_params
    assert held("zero1", "params") == base_params  # ZeRO-1/2 keep every weight on every rank
    # FSDP2 shards the fp32 weights themselves (no separate master copy) and the optimizer state.
    assert held("fsdp2-zero3", "params") <= 0.55 * base_params
    assert held("fsdp2-zero3", "optimizer_state") <= 0.55 * base_state
    assert held("fsdp2-zero3", "master_params") == 0
    # The planner, from shapes alone, within 10% of what each engine actually holds.
    for name in ("zero0", "zero1", "zero2", "zero3", "fsdp2-zero2", "fsdp2-zero3"):
        planned = runs[name]["planned"]
        assert held(name, "optimizer_state") == pytest.approx(planned["optimizer_states"], rel=0.10), name
        assert held(name, "params") == pytest.approx(planned["params"], rel=0.10), name


def test_fsdp2_resumes_exactly_and_keeps_fp32_weights_under_bf16(runs):
    """A resume from FSDP2's distributed checkpoint at step 10 goes on as the run that wrote it;
    in bf16 the weights at rest and the optimizer state stay fp32 (the bf16 copies are made per
    block at each gather), and the run follows the fp32 reference within bf16's rounding."""
    full, resumed = runs["fsdp2-zero3"], runs["fsdp2-resumed"]
    assert resumed["steps"] == list(range(11, STEPS + 1))
    assert _max_rel(resumed["loss"], full["loss"][10:]) <= 1e-6
    dtypes = runs["fsdp2-bf16-dtypes"]["dtypes"]
    assert dtypes["params"] == dtypes["stepped"] == dtypes["optimizer_state"] == ["torch.float32"]
    loss = runs["fsdp2-bf16"]["loss"]
    assert sum(loss[-5:]) < sum(loss[:5]) - 2.5
    assert _max_rel(loss, runs["reference"]["loss"]) < 0.2


def test_pipeline_resumes_exactly(runs):
    full, resumed = runs["pp2"], runs["pp2-resumed"]
    assert resumed["steps"] == list(range(11, STEPS + 1))
    assert _max_rel(resumed["loss"], full["loss"][10:]) <= 1e-6


def test_bf16_trains_with_fp32_master_weights_and_optimizer_state(runs):
    loss = runs["bf16-zero2"]["loss"]
    assert sum(loss[-5:]) < sum(loss[:5]) - 2.5
    assert _max_rel(loss, runs["reference"]["loss"]) < 0.2  # bf16 rounding, same trajectory
    for name in ("bf16-zero0-dtypes", "bf16-zero2-dtypes"):
        dtypes = runs[name]["dtypes"]
        assert dtypes["params"] == ["torch.bfloat16"], name
        assert dtypes["stepped"] == ["torch.float32"] and dtypes["optimizer_state"] == ["torch.float32"], name


def test_hybrid_two_replicas_by_two_stages(byte_dataset, tmp_path):
    run = _harness(tmp_path, "hybrid", HYBRID, 4, byte_dataset, timeout=600)["pp2-dp2"]
    assert run["steps"] == list(range(1, 31))
    assert sum(run["loss"][-5:]) < sum(run["loss"][:5]) - 2.0, run["loss"]


def test_the_llama_family_trains_alike_under_zero_pipeline_and_recompute(runs):
    ref = runs["llama-zero2-ckpt"]["loss"]
    assert sum(ref[-5:]) < sum(ref[:5]) - 2.5  # it learns
    for name in ("llama-zero3", "llama-pp2", "llama-fsdp2-ckpt"):
        assert _max_rel(runs[name]["loss"], ref) <= 1e-4, name


@pytest.mark.parametrize(
    "name,replicas",
    [
        ("zero0", 2),
        ("zero1", 2),
        ("zero2", 2),
        ("zero3", 2),
        ("zero3-offload", 2),
        ("pp2", 1),
        ("llama-zero2-ckpt", 2),
        ("llama-zero3", 2),
        ("llama-pp2", 1),
        ("fsdp2-zero3", 2),
        ("llama-fsdp2-ckpt", 2),
        ("tp2-zero0", 1),
        ("tp2-zero2", 1),
        ("llama-tp2-zero1", 1),
    ],
)
def test_a_checkpoint_consolidates_to_the_model_that_was_evaluated(runs, tmp, byte_dataset, name, replicas):
    """`kiln export`'s reader merges every sharding (ZeRO partitions, pipeline layer files) into
    the whole model: its validation loss on the run's own eval batches is the one the run logged."""
    from kiln.data.manifest import load_manifest
    from kiln.data.sources import ParquetSource
    from kiln.infer.load import load_model
    from kiln.storage import resolve

    loaded = load_model(str(tmp / "ckpt" / name))
    assert loaded.vocab_size == 257 and loaded.cfg.vocab_size == 320  # the byte vocab, padded to 64s
    assert loaded.cfg.arch == ("llama" if name.startswith("llama") else "gpt")
    model = loaded.build()
    losses = []
    for rank in range(replicas):  # what `evaluate` did: each replica its first eval batches, averaged
        for i, batch in enumerate(
            ParquetSource(load_manifest(resolve(str(byte_dataset))), rank, replicas, 4).val_batches()
        ):
            if i == 2:  # train.eval_batches in the harness
                break
            with torch.no_grad():
                losses.append(model(batch[:, :-1], batch[:, 1:])[1].item())
    logged = runs[name]["final"]["loss/val"]
    assert abs(sum(losses) / len(losses) - logged) <= 1e-5 * logged


@pytest.mark.parametrize("name", ["tp2-zero0", "tp2-zero1", "tp2-zero2", "llama-tp2-zero0", "llama-tp2-zero1"])
def test_tensor_parallel_matches_one_rank(runs, name):
    """TP=2 over 2 ranks: the same losses as one rank (the llama family: as its data-parallel run),
    20 fp32 steps with gradient clipping at 1.0 (Kiln's default), within 1e-4."""
    ref = runs["llama-zero2-ckpt" if name.startswith("llama") else "reference"]["loss"]
    run = runs[name]["loss"]
    assert len(run) == STEPS
    assert _max_rel(run, ref) <= 1e-4, (run, ref)
    assert sum(run[-5:]) < sum(run[:5]) - 2.5  # and it learns


def test_tensor_parallel_holds_half_the_split_weights_and_resumes_exactly(runs):
    """Each rank holds 1/2 of the blocks' projections (and their optimizer state) and all of the
    embeddings and norms, as the planner says; a resume from step 10 continues exactly."""
    from kiln.model import config_for
    from kiln.model_size import split_params

    whole = runs["zero0"]["final"]["memory/params_bytes"]  # fp32, every weight on every rank
    split = 4 * split_params(config_for("debug"))  # the projections' shapes need no vocab or seq_len
    assert runs["tp2-zero0"]["final"]["memory/params_bytes"] == whole - split / 2
    for name in ("tp2-zero0", "tp2-zero1"):
        planned, final = runs[name]["planned"], runs[name]["final"]
        assert final["memory/params_bytes"] == pytest.approx(planned["params"], rel=0.10), name
        assert final["memory/optimizer_state_bytes"] == pytest.approx(planned["optimizer_states"], rel=0.10), name
    full, resumed = runs["tp2-zero0"], runs["tp2-resumed"]
    assert resumed["steps"] == list(range(11, STEPS + 1))
    assert _max_rel(resumed["loss"], full["loss"][10:]) <= 1e-6


def test_two_replicas_by_two_tensor_parallel_ranks(runs, byte_dataset, tmp_path):
    """4 ranks on 2 cores (oversubscribed): DP=2 x TP=2 matches the one-rank reference."""
    run = _harness(tmp_path, "dp-tp", DP_TP, 4, byte_dataset, timeout=600)["dp2-tp2"]
    assert _max_rel(run["loss"], runs["reference"]["loss"]) <= 1e-4, run["loss"]


def test_a_tensor_parallel_export_loads_in_transformers_with_kilns_logits(runs, tmp, tmp_path):
    """`kiln export` of a TP=2 checkpoint (llama, GQA: q, k and v split by whole heads) is one
    Hugging Face model whose logits are the consolidated Kiln model's."""
    transformers = pytest.importorskip("transformers")
    from kiln.infer.commands import export

    loaded, _ = export(str(tmp / "ckpt" / "llama-tp2-zero1"), str(tmp_path / "hf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = loaded.build()
    x = torch.randint(0, loaded.vocab_size, (2, 48))
    with torch.no_grad():
        a, b = theirs(x).logits, ours(x)
    n = min(a.shape[-1], b.shape[-1])  # the export may drop the padding rows of the vocabulary
    assert n >= loaded.vocab_size and (a[..., :n] - b[..., :n]).abs().max().item() <= 1e-5


def test_lora_trains_only_its_adapters_and_resumes_exactly(runs, tmp):
    """LoRA at ZeRO-2 on two ranks: the trainable count is the formula's, the run learns and
    equals ZeRO-0's, the planner counts what the engine holds, a resume goes on exactly (on two
    ranks, and on one), and the checkpoint is smaller than the full fine-tune's by the adapters'
    share of the weights."""
    from kiln.hf_checkpoint import read_config
    from kiln.lora import LoraConfig, adapter_params

    lora, zero0, resumed, full = (runs[n] for n in ("lora-zero2", "lora-zero0", "lora-zero2-resumed", "full-zero2"))
    base = read_config(tmp / "ckpt" / "base-llama-debug")
    assert lora["trainable"] == adapter_params(base, LoraConfig(rank=4)) == zero0["trainable"]
    assert full["trainable"] == full["params"] == lora["params"] - lora["trainable"]  # the base, frozen
    assert len(lora["loss"]) == STEPS and sum(lora["loss"][-5:]) < sum(lora["loss"][:5]) - 1.5  # a random base
    assert _max_rel(lora["loss"], zero0["loss"]) <= 1e-4
    assert resumed["steps"] == runs["lora-one-rank"]["steps"] == list(range(11, STEPS + 1))
    assert _max_rel(resumed["loss"], lora["loss"][10:]) <= 1e-6
    assert _max_rel(runs["lora-one-rank"]["loss"], lora["loss"][10:]) <= 1e-6  # on one rank
    for name in ("lora-zero2", "lora-zero0"):
        held, planned = runs[name]["final"], runs[name]["planned"]
        assert held["memory/optimizer_state_bytes"] == pytest.approx(planned["optimizer_states"], rel=0.10), name
        assert held["memory/params_bytes"] == pytest.approx(planned["params"], rel=0.10), name

    def state_bytes(name):
        return sum(f.stat().st_size for f in (tmp / "ckpt" / name / "step_00000010" / "state").iterdir())

    share = lora["trainable"] / full["params"]  # fp32 weights, master and two moments: 16 bytes each
    assert 0.8 * share <= state_bytes("lora-zero2") / state_bytes("full-zero2") <= 1.3 * share


def test_a_lora_checkpoint_exports_merged_and_as_peft_adapters(runs, tmp):
    """The merged model computes what base + adapters compute (1e-5); the adapter export in
    PEFT's layout, loaded by peft onto transformers' model of the base, gives the same logits, as
    does the merged export loaded by transformers. Compared in float64: this trained model's
    own fp32 rounding moves its logits by up to 5e-5 (measured against float64, merged or not),
    which would hide what merging changes."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from kiln import lora as kiln_lora
    from kiln.errors import ConfigError
    from kiln.infer.commands import export
    from kiln.infer.load import load_model

    base_dir = tmp / "ckpt" / "base-llama-debug"
    ckpt = tmp / "ckpt" / "lora-zero2" / "step_00000010"
    merged = load_model(str(ckpt))
    assert merged.lora is not None and merged.adapters
    unmerged = load_model(str(base_dir)).build()
    kiln_lora.apply(unmerged, merged.lora, seed=0)
    missing, unexpected = unmerged.load_state_dict(merged.adapters, strict=False)
    assert not unexpected and all(not kiln_lora.is_adapter(k) for k in missing)
    ours = merged.build().double()
    unmerged = unmerged.double().eval()
    x = torch.randint(0, merged.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(x) - unmerged(x)).abs().max().item() <= 1e-5
        assert (ours(x) - load_model(str(base_dir)).build().double()(x)).abs().max().item() > 1e-3  # it trained
    export(str(ckpt), str(tmp / "peft"), adapters=True)
    export(str(ckpt), str(tmp / "merged"))
    theirs = (
        peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), tmp / "peft")
        .double()
        .eval()
    )
    flat = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged").double().eval()
    V = merged.vocab_size
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)[..., :V]).abs().max().item() <= 1e-5
        assert (flat(x).logits - ours(x)[..., :V]).abs().max().item() <= 1e-5
    moved = base_dir.with_name("moved")
    base_dir.rename(moved)  # the base the card names is gone: one line saying so
    try:
        with pytest.raises(ConfigError, match="holds only its adapters, and the base model it adapts"):
            load_model(str(ckpt))
    finally:
        moved.rename(base_dir)
