"""The time a rank spends in the tensor-parallel all-reduces, measured, for the step breakdown.

DeepSpeed's AutoTP layers all-reduce through `deepspeed.comm.all_reduce`: twice per block in
the forward (the row-parallel outputs) and twice in the backward (the column-parallel inputs'
gradients). DeepSpeed's comms logger times every collective alike, with no split by process
group, and synchronizes the device around each op; so Kiln wraps that one function and counts
only the calls on the tensor-parallel group. On a GPU each call is bracketed by CUDA events on
the current stream (which waits for the NCCL kernel), read once per metrics step; on a CPU
(gloo runs the collective as it is called) the host clock is the measure.
"""

from __future__ import annotations

import time

import torch

METRIC = "time/tensor_parallel_comm_s"


class CollectiveTimer:
    """Seconds in `group`'s all-reduces while `on`, summed until `read`."""

    def __init__(self, group, cuda: bool):
        self.group, self.cuda, self.on = group, cuda, False
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def install(self) -> None:
        """Wrap `deepspeed.comm.all_reduce` (which the AutoTP layers look up at each call)."""
        import deepspeed.comm as dist

        original = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)

        def all_reduce(*args, **kwargs):
            if not self.on or kwargs.get("group", args[2] if len(args) > 2 else None) is not self.group:
                return original(*args, **kwargs)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = original(*args, **kwargs)
                end.record()
                self._events.append((start, end))
                return out
            begin = time.perf_counter()
            out = original(*args, **kwargs)
            self._seconds += time.perf_counter() - begin
            return out

        all_reduce.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps sets it
        dist.all_reduce = all_reduce

    def read(self) -> float:
        """Seconds timed since the last read."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds
