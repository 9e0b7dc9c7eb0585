"""A `torch.profiler` window over a few steps on chosen ranks.

`train.profile.start_step: N` profiles steps N .. N+steps-1 on `train.profile.ranks`. Each
profiled rank writes a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev),
logs the top-10 operators by self time, and on a GPU also dumps a CUDA memory snapshot (open it
in https://pytorch.org/memory_viz). Host memory is profiled over the same steps with memray
(a maintained allocation tracker): its capture, a flame graph of where the window's peak host
memory was allocated, and the top allocation sites. The files go to the run's MLflow artifacts
under `profile/`.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import ConfigError
from kiln.guard import temp_dir

log = logging.getLogger("kiln.train")


@dataclass
class ProfileConfig:
    start_step: int = 0
    """First profiled step; 0 turns profiling off. Pick a step after warm-up (allocator, JIT,
    Ray Data start-up) unless start-up is what you are after."""
    steps: int = 3
    """Steps in the window: a few, since traces grow by megabytes a step."""
    ranks: str = "0"
    """Ranks that profile: comma-separated ("0,3") or "all". One is usually enough; all of them
    find a straggler."""

    def rank_set(self, world_size: int) -> set[int]:
        if self.ranks.strip() == "all":
            return set(range(world_size))
        return {int(r) for r in self.ranks.split(",") if r.strip()}

    def check(self, max_steps: int, world_size: int) -> None:
        """A window inside the run, on ranks that exist."""
        if self.start_step < 0 or self.steps < 1:
            raise ConfigError(
                f"train.profile: start_step = {self.start_step}, steps = {self.steps}: expected "
                "start_step >= 0 (0: off) and steps >= 1"
            )
        if self.start_step and self.start_step + self.steps - 1 > max_steps:
            raise ConfigError(
                f"train.profile: steps {self.start_step}-{self.start_step + self.steps - 1} run past "
                f"train.max_steps = {max_steps}"
            )
        try:
            ranks = self.rank_set(world_size)
        except ValueError:
            raise ConfigError(
                f"train.profile.ranks = {self.ranks!r}: expected comma-separated ranks or 'all'"
            ) from None
        if any(r < 0 or r >= world_size for r in ranks):
            raise ConfigError(f"train.profile.ranks = {self.ranks!r}: ranks run 0..{world_size - 1}")


class StepProfiler:
    """`begin(step)` before a step and `end(step)` after it; `end` returns the finished window's
    directory once its last step is done, else None."""

    def __init__(self, cfg: ProfileConfig, rank: int, world_size: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.enabled = cfg.start_step > 0 and rank in cfg.rank_set(world_size)
        self._prof = None
        self._memray = None
        self._out: Path | None = None
        self.last = cfg.start_step + cfg.steps - 1

    def begin(self, step: int) -> None:
        if not self.enabled or step != self.cfg.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._out = temp_dir(None, "profile")
        self._prof = prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        prof.__enter__()
        self._memray = _host_tracker(self._out / f"host_memory_rank{self.rank}.bin")
        if self._memray is not None:
            # Entered here, not in a helper: memray follows the frames entered after it starts, and
            # loses its place when more than the frame that started it returns before them.
            self._memray.__enter__()
        log.info("rank %d: profiling steps %d-%d", self.rank, step, self.last)

    def end(self, step: int) -> Path | None:
        if self._prof is None or step != self.last:
            return None
        out = self._out
        if self._memray is not None:
            self._memray.__exit__(None, None, None)
        self._prof.__exit__(None, None, None)
        if self._memray is not None:
            _host_report(out / f"host_memory_rank{self.rank}.bin")
        self._prof.export_chrome_trace(str(out / f"trace_rank{self.rank}.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._prof.key_averages().table(sort_by=sort, row_limit=10)
        (out / f"top_ops_rank{self.rank}.txt").write_text(table)
        log.info(
            "rank %d: top operators over steps %d-%d by self time\n%s", self.rank, self.cfg.start_step, self.last, table
        )
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(out / f"cuda_memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._prof = None
        return out


def _host_tracker(path: Path):
    """A memray Tracker writing to `path`, not yet entered; None where memray is missing."""
    try:
        import memray
    except ImportError:
        log.warning("memray is not installed: no host memory profile (pip install -e '.[profile]', or memray)")
        return None
    return memray.Tracker(str(path), follow_fork=False)


def _host_report(capture: Path) -> None:
    """Beside the capture: the top allocation sites at the window's peak (text) and a flame graph."""
    from memray import FileReader

    reader = FileReader(str(capture))
    records = sorted(
        reader.get_high_watermark_allocation_records(merge_threads=True), key=lambda r: r.size, reverse=True
    )[:15]
    lines = [
        f"peak host memory in the window: {reader.metadata.peak_memory / 2**20:.1f} MiB "
        f"({reader.metadata.total_allocations:,} allocations)",
        "top allocation sites at the peak:",
    ]
    for r in records:
        frame = next(iter(r.stack_trace()), None)
        where = f"{frame[0]} {frame[1]}:{frame[2]}" if frame else "(no Python frame)"
        lines.append(f"  {r.size / 2**20:9.2f} MiB in {r.n_allocations:6d} allocation(s)  {where}")
    capture.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    log.info("%s", "\n".join(lines[:6]))
    html = capture.with_suffix(".html")
    done = subprocess.run(
        [sys.executable, "-m", "memray", "flamegraph", "-f", "-o", str(html), str(capture)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        log.warning("memray flamegraph failed: %s", done.stderr.strip()[-300:])
