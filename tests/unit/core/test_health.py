"""The training-health guard: its verdicts on their own, its config errors, and each policy on a
real DeepSpeed run (local launcher, no Ray) with a NaN and a spike planted in rank 0's loss."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import mlflow_store  # the suite's helper; it imports MLflow only when a store is made
import pytest
import torch

from kiln.config import load_config
from kiln.core import checkpoint
from kiln.core.health import MIN_HISTORY, BadLoss, HealthConfig, HealthGuard
from kiln.errors import ConfigError

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

REPO = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


def _guard(**kw) -> HealthGuard:
    return HealthGuard(HealthConfig(**kw), rank=0, device=CPU)


def _judge(guard: HealthGuard, step: int, *losses: float) -> str | None:
    for loss in losses:
        guard.observe(torch.tensor(loss))
    return guard.verdict(step)


def test_verdicts_nan_inf_and_spikes_over_the_running_median():
    guard = _guard(policy="skip", spike_factor=3.0, max_in_a_row=2)
    assert "not finite on 1 of 1" in _judge(guard, 1, float("nan"))
    assert "not finite" in _judge(guard, 1, 2.0, float("inf"))  # one bad micro-batch spoils the step
    for i in range(MIN_HISTORY - 1):  # too little history to call anything a spike
        assert _judge(guard, 2, 10.0 if i == 0 else 2.0) is None
    assert _judge(guard, 3, 7.0) is None  # the MIN_HISTORY-th good step
    said = _judge(guard, 4, 2.0, 7.0)  # median 2.0: 3.5x
    assert said is not None and "7 is 3.5x the running median 2 on 1 of 1 rank(s)" in said
    assert _judge(guard, 5, 5.9) is None  # 2.95x: fine, and it resets the count
    _judge(guard, 6, float("nan"))
    _judge(guard, 7, float("nan"))
    with pytest.raises(BadLoss, match="3 bad steps in a row") as bad:
        _judge(guard, 8, float("nan"))
    assert bad.value.fatal
    assert _judge(_guard(policy="off"), 1, float("nan")) is None


def test_a_shut_gate_keeps_the_step_from_weights_optimizer_state_and_schedule():
    from kiln.core.optim import StepGate, build_scheduler, gate_optimizer
    from kiln.core.schedule import ScheduleConfig

    model = torch.nn.Linear(4, 4)
    gate = StepGate()
    opt = gate_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), gate)
    sched = build_scheduler(opt, ScheduleConfig(name="linear", warmup_steps=2), 10, gate)
    model(torch.ones(1, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    lr = sched.get_last_lr()[0]
    gate.open = False
    opt.step()
    sched.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state and sched.get_last_lr()[0] == lr and gate.withheld == 1
    gate.open = True
    opt.step()
    sched.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert sched.get_last_lr()[0] != lr


def test_the_votes_go_out_before_the_last_backward_and_are_read_after_it():
    """A step's one host read must not wait for its backward: on a GPU that drains the queue, and
    the GPU idles while the host works through the optimizer's step. So `train_step` casts the
    votes after the last micro-batch's forward and reads them once the backward is queued; a bad
    loss still keeps the step from the weights (the gate is shut before `step`)."""
    from kiln.core.optim import StepGate
    from kiln.core.step import PhaseTimer, train_step

    calls: list[str] = []
    model = torch.nn.Linear(4, 1)
    guard, gate = _guard(), StepGate()

    class Recorder:  # the Engine calls train_step makes, in order, over a real module
        pipeline = False

        def forward(self, inputs, targets):
            calls.append("forward")
            return ((model(inputs.float()) - targets.float()) ** 2).mean()

        def backward(self, loss):
            calls.append("backward")
            loss.backward()

        def step(self):
            calls.append(f"step, gate {'open' if gate.open else 'shut'}")

    for name in ("vote", "verdict"):
        real = getattr(guard, name)
        setattr(guard, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1])
    rows = [torch.ones(2, 5), torch.ones(2, 5)]
    assert train_step(Recorder(), iter(rows), 2, guard, gate, PhaseTimer(CPU), 1).skipped is None
    want = ["forward", "backward", "step, gate open", "forward", "vote", "backward", "verdict"]
    assert calls == [*want, "step, gate open"]
    calls.clear()
    guard.cfg.policy, guard.inject = "skip", lambda loss, step: loss * float("nan")
    assert "not finite" in train_step(Recorder(), iter(rows), 2, guard, gate, PhaseTimer(CPU), 2).skipped
    assert calls == [*want, "step, gate shut"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_verdict_waits_for_its_votes_alone():
    """On CUDA the votes reach the host through a page-locked copy and an event: the verdicts
    are the CPU's, and the read returns while later work is still queued."""
    cuda = torch.device("cuda")
    guard = HealthGuard(HealthConfig(spike_factor=3.0), rank=0, device=cuda)

    def judge(step: int, loss: float) -> str | None:
        guard.observe(torch.tensor(loss, device=cuda))  # a loss where the model computes it
        return guard.verdict(step)

    for step in range(1, MIN_HISTORY + 1):
        assert judge(step, 2.0) is None
    guard.observe(torch.tensor(float("nan"), device=cuda))
    guard.vote()
    a = torch.randn(4096, 4096, device=cuda)
    for _ in range(20):  # queued behind the votes: the read does not wait for it
        a = a @ a / 64
    assert "not finite" in guard.verdict(MIN_HISTORY + 1)
    assert not torch.cuda.current_stream().query()
    assert "7 is 3.5x the running median 2" in judge(MIN_HISTORY + 2, 7.0)


def test_injections_hit_rank_0_once():
    guard = _guard(inject="nan@3, spike@5")
    loss = torch.tensor(2.0)
    assert guard.inject(loss, 2) is loss
    assert math.isnan(guard.inject(loss, 3).item()) and guard.inject(loss, 3).item() == 2.0
    assert guard.inject(loss, 5).item() == 200.0
    other = HealthGuard(HealthConfig(inject="nan@3"), rank=1, device=CPU)
    assert other.inject(loss, 3).item() == 2.0


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.health.policy=retry"], "train.health.policy = 'retry' is not allowed"),
        (["train.health.inject=nan@0"], "train.health.inject = 'nan@0': nan@0 is not nan@STEP or spike@STEP"),
        (["train.health.spike_factor=0.5"], "train.health.spike_factor = 0.5: expected 0 (off) or a number > 1"),
        (["train.health.max_rollbacks=0"], "max_rollbacks = 0: expected integers >= 1"),
        (
            ["train.health.policy=skip", "parallel.pipeline_stages=2", "parallel.zero_stage=1"],
            "train.health.policy = 'skip' with parallel.pipeline_stages > 1",
        ),
    ],
)
def test_config_mistakes_are_named(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(str(REPO / "jobs/configs/debug.yaml"), overrides)
    assert needle in str(e.value)


def test_each_policy_on_a_real_run(byte_dataset, tmp_path):
    # One process each, 2 micro-batches a step, all three at once. (Two ranks that must agree to
    # leave out a micro-batch whose loss is NaN on one of them: the ZeRO-2 run on Ray.)
    runs = {
        "skip": ["train.health.spike_factor=3", "train.health.inject=nan@6,spike@12"],
        "rollback": ["train.checkpoint_every=4", "train.health.inject=nan@6"],
        "stop": ["train.checkpoint_every=4", "train.health.inject=nan@6"],
        # a second bad loss once the one rollback allowed is spent stops the run
        "capped": ["train.checkpoint_every=4", "train.health.inject=nan@6,nan@9", "train.health.max_rollbacks=1"],
    }
    procs = {
        name: _start(
            byte_dataset, tmp_path / name, [f"train.health.policy={'rollback' if name == 'capped' else name}", *sets]
        )
        for name, sets in runs.items()
    }
    out = {name: (p.communicate(timeout=600), p.returncode) for name, p in procs.items()}

    (_, err), rc = out["skip"]
    assert rc == 0, err[-3000:]
    run, client = _run(tmp_path / "skip")
    tags = _health_tags(run)
    assert tags[0] == "step 6: skipped the step's 2 micro-batch(es): loss is not finite on 1 of 1 rank(s)", tags
    assert (
        tags[1].startswith("step 12: skipped the step's 2 micro-batch(es): loss ") and "x the running median" in tags[1]
    ), tags
    skipped = client.get_metric_history(run.info.run_id, "health/skipped_batches")
    assert sorted((m.step, m.value) for m in skipped) == [(6, 2.0), (12, 4.0)]
    losses = _losses(client, run)
    assert [s for s, _ in losses] == list(range(1, 15)) and all(math.isfinite(v) for _, v in losses)
    assert losses[-1][1] < losses[0][1] - 0.5

    (_, err), rc = out["rollback"]
    assert rc == 0, err[-3000:]
    run, client = _run(tmp_path / "rollback")
    tags = _health_tags(run)
    assert tags == [
        "step 6: rolled back to step_00000004, skipping the data of steps 5-6: loss is not finite on 1 of 1 rank(s)"
    ], tags
    assert [m.value for m in client.get_metric_history(run.info.run_id, "health/rollbacks")] == [1.0]
    losses = _losses(client, run)  # steps 5 and 6 were trained twice (on different data)
    assert sorted({s for s, _ in losses}) == list(range(1, 15)) and all(math.isfinite(v) for _, v in losses)
    assert [s for s, _ in losses].count(5) == 2 and run.info.status == "FINISHED"

    (_, err), rc = out["stop"]
    assert rc == 1, err[-3000:]  # a runtime failure (kiln.errors)
    assert (
        "kiln: error: training stopped at step 6: loss is not finite on 1 of 1 rank(s) "
        "(train.health.policy = stop); the newest complete checkpoint is " in err
    ), err[-3000:]
    assert "Traceback" not in err
    run, client = _run(tmp_path / "stop")
    assert run.info.status == "FAILED" and _health_tags(run) == [
        "step 6: stopped: loss is not finite on 1 of 1 rank(s)"
    ]
    root = tmp_path / "stop" / "runs" / run.info.run_name
    assert sorted(p.name for p in root.iterdir()) == ["kiln-run.json", "step_00000004"]
    assert checkpoint.is_complete(str(root / "step_00000004"))

    (_, err), rc = out["capped"]
    assert rc == 1, err[-3000:]  # a runtime failure (kiln.errors)
    assert (
        "kiln: error: training stopped at step 9: loss is not finite on 1 of 1 rank(s) (1 rollback(s) "
        "already, train.health.max_rollbacks = 1); the newest complete checkpoint is " in err
    ), err[-3000:]
    run, client = _run(tmp_path / "capped")
    assert _health_tags(run) == [
        "step 6: rolled back to step_00000004, skipping the data of steps 5-6: loss is not finite on 1 of 1 rank(s)",
        "step 9: stopped: loss is not finite on 1 of 1 rank(s)",
    ], _health_tags(run)
    assert run.info.status == "FAILED"


def _start(byte_dataset, where: Path, sets: list[str]) -> subprocess.Popen:
    where.mkdir()
    overrides = [
        f"data.path={byte_dataset}",
        "train.max_steps=14",
        "train.eval_every=0",
        "train.micro_batch_size=8",
        "train.grad_accum_steps=2",
        "schedule.warmup_steps=2",
        "logging.progress_every=1",
        f"logging.tracking_uri={mlflow_store.sqlite_store(where)}",
        f"train.storage_path={where}/runs",
        *sets,
    ]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln.launch.local",
            "--config",
            str(REPO / "jobs/configs/debug.yaml"),
            *[a for o in overrides for a in ("--set", o)],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=where,
    )


def _run(where: Path):
    from mlflow.tracking import MlflowClient  # here, not above: the GPU test runs where MLflow is not installed

    client = MlflowClient(f"sqlite:///{where}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("kiln-demo").experiment_id])
    return run, client


def _health_tags(run) -> list[str]:
    tags = {int(k.rsplit(".", 1)[1]): v for k, v in run.data.tags.items() if k.startswith("kiln.health.")}
    return [tags[n] for n in sorted(tags)]


def _losses(client, run) -> list[tuple[int, float]]:
    history = client.get_metric_history(run.info.run_id, "loss/train")
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.step, m.timestamp))]
