"""`kiln sweep`'s live line on a terminal: trials done, what runs now and at which step, the
best metric so far, elapsed time and an upper-bound ETA.

A Tune callback in the driver feeds it from the trials' reports (rank 0's `loss/val` at each
eval step), so the step shown moves at eval granularity. Off a terminal Kiln leaves Tune's own
periodic status table, which reads fine in CI and `ray job logs`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

from ray.tune import Callback

from kiln.ui.progress import TerminalBar, duration


@dataclass
class SweepState:
    total: int
    max_steps: int
    metric: str
    mode: str
    started: float = field(default_factory=time.monotonic)
    steps: dict[str, int] = field(default_factory=dict)
    """Newest reported step of every trial seen, finished or not."""
    running: set[str] = field(default_factory=set)
    done: int = 0
    failed: int = 0
    best: tuple[float, str] | None = None

    def result(self, trial_id: str, result: dict) -> None:
        self.running.add(trial_id)
        self.steps[trial_id] = int(result.get("step", result.get("training_iteration", 0)) or 0)
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            better = self.best is None or (value < self.best[0] if self.mode == "min" else value > self.best[0])
            if better:
                self.best = (float(value), trial_id)

    def finished(self, trial_id: str, failed: bool = False) -> None:
        self.running.discard(trial_id)
        self.done += 1
        self.failed += failed

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self.started
        run_now = ", ".join(f"{t[-5:]} step {self.steps.get(t, 0)}/{self.max_steps}" for t in sorted(self.running))
        best = f"best {self.metric} {self.best[0]:.4f} ({self.best[1][-5:]})" if self.best else "no result yet"
        failed = f" ({self.failed} failed)" if self.failed else ""
        # An upper bound: ASHA stops trials early, so the sweep usually ends sooner.
        steps_run = sum(self.steps.values())
        budget = self.total * self.max_steps
        eta = f" | eta <= {duration(elapsed * (budget - steps_run) / steps_run)}" if steps_run else ""
        return (
            f"sweep {self.done}/{self.total} trials done{failed} | running: {run_now or '-'} | {best}"
            f" | {duration(elapsed)}{eta}"
        )


class SweepProgress(Callback):
    """Redraws the sweep's line on every trial report and end. Tune pickles its callbacks with
    the experiment state (for --resume), so the terminal is opened lazily and never pickled."""

    def __init__(self, state: SweepState):
        self.state = state
        self._bar: TerminalBar | None = None

    def __getstate__(self) -> dict:
        return {"state": self.state, "_bar": None}

    def _draw(self) -> None:
        if self._bar is None:
            self._bar = TerminalBar(sys.stderr)
        self._bar.draw(self.state.line(), force=True)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.state.result(trial.trial_id, result)
        self._draw()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.state.finished(trial.trial_id)
        self._draw()

    def on_trial_error(self, iteration, trials, trial, **info):
        self.state.finished(trial.trial_id, failed=True)
        self._draw()

    def on_experiment_end(self, trials, **info):
        if self._bar is not None:
            self._bar.close()
