"""The engine Kiln builds around the GPT: what it leaves out of a one-process run changes nothing,
and its clipping leaves the norm on the device."""

import json
import subprocess
import sys

import pytest

from kiln.launch.local import free_port

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

# One process, world size 1: two ZeRO-0 engines from the same seed, one as Kiln builds it (no
# gradient all-reduce) and one with DeepSpeed's all-reduce forced back on; 3 optimizer steps of
# 2 micro-batches each on the same batches. Then a ZeRO-1 engine, which must keep its own reduce.
SCRIPT = r"""
import json, os, sys
import torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from kiln.config import load_config
from kiln.parallel.engine import build_engine
from kiln.core.process import WorldInfo

def config(stage, *more):
    return load_config(None, ["model.flavour=debug", "model.vocab_size=256", "model.seq_len=32",
                              f"parallel.zero_stage={stage}", "parallel.num_workers=1", "train.grad_accum_steps=2",
                              "train.micro_batch_size=4", "train.grad_clip=1.0", "optim.lr=1e-2", *more])

def engine(stage, *more):
    cfg = config(stage, *more)
    return build_engine(cfg, cfg.model.shape(), WorldInfo())[0].ds

lone, forced = engine(0), engine(0)
flags = [lone.enable_backward_allreduce]
forced.enable_backward_allreduce = True
reduced = []
bucketed = forced.buffered_allreduce_fallback  # the collective at each accumulation boundary
forced.buffered_allreduce_fallback = lambda *a, **k: (reduced.append(1), bucketed(*a, **k))[1]
torch.manual_seed(0)
batches = [torch.randint(0, 256, (4, 33)) for _ in range(6)]
for batch in batches:
    for e in (lone, forced):
        _, loss = e(batch[:, :-1], batch[:, 1:])
        e.backward(loss)
        e.step()
same = all(torch.equal(a, b) for a, b in zip(lone.module.parameters(), forced.module.parameters()))
moved = any(not torch.equal(a, b) for a, b in zip(lone.module.parameters(), engine(0).module.parameters()))
flags.append(engine(1).enable_backward_allreduce)

# Kiln's clipping on this path against torch's clip_grad_norm_ on copies of the same gradients,
# counting the host reads of device values (aten._local_scalar_dense: .item(), float(), bool()).
from torch.utils._python_dispatch import TorchDispatchMode
class HostReads(TorchDispatchMode):
    count = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        HostReads.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
params = list(lone.module.parameters())
for i, p in enumerate(params):
    p.grad = torch.randn_like(p) * (i + 1)
copies = [p.detach().clone().requires_grad_() for p in params]
for p, c in zip(params, copies):
    c.grad = p.grad.clone()
with HostReads():
    norm = lone.clip_fp32_gradients()
want = torch.nn.utils.clip_grad_norm_(copies, 1.0)
clip = {"reads": HostReads.count, "norm": [float(norm), float(want)], "kept": lone.get_global_grad_norm() is norm,
        "grads": all(torch.allclose(p.grad, c.grad, rtol=1e-5, atol=0) for p, c in zip(params, copies))}

# DeepSpeed's gradient buckets during a backward, as allocated, against the planner's count.
import dataclasses
from kiln.plan.memory import estimate, plan_input
buckets = []
for stage, more, gpu in ((1, [], False), (2, [], False), (2, ["parallel.deepspeed.zero_optimization.overlap_comm=true"], True),
                         (3, [], False), (2, ["parallel.deepspeed.zero_optimization.reduce_bucket_size=5000"], False)):
    ds = engine(stage, *more)
    held = []
    def look(grad, ds=ds, held=held):
        for b in ds.optimizer.ipg_buckets.values():
            bufs = b.buffer if isinstance(b.buffer, list) else [b.buffer]
            held.append(sum(t.numel() * t.element_size() for t in bufs if t is not None))
        return grad
    next(p for p in ds.module.parameters() if p.requires_grad).register_hook(look)
    _, loss = ds(batches[0][:, :-1], batches[0][:, 1:])
    ds.backward(loss)
    cfg = config(stage, *more)
    planned = estimate(dataclasses.replace(plan_input(cfg, cfg.model.shape(), 80), use_gpu=gpu)).buckets
    buckets.append([max(held), planned])

# FSDP2's units: the default groups the debug model's blocks into one; 0 gives each block its own.
units, fsdp2_losses = [], []
for unit_params in ([], ["parallel.fsdp2_unit_params=0"]):
    cfg = config(3, "parallel.engine=fsdp2", "model.n_layer=4", *unit_params)
    fsdp = build_engine(cfg, cfg.model.shape(), WorldInfo())[0]
    units.append(len({id(b._get_fsdp_state()._fsdp_param_group) for b in fsdp.model.blocks}))
    losses = []
    for batch in [batches[0]] * 6:  # one batch again and again: its loss falls
        loss = fsdp.forward(batch[:, :-1], batch[:, 1:])
        fsdp.backward(loss)
        fsdp.step()
        losses.append(loss.item())
    fsdp2_losses.append(losses)
# Device syncs through DeepSpeed's accelerator on steps 3-4 (its throughput timer starts timing at
# step 2), as Kiln configures each stage and with DeepSpeed's timer put back by the passthrough.
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
synced = []
for stage, more in ((0, []), (2, []), (3, []), (0, ["parallel.deepspeed.timers.throughput.enabled=true"])):
    ds, count = engine(stage, *more), [0]
    for i, batch in enumerate(batches[:8] * 2):
        if i == 4:
            plain_sync, acc.synchronize = acc.synchronize, lambda *a, **k: count.__setitem__(0, count[0] + 1)
        _, loss = ds(batch[:, :-1], batch[:, 1:])
        ds.backward(loss)
        ds.step()
    acc.synchronize = plain_sync
    synced.append(count[0])

print(json.dumps({"synced": synced, "flags": flags, "same": same, "moved": moved, "reduced": len(reduced), "clip": clip, "buckets": buckets,
                  "units": units, "fsdp2_losses": fsdp2_losses}))
"""


@pytest.fixture(scope="module")
def out():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_one_process_zero0_run_skips_the_gradient_allreduce_and_trains_identically(out):
    assert out["flags"] == [False, True]  # ZeRO-0 alone skips it; ZeRO-1 keeps its optimizer's reduce
    assert out["reduced"] == 3  # the forced engine did all-reduce, once per optimizer step
    assert out["moved"]  # the steps changed the weights
    assert out["same"]  # and bit for bit as with the all-reduce


def test_clipping_matches_torch_and_reads_nothing_back_to_the_host(out):
    """DeepSpeed's fp32 path (fp32 and bf16-autocast runs) clips with Kiln's replacement: the same
    norm and gradients as torch's clip_grad_norm_, and the norm stays a device tensor (a host read
    would stall a GPU's queue every step; the metrics read it on logged steps)."""
    clip = out["clip"]
    assert clip["reads"] == 0
    assert clip["kept"]
    norm, want = clip["norm"]
    assert want > 10 and abs(norm - want) <= 1e-5 * want  # the planted gradients needed clipping
    assert clip["grads"]


def test_deepspeed_engines_never_wait_for_the_device_within_a_step(out):
    """DeepSpeed's throughput timer synchronizes the device at every forward and step by
    default, draining a GPU's queue twice a step to time what Kiln's meter times already: Kiln
    turns it off, at every stage. The last row is DeepSpeed's default, put back through the
    passthrough: the spy sees its syncs (8 micro-batches, 4 optimizer steps)."""
    *kiln, default = out["synced"]
    assert kiln == [0, 0, 0]
    assert default >= 8


def test_deepspeed_gradient_buckets_are_sized_to_the_model_and_planned_as_allocated(out):
    """ZeRO-1/2 allocate `reduce_bucket_size` elements at each backward (twice with overlapped
    communication), ZeRO-3 once: Kiln sizes the bucket to the trained parameters (DeepSpeed's
    500M-element default is 1.9 GiB in fp32 for a 0.4M-parameter model), and the planner counts
    what DeepSpeed holds, a passthrough `reduce_bucket_size` included."""
    from kiln.model import config_for
    from kiln.model_size import num_params

    params = num_params(config_for("debug", vocab_size=256, seq_len=32), non_embedding=False)
    held = [h for h, _ in out["buckets"]]
    assert held == [4 * params, 4 * params, 2 * 4 * params, 4 * params, 4 * 5000]  # fp32 gradients
    assert [planned for _, planned in out["buckets"]] == held


def test_fsdp2_groups_small_blocks_into_one_unit_and_trains_as_one_unit_a_block(out):
    """`parallel.fsdp2_unit_params` (default 100M) gathers the debug model's four blocks as one
    FSDP2 unit, where 0 gives each block its own; the two layouts compute the same losses."""
    assert out["units"] == [1, 4]
    grouped, per_block = out["fsdp2_losses"]
    assert grouped[-1] < grouped[0] - 0.1  # it learns
    assert grouped == pytest.approx(per_block, rel=1e-6)


@pytest.mark.parametrize(
    "stage, more, overlap, buckets",
    [
        (2, [], False, 1),  # one bucket holds every gradient: nothing to overlap, no second buffer
        (2, ["parallel.deepspeed.zero_optimization.reduce_bucket_size=5000"], True, 2),
        (2, ["parallel.deepspeed.zero_optimization.overlap_comm=true"], True, 2),  # the run's word wins
        (3, [], True, 1),  # ZeRO-3's gathers run on their own stream under it
        (2, ["parallel.use_gpu=false"], False, 1),
    ],
)
def test_deepspeed_overlaps_the_reduction_on_gpus_where_it_can_and_the_planner_agrees(stage, more, overlap, buckets):
    """On a GPU, ZeRO-2's `overlap_comm` pays only for more than one bucket of gradients: with one,
    DeepSpeed reduces it after the backward anyway, and `overlap_comm` would double the bucket and
    synchronize the device at each reduction. Kiln's config and the planner read one rule."""
    from kiln.config import load_config
    from kiln.layout_rules import reduce_bucket_elements
    from kiln.model_size import num_params
    from kiln.parallel.engine import deepspeed_config
    from kiln.plan.memory import estimate, plan_input

    cfg = load_config(
        None,
        [
            "model.flavour=debug",
            "model.vocab_size=256",
            "model.seq_len=32",
            "parallel.num_workers=1",
            "parallel.use_gpu=true",
            f"parallel.zero_stage={stage}",
            *more,
        ],
    )
    mcfg = cfg.model.shape()
    assert deepspeed_config(cfg, 1, mcfg)["zero_optimization"]["overlap_comm"] is overlap
    bucket = reduce_bucket_elements(
        num_params(mcfg, False), 0, int(cfg.parallel.deepspeed_zero("reduce_bucket_size") or 0)
    )
    assert estimate(plan_input(cfg, mcfg, 80)).buckets == buckets * 4 * bucket  # fp32 gradients
