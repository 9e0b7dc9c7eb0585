"""Tune's population-based training scheduler, with failed trials left out of its waits, and
no decision at a trial's last step.

Synchronous PBT (`sweep.scheduler.synch`) decides at each perturbation step once every live
trial has reached it, pausing those that arrive first. Ray Tune (2.60) counts a trial that
failed as live for ever: only a TERMINATED trial leaves the controller's live set. So one trial
that fails before a decision, or while the others wait at one, stops the sweep for good: no
trial runs, and none is started (CI saw it: a trial lost to a failed MLflow write hung a
two-trial sweep until its test's timeout). This subclass shows the scheduler the trials that
have not failed, and takes a decision the failed trial was the last one waited for at once.
Tune has no hook to change which trials count as live, hence a subclass.

Tune's PBT also takes a decision at a result on the perturbation step whatever comes after it,
the run's last step included. Where `train.max_steps` is a multiple of the interval, as it
usually is, synchronous PBT paused every trial at its last step; the last report offers no
checkpoint (a finished trial is nobody's starting point), so Tune started each trial again from
the one before, and every trial trained its last interval twice (seen in the PBT test on Ray: a
third round of restarts, 7-12 again, for a 12-step sweep deciding every 6). A trial's result at
its last step is no decision here: it ends.
"""

from __future__ import annotations

from typing import Any

from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler


class _Survivors:
    """The controller as PBT reads it, without the trials that failed."""

    def __init__(self, controller: Any, failed: set[Trial]):
        self._controller, self._failed = controller, failed

    def get_live_trials(self) -> list[Trial]:
        return [t for t in self._controller.get_live_trials() if t not in self._failed]

    def get_trials(self) -> list[Trial]:
        return [t for t in self._controller.get_trials() if t not in self._failed]

    def __getattr__(self, name: str) -> Any:  # saving, pausing and the rest: the controller's own
        return getattr(self._controller, name)


class SurvivorsPBT(PopulationBasedTraining):
    """`PopulationBasedTraining` that decides among the trials that have not failed, and never at
    the trials' last step, `max_steps` (the space cannot draw `train.max_steps` for PBT:
    `kiln.sweep.config.PBT_MUTABLE`)."""

    def __init__(self, *args: Any, max_steps: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._failed: set[Trial] = set()
        self._max_steps = max_steps

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict) -> str:
        if result.get(self._time_attr, 0) >= self._max_steps:
            return TrialScheduler.CONTINUE  # its last step: the trial ends, nothing to decide
        return super().on_trial_result(_Survivors(tune_controller, self._failed), trial, result)

    def on_trial_error(self, tune_controller: Any, trial: Trial) -> None:
        self._failed.add(trial)  # Tune calls this before it marks the trial ERROR
        super().on_trial_error(tune_controller, trial)
        if not self._synch:
            return
        view = _Survivors(tune_controller, self._failed)
        due = self._next_perturbation_sync
        live = view.get_live_trials()
        if not live or any(self._trial_state[t].last_train_time < due for t in live):
            return  # a live trial has yet to arrive: its result takes the decision
        # Every survivor waits, paused, at the decision: take it as the failed trial's result would
        # have (after it, each is behind the next decision, so Tune starts them again).
        waiting = next((t for t in live if t.status == Trial.PAUSED and self._trial_state[t].last_result), None)
        if waiting is not None:
            super().on_trial_result(view, waiting, self._trial_state[waiting].last_result)
