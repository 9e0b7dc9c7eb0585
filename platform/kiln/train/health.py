"""Training-health guard: a non-finite or spiking loss never reaches the optimizer unnoticed.

Each micro-batch's loss is checked right after its forward pass and before its backward pass,
and every rank takes the same decision (one all-reduce of two numbers), so the ranks' later
collectives stay paired. A loss is bad when it is not finite on some rank, or when the ranks'
mean exceeds `spike_factor` times the median of the last `spike_window` good losses.

What happens then is the policy:
- skip: the micro-batch gets no backward pass and the next one from the stream takes its place,
  so the optimizer step is made of good micro-batches only;
- rollback: the newest complete checkpoint is loaded and training goes on from its step with
  the data after the bad batch (the window between the checkpoint and the bad batch is skipped);
- stop: the run ends with the step, the loss and the reason.
A pipeline runs forward, backward and the step inside DeepSpeed's schedule, so there the check
sees the loss after the step: rollback and stop work, skip is refused when the config is loaded.
"""

from __future__ import annotations

import collections
import math
import statistics

import torch

from kiln.config import HealthConfig
from kiln.train.collectives import mean_over_ranks, ranks

MIN_HISTORY = 10  # good losses seen before a spike can be called: the first steps fall fast


class BadLoss(Exception):
    """Raised inside a step when the policy is rollback or stop; the loop decides what follows."""

    def __init__(self, step: int, reason: str, fatal: bool = False):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason, self.fatal = step, reason, fatal  # fatal: stop whatever the policy


class HealthGuard:
    def __init__(self, cfg: HealthConfig, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self._recent: collections.deque[float] = collections.deque(maxlen=cfg.spike_window)
        self._pending = cfg.injections()
        self.in_a_row = 0
        self.skipped = 0
        self.rollbacks = 0
        self.events: list[str] = []  # what happened since the loop last looked, for the run's tags
        self.recorded = 0  # events tagged so far (rank 0)

    @property
    def active(self) -> bool:
        return self.cfg.policy != "off"

    def inject(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Apply a fault planted for this step, once (rank 0 only: the others must notice anyway)."""
        kind = self._pending.pop(step, None) if self.rank == 0 else None
        if kind == "nan":
            return loss * float("nan")
        if kind == "spike":
            return loss * 100.0
        return loss

    def check(self, loss: torch.Tensor, step: int) -> str | None:
        """None if this micro-batch's loss is good, else why not. Every rank must call it for
        every micro-batch: the verdict is reached together."""
        if not self.active:
            return None
        value = float(loss.detach().float())
        finite = math.isfinite(value)
        share_bad, mean = mean_over_ranks([0.0 if finite else 1.0, value if finite else 0.0], self.device)
        reason = None
        if share_bad:
            world = ranks()
            reason = f"loss is not finite on {round(share_bad * world)} of {world} rank(s)"
        else:
            if self.cfg.spike_factor and len(self._recent) >= MIN_HISTORY:
                median = statistics.median(self._recent)
                if mean > self.cfg.spike_factor * median:
                    reason = (f"loss {mean:.4g} is {mean / median:.1f}x the running median {median:.4g} "
                              f"(train.health.spike_factor = {self.cfg.spike_factor:g})")
            if reason is None:
                self._recent.append(mean)
                self.in_a_row = 0
                return None
        self.in_a_row += 1
        if self.in_a_row > self.cfg.max_in_a_row:
            raise BadLoss(step, f"{reason}; {self.in_a_row} bad micro-batches in a row "
                                f"(train.health.max_in_a_row = {self.cfg.max_in_a_row}): the run diverged",
                          fatal=True)
        return reason

    def skip(self, step: int, reason: str) -> None:
        """A micro-batch left out under the skip policy: counted, and an event for the run."""
        self.skipped += 1
        self.events.append(f"step {step}: skipped a micro-batch: {reason}")

    def metrics(self) -> dict[str, float]:
        return {"health/skipped_batches": float(self.skipped), "health/rollbacks": float(self.rollbacks)}
