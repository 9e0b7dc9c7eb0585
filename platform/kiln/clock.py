"""Start-up timing: when this process began, and the marks a run's start-up is measured by.

Torch-free, so the command front end can take its start time before importing anything heavy.
A mark is the Unix time a stage of start-up was reached, carried as a metric
`time/startup/<mark>_unix` from wherever it was taken (the driver, a Ray worker) to the run
summary, which turns consecutive marks into the start-up breakdown (`startup_breakdown`).
"""

from __future__ import annotations

import time

STARTUP = "time/startup/"

# The marks in the order start-up reaches them, each with what the time up to it was spent on.
MARKS = (
    ("command", "interpreter start"),
    ("preflight", "imports and pre-launch checks"),
    ("ray", "Ray start or connect"),
    ("mlflow", "MLflow run"),
    ("fit", "trainer set-up"),
    ("worker_process", "Train controller and worker start"),
    ("worker_entry", "worker imports"),
    ("engine", "data source, tracking and engine"),
    ("first_step", "first batch and first step"),
)


# A restarted worker group's way back, logged once after its first step: when its processes
# started, its engine was ready and its first step ended, and the seconds its checkpoint took to
# download, reshard and load. bench/resize.py splits a resize's cost with them.
RESTART = "restart/"
RESTART_WORKER_START = f"{RESTART}worker_start_unix"
RESTART_ENGINE = f"{RESTART}engine_ready_unix"
RESTART_LOAD = f"{RESTART}load_s"
RESTART_FIRST_STEP = f"{RESTART}first_step_unix"


def process_start() -> float:
    """When this process started (interpreter start-up and imports included)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a sandbox without /proc: the clock is the best there is
        return time.time()


def startup_mark(name: str, when: float | None = None) -> dict[str, float]:
    """A start-up mark as a metric: the Unix time `name` was reached (now by default)."""
    assert name in dict(MARKS), name
    return {f"{STARTUP}{name}_unix": time.time() if when is None else when}


def _spans(metrics: dict[str, float]) -> list[tuple[str, str, float]]:
    """[(mark, what the time up to it went on, seconds)] between consecutive marks in `metrics`."""
    present = [
        (name, what, metrics[f"{STARTUP}{name}_unix"]) for name, what in MARKS if f"{STARTUP}{name}_unix" in metrics
    ]
    return [(name, what, max(0.0, t - before)) for (_, _, before), (name, what, t) in zip(present, present[1:])]


def startup_breakdown(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """[(what the time went on, seconds)] between consecutive marks present in `metrics`."""
    return [(what, s) for _, what, s in _spans(metrics)]


def startup_seconds(metrics: dict[str, float]) -> dict[str, float]:
    """The same spans as metrics, `time/startup/<mark>_s`: the seconds up to each mark."""
    return {f"{STARTUP}{name}_s": s for name, _, s in _spans(metrics)}
