"""Where the training loop's output goes: one bundle of four sinks (and, under Ray, where a
restarted run's checkpoint comes from).

- `logger`: per-step metrics, tags and artifacts (MLflow on rank 0, `kiln.tracking`);
- `live`: gauges for Prometheus (Ray's metrics endpoint, `kiln.ray.live_metrics`);
- `progress`: what a person watches (a bar or log lines, `kiln.ui.progress`);
- `report`: Ray Train's `report` (metrics and checkpoints to the controller and Tune);
- `restored`: the checkpoint Ray Train hands a restarted worker group.

The loop knows only these protocols; the launchers plug in the real ones. Every rank gets a
bundle, and every rank calls `report` the same number of times (Ray Train requires that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kiln.ui.progress import ProgressSink

# Ray Train's report: metrics and a local checkpoint directory in; back, for a checkpoint the
# directory is gone from, a function that fetches it again (what a rollback reloads).
Fetch = Callable[[], str]


class Restored(Protocol):
    """A checkpoint a restarted run resumes from, kept in storage: calling it (on all ranks
    together) downloads it and returns the directory; `release` removes that copy."""

    def __call__(self) -> str: ...

    def release(self) -> None: ...


Report = Callable[[dict, "str | None"], "Fetch | None"]


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tag(self, key: str, value: str) -> None: ...
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    """What every rank but 0 gets: only rank 0 logs."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        pass

    def close(self) -> None:
        pass


class LiveMetrics(Protocol):
    def observe(self, metrics: dict[str, float], step: int) -> None: ...
    def step_seconds(self, seconds: float) -> None: ...
    def checkpointed(self, seconds: float) -> None: ...
    def close(self) -> None: ...


class NullLive:
    """Where no Ray runs (the local launcher, tests): no live export."""

    def observe(self, metrics: dict[str, float], step: int) -> None:
        pass

    def step_seconds(self, seconds: float) -> None:
        pass

    def checkpointed(self, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Sinks:
    logger: MetricLogger = field(default_factory=NullLogger)
    live: LiveMetrics = field(default_factory=NullLive)
    progress: ProgressSink | None = None
    """Rank 0's progress display; None: log lines every `logging.progress_every` steps."""
    report: Report | None = None
    """Ray Train's report; None where no controller listens (the local launcher)."""
    restored: Restored | None = None
    """Under Ray, after a restart: the checkpoint to resume from (it wins over
    `train.resume_from`). The loop loads it, removes the local copy at once, and downloads it
    again only for a rollback, so restarts leave no copies on a node's disk."""

    def close(self) -> None:
        self.logger.close()
        self.live.close()
        if self.progress is not None:
            self.progress.close()
