"""`kiln sweep`'s live line, fed as Tune's callback would feed it."""

import pickle
from pathlib import Path
from types import SimpleNamespace

from kiln.sweep.config import expected_trials, load_sweep
from kiln.sweep.progress import SweepProgress, SweepState

REPO = Path(__file__).resolve().parents[3]


def test_example_sweep_expects_its_fifteen_trials():
    sweep = load_sweep(str(REPO / "jobs/configs/sweeps/optimizers-x-schedules.yaml"))
    assert expected_trials(sweep.config) == 15  # 5 optimizers x 3 schedules, one sample each


def test_line_counts_trials_tracks_the_best_and_bounds_the_eta():
    s = SweepState(total=15, max_steps=60, metric="loss/val", mode="min", started=0.0)
    s.result("abc_00000", {"step": 15, "loss/val": 5.2})
    s.result("abc_00001", {"step": 15, "loss/val": 4.9})
    s.result("abc_00000", {"step": 30, "loss/val": 5.0})
    s.finished("abc_00000")  # stopped by ASHA at step 30
    # 45 trial-steps in 100 s; the whole budget is 15 x 60 = 900, so at most 855 more: 1900 s.
    assert s.line(now=100.0) == (
        "sweep 1/15 trials done | running: 00001 step 15/60 | best loss/val 4.9000 (00001) | 1m40s | eta <= 31m40s"
    )
    s.result("abc_00001", {"step": 30, "loss/val": float("nan")})  # a NaN is never the best
    s.finished("abc_00001", failed=True)
    assert "2/15 trials done (1 failed) | running: - | best loss/val 4.9000 (00001)" in s.line(now=200.0)

    top = SweepState(total=2, max_steps=10, metric="accuracy", mode="max", started=0.0)
    top.result("t_00000", {"step": 10, "accuracy": 0.4})
    top.result("t_00001", {"step": 10, "accuracy": 0.7})
    assert "best accuracy 0.7000 (00001)" in top.line(now=1.0)


def test_callback_survives_tunes_pickling_after_drawing(monkeypatch, capsys):
    cb = SweepProgress(SweepState(total=3, max_steps=10, metric="loss/val", mode="min"))
    cb.on_trial_result(1, [], SimpleNamespace(trial_id="x_00000"), {"step": 5, "loss/val": 3.0})
    assert "running: 00000 step 5/10" in capsys.readouterr().err
    restored = pickle.loads(pickle.dumps(cb))  # Tune saves callbacks with the experiment state
    assert restored.state.best == (3.0, "x_00000") and restored._bar is None
