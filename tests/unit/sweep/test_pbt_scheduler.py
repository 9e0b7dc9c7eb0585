"""Synchronous PBT goes on when a trial fails: Tune's own scheduler waits for it for ever. And a
trial's last step is no decision: Tune's own pauses every trial there, to train its last
interval again.

Tune's real scheduler and real trials; the controller is a stand-in with the two views PBT
reads, and it keeps a failed trial live as Tune's controller does (only TERMINATED leaves).
A whole sweep with a failing trial on Ray is too slow for the unit lane; the PBT test on Ray
(tests/integration/test_sweep_on_ray.py) runs this scheduler end to end."""

import pytest
from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining

from kiln.sweep.pbt_scheduler import SurvivorsPBT


class Controller:
    search_alg = None  # a grid, as the PBT test's sweep: Tune's BasicVariantGenerator

    def __init__(self, trials):
        self.trials = trials

    def get_trials(self):
        return list(self.trials)

    def get_live_trials(self):
        return {t for t in self.trials if t.status != Trial.TERMINATED}


MAX_STEPS = 18  # the runs' last step


def _population(cls):
    sched = cls(
        **({"max_steps": MAX_STEPS} if cls is SurvivorsPBT else {}),
        time_attr="step",
        metric="loss/val",
        mode="min",
        perturbation_interval=6,
        hyperparam_mutations={"optim.lr": [1e-4, 3e-3]},
        synch=True,
    )
    trials = [Trial("__fake", config={"optim.lr": lr}, stub=True) for lr in (1e-4, 3e-3)]
    ctl = Controller(trials)
    for t in trials:
        sched.on_trial_add(ctl, t)
        t.set_status(Trial.RUNNING)
    return sched, ctl, trials


def _fail(sched, ctl, trial):
    sched.on_trial_error(ctl, trial)  # as Tune's controller: the scheduler first, then the status
    trial.set_status(Trial.ERROR)


def _report_at_decision(sched, ctl, trial):
    decision = sched.on_trial_result(ctl, trial, {"step": 6, "loss/val": 2.0, "training_iteration": 1})
    assert decision == "PAUSE"  # synchronous PBT pauses every trial that reaches a decision
    trial.set_status(Trial.PAUSED)


@pytest.mark.parametrize("cls", [SurvivorsPBT, PopulationBasedTraining])
@pytest.mark.parametrize("order", ["fails, then the other reaches the decision", "fails while the other waits at it"])
def test_a_failed_trial_does_not_hold_the_decision(cls, order):
    sched, ctl, (survivor, failing) = _population(cls)
    if order.startswith("fails, then"):
        _fail(sched, ctl, failing)
        _report_at_decision(sched, ctl, survivor)
    else:
        _report_at_decision(sched, ctl, survivor)
        assert sched.choose_trial_to_run(ctl) is None  # it waits for the other, as it should
        _fail(sched, ctl, failing)
    resumed = sched.choose_trial_to_run(ctl)
    if cls is PopulationBasedTraining:
        assert resumed is None  # Tune's own: the survivor waits for the failed trial for ever
    else:
        assert resumed is survivor
        # ... and goes on to the next decision, which it takes alone.
        survivor.set_status(Trial.RUNNING)
        decision = sched.on_trial_result(ctl, survivor, {"step": 12, "loss/val": 1.5, "training_iteration": 2})
        assert decision == "PAUSE" and survivor.status == Trial.RUNNING
        survivor.set_status(Trial.PAUSED)
        assert sched.choose_trial_to_run(ctl) is survivor


@pytest.mark.parametrize("cls", [SurvivorsPBT, PopulationBasedTraining])
def test_the_last_step_is_no_decision(cls):
    """A trial reports step 18, a multiple of the interval and the run's last step: it ends
    there. Tune's own pauses it for a decision (and, with no checkpoint offered at the last step,
    would start it again from its previous one)."""
    sched, ctl, (first, _) = _population(cls)
    decision = sched.on_trial_result(ctl, first, {"step": MAX_STEPS, "loss/val": 1.0, "training_iteration": 3})
    assert decision == ("PAUSE" if cls is PopulationBasedTraining else "CONTINUE")
