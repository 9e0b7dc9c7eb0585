"""Local SGD and DiLoCo: replicas that train on their own and agree every H steps
(`parallel.sync`).

Between syncs each data-parallel replica steps its own optimizer on its own rows, with
DeepSpeed's gradient all-reduce off (`enable_backward_allreduce`), so a step sends nothing.
Every `parallel.sync_every` (H) steps, and at the last step:
- local_sgd averages the replicas' weights (Stich 2019; torch's `PostLocalSGDOptimizer`);
- diloco averages each replica's pseudo-gradient, the anchor (the weights at the last sync)
  minus its weights now, and steps the anchor with an outer Nesterov SGD; every replica then
  starts again from the new anchor (Douillard et al. 2023, "DiLoCo", algorithm 1).

A sync all-reduces the trainable weights' size once, 2(n-1)/n of it under ring accounting, so a
step sends 1/H of what ZeRO-0's gradient all-reduce would (`kiln.plan.throughput` says the same).
torch's own `PostLocalSGDOptimizer` wraps a DDP model and torchft's `DiLoCo` a torchft Manager;
neither fits behind DeepSpeed's engine, so this wrapper is Kiln's, and the outer step is torch's
SGD. Checkpoints hold each replica's own weights and inner optimizer state beside the anchor and
outer momentum (`kiln.parallel.replica_engine`), so a resume between syncs is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.core.dtypes import torch_dtype
from kiln.core.health import BadLoss
from kiln.core.optim import StepGate
from kiln.parallel.deepspeed_engine import DeepSpeedEngine, inner_optimizer
from kiln.parallel.replica_engine import ReplicaEngine, all_reduce_mean


def outer_optimizer(anchor: torch.Tensor, lr: float, momentum: float) -> torch.optim.SGD:
    """DiLoCo's outer optimizer over the flat anchor: Nesterov SGD (plain SGD at momentum 0).
    Its momentum buffer is made now, zeros, not at the first sync: memory is measured at the
    first step, and torch's first update of a zero buffer is the gradient, as its lazy one is."""
    outer = torch.optim.SGD([anchor], lr=lr, momentum=momentum, nesterov=momentum > 0)
    if momentum > 0:
        outer.state[anchor]["momentum_buffer"] = torch.zeros_like(anchor)
    return outer


def diloco_step(
    anchor: torch.Tensor,
    weights: torch.Tensor,
    outer: torch.optim.Optimizer,
    average: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype = torch.float32,
    guard: bool = False,
) -> bool:
    """One outer step, in place: the pseudo-gradient `anchor - weights` averaged over the
    replicas by `average` (sent in `dtype`), the anchor stepped by `outer`, and `weights` set to
    the new anchor. With `guard`, a non-finite average steps nothing (the anchor and its
    momentum stay clean) and `weights` go back to the anchor; False then."""
    delta = average((anchor - weights).to(dtype)).to(anchor.dtype)
    if guard and not bool(torch.isfinite(delta).all()):  # the same average, so the same verdict, on every rank
        weights.copy_(anchor)
        return False
    anchor.grad = delta
    outer.step()
    anchor.grad = None
    weights.copy_(anchor)
    return True


class PeriodicSync(ReplicaEngine):
    """Replicas that step on their own and sync every `every` steps, and at `last_step`."""

    def __init__(
        self,
        inner: DeepSpeedEngine,
        method: str,
        every: int,
        last_step: int,
        gate: StepGate,
        micro_batches: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compression: str = "none",
        guard: bool = True,
    ):
        super().__init__(inner, gate, micro_batches)
        self.method, self.every, self.last_step, self.spread = method, every, last_step, every
        self.guard = guard  # the health guard's check of the synchronized weights (train.health)
        self.dtype = torch_dtype(compression)
        self.anchor: torch.Tensor | None = None
        self.outer: torch.optim.Optimizer | None = None
        if method == "diloco":
            self.anchor = self._flat()
            self.outer = outer_optimizer(self.anchor, outer_lr, outer_momentum)

    def after_step(self) -> None:
        if self.steps % self.every == 0 or self.steps == self.last_step:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Bring every replica to the same weights. The health guard judges them: where they are
        not finite, BadLoss goes to `train.health.policy`; DiLoCo first withholds its outer step
        and puts every replica back at the last sync's weights, which skip keeps."""
        weights = self._flat()
        if self.method == "local_sgd":
            self.communicate(all_reduce_mean, weights)
            if self.guard and not bool(torch.isfinite(weights).all()):
                raise BadLoss(self.steps, "the replicas' averaged weights are not finite after the sync")
        else:
            assert self.anchor is not None and self.outer is not None
            args = (self.anchor, weights, self.outer, all_reduce_mean, self.dtype, self.guard)
            if not self.communicate(diloco_step, *args):
                self._unflat(weights)
                raise BadLoss(
                    self.steps,
                    f"the replicas' averaged pseudo-gradient is not finite: the outer step was withheld and "
                    f"every replica went back to the last sync's weights ({self.every} steps of inner "
                    "progress dropped)",
                    undone=True,
                )
        self._unflat(weights)

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _unflat(self, flat: torch.Tensor) -> None:
        for p, part in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.copy_(part.view_as(p))

    def own_state(self) -> dict:
        return {
            "weights": [p.detach().cpu() for p in self.params],
            "optimizer": inner_optimizer(self.inner.ds).state_dict(),
            "anchor": None if self.anchor is None else self.anchor.cpu(),
            "outer": None if self.outer is None else self.outer.state_dict(),
        }

    def restore(self, state: dict | None) -> None:
        if state is None:  # a synchronous run's checkpoint: every replica holds its weights
            if self.anchor is not None:
                self.anchor.copy_(self._flat())
            return
        for p, saved in zip(self.params, state["weights"]):
            p.copy_(saved)
        inner_optimizer(self.inner.ds).load_state_dict(state["optimizer"])
        if self.anchor is not None and self.outer is not None:
            self.anchor.copy_(state["anchor"] if state["anchor"] is not None else self._flat())
            if state["outer"] is not None:
                self.outer.load_state_dict(state["outer"])

    def held_tensors(self) -> list[torch.Tensor]:
        """DiLoCo's anchor and outer momentum."""
        if self.outer is None or self.anchor is None:
            return []
        return [self.anchor, *(v for s in self.outer.state.values() for v in s.values() if torch.is_tensor(v))]
