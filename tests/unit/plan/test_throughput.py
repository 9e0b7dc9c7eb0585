"""The scaling-on-paper model against hand-computed numbers."""

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.model import config_for
from kiln.model_size import block_params, flops_per_token, num_params
from kiln.plan.memory import PlanInput
from kiln.plan.throughput import INSTANCES, Cluster, cluster_from_yaml, throughput

REPO = Path(__file__).resolve().parents[3]
M = config_for("1.3b", vocab_size=50304)
N = num_params(M, non_embedding=False)
P5 = INSTANCES["p5.48xlarge"]  # 8 x H100: 989 TFLOP/s, NVLink 450 GB/s per device, 3200 Gb/s per node


def plan(**kw) -> PlanInput:
    return PlanInput(model=M, **({"micro_batch": 8, "precision": "bf16"} | kw))


BUCKET = 500_000_000  # DeepSpeed's reduce bucket for a model over 500M parameters
LAST = N - 2 * BUCKET  # 1.3B's gradients fill 3 buckets: the last one's reduction waits for nothing


def test_one_node_compute_time_and_what_hides_behind_the_backward():
    t = throughput(plan(world_size=8, zero_stage=2), Cluster(P5, 1, "x"), mfu=0.5)
    tokens = 8 * 2048
    assert t.compute_s == pytest.approx(flops_per_token(M) * tokens / (989e12 * 0.5))
    # DeepSpeed's ZeRO-2 all-reduces the 2-byte grads (a ring: 2 (n-1)/n of them) and gathers the
    # updated weights ((n-1)/n), over NVLink's 450 GB/s
    assert t.comm_s == pytest.approx(7 / 8 * N * (2 * 2 + 2) / 450e9)
    assert t.data_parallel_bytes == pytest.approx(7 / 8 * N * (2 * 2 + 2))
    # Its buckets reduce during the backward but the last; the gather follows the optimizer step.
    assert t.exposed_comm_s == pytest.approx(7 / 8 * (N * 2 + LAST * 2 * 2) / 450e9)
    assert t.tokens_per_step == tokens * 8 and t.tokens_per_s == pytest.approx(tokens * 8 / t.step_s)
    # ZeRO-0 and ZeRO-1 reduce after the last backward: nothing of theirs hides.
    for stage in (0, 1):
        after = throughput(plan(world_size=8, zero_stage=stage), Cluster(P5, 1, "x"), mfu=0.5)
        assert after.exposed_comm_s == pytest.approx(after.comm_s) and after.comm_s > 0, stage


def test_across_nodes_the_network_share_per_device_bounds_the_ring():
    p4d = INSTANCES["p4d.24xlarge"]  # 400 Gb/s per node = 6.25 GB/s per device
    t = throughput(plan(world_size=16, zero_stage=2, micro_batch=1), Cluster(p4d, 2, "x"), mfu=0.4)
    assert t.comm_s == pytest.approx(15 / 16 * N * (2 * 2 + 2) / 6.25e9)
    overlapped = 15 / 16 * (N - LAST) * 2 * 2 / 6.25e9  # more than the backward can hide
    after = 15 / 16 * (N * 2 + LAST * 2 * 2) / 6.25e9
    assert t.exposed_comm_s == pytest.approx(after + overlapped - 2 / 3 * t.compute_s)
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s)


def test_zero3_moves_what_deepspeeds_zero2_does_and_its_forward_gather_is_exposed():
    """DeepSpeed's ZeRO-2 all-reduces the gradients (2Ψ) and gathers the weights (Ψ); ZeRO-3
    reduce-scatters them (Ψ) and gathers the weights twice (2Ψ). FSDP2 at zero_stage 2 is the
    ZeRO paper's 2Ψ (tests/unit/parallel checks each against the bytes a run sends)."""
    c = Cluster(P5, 1, "x")
    z2, z3 = throughput(plan(world_size=8, zero_stage=2), c), throughput(plan(world_size=8, zero_stage=3), c)
    assert z3.comm_s == pytest.approx(z2.comm_s)
    # the forward's gather and the last bucket's reduce-scatter; the rest hides behind the backward
    assert z3.exposed_comm_s == pytest.approx(7 / 8 * (N * 2 + LAST * 2) / 450e9)
    fsdp2 = throughput(plan(world_size=8, zero_stage=2, engine="fsdp2"), c)
    assert fsdp2.comm_s == pytest.approx(2 / 3 * z2.comm_s)


def test_sharded_gradients_travel_every_micro_batch_and_fsdp2s_last_units_wait_for_nothing():
    """Under accumulation ZeRO-2/3 and FSDP2 reduce each micro-batch's gradients (a rank keeps
    only its partition), and ZeRO-3 and FSDP2 gather the weights for each; ZeRO-0/1 reduce once
    a step. FSDP2's last reduce-scatters, of block 0's unit and of the root (embeddings, head),
    start after the backward's last gradient; with one unit for every block (the default
    grouping of a model whose blocks hold under 100M parameters together) nothing hides."""
    c = Cluster(P5, 1, "x")
    for stage, engine, grows in (
        (0, "deepspeed", 1),
        (1, "deepspeed", 1),
        (2, "deepspeed", (4 * 4 + 2) / 6),
        (3, "deepspeed", 4),
        (2, "fsdp2", 4),
        (3, "fsdp2", 4),
    ):
        one = throughput(plan(world_size=8, zero_stage=stage, engine=engine), c, grad_accum=1)
        four = throughput(plan(world_size=8, zero_stage=stage, engine=engine), c, grad_accum=4)
        assert four.data_parallel_bytes == pytest.approx(grows * one.data_parallel_bytes), (stage, engine)
    per_block = throughput(plan(world_size=8, zero_stage=3, engine="fsdp2", fsdp2_unit_params=0), c)
    root = N - M.n_layer * block_params(M)
    # forward gathers, then the reduce-scatters of block 0 and the root
    assert per_block.exposed_comm_s == pytest.approx(7 / 8 * (N * 2 + (root + block_params(M)) * 2) / 450e9)
    small = config_for("gpt2-124m", vocab_size=50304)
    grouped = throughput(
        PlanInput(model=small, world_size=8, micro_batch=8, precision="bf16", zero_stage=3, engine="fsdp2"), c
    )
    assert grouped.exposed_comm_s == pytest.approx(grouped.comm_s - 7 / 8 * num_params(small, False) * 2 / 450e9)


def test_gradient_compression_sends_the_gradients_in_two_bytes():
    c = Cluster(P5, 1, "x")
    for stage, plain_bytes, compressed_bytes in (
        (0, 2 * 4, 2 * 2),
        (2, 2 * 4 + 4, 2 * 2 + 4),
        (3, 4 + 2 * 4, 2 + 2 * 4),
    ):
        plain = throughput(plan(world_size=8, zero_stage=stage, precision="fp32"), c)
        small = throughput(plan(world_size=8, zero_stage=stage, precision="fp32", grad_compression="bf16"), c)
        assert plain.comm_s == pytest.approx(7 / 8 * N * plain_bytes / 450e9), stage
        assert small.comm_s == pytest.approx(7 / 8 * N * compressed_bytes / 450e9), stage
    # a bf16 run's gradients travel in 2 bytes already
    same = [throughput(plan(world_size=8, grad_compression=g), c).comm_s for g in ("none", "bf16")]
    assert same[0] == pytest.approx(same[1])


def test_pipeline_bubble_and_checkpointing():
    c = Cluster(P5, 1, "x")
    t = throughput(plan(world_size=8, pipeline_stages=4, micro_batches=8), c)
    assert t.bubble_s == pytest.approx(t.compute_s * 3 / 8)  # (P-1)/m
    base = throughput(plan(world_size=8), c)
    ckpt = throughput(plan(world_size=8, activation_checkpointing=True), c)
    assert ckpt.compute_s == pytest.approx(base.compute_s * 4 / 3)


def test_cluster_yaml_gives_the_preferred_gpu_group_and_its_size():
    c = cluster_from_yaml(REPO / "cluster" / "aws-gpu.yaml")
    assert (c.node, c.nodes, c.world_size) == (INSTANCES["p4d.24xlarge"], 8, 64)
    assert "gpu-spot" in c.source
    assert cluster_from_yaml(REPO / "cluster" / "gcp-gpu.yaml", nodes=2).world_size == 16
    with pytest.raises(ConfigError, match="no GPU node type with a known instance type"):
        cluster_from_yaml(REPO / "cluster" / "onprem.yaml")


def test_kiln_plan_cluster_prints_throughput_time_and_cost():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.cli",
            "plan",
            "--cluster",
            str(REPO / "cluster/aws-gpu.yaml"),
            "--model",
            "1.3b",
            "--precision",
            "bf16",
            "--micro-batch",
            "4",
            "--zero-stage",
            "2",
            "--target-tokens",
            "1e9",
            "--usd-per-hour",
            "100",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "64 x A100-40GB" in out and "tokens/s:" in out
    assert "1e+09 tokens" in out and "at $100.00/h" in out
    assert "preemptions at 0.01 per node-hour" in out and "none is written: back to step 0" in out, out


def test_preemptions_cost_a_resize_and_half_a_checkpoint_interval_each():
    from kiln.plan import throughput as tp

    # 10 nodes for 100 h at 0.01 a node-hour: 10 losses. Checkpoints every 600 steps of 1 s and
    # every 5 min: the 300 s interval wins, so each loss repeats 150 s on average.
    line = tp.Preemptions(0.01, every_steps=600, every_minutes=5).format(100 * 3600, 1.0, 10, 360.0)
    added = 10 * (tp.RESIZE_S + 150)
    assert f"+{tp.duration(added)} ({added / 360000:.1%}), ${360 * added / 3600:,.0f}" in line, line
    assert "10 over the run" in line and "2.5 min of steps since the last checkpoint" in line
    # No checkpoint: a loss starts the run again, half of it lost on average.
    never = tp.Preemptions(0.01).format(3600.0, 1.0, 1, 1.0)
    assert "none is written: back to step 0" in never and "30.0 min of steps" in never


def test_tensor_parallel_divides_compute_and_adds_four_exposed_all_reduces_per_block():
    c = Cluster(P5, 1, "x")
    dp8, tp2 = (
        throughput(plan(world_size=8, zero_stage=1), c),
        throughput(plan(world_size=8, zero_stage=1, tensor_parallel=2), c),
    )
    head = 6 * M.vocab_size * M.d_model  # per token, on both tensor-parallel ranks
    assert tp2.compute_s == pytest.approx(dp8.compute_s * (flops_per_token(M) + head) / flops_per_token(M) / 2)
    activation = 8 * 2048 * M.d_model * 2  # b x s x h in bf16
    assert tp2.tp_comm_s == pytest.approx(M.n_layer * 4 * activation * 2 * 1 / 2 / 450e9)
    assert tp2.exposed_comm_s >= tp2.tp_comm_s and dp8.tp_comm_s == 0
    assert tp2.tokens_per_step == dp8.tokens_per_step / 2  # 4 replicas, not 8
