"""Sweep files: what a trial gets, and every bad input refused before any trial starts."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.errors import ConfigError
from kiln.sweep.config import load_sweep, param_space

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "jobs/configs/sweeps/optimizers-x-schedules.yaml"


PBT_BASE = {"train.checkpoint_every": 10, "train.eval_every": 5}


def _write(tmp_path, **fields) -> Path:
    doc = {
        "name": "t",
        "base": str(REPO / "jobs/configs/debug.yaml"),
        "space": {"optim.name": {"choice": ["adamw", "sgd"]}},
        **fields,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_example_sweep_is_five_optimizers_by_three_schedules_with_asha():
    sweep = load_sweep(EXAMPLE)
    cfg = sweep.config
    assert cfg.scheduler.name == "asha" and cfg.search == "grid"
    space = param_space(cfg)
    assert space["optim.name"] == {"grid_search": ["sgd", "adam", "adamw", "rmsprop", "lamb"]}
    assert len(space["schedule.name"]["grid_search"]) == 3
    assert sweep.base_config.model.flavour == "debug" and sweep.base_config.parallel.num_workers == 2


def test_trial_config_applies_params_then_conditionals():
    sweep = load_sweep(EXAMPLE)
    sgd = sweep.trial_config({"optim.name": "sgd", "schedule.name": "exponential"})
    assert sgd.optim.name == "sgd" and sgd.optim.lr == 0.3 and sgd.optim.nesterov
    assert sgd.schedule.name == "exponential" and sgd.schedule.decay_rate == 0.04
    lamb = sweep.trial_config({"optim.name": "lamb", "schedule.name": "cosine"})
    assert lamb.optim.lr == 0.02 and not lamb.optim.nesterov and lamb.train.max_steps == 60


def test_distributions_map_to_tune(tmp_path):
    sweep = load_sweep(
        _write(
            tmp_path,
            space={
                "optim.lr": {"loguniform": [1e-4, 1e-2]},
                "optim.beta2": {"uniform": [0.9, 0.99]},
                "train.micro_batch_size": {"randint": [4, 17]},
                "optim.name": {"choice": ["adam", "lamb"]},
            },
        )
    )
    space = param_space(sweep.config)
    assert type(space["optim.lr"]).__name__ == "Float" and space["optim.lr"].lower == 1e-4
    assert type(space["train.micro_batch_size"]).__name__ == "Integer"
    assert space["optim.name"].categories == ["adam", "lamb"]


@pytest.mark.parametrize(
    "fields, needle",
    [
        (
            {"space": {"optim.name": {"choice": ["adamw", "adagrad"]}}},
            "sweep.space.optim.name.choice value 'adagrad': a trial would get optim.name = 'adagrad' is not allowed",
        ),
        ({"space": {"schedule.name": {"grid": ["cosine", "step"]}}}, "schedule.name = 'step' is not allowed"),
        ({"space": {"optim.lrr": {"choice": [1e-3]}}}, "unknown config key 'optim.lrr'; did you mean 'lr'?"),
        ({"space": {"optim": {"choice": [1]}}}, "'optim' is a section"),
        ({"space": {"optim.name": {"choice": []}}}, "sweep.space.optim.name.choice = []: expected a non-empty list"),
        ({"space": {"optim.lr": {"loguniform": [1e-2, 1e-4]}}}, "low must be below high"),
        ({"space": {"optim.lr": {"loguniform": [0, 1e-2]}}}, "low must be > 0 for a log scale"),
        ({"space": {"optim.lr": {"normal": [0, 1]}}}, "expected one of {choice: ..., grid: ..."),
        ({"space": {"optim.lr": {"uniform": [1e-3, 20.0]}}}, "optim.lr = 20.0 is out of range"),
        (
            {"space": {"optim.lr": {"uniform": [1e-3, 1e-2]}}, "search": "grid"},
            "search 'grid' needs every space entry to be grid or choice",
        ),
        ({"space": {}}, "sweep.space is empty"),
        ({"scheduler": {"name": "hyperband"}}, "sweep.scheduler.name = 'hyperband' is not allowed"),
        (
            {"scheduler": {"name": "pbt"}},
            "sweep.scheduler.name = 'pbt' forks trials from their checkpoints: set train.checkpoint_every > 0",
        ),
        (
            {"scheduler": {"name": "pbt"}, "overrides": PBT_BASE | {"train.eval_every": 4}},
            "train.checkpoint_every = 10 must be a multiple of train.eval_every = 4",
        ),
        (
            {"scheduler": {"name": "pbt"}, "overrides": PBT_BASE | {"train.checkpoint_every_minutes": 5}},
            "train.checkpoint_every_minutes = 5 with sweep.scheduler.name = 'pbt': a timed checkpoint",
        ),
        (
            {"scheduler": {"name": "pbt", "perturbation_interval": 15}, "overrides": PBT_BASE},
            "sweep.scheduler.perturbation_interval = 15: expected a multiple of train.checkpoint_every = 10",
        ),
        ({"scheduler": {"name": "pbt", "quantile_fraction": 0.75}, "overrides": PBT_BASE}, "quantile_fraction = 0.75"),
        (
            {"scheduler": {"name": "pbt"}, "overrides": PBT_BASE, "space": {"optim.lr": {"grid": [1e-3]}}},
            "expected at least 2 trials",
        ),
        (
            {"scheduler": {"name": "pbt"}, "overrides": PBT_BASE, "space": {"model.n_layer": {"grid": [1, 2]}}},
            "sweep.space.model.n_layer: PBT changes a trial's settings while it trains",
        ),
        (
            {"scheduler": {"name": "pbt"}, "overrides": PBT_BASE, "space": {"optim.name": {"grid": ["adam", "sgd"]}}},
            "sweep.space.optim.name: PBT changes",
        ),
        # a mutation PBT could make outside the field's range: its bounds are checked like any draw
        (
            {
                "scheduler": {"name": "pbt"},
                "overrides": PBT_BASE,
                "num_samples": 4,
                "space": {"optim.beta2": {"uniform": [0.9, 1.2]}},
            },
            "sweep.space.optim.beta2.uniform bound 1.2 (PBT mutates the field within it): a trial would get optim.beta2",
        ),
        (
            {
                "scheduler": {"name": "pbt"},
                "overrides": PBT_BASE,
                "num_samples": 4,
                "storage_path": "s3://b/sweeps",
                "space": {"optim.lr": {"loguniform": [1e-4, 1e-2]}},
            },
            "PBT forks a trial from another's checkpoint by path",
        ),
        ({"scheduler": {"grace_period": 500}}, "grace_period = 500 exceeds train.max_steps = 200"),
        ({"num_samples": 0}, "sweep.num_samples = 0 is out of range"),
        ({"overrides": {"train.eval_every": 0}}, "sweep.metric = 'loss/val' needs train.eval_every > 0"),
        ({"conditional": {"optim.name=sgd": {"optim.momentun": 0.5}}}, "did you mean 'momentum'?"),
        ({"base": "missing.yaml"}, "sweep.base = 'missing.yaml'"),
        ({"serach": "grid"}, "unknown config key 'sweep.serach'; did you mean 'search'?"),
        (
            {"space": {"train.health.spike_factor": {"choice": [0, 0.5]}}},
            "sweep.space.train.health.spike_factor.choice value 0.5: a trial would get train.health.spike_factor = 0.5",
        ),
    ],
)
def test_bad_sweeps_are_refused_with_the_field_named(tmp_path, fields, needle):
    with pytest.raises(ConfigError) as e:
        load_sweep(_write(tmp_path, **fields))
    assert needle in str(e.value)


def test_cli_refuses_a_bad_sweep_in_one_line_before_any_trial(tmp_path):
    path = _write(tmp_path, space={"optim.lr": {"loguniform": [1.0, 0.1]}})
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "sweep", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("kiln: error: sweep.space.optim.lr.loguniform = [1.0, 0.1]")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_resume_of_an_unknown_sweep_names_what_is_there(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "sweep", "--resume", "nope", "--storage-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no sweep 'nope' to resume under" in proc.stderr


def test_pbt_mutates_the_space_and_keeps_each_value_within_its_entry(tmp_path):
    """PBT's own explore step multiplies by 0.8 or 1.2 and never looks at a range; Kiln's
    `Bounds` brings the value back inside the space entry, which validation checked."""
    from kiln.sweep.pbt import Bounds, scheduler

    sweep = load_sweep(
        _write(
            tmp_path,
            scheduler={"name": "pbt"},
            overrides=PBT_BASE,
            num_samples=4,
            space={
                "optim.lr": {"loguniform": [1e-4, 1e-2]},
                "schedule.warmup_steps": {"randint": [0, 10]},
                "optim.beta2": {"choice": [0.9, 0.95, 0.99]},
            },
        )
    )
    pbt = scheduler(sweep.config, sweep.base_config.train.checkpoint_every, sweep.base_config.train.max_steps)
    assert pbt._perturbation_interval == 10 and pbt._time_attr == "step"
    assert pbt._hyperparam_mutations["optim.beta2"] == [0.9, 0.95, 0.99]
    clip = Bounds(sweep.config.space)
    assert clip({"optim.lr": 1.2e-2, "schedule.warmup_steps": 11, "optim.beta2": 0.95}) == {
        "optim.lr": 1e-2,
        "schedule.warmup_steps": 9,
        "optim.beta2": 0.95,
    }
    assert clip({"optim.lr": 0.5e-4, "schedule.warmup_steps": -1}) == {"optim.lr": 1e-4, "schedule.warmup_steps": 0}
    assert clip({"optim.lr": 3e-3}) == {"optim.lr": 3e-3}
