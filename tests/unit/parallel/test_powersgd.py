"""PowerSGD (`parallel.grad_compression: powersgd`): a step against the algorithm by hand, the
error feedback that makes the sum of compressed updates reach the sum of gradients, what is
compressed and what the planner counts. The run on two ranks (bytes, learning, an exact resume) is
in test_parallelism.py."""

import pytest
import torch

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.model import config_for
from kiln.model_size import num_params, param_shapes
from kiln.parallel.optimizer_shards import owners
from kiln.parallel.powersgd import PowerSGD, compressed, elements_sent, held_elements
from kiln.plan.memory import PlanInput, estimate
from kiln.plan.throughput import data_parallel_bytes


def alone(t: torch.Tensor) -> torch.Tensor:
    return t  # one replica: its average is itself


def test_one_rank_1_step_by_hand():
    """M = [[1, 2], [3, 4]], Q = (1, 1): P = M Q = (3, 7), orthonormal P^ = (3, 7)/sqrt(58);
    Q' = Mᵀ P^ = (24, 34)/sqrt(58); M' = P^ Q'ᵀ = [[72, 102], [168, 238]]/58; E = M - M'. The
    next step compresses its gradient plus E, from Q'."""
    m = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    psgd = PowerSGD([torch.zeros(8, 8)], rank=1, start_step=0)  # any compressed shape; then set by hand
    psgd.which, psgd.errors, psgd.qs = (
        [0],
        {0: torch.zeros(2, 2, dtype=torch.float64)},
        {0: torch.ones(2, 1, dtype=torch.float64)},
    )
    grad = m.clone()
    psgd.reduce_([grad], step=1, average=alone)
    expected = torch.tensor([[72.0, 102.0], [168.0, 238.0]], dtype=torch.float64) / 58
    assert torch.allclose(grad, expected, atol=1e-12)
    assert torch.allclose(psgd.errors[0], m - expected, atol=1e-12)
    assert torch.allclose(psgd.qs[0].flatten().abs(), torch.tensor([24.0, 34.0], dtype=torch.float64) / 58**0.5)
    # Step 2: the gradient M again; compressed is M + E, and what it leaves out becomes E.
    before = psgd.errors[0].clone()
    grad = m.clone()
    psgd.reduce_([grad], step=2, average=alone)
    assert torch.allclose(grad + psgd.errors[0], m + before, atol=1e-12)


def test_error_feedback_makes_the_compressed_updates_sum_to_the_gradients():
    """A fixed 24 x 16 gradient, rank 1: one compression misses most of it, but with error
    feedback the sum of compressed updates differs from the sum of gradients by the last error
    buffer only, which stays bounded, so their mean approaches the gradient as 1/T (0.94 of
    its norm off after one step, 0.03 after 300)."""
    torch.manual_seed(0)
    g = torch.randn(24, 16)
    psgd = PowerSGD([g], rank=1, start_step=0)
    total, first = torch.zeros_like(g), None
    for step in range(1, 301):
        grad = g.clone()
        psgd.reduce_([grad], step, alone)
        total += grad
        if first is None:
            first = (grad - g).norm() / g.norm()
        assert torch.allclose(total + psgd.errors[0], step * g, atol=1e-3)  # sum of updates + E = sum of gradients
        assert psgd.errors[0].norm() < 15 * g.norm()  # bounded
    assert first > 0.5  # one rank-1 compression of a random matrix keeps little of it
    assert (total / 300 - g).norm() / g.norm() < 0.05


def test_before_the_start_step_every_gradient_goes_whole_and_vectors_always_do():
    torch.manual_seed(1)
    w, b = torch.randn(32, 32), torch.randn(32)
    psgd = PowerSGD([w, b], rank=2, start_step=5)
    assert psgd.which == [0]
    gw, gb = w.clone(), b.clone()
    psgd.reduce_([gw, gb], step=4, average=alone)
    assert torch.equal(gw, w) and torch.equal(gb, b) and psgd.errors[0].abs().max() == 0
    psgd.reduce_([gw, gb], step=5, average=alone)
    assert not torch.allclose(gw, w) and torch.equal(gb, b)


def test_only_matrices_whose_factors_are_twice_smaller_are_compressed():
    assert compressed((64, 64), 4) and not compressed((64,), 4)
    assert not compressed((8, 8), 4)  # (8 + 8) x 4 x 2 = 128 >= 64
    assert elements_sent([(64, 64), (64,)], 4) == (64 + 64) * 4 + 64
    assert held_elements([(64, 64), (64,)], 4) == 64 * 64 + 64 * 4


def test_the_planner_counts_powersgds_factors_and_buffers():
    m = config_for("debug", vocab_size=320, seq_len=64)
    psi = num_params(m, non_embedding=False)
    shapes = param_shapes(m)
    assert sum(torch.Size(s).numel() for s in shapes) == psi  # the meta model's shapes are the model's
    base = dict(model=m, world_size=2, zero_stage=0, precision="fp32", mixed_precision="weights", use_gpu=False)
    p = PlanInput(**base, grad_compression="powersgd", powersgd_rank=2)
    assert data_parallel_bytes(p) == 4 * elements_sent(shapes, 2)  # 2(n-1)/n of fp32 at n = 2
    assert data_parallel_bytes(p) < 0.5 * data_parallel_bytes(PlanInput(**base))
    held = estimate(p).optimizer_states - estimate(PlanInput(**base)).optimizer_states
    assert held == 4 * held_elements(shapes, 2)


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["parallel.powersgd_rank=0"], "parallel.powersgd_rank"),
        (["parallel.zero_stage=2"], "with ZeRO-2: Kiln moves whole replicas' gradients or weights, which ZeRO 2-3"),
        (["parallel.zero_stage=1", "parallel.offload_optimizer=cpu"], "with parallel.offload_*"),
        (["parallel.sync=local_sgd"], "between syncs no gradient travels"),
        (["train.precision=bf16", "train.mixed_precision=weights"], "train.precision = 'bf16'"),
    ],
)
def test_what_powersgd_cannot_serve_is_refused_by_name(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["parallel.grad_compression=powersgd", "parallel.zero_stage=0", *sets])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_zero_1_shards_the_optimizer_evenly_and_the_planner_counts_its_gather():
    """At zero_stage 1 each rank steps the weights `owners` gives it (largest first to the least
    loaded rank), and the planner counts half Adam's state per rank and one gather of the
    weights a step on top of PowerSGD's factors, with no fp32 copy apart from the model."""
    assert owners([10, 7, 5, 3, 1], 2) == [0, 1, 1, 0, 1]  # loads 10+3 and 7+5+1
    assert owners([4, 4, 4], 3) == [0, 1, 2]
    m = config_for("debug", vocab_size=320, seq_len=64)
    sizes = [torch.Size(s).numel() for s in param_shapes(m)]
    psi = sum(sizes)
    split = owners(sizes, 2)
    halves = [sum(n for n, r in zip(sizes, split) if r == k) for k in (0, 1)]
    assert max(halves) / (psi / 2) < 1.01  # within 1% of even for the debug model
    base = dict(model=m, world_size=2, precision="fp32", mixed_precision="weights", use_gpu=False)
    base.update(grad_compression="powersgd", powersgd_rank=2)
    zero0, zero1 = PlanInput(**base, zero_stage=0), PlanInput(**base, zero_stage=1)
    assert data_parallel_bytes(zero1) - data_parallel_bytes(zero0) == pytest.approx(4 * psi / 2)
    adam = 4 * 2 * psi
    assert estimate(zero0).optimizer_states - estimate(zero1).optimizer_states == pytest.approx(adam / 2, rel=1e-6)
    assert estimate(zero1).master == 0
