"""The leak check on this process's real RSS: a planted leak is named, flat memory is not."""

import logging

import psutil

from kiln.core.leaks import MIN_GROWTH_BYTES, WINDOW, LeakWatch


def _rss() -> dict[str, float]:
    return {"host": float(psutil.Process().memory_info().rss)}


def test_a_planted_host_leak_is_warned_about_once_and_reported(caplog):
    watch, kept = LeakWatch(warmup_end=5), []
    rates = []
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        for step in range(1, 6 + 2 * WINDOW + 5):
            kept.append(bytearray(8 * 2**20))  # the leak: 8 MiB kept every step, pages touched
            rates.append(watch.sample(step, _rss())["memory/leak_bytes_per_step"])
    warnings = [r.getMessage() for r in caplog.records if "possible memory leak" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("possible memory leak: host memory grew ") and "MiB/step" in warnings[0]
    assert all(r == 0.0 for r in rates[: 5 + 2 * WINDOW - 1])  # warm-up, then two full windows first
    assert 7 * 2**20 < rates[-1] < 9 * 2**20, rates[-1]  # about the 8 MiB a step planted


def test_flat_or_sawtooth_memory_is_not_a_leak(caplog):
    watch, rates = LeakWatch(warmup_end=0), []
    with caplog.at_level(logging.WARNING, logger="kiln.train"):
        for step in range(1, 3 * WINDOW):
            scratch = bytearray(32 * 2**20)  # allocated and freed each step, as a training step does
            rates.append(watch.sample(step, _rss())["memory/leak_bytes_per_step"])
            del scratch
        # a sawtooth that climbs MIN_GROWTH_BYTES but falls back as often as it rises
        for step in range(3 * WINDOW, 5 * WINDOW):
            level = (step % 2) * 2 * MIN_GROWTH_BYTES
            rates.append(watch.sample(step, {"device": float(level)})["memory/leak_bytes_per_step"])
        # one jump of a leak's size in mid-window (an evaluation's buffers, kept), flat around it:
        # it tilts a fitted line as a leak would (the demo warned on one), but is not growth
        for step in range(5 * WINDOW, 7 * WINDOW):
            level = 2 * MIN_GROWTH_BYTES if step >= 6 * WINDOW else MIN_GROWTH_BYTES
            rates.append(watch.sample(step, {"jump": float(level + step)})["memory/leak_bytes_per_step"])
        # a start-up still settling after warm-up: steady growth of a leak's size through one
        # window, flat after (the demo's RSS, 762 to 814 MiB by step ~100, warned before)
        for step in range(7 * WINDOW, 10 * WINDOW):
            level = min(step - 7 * WINDOW, WINDOW) * MIN_GROWTH_BYTES / (WINDOW / 2)
            rates.append(watch.sample(step, {"settling": float(level)})["memory/leak_bytes_per_step"])
    assert rates and max(rates) == 0.0
    assert not [r for r in caplog.records if "possible memory leak" in r.getMessage()]
