"""Leak detection: host RSS and device memory that keep growing after warm-up.

A training step allocates and frees the same memory every time, so after the first steps
(allocator warm-up, optimizer state, caches) a rank's memory is flat. Memory that still grows
step after step is a leak: tensors kept in a list, a graph held through a logged loss, a cache
without bound. `LeakWatch` fits a line through the last `window` samples of each (one per
metrics step); when the growth over the window is steady (nearly every sample at or above the
last, and both halves of the window growing) and large (over `min_growth_bytes`), it warns once and reports the rate, which the
Prometheus series `kiln_memory_leak_bytes_per_step` and the alert KilnMemoryLeak carry. It
takes two such windows, one after the other: a start-up still settling grows through the first
window after warm-up, then stops (the demo warned on one: RSS 762 to 814 MiB by step ~100, flat
after), where a leak goes on.
"""

from __future__ import annotations

import collections
import logging

log = logging.getLogger("kiln.train")

WINDOW = 20  # samples a trend is fitted over: long enough that one big batch is not a trend
MIN_GROWTH_BYTES = 64 * 2**20  # growth over the window below this is noise (allocator caches, page cache)
STEADY_SHARE = 0.8  # share of samples at or above the one before: growth, not a sawtooth


class LeakWatch:
    def __init__(self, warmup_end: int, window: int = WINDOW, min_growth_bytes: float = MIN_GROWTH_BYTES):
        self.warmup_end, self.window, self.min_growth = warmup_end, window, min_growth_bytes
        self._samples: dict[str, collections.deque] = {}
        self.warned: set[str] = set()

    def sample(self, step: int, used: dict[str, float]) -> dict[str, float]:
        """Record each source's bytes in use (e.g. {'host': rss, 'device': allocated}); return
        `memory/leak_bytes_per_step`: the fastest steady growth now seen, 0 when none."""
        if step <= self.warmup_end:
            return {"memory/leak_bytes_per_step": 0.0}
        worst = 0.0
        for name, value in used.items():
            samples = self._samples.setdefault(name, collections.deque(maxlen=2 * self.window))
            samples.append((step, float(value)))
            held = list(samples)
            earlier, latest = held[: self.window], held[self.window :]
            rate = self._leak_rate(latest) if self._leak_rate(earlier) else 0.0
            if rate and name not in self.warned:
                self.warned.add(name)
                first, last = samples[0], samples[-1]
                log.warning(
                    "possible memory leak: %s memory grew %.0f MiB over steps %d-%d (%.2f MiB/step) "
                    "after warm-up, and keeps growing; profile host memory with train.profile "
                    "(memray) to see where it is allocated",
                    name,
                    (last[1] - first[1]) / 2**20,
                    first[0],
                    last[0],
                    rate / 2**20,
                )
            worst = max(worst, rate)
        return {"memory/leak_bytes_per_step": worst}

    def _leak_rate(self, samples: list[tuple[int, float]]) -> float:
        """The least-squares growth in bytes per step over a window of samples when it is steady
        and large, else 0."""
        if len(samples) < self.window:
            return 0.0
        steps = [s for s, _ in samples]
        values = [v for _, v in samples]
        n = len(samples)
        mean_s, mean_v = sum(steps) / n, sum(values) / n
        var = sum((s - mean_s) ** 2 for s in steps)
        if not var:
            return 0.0
        slope = sum((s - mean_s) * (v - mean_v) for s, v in zip(steps, values)) / var
        rising = sum(b >= a for a, b in zip(values, values[1:])) / (n - 1)
        grown = slope * (steps[-1] - steps[0])
        # Both halves of the window must grow: one jump (an evaluation's buffers, a bigger
        # batch) tilts the fitted line as much as a leak would, but lies in one half only.
        mid = n // 2
        halves = min(values[mid] - values[0], values[-1] - values[mid])
        steady = rising >= STEADY_SHARE and halves >= self.min_growth / 4
        return slope if grown >= self.min_growth and steady else 0.0
