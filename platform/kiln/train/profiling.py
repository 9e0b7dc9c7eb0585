"""A `torch.profiler` window over a few steps on chosen ranks.

`train.profile.start_step: N` profiles steps N .. N+steps-1 on `train.profile.ranks`. Each
profiled rank writes a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev),
logs the top-10 operators by self time, and on a GPU also dumps a CUDA memory snapshot (open it
in https://pytorch.org/memory_viz). The files go to the run's MLflow artifacts under `profile/`.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from kiln.config import ProfileConfig

log = logging.getLogger("kiln.train")


class StepProfiler:
    """`begin(step)` before a step and `end(step)` after it; `end` returns the finished window's
    directory once its last step is done, else None."""

    def __init__(self, cfg: ProfileConfig, rank: int, world_size: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.enabled = cfg.start_step > 0 and rank in cfg.rank_set(world_size)
        self._prof = None
        self.last = cfg.start_step + cfg.steps - 1

    def begin(self, step: int) -> None:
        if not self.enabled or step != self.cfg.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._prof.__enter__()
        log.info("rank %d: profiling steps %d-%d", self.rank, step, self.last)

    def end(self, step: int) -> Path | None:
        if self._prof is None or step != self.last:
            return None
        self._prof.__exit__(None, None, None)
        out = Path(tempfile.mkdtemp(prefix="kiln-profile-"))
        self._prof.export_chrome_trace(str(out / f"trace_rank{self.rank}.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self._prof.key_averages().table(sort_by=sort, row_limit=10)
        (out / f"top_ops_rank{self.rank}.txt").write_text(table)
        log.info("rank %d: top operators over steps %d-%d by self time\n%s",
                 self.rank, self.cfg.start_step, self.last, table)
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(out / f"cuda_memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._prof = None
        return out
