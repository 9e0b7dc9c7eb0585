"""Training-health guard: a non-finite or spiking loss never reaches the optimizer unnoticed.

The check stays off the host's hot path: each micro-batch's loss is judged on the device as it
comes (`observe`, no host read), and the step's verdict is taken once, before the optimizer
step, with one all-reduce and one host read, so every rank takes the same decision. The votes
are cast after the step's last forward (`vote`: the all-reduce, and a copy to the host that an
event marks) and read after its backward is queued (`verdict`), so the host waits for the
forward alone: the backward runs on a GPU while the host queues the optimizer's step and the
next forward. A read after the backward would drain the queue, leaving the GPU idle while the
host works through the optimizer's step.
A loss is bad when it is not finite, or when it exceeds `spike_factor` times the median of the
last `spike_window` good steps' mean losses (each rank against its own median).

What happens to a step with a bad micro-batch is the policy:
- skip: the step's gradients never reach the optimizer (the loop shuts the `StepGate`), and the
  step is run again on the next micro-batches of the stream;
- rollback: the newest complete checkpoint is loaded and training goes on from its step with
  the data after the bad batch (the window between the checkpoint and the bad batch is skipped);
- stop: the run ends with the step, the loss and the reason.
A pipeline runs forward, backward and the step inside DeepSpeed's schedule, so there the verdict
comes after the step: rollback and stop work, skip is refused when the config is loaded. Under
`parallel.sync` the engine judges the synchronized weights at each sync too
(`kiln.parallel.periodic_sync`) and raises BadLoss into the same policies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from kiln.core.collectives import ranks
from kiln.errors import ConfigError


@dataclass
class HealthConfig:
    policy: Literal["stop", "skip", "rollback", "off"] = "stop"
    """What a bad loss does: `stop` the run (the default: never train on garbage), `skip` the
    step (its gradients never reach the optimizer; it runs again on the next data), `rollback`
    to the newest complete checkpoint, or `off` (no check, no per-step read of the device)."""
    spike_factor: float = 0.0
    """A loss above this many times the running median of recent good losses is bad too; 0: only
    a non-finite loss is. 3 is a sensible value once a run's loss has settled."""
    spike_window: int = 50
    """How many recent good steps' mean losses the running median covers."""
    max_in_a_row: int = 10
    """Stop after this many bad steps in a row under skip or rollback: that is divergence, not a
    bad batch."""
    max_rollbacks: int = 5
    """Stop once the run has rolled back this many times in all: a run that keeps meeting bad
    losses needs a lower LR or cleaner data, not more rollbacks."""
    inject: str = ""
    """For testing the guard: comma-separated `nan@S` or `spike@S` make rank 0's first
    micro-batch loss of step S NaN, or 100 times larger."""

    @property
    def active(self) -> bool:
        """Whether the guard judges anything (every policy but `off`)."""
        return self.policy != "off"

    def injections(self) -> dict[int, str]:
        """{step: 'nan' | 'spike'}; raises ValueError on anything else."""
        out: dict[int, str] = {}
        for item in filter(None, (s.strip() for s in self.inject.split(","))):
            kind, _, step = item.partition("@")
            if kind not in ("nan", "spike") or not step.isdigit() or int(step) < 1:
                raise ValueError(item)
            out[int(step)] = kind
        return out

    def check(self, pipeline_stages: int) -> None:
        if self.spike_factor < 0 or (self.spike_factor and self.spike_factor <= 1):
            raise ConfigError(f"train.health.spike_factor = {self.spike_factor}: expected 0 (off) or a number > 1")
        if self.spike_window < 1 or self.max_in_a_row < 1 or self.max_rollbacks < 1:
            raise ConfigError(
                f"train.health: spike_window = {self.spike_window}, max_in_a_row = "
                f"{self.max_in_a_row}, max_rollbacks = {self.max_rollbacks}: expected integers >= 1"
            )
        try:
            self.injections()
        except ValueError as e:
            raise ConfigError(f"train.health.inject = {self.inject!r}: {e} is not nan@STEP or spike@STEP") from None
        if self.policy == "skip" and pipeline_stages > 1:
            raise ConfigError(
                "train.health.policy = 'skip' with parallel.pipeline_stages > 1: DeepSpeed's pipeline "
                "engine runs forward, backward and the step in one call, so a micro-batch cannot be "
                "left out; expected 'stop' or 'rollback'"
            )


MIN_HISTORY = 10  # good steps seen before a spike can be called: the first steps fall fast


class BadLoss(Exception):
    """Raised inside a step when the policy is rollback or stop; the loop decides what follows."""

    def __init__(self, step: int, reason: str, fatal: bool = False, undone: bool = False):
        super().__init__(f"step {step}: {reason}")
        self.step, self.reason, self.fatal = step, reason, fatal  # fatal: stop whatever the policy
        # undone: the engine already put every replica back where it was (a DiLoCo sync it
        # withheld), so under skip training goes on from the next step.
        self.undone = undone


class HealthGuard:
    def __init__(self, cfg: HealthConfig, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        # On the device: the step's [non-finite, spiking, micro-batches, loss sum of the finite
        # ones] micro-batch counts, and the ring of recent good steps' mean losses (NaN: empty) the median reads.
        self._step = torch.zeros(4, device=device)
        self._recent = torch.full((cfg.spike_window,), float("nan"), device=device)
        self._threshold = torch.full((), float("inf"), device=device)
        self._worst = torch.zeros((), device=device)  # this rank's highest spiking loss this step
        # The step's cast votes, on their way to the host: (counts, worst, votes).
        self._cast: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # On CUDA the votes' page-locked host copy and the event that marks it done (one each:
        # a step's read comes before the next step's copy).
        cuda = device.type == "cuda"
        self._host = torch.empty(2, pin_memory=True) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None
        self._filled = 0  # good steps in the ring (host count: the verdict is read on the host)
        self._pending = cfg.injections()
        self.in_a_row = 0
        self.skipped = 0
        self.rollbacks = 0
        self.events: list[str] = []  # what happened since the loop last looked, for the run's tags
        self.recorded = 0  # events tagged so far (rank 0)

    @property
    def active(self) -> bool:
        return self.cfg.active

    def inject(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Apply a fault planted for this step, once (rank 0 only: the others must notice anyway)."""
        kind = self._pending.pop(step, None) if self.rank == 0 else None
        if kind == "nan":
            return loss * float("nan")
        if kind == "spike":
            return loss * 100.0
        return loss

    def observe(self, loss: torch.Tensor) -> None:
        """Judge one micro-batch's loss on the device; nothing is read back to the host."""
        if not self.active:
            return
        value = loss.detach().float().reshape(())
        finite = torch.isfinite(value)
        spiking = finite & (value > self._threshold)
        self._worst = torch.maximum(self._worst, torch.where(spiking, value, torch.zeros_like(value)))
        self._step += torch.stack(
            [
                (~finite).float(),
                spiking.float(),
                torch.ones_like(value),
                torch.where(finite, value, torch.zeros_like(value)),
            ]
        )

    def vote(self) -> None:
        """Cast this rank's votes on the step's micro-batches (after the last one's forward): the
        all-reduce over ranks and the copy to the host are queued, nothing waits for them. Every
        rank must call it once per step, at the same point (`verdict` does if nobody did)."""
        if not self.active:
            return
        local, worst = self._step.clone(), self._worst.clone()
        self._step.zero_()
        self._worst.zero_()
        # Ranks, not micro-batches, are counted: [ranks with a non-finite loss, ranks with a spike].
        votes = torch.stack([local[0].clamp(max=1.0), local[1].clamp(max=1.0)])
        if ranks() > 1:
            dist.all_reduce(votes)
        if self._host is not None and self._copied is not None:
            self._host.copy_(votes, non_blocking=True)
            self._copied.record()
        self._cast = (local, worst, votes)

    def verdict(self, step: int) -> str | None:
        """None if every micro-batch of this step was good on every rank, else why not: the one
        host read of a step, which waits for the votes (`vote`) and no later work."""
        if not self.active:
            return None
        if self._cast is None:
            self.vote()
        assert self._cast is not None
        local, worst, votes = self._cast
        self._cast = None
        if self._host is not None and self._copied is not None:
            self._copied.synchronize()  # the votes' copy alone, not the backward queued behind it
            votes = self._host
        nonfinite, spiking = votes.tolist()
        if not nonfinite and not spiking:
            self._remember(local[3] / local[2].clamp(min=1.0))
            self.in_a_row = 0
            return None
        where = f"on {int(nonfinite or spiking)} of {ranks()} rank(s)"
        if nonfinite:
            reason = f"loss is not finite {where}"
        else:
            value, median = float(worst), float(torch.nanmedian(self._recent))
            mine = (
                f" {value:.4g} is {value / median:.1f}x the running median {median:.4g}"
                if value
                else f" above {self.cfg.spike_factor:g}x the running median"
            )
            reason = f"loss{mine} {where} (train.health.spike_factor = {self.cfg.spike_factor:g})"
        self.in_a_row += 1
        if self.in_a_row > self.cfg.max_in_a_row:
            raise BadLoss(
                step,
                f"{reason}; {self.in_a_row} bad steps in a row "
                f"(train.health.max_in_a_row = {self.cfg.max_in_a_row}): the run diverged",
                fatal=True,
            )
        return reason

    def _remember(self, mean_loss: torch.Tensor) -> None:
        """A good step's mean loss into the ring; the spike threshold follows, on the device."""
        if not self.cfg.spike_factor:
            return
        self._recent[self._filled % self.cfg.spike_window] = mean_loss
        self._filled += 1
        if self._filled >= MIN_HISTORY:
            self._threshold = self.cfg.spike_factor * torch.nanmedian(self._recent)

    def skip(self, step: int, micro_batches: int, reason: str) -> None:
        """A step left out under the skip policy: counted, and an event for the run."""
        self.skipped += micro_batches
        self.events.append(f"step {step}: skipped the step's {micro_batches} micro-batch(es): {reason}")

    def metrics(self) -> dict[str, float]:
        return {"health/skipped_batches": float(self.skipped), "health/rollbacks": float(self.rollbacks)}
