"""Every schedule against hand-computed values; all are pure functions of the step."""

import math

import pytest

from kiln.core.schedule import ScheduleConfig, lr_curve, lr_multiplier, plot_schedule


def test_warmup_then_cosine_to_floor():
    s = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, s, 110) == pytest.approx(0.1)
    assert lr_multiplier(9, s, 110) == pytest.approx(1.0)
    assert lr_multiplier(10, s, 110) == pytest.approx(1.0)
    # halfway through decay: floor + (1 - floor) * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lr_multiplier(60, s, 110) == pytest.approx(0.55)
    assert lr_multiplier(110, s, 110) == pytest.approx(0.1)
    assert lr_multiplier(35, s, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_linear_and_constant():
    lin = ScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_multiplier(s, lin, 4) for s in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    const = ScheduleConfig(name="constant", warmup_steps=2, min_lr_ratio=0.0)
    assert [lr_multiplier(s, const, 10) for s in range(4)] == pytest.approx([0.5, 1, 1, 1])


def test_exponential_is_e_to_minus_lambda_t_above_the_floor():
    s = ScheduleConfig(name="exponential", warmup_steps=0, min_lr_ratio=0.0, decay_rate=0.1)
    assert lr_multiplier(0, s, 100) == pytest.approx(1.0)
    assert lr_multiplier(10, s, 100) == pytest.approx(0.36787944)  # e^-1
    assert lr_multiplier(20, s, 100) == pytest.approx(0.13533528)  # e^-2
    floored = ScheduleConfig(name="exponential", warmup_steps=5, min_lr_ratio=0.5, decay_rate=0.1)
    assert lr_multiplier(5 + 10, floored, 100) == 0.5  # e^-1 < 0.5: held at the floor
    assert lr_multiplier(5 + 2, floored, 100) == pytest.approx(0.81873075)  # e^-0.2, t after warmup


def test_inverse_sqrt():
    s = ScheduleConfig(name="inverse_sqrt", warmup_steps=4, min_lr_ratio=0.0)
    # warmup 1/4 .. 1, then sqrt(4 / (4 + t)): t = 0 -> 1, t = 12 -> 0.5, t = 60 -> 0.25
    assert [lr_multiplier(s_, s, 100) for s_ in (0, 3, 4, 16, 64)] == pytest.approx([0.25, 1, 1, 0.5, 0.25])


def test_cosine_restarts_sgdr():
    s = ScheduleConfig(name="cosine_restarts", warmup_steps=0, min_lr_ratio=0.0, restart_period=4, restart_mult=2)
    # cycles [0, 4), [4, 12), [12, 28): the LR is back at the peak on 0, 4 and 12.
    got = [lr_multiplier(t, s, 100) for t in (0, 1, 2, 4, 8, 11, 12, 28)]
    cos_quarter = 0.5 * (1 + math.cos(math.pi / 4))  # 0.8535534
    last_of_cycle_2 = 0.5 * (1 + math.cos(math.pi * 7 / 8))  # 0.0380602
    assert got == pytest.approx([1, cos_quarter, 0.5, 1, 0.5, last_of_cycle_2, 1, 1])
    floored = ScheduleConfig(name="cosine_restarts", warmup_steps=0, min_lr_ratio=0.1, restart_period=4, restart_mult=1)
    assert [lr_multiplier(t, floored, 100) for t in (2, 6, 8)] == pytest.approx([0.55, 0.55, 1.0])


def test_unknown_schedule_is_refused_by_the_config():
    from kiln.config import load_config
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="schedule.name = 'step' is not allowed"):
        load_config(None, ["schedule.name=step"])


def test_plot_writes_a_png(tmp_path):
    s = ScheduleConfig(name="cosine_restarts", warmup_steps=5, restart_period=20)
    out = plot_schedule(s, 1e-3, 100, str(tmp_path / "lr.png"))
    data = (tmp_path / "lr.png").read_bytes()
    assert out.endswith("lr.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert list(tmp_path.iterdir()) == [tmp_path / "lr.png"]  # no temp file left
    assert len(lr_curve(s, 1e-3, 100)) == 100
