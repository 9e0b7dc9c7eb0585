"""Local SGD and DiLoCo (`parallel.sync`): the outer step against its formula by hand, the rules
that refuse what cannot sync, and what the planner says a sync sends and holds. The runs on two
ranks (H=1 against synchronous training, a resume between syncs) are in test_parallelism.py."""

import sys
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.model import config_for
from kiln.model_size import num_params
from kiln.parallel.periodic_sync import diloco_step, outer_optimizer
from kiln.plan.memory import PlanInput, estimate
from kiln.plan.throughput import data_parallel_bytes


def _replica(anchor, weights, outer, others, dtype=torch.float32):
    """One replica's outer step, the other replicas' pseudo-gradients given: the average is theirs
    and this one's, as an all-reduce would make it."""
    seen = []

    def average(delta):
        seen.append(delta.dtype)
        return (delta + sum(o.to(delta.dtype) for o in others)) / (1 + len(others))

    diloco_step(anchor, weights, outer, average, dtype)
    return seen


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient_by_hand():
    """Two replicas, anchor (1, 2): their weights (0.5, 2.5) and (0.7, 1.5) give pseudo-gradients
    (0.5, -0.5) and (0.3, 0.5), averaged (0.4, 0). Nesterov at lr 0.7, momentum 0.9 from an empty
    buffer: b = g, step g + 0.9 b = (0.76, 0), anchor (1 - 0.532, 2) = (0.468, 2). A second sync
    with both replicas at (0.368, 2.2): g = (0.1, -0.2), b = 0.9 (0.4, 0) + g = (0.46, -0.2),
    step g + 0.9 b = (0.514, -0.38), anchor (0.468 - 0.3598, 2 + 0.266) = (0.1082, 2.266)."""
    anchor = torch.tensor([1.0, 2.0], dtype=torch.float64)
    outer = outer_optimizer(anchor, lr=0.7, momentum=0.9)
    weights = torch.tensor([0.5, 2.5], dtype=torch.float64)
    _replica(anchor, weights, outer, [torch.tensor([0.3, 0.5], dtype=torch.float64)], torch.float64)
    assert anchor.tolist() == pytest.approx([0.468, 2.0], abs=1e-12)
    assert torch.equal(weights, anchor)  # the replica starts again from the new anchor
    weights = torch.tensor([0.368, 2.2], dtype=torch.float64)
    _replica(anchor, weights, outer, [torch.tensor([0.1, -0.2], dtype=torch.float64)], torch.float64)
    assert anchor.tolist() == pytest.approx([0.1082, 2.266], abs=1e-12)


def test_outer_lr_1_without_momentum_is_the_replicas_average():
    """DiLoCo at outer lr 1, momentum 0 lands on the replicas' mean weights: local SGD."""
    torch.manual_seed(0)
    anchor = torch.randn(64)
    mine, theirs = anchor + 0.1 * torch.randn(64), anchor + 0.1 * torch.randn(64)
    expected = (mine + theirs) / 2
    _replica(anchor, mine, outer_optimizer(anchor, lr=1.0, momentum=0.0), [anchor - theirs])
    assert torch.allclose(mine, expected, atol=1e-6)


def test_the_pseudo_gradient_travels_in_the_compression_dtype():
    anchor = torch.ones(8)
    sent = _replica(anchor, torch.zeros(8), outer_optimizer(anchor, 0.7, 0.9), [torch.ones(8)], torch.bfloat16)
    assert sent == [torch.bfloat16] and anchor.dtype == torch.float32


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["parallel.sync_every=0"], "parallel.sync_every"),
        (["parallel.outer_lr=0"], "parallel.outer_lr"),
        (["parallel.outer_lr=-0.5"], "parallel.outer_lr"),
        (["parallel.outer_momentum=1"], "parallel.outer_momentum"),
        (["parallel.zero_stage=2"], "expected parallel.engine 'deepspeed' with parallel.zero_stage 0"),
        (["parallel.zero_stage=1"], "with ZeRO-1: Kiln moves whole replicas' gradients or weights, which ZeRO 1-3"),
        (["parallel.engine=fsdp2", "parallel.zero_stage=3"], "FSDP2 (ZeRO-3)"),
        (["parallel.num_workers=4", "parallel.pipeline_stages=2"], "parallel.pipeline_stages = 2"),
        (["parallel.num_workers=4", "parallel.tensor_parallel=2"], "parallel.tensor_parallel = 2"),
        (["parallel.num_workers=[1, 2]"], "(elastic)"),
        (["parallel.sync=local_sgd", "parallel.grad_compression=bf16"], "local SGD averages the weights"),
        (["train.precision=bf16", "train.mixed_precision=weights"], "train.precision = 'bf16'"),
        (["train.precision=fp16"], "train.precision = 'fp16'"),
        (["train.eval_every=25"], "train.eval_every = 25"),
        (["train.keep_checkpoints_by=loss/val", "train.checkpoint_every=7"], "train.keep_checkpoints_by"),
    ],
)
def test_what_cannot_sync_is_refused_by_name(sets, needle):
    base = ["parallel.sync=diloco", "parallel.zero_stage=0", "parallel.sync_every=10", "train.eval_every=100"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, *sets])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_what_can_sync_loads():
    for sets in (
        ["parallel.sync=local_sgd"],
        ["parallel.sync=diloco", "parallel.grad_compression=bf16"],
        ["parallel.sync=diloco", "train.precision=bf16", "train.mixed_precision=autocast"],
    ):
        cfg = load_config(None, ["parallel.zero_stage=0", "parallel.sync_every=10", *sets])
        assert cfg.parallel.sync == sets[0].split("=")[1]


def test_the_planner_sends_the_weights_once_per_sync_and_holds_diloco_s_anchor():
    m = config_for("debug", vocab_size=320, seq_len=64)
    psi = num_params(m, non_embedding=False)
    base = dict(model=m, world_size=2, zero_stage=0, precision="fp32", mixed_precision="weights", use_gpu=False)
    every = PlanInput(**base)
    assert data_parallel_bytes(every) == 2 * 4 * psi / 2  # the gradients' ring all-reduce, every step
    for sync, compression, per_param in (("local_sgd", "none", 4), ("diloco", "none", 4), ("diloco", "bf16", 2)):
        p = PlanInput(**base, sync=sync, sync_every=20, grad_compression=compression)
        assert data_parallel_bytes(p) == pytest.approx(2 * per_param * psi / 2 / 20), (sync, compression)
    held = estimate(PlanInput(**base, sync="diloco", sync_every=20)).optimizer_states
    assert held - estimate(every).optimizer_states == 2 * 4 * psi  # the anchor and its momentum
    assert (
        estimate(PlanInput(**base, sync="local_sgd", sync_every=20)).optimizer_states
        == estimate(every).optimizer_states
    )


def test_the_planner_offers_a_syncing_run_only_layouts_it_syncs():
    from kiln.plan.options import format_table, options, tensor_parallel_sizes

    m = config_for("1.3b")
    p = PlanInput(model=m, world_size=8, device_memory_gib=40, micro_batch=8, zero_stage=0, sync="diloco")
    assert {o.plan.zero_stage for o in options(p)} == {0}
    assert {o.plan.zero_stage for o in options(PlanInput(model=m, world_size=8))} == {0, 1, 2, 3}
    assert tensor_parallel_sizes(p, 8) == [1]
    assert "or leave parallel.sync = 'diloco' (ZeRO shards)" in format_table(
        p
    )  # 1.3B at ZeRO-0 with DiLoCo's copies: no fit in 40 GiB


def test_a_non_finite_sync_is_withheld_and_the_replicas_go_back_to_the_last_one():
    """The health guard on the synchronized model: a pseudo-gradient average that is not finite
    (one replica's weights blew up) steps neither the anchor nor its momentum, and puts this
    replica back at the anchor; the loop then keeps training under skip (the step is "undone")
    and stops under stop, naming the sync."""
    from kiln.core.health import BadLoss, HealthConfig, HealthGuard
    from kiln.core.loop import TrainingUnhealthy, _after_bad_loss

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_harness import Capture

    anchor = torch.tensor([1.0, 2.0])
    outer = outer_optimizer(anchor, lr=0.7, momentum=0.9)
    weights = torch.tensor([0.5, 2.5])
    assert not diloco_step(anchor, weights, outer, lambda d: d + torch.tensor([float("nan"), 0.0]), guard=True)
    assert anchor.tolist() == [1.0, 2.0] and torch.equal(weights, anchor)
    assert not outer.state[anchor]["momentum_buffer"].any()
    assert diloco_step(anchor, torch.tensor([0.5, 2.5]), outer, lambda d: d, guard=True)  # a finite one steps
    assert anchor.tolist() == pytest.approx([1 - 0.7 * 0.95, 2.0 + 0.7 * 0.95])

    bad = BadLoss(12, "the replicas' averaged pseudo-gradient is not finite", undone=True)
    guard = HealthGuard(HealthConfig(policy="skip"), 0, torch.device("cpu"))
    logs = Capture()  # the MetricLogger interface, in memory
    assert _after_bad_loss(bad, guard, engine=None, last_good=None, rank=0, logger=logs) == 12
    assert any("pseudo-gradient is not finite" in v for v in logs.tags.values())
    with pytest.raises(TrainingUnhealthy, match="step 12: the replicas' averaged"):
        _after_bad_loss(bad, HealthGuard(HealthConfig(policy="stop"), 0, torch.device("cpu")), None, None, 0, logs)
    local = BadLoss(8, "the replicas' averaged weights are not finite after the sync")
    with pytest.raises(TrainingUnhealthy, match="cannot be withheld once taken"):
        _after_bad_loss(local, guard, None, None, 0, logs)
