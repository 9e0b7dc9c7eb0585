"""The step meter's peak where no datasheet gives one: probed more than once, the highest kept,
and the probes' time left out of the steady-state throughput."""

import time
import types

import torch

from kiln.config import load_config
from kiln.core import meter as meter_mod
from kiln.core.meter import PEAK_PROBES, WARMUP_STEPS_EXCLUDED, StepMeter


def test_the_cpu_peak_is_the_best_of_several_probes_whose_time_is_not_the_steps(monkeypatch):
    rates = iter([1e9, 4e9, 2e9, 8e9])  # the second probe is the best of the first PEAK_PROBES
    probes = []

    def probe(device, precision):
        probes.append(time.perf_counter())
        time.sleep(0.5)  # far longer than a step here: it would show in the throughput if counted
        return next(rates)

    monkeypatch.setattr(meter_mod, "measured_peak_flops", probe)
    cfg = load_config(None, ["model.flavour=debug", "model.vocab_size=256", "model.seq_len=32", "train.max_steps=20"])
    meter = StepMeter(cfg, cfg.model.shape(), 1, torch.device("cpu"), tokens_per_step=1000, done=0)
    engine = types.SimpleNamespace(
        grad_norm=lambda: None, memory=lambda: {"memory/params_bytes": 80.0}, overflow=lambda: (0, 0.0)
    )  # the `Engine` seam's reads
    mfus = []
    for step in range(1, 21):
        meter.begin()
        time.sleep(0.01)  # the step
        metrics = meter.metrics(step, meter.step_time(step), 1.0, 1e-3, {}, 0.0, engine, 0)
        mfus.append(metrics.get("mfu"))
        meter.end(step, 0.0)
    assert len(probes) == PEAK_PROBES == 3  # at warm-up's end and the next two metric steps (every step here)
    assert meter.peak == 4e9
    assert mfus[WARMUP_STEPS_EXCLUDED - 2] is None and mfus[WARMUP_STEPS_EXCLUDED - 1] is not None
    summary = meter.summary()
    assert summary["mfu"] == meter.mfu(summary["throughput/tokens_per_s"])
    # 15 steady steps of ~10 ms (0.15 s); the two probes inside them would add 1 s if counted.
    assert meter.steady_time < 0.6, meter.steady_time
