"""A DeepSpeed ZeRO-0 engine whose data-parallel communication is Kiln's own.

DeepSpeed's gradient all-reduce is off (`enable_backward_allreduce`), so each replica holds its
own gradients at the accumulation boundary. A subclass communicates there: PowerSGD
(`kiln.parallel.powersgd`) reduces compressed gradients before the optimizer steps, local SGD and
DiLoCo (`kiln.parallel.periodic_sync`) sync the weights after it every H steps. DeepSpeed has no
hook for either (its feature request #3061 for PowerSGD is open), so this seam is Kiln's.

What a subclass keeps per replica (error buffers, anchors, its own weights between syncs) is
saved beside DeepSpeed's checkpoint as `kiln_replica.rank<r>.pt`, written by every rank, so a
resume is exact. Everything else passes through to `DeepSpeedEngine`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kiln.core.optim import StepGate
from kiln.parallel.comm_bytes import COUNTER
from kiln.parallel.deepspeed_engine import DeepSpeedEngine

log = logging.getLogger(__name__)

STATE = "kiln_replica.rank{rank}.pt"


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """`t` averaged over the default process group's ranks (the data-parallel replicas), in place."""
    dist.all_reduce(t)
    return t.div_(dist.get_world_size())


class ReplicaEngine:
    """The loop's `Engine` over a DeepSpeed ZeRO-0 engine with its gradient all-reduce off."""

    pipeline = False

    def __init__(self, inner: DeepSpeedEngine, gate: StepGate, micro_batches: int):
        inner.ds.enable_backward_allreduce = False  # each replica keeps its own gradients
        self.inner, self.gate = inner, gate
        self.micro_batches, self._micro = micro_batches, 0
        self.steps = 0  # optimizer steps taken (the loop's step count)
        self.params = [p for p in inner.ds.module.parameters() if p.requires_grad]
        self.sent: dict[str, float] = {}  # the last communication's bytes and seconds (`COUNTER.apart`)
        self.spread = 1  # steps that communication serves (comm_metrics divides by it)

    @property
    def ds(self):
        """The DeepSpeed engine under it (for code in `kiln.parallel` and tests that inspect it)."""
        return self.inner.ds

    # ---- what a subclass does ---------------------------------------------------------------
    def before_step(self) -> None:
        """At the accumulation boundary, before the optimizer steps (every replica alike)."""

    def after_step(self) -> None:
        """After an optimizer step that was taken (`steps` counts it already)."""

    def own_state(self) -> dict:
        """What this replica keeps that DeepSpeed's checkpoint does not."""
        return {}

    def restore(self, state: dict | None) -> None:
        """Back to `own_state`'s (None: the checkpoint has none, as a synchronous run's)."""

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> None:
        boundary = self._micro + 1 == self.micro_batches
        taken = boundary and self.gate.open  # the health guard may withhold it, on every rank alike
        if taken:
            self.before_step()
        self.inner.step()
        self._micro = 0 if boundary else self._micro + 1
        if taken:
            self.steps += 1
            self.after_step()

    def communicate(self, fn, *args):
        """`fn(*args)`, its collectives counted apart into `sent` (spread over `spread` steps)."""
        with COUNTER.apart() as sent:
            result = fn(*args)
        self.sent = sent
        return result

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, directory: str, client_state: dict) -> None:
        self.inner.save(directory, client_state)
        torch.save(self.own_state(), os.path.join(directory, STATE.format(rank=dist.get_rank())))

    @torch.no_grad()
    def load(self, directory: str, reshard: bool = False) -> dict:
        client = self.inner.load(directory, reshard)
        self.steps, self._micro = int(client["step"]), 0
        path = os.path.join(directory, STATE.format(rank=dist.get_rank()))
        if not os.path.exists(path):
            log.info("%s holds no replica's own state: every replica starts from its weights", directory)
            self.restore(None)
        else:
            self.restore(torch.load(path, map_location="cpu", weights_only=False))
        return client

    # ---- what passes through ------------------------------------------------------------------
    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner.forward(inputs, targets, documents)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def train_batch(self, pairs: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        raise NotImplementedError("Kiln's own communication runs without a pipeline (kiln.topology)")

    def eval_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.inner.eval_loss(inputs, targets, documents)

    def set_training(self, on: bool) -> None:
        self.inner.set_training(on)

    def set_micro_batches(self, n: int) -> None:
        self.inner.set_micro_batches(n)
        self.micro_batches = n

    def grad_norm(self) -> torch.Tensor | float | None:
        return self.inner.grad_norm()

    def overflow(self) -> tuple[int, float]:
        return self.inner.overflow()

    def measure_comm(self, on: bool) -> None:
        self.inner.measure_comm(on)

    def comm_metrics(self) -> dict[str, float]:
        """The step's own bytes (and seconds), with the last communication's spread over the
        steps it serves."""
        out = self.inner.comm_metrics()
        for key, value in self.sent.items():
            out[key] = out.get(key, 0.0) + value / self.spread
        return out

    def memory(self) -> dict[str, float]:
        """The inner engine's, with what this replica keeps (`held_tensors`) as optimizer state."""
        out = self.inner.memory()
        out["memory/optimizer_state_bytes"] += sum(t.numel() * t.element_size() for t in self.held_tensors())
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        return []
