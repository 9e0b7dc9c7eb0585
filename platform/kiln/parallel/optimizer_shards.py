"""ZeRO-1 for Kiln's own communication: each replica steps the optimizer on its share of the
weights only, so it holds that share's optimizer state, then the replicas gather the stepped
weights (`parallel.zero_stage: 1` with `parallel.grad_compression: powersgd`).

PowerSGD leaves every replica the same averaged gradients, so any one of them can step any
weight; ZeRO-1 lets each keep 1/n of the optimizer's state (Adam's two moments: 8 bytes a
weight) at the price of one all-gather of the weights a step. DeepSpeed's ZeRO-1 cannot be the
one to do it: it reduces the gradients inside its own optimizer (`reduce_gradients`), where
PowerSGD's cannot take their place, so DeepSpeed runs at stage 0 (`kiln.layout_rules.
deepspeed_zero_stage`) and the sharding is here. torch's `ZeroRedundancyOptimizer` shards the
same way, but answers `state_dict()` only on the rank it consolidated to, while DeepSpeed's
checkpoint asks every rank; so the torch optimizer stays whole and each rank hides the
gradients of the weights it does not own from its step: torch's optimizers keep no state for a
weight without a gradient. Each rank's state goes into its own checkpoint file
(`kiln.parallel.replica_engine`).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kiln.core.optim import StepGate


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that steps each of the weights of `sizes`: the largest first, each to the rank
    with the fewest elements so far (torch's `ZeroRedundancyOptimizer` rule), so the shards are
    near equal and every rank computes the same answer."""
    load = [0] * ranks
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + sizes[i]
    return out


class OptimizerShards:
    """Makes `opt` step only this rank's share of `params`, and gathers the stepped weights."""

    def __init__(self, opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], gate: StepGate):
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.params = list(params)
        owner = owners([p.numel() for p in self.params], self.ranks)
        self.others = [p for p, r in zip(self.params, owner) if r != self.rank]
        self.shard = [[p for p, r in zip(self.params, owner) if r == k] for k in range(self.ranks)]
        self.width = max(sum(p.numel() for p in s) for s in self.shard)  # each rank's padded share
        inner = opt.step  # gated already (`kiln.core.optim.gate_optimizer`)

        def step(opt_self, *args, **kwargs):
            if not gate.open:  # a withheld step changes no weight: nothing to gather
                return inner(*args, **kwargs)
            hidden = [(p, p.grad) for p in self.others]
            for p in self.others:
                p.grad = None
            out = inner(*args, **kwargs)
            for p, g in hidden:  # DeepSpeed zeroes them as usual after the step
                p.grad = g
            self.gather()
            return out

        opt.step = types.MethodType(step, opt)

    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's stepped share to every rank: one all-gather of equal, padded pieces."""
        mine = self.shard[self.rank]
        flat = torch.zeros(self.width, dtype=self.params[0].dtype, device=self.params[0].device)
        if mine:
            flat[: sum(p.numel() for p in mine)].copy_(torch.cat([p.reshape(-1) for p in mine]))
        pieces = [torch.empty_like(flat) for _ in range(self.ranks)]
        dist.all_gather(pieces, flat)
        for k, piece in enumerate(pieces):
            if k == self.rank:
                continue
            offset = 0
            for p in self.shard[k]:
                p.copy_(piece[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
