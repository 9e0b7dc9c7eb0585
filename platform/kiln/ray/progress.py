"""The progress bar across Ray: rank 0 posts each step to a `ProgressBoard` actor, and the
driver, which owns the terminal, polls it and redraws its bar.

The board is created by the driver only when its stderr is a terminal, costs no CPU slot
(num_cpus=0), and outlives a worker-group restart, so the bar carries on after a failure.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import ray

from kiln.ui.progress import DriverBar, Progress

log = logging.getLogger("kiln.train")


@ray.remote(num_cpus=0)
class ProgressBoard:
    """Holds the newest progress a run's rank 0 posted."""

    def __init__(self) -> None:
        self.latest: dict | None = None

    def post(self, p: dict) -> None:
        self.latest = p

    def get(self) -> dict | None:
        return self.latest


class BoardSink:
    """Rank 0's side: posts at most every `min_interval_s` (fire and forget; the last step
    always goes), so a fast loop does not queue thousands of actor calls."""

    def __init__(self, board, min_interval_s: float = 0.2):
        self.board, self.min_interval_s = board, min_interval_s
        self._last = float("-inf")

    def update(self, p: Progress) -> None:
        now = time.monotonic()
        if p.step >= p.total or now - self._last >= self.min_interval_s:
            self.board.post.remote(dataclasses.asdict(p))
            self._last = now

    def close(self) -> None:
        pass


class BoardWatcher:
    """The driver's side: a thread that polls the board and updates `bar` while fit() blocks."""

    def __init__(self, board, bar: DriverBar, interval_s: float = 0.5):
        self.board, self.bar, self.interval_s = board, bar, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-progress", daemon=True)
        self._shown: dict | None = None

    def __enter__(self) -> BoardWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()  # the final step, if it landed after the last tick
        self.bar.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def _poll(self) -> None:
        try:
            latest = ray.get(self.board.get.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 - a lost frame must never fail the run
            log.debug("progress board unreachable: %s", e)
            return
        if latest and latest != self._shown:
            self._shown = latest
            self.bar.update(Progress(**latest))
