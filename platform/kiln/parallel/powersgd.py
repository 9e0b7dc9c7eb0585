"""PowerSGD: gradients averaged over the replicas as rank-r factors, with error feedback
(`parallel.grad_compression: powersgd`).

Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression" (algorithm
1), as torch's DDP comm hook (`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`) runs
it. Each gradient of two or more dimensions, seen as an n x m matrix M, with this rank's error
buffer E and the factor Q kept from the last step (warm start):

    M = M + E                                  what earlier compressions left out
    P = M Q;   all-reduce-mean P;   P = an orthonormal basis of P's columns
    Q = Mᵀ P;  all-reduce-mean Q
    M' = P Qᵀ; E = M - M';  the gradient becomes M', the same on every replica

so a rank sends (n + m) r numbers instead of n m. Vectors (biases, norms), and matrices whose
factors would not be at least 2x smaller (torch's `min_compression_rate`), go whole in one
all-reduce. Before `parallel.powersgd_start_step` every gradient goes whole and E stays zero
(torch's `start_powerSGD_iter`: early gradients change too fast for the warm start).

torch's hook runs on DDP's buckets and DeepSpeed has no comm hook, so the algorithm runs here on
the gradients at the accumulation boundary, before clipping and the optimizer step
(`kiln.parallel.replica_engine`). Checkpoints hold each rank's E and Q, so a resume is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kiln.core.optim import StepGate
from kiln.parallel.deepspeed_engine import DeepSpeedEngine, inner_optimizer
from kiln.parallel.optimizer_shards import OptimizerShards
from kiln.parallel.replica_engine import ReplicaEngine, all_reduce_mean

MIN_COMPRESSION_RATE = 2  # torch's default: compress only where the factors are 2x smaller


def as_matrix(shape: Sequence[int]) -> tuple[int, int] | None:
    """(n, m) a gradient of `shape` is compressed as, or None: it goes whole."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = 1
    for d in shape[1:]:
        m *= int(d)
    return (n, m)


def compressed(shape: Sequence[int], rank: int) -> bool:
    """Whether PowerSGD factors a gradient of `shape` at `rank` (the one rule the engine and the
    planner share)."""
    nm = as_matrix(shape)
    return nm is not None and (nm[0] + nm[1]) * rank * MIN_COMPRESSION_RATE < nm[0] * nm[1]


def elements_sent(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Numbers all-reduced a step: each compressed matrix's P and Q, every other gradient whole."""
    total = 0
    for shape in shapes:
        if compressed(shape, rank):
            n, m = as_matrix(shape)  # type: ignore[misc]  # compressed: a matrix
            total += (n + m) * rank
        else:
            total += int(torch.Size(shape).numel())
    return total


def held_elements(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Numbers a rank keeps: each compressed matrix's error buffer (n m) and factor Q (m r)."""
    total = 0
    for shape in shapes:
        if compressed(shape, rank):
            n, m = as_matrix(shape)  # type: ignore[misc]
            total += n * m + m * rank
    return total


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of `p`'s columns (reduced QR; torch's hook does the same)."""
    return torch.linalg.qr(p).Q


class PowerSGD:
    """The compressor's state (E and Q per compressed gradient) and its step."""

    def __init__(self, params: Sequence[torch.Tensor], rank: int, start_step: int, seed: int = 0):
        self.rank, self.start_step = rank, start_step
        self.which = [i for i, p in enumerate(params) if compressed(p.shape, rank)]
        gen = torch.Generator().manual_seed(seed)  # every replica starts from the same Q
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        for i in self.which:
            n, m = as_matrix(params[i].shape)  # type: ignore[misc]
            self.errors[i] = torch.zeros(n, m, device=params[i].device)
            self.qs[i] = torch.randn(m, rank, generator=gen).to(params[i].device)

    def reduce_(
        self, grads: Sequence[torch.Tensor], step: int, average: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """`grads` (one per parameter, in order) averaged over the replicas in place: the
        compressed ones as rank-r approximations from step `start_step` on."""
        compress = self.which if step >= self.start_step else []
        skipped = set(compress)
        whole = [g for i, g in enumerate(grads) if i not in skipped]
        if whole:  # one all-reduce for every gradient that goes whole
            flat = average(torch.cat([g.reshape(-1).float() for g in whole]))
            for g, part in zip(whole, flat.split([g.numel() for g in whole])):
                g.copy_(part.view_as(g))
        if not compress:
            return
        ms = [grads[i].reshape(self.errors[i].shape).float() + self.errors[i] for i in compress]
        ps = _averaged([m @ self.qs[i] for m, i in zip(ms, compress)], average)
        ps = [orthonormalize(p) for p in ps]
        qs = _averaged([m.T @ p for m, p in zip(ms, ps)], average)
        for i, m, p, q in zip(compress, ms, ps, qs):
            approx = p @ q.T
            self.errors[i] = m - approx
            self.qs[i] = q
            grads[i].copy_(approx.view_as(grads[i]))

    def state_dict(self) -> dict:
        return {"errors": {i: e.cpu() for i, e in self.errors.items()}, "qs": {i: q.cpu() for i, q in self.qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        for i in self.which:
            self.errors[i] = state["errors"][i].to(self.errors[i].device)
            self.qs[i] = state["qs"][i].to(self.qs[i].device)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.errors.values(), *self.qs.values()]


def _averaged(tensors: list[torch.Tensor], average: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Each of `tensors` averaged over the replicas, in one all-reduce."""
    flat = average(torch.cat([t.reshape(-1) for t in tensors]))
    return [part.view_as(t) for t, part in zip(tensors, flat.split([t.numel() for t in tensors]))]


class PowerSGDEngine(ReplicaEngine):
    """DeepSpeed ZeRO-0 with its gradients averaged by PowerSGD at each step; with `shard`, each
    replica steps and holds the optimizer state of its share of the weights only (ZeRO-1,
    `kiln.parallel.optimizer_shards`)."""

    def __init__(
        self,
        inner: DeepSpeedEngine,
        gate: StepGate,
        micro_batches: int,
        rank: int,
        start_step: int,
        seed: int,
        shard: bool = False,
    ):
        super().__init__(inner, gate, micro_batches)
        self.compressor = PowerSGD(self.params, rank, start_step, seed)
        self.shards = OptimizerShards(inner_optimizer(inner.ds), self.params, gate) if shard else None

    @torch.no_grad()
    def before_step(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.communicate(self.compressor.reduce_, grads, self.steps + 1, all_reduce_mean)
        for p, g in zip(self.params, grads):
            if p.grad is None:
                p.grad = g

    def own_state(self) -> dict:
        """E and Q; sharded, this rank's optimizer state too (DeepSpeed's file holds rank 0's)."""
        state = {"powersgd": self.compressor.state_dict()}
        if self.shards is not None:
            state["optimizer"] = inner_optimizer(self.inner.ds).state_dict()
        return state

    def restore(self, state: dict | None) -> None:
        if state is None:
            return
        self.compressor.load_state_dict(state["powersgd"])
        if self.shards is not None and "optimizer" in state:
            inner_optimizer(self.inner.ds).load_state_dict(state["optimizer"])

    def held_tensors(self) -> list[torch.Tensor]:
        """The error buffers (a gradient's size each) and the factors Q."""
        return self.compressor.tensors()
