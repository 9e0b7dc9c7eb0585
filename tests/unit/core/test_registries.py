"""A new optimizer or LR schedule is one entry in its registry: a fake plugged in there alone is
allowed by the config (`kiln config`), planned for by `kiln plan`, offered by the CLI's choices,
and built by the training code."""

import pytest
import torch

from kiln.cli import main
from kiln.cli_args import build_parser
from kiln.config import load_config
from kiln.core.optim import OPTIMIZERS, Optimizer, build_optimizer
from kiln.core.schedule import SCHEDULES, lr_multiplier
from kiln.errors import ConfigError


@pytest.fixture
def fake(monkeypatch):
    """'fake': SGD underneath, with three state tensors per parameter as far as the planner knows;
    'half': a schedule at half the peak after warmup."""
    monkeypatch.setitem(OPTIMIZERS, "fake", Optimizer(lambda g, o, impl: torch.optim.SGD(g, lr=o.lr), states=3))
    monkeypatch.setitem(SCHEDULES, "half", lambda t, T, s: 0.5)


def _plan_optim_gib(capsys, optimizer: str) -> float:
    assert main(["plan", "--model", "gpt2-124m", "--optimizer", optimizer, "--world-size", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    first = next(r for r in rows if r[:3] == ["0", "-", "off"])  # ZeRO-0, no offload, no checkpointing
    return float(first[6])  # the optimizer state column


def test_a_plugged_in_optimizer_reaches_the_config_the_planner_and_the_cli(fake, capsys):
    assert main(["config", "--set", "optim.name=fake", "--set", "schedule.name=half"]) == 0
    text = capsys.readouterr().out
    assert "name: fake" in text and "'fake']" in text and "name: half" in text and "'half']" in text
    # The planner counts its three states: three times SGD's one.
    assert _plan_optim_gib(capsys, "fake") == pytest.approx(3 * _plan_optim_gib(capsys, "sgd"), abs=0.02)
    plan = next(
        a
        for a in build_parser()._subparsers._group_actions[0].choices["plan"]._actions
        if "--optimizer" in a.option_strings
    )
    assert "fake" in plan.choices and list(plan.choices)[-1] == "fake"
    cfg = load_config(None, ["optim.name=fake", "schedule.name=half", "schedule.warmup_steps=2"])
    assert isinstance(build_optimizer(torch.nn.Linear(2, 2), cfg.optim), torch.optim.SGD)
    assert [lr_multiplier(s, cfg.schedule, 10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 0.5, 0.5]


def test_a_name_no_registry_holds_is_refused_with_the_registered_ones(capsys):
    with pytest.raises(ConfigError, match=r"optim.name = 'fake' is not allowed: expected one of \['adamw'"):
        load_config(None, ["optim.name=fake"])
    with pytest.raises(ConfigError, match=r"schedule.name = 'half' is not allowed: expected one of \['cosine'"):
        load_config(None, ["schedule.name=half"])
    with pytest.raises(SystemExit):
        main(["plan", "--optimizer", "fake"])
    assert "invalid choice: 'fake' (choose from 'adamw', 'adam', 'sgd', 'rmsprop', 'lamb')" in capsys.readouterr().err
