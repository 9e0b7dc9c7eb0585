"""One optimizer step, with nothing on its hot path that waits for the GPU.

`train_step` runs a step's micro-batches: forward, the health guard's look at the loss (on the
device), backward, and DeepSpeed's step, which updates the weights at the accumulation boundary.
The host reads the device once per step at most: the guard's verdict, just before the boundary,
so a bad micro-batch's gradients never reach the optimizer. Its votes are cast after the last
forward and read once the backward is queued, so that read waits for the forward, not the
backward (`kiln.core.health`). Phase times come from CUDA events (`PhaseTimer`), read only when a
step's metrics are built.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.core.engine import Engine
from kiln.core.health import BadLoss, HealthGuard
from kiln.core.optim import StepGate
from kiln.model import inputs_and_targets

PHASES = ("time/forward_s", "time/backward_s", "time/optimizer_s")


class PhaseTimer:
    """Seconds per phase of the step in hand: forward, backward (gradient all-reduce included)
    and optimizer.

    On a GPU each phase boundary records a CUDA event, and `read` waits for the last one and sums
    the intervals: no synchronize between phases, and none at all on steps nobody reads (`on`
    False). On CPU, where ops run as they are called, the host clock is the measure.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.on = True
        self._marks: list[tuple[str | None, Any]] = []  # perf_counter() floats, or CUDA events

    def start(self) -> None:
        """A phase run begins (after the micro-batch's data is in hand)."""
        if self.on:
            self._marks.append((None, self._now()))

    def lap(self, phase: str) -> None:
        """`phase` ends now; the next one starts."""
        if self.on:
            self._marks.append((phase, self._now()))

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self) -> dict[str, float]:
        """The step's seconds per phase, then a fresh start for the next step."""
        out = dict.fromkeys(PHASES, 0.0)
        if self.cuda and self._marks:
            self._marks[-1][1].synchronize()
        for (_, before), (phase, after) in zip(self._marks, self._marks[1:]):
            if phase is not None:
                out[phase] += before.elapsed_time(after) / 1e3 if self.cuda else after - before
        self._marks.clear()
        return out


@dataclass
class StepResult:
    loss: torch.Tensor | None  # the mean micro-batch loss, on the device; None: the step was skipped
    data_wait_s: float  # host seconds spent waiting for batches
    skipped: str | None = None  # why the step was left out (skip policy)


def model_inputs(batch: torch.Tensor, documents: bool) -> tuple[torch.Tensor, ...]:
    """An engine's arguments for a micro-batch of rows: (inputs, targets), and each input's
    document where the run attends within documents (so an engine that never does keeps the
    two-argument `forward`)."""
    inputs, targets, docs = inputs_and_targets(batch, documents)
    return (inputs, targets) if docs is None else (inputs, targets, docs)


def train_step(
    engine: Engine,
    batches: Iterator[torch.Tensor],
    micro_batches: int,
    guard: HealthGuard,
    gate: StepGate,
    timer: PhaseTimer,
    step: int,
    documents: bool = False,
) -> StepResult:
    """One optimizer step over `micro_batches` micro-batches (already on the device); with
    `documents`, each attends within its rows' documents (`kiln.model.inputs_and_targets`).

    A bad verdict shuts `gate`, so DeepSpeed's step at the boundary leaves the weights and the
    LR schedule as they were; then under skip the result says so and the loop runs the step
    again on fresh data, while under rollback or stop BadLoss is raised once the step is
    complete (DeepSpeed's accumulation count stays whole). A pipeline runs everything inside
    `train_batch`, so its verdict comes after its step (skip is refused there).
    """
    wait = 0.0
    clock = time.perf_counter

    def next_batch() -> torch.Tensor:
        nonlocal wait
        start = clock()
        batch = next(batches)
        wait += clock() - start
        return batch

    if engine.pipeline:  # the engine runs the whole 1F1B schedule (and the step) in train_batch
        pairs = [model_inputs(next_batch(), False) for _ in range(micro_batches)]  # no documents (config)
        loss = guard.inject(engine.train_batch(iter(pairs)).detach().float(), step)
        guard.observe(loss)
        reason = guard.verdict(step)
        if reason is not None:
            raise BadLoss(step, reason)
        return StepResult(loss, wait)
    loss_sum = None
    reason = None
    for i in range(micro_batches):
        batch = next_batch()
        timer.start()
        loss = engine.forward(*model_inputs(batch, documents))
        loss = guard.inject(loss, step)
        guard.observe(loss)
        last = i == micro_batches - 1
        if last:  # the votes go out before the backward is queued: its read waits for them alone
            guard.vote()
        timer.lap("time/forward_s")
        engine.backward(loss)
        timer.lap("time/backward_s")
        if last:  # the one host read of the step, before the boundary
            reason = guard.verdict(step)
            gate.open = reason is None
        engine.step()  # steps the optimizer at the accumulation boundary only
        timer.lap("time/optimizer_s")
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    gate.open = True
    assert loss_sum is not None  # micro_batches >= 1
    if reason is None:
        return StepResult(loss_sum / micro_batches, wait)
    if guard.cfg.policy == "skip":
        guard.skip(step, micro_batches, reason)
        return StepResult(None, wait, skipped=reason)
    raise BadLoss(step, reason)
