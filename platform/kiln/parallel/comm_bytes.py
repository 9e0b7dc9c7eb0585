"""The bytes a rank sends in a training step, counted: `comm/bytes_per_step`.

DeepSpeed (its gradient all-reduce, ZeRO's reduce-scatters and gathers, AutoTP's all-reduces,
the pipeline's sends) and FSDP2 all reach the wire through `torch.distributed`'s functions, which
they look up at each call. So one wrapper per function there counts every engine and layout alike.
DeepSpeed's comms logger would see DeepSpeed's calls only, and it synchronizes the device around
every op. Hand-written for that reason.

Each call counts what a rank sends under the ring algorithms NCCL and gloo use, over the n ranks
of its group (Patarasuk & Yuan 2009; NCCL's bus-bandwidth accounting):
- all-reduce: 2(n-1)/n of the tensor;
- reduce-scatter and all-to-all: (n-1)/n of the input;
- all-gather: n-1 copies of its own shard;
- broadcast (the source rank), reduce and send: the tensor.

These are the bytes on each rank's link, the figure that gradient compression and less frequent
synchronization shrink, and the planner's data-parallel volume (`kiln.plan.throughput`) counts the
same. Counted only while `on` (the loop's metrics steps, training only), so Kiln's own metric
reductions and validation are left out.

`comm/time_s` is the host's seconds inside the same calls, on CPU workers only (`timed`): gloo
returns when a collective is done, so that is its time on the link; NCCL returns once the
collective is queued on the GPU, so a GPU run logs no such figure rather than a wrong one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

METRIC = "comm/bytes_per_step"
TIME_METRIC = "comm/time_s"


def _size(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_size(x) for x in t)
    return 0


def _ring_all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


def _ring_scatter(n: int) -> float:
    return (n - 1) / n


def _ring_gather(n: int) -> float:
    return n - 1


def _whole(n: int) -> float:
    return 1.0


# torch.distributed's sending functions: (the argument sent: position, keyword), the group's
# position, and the share of it a rank sends over a group of n.
SENDS: dict[str, tuple[int, str, int, Callable[[int], float]]] = {
    "all_reduce": (0, "tensor", 2, _ring_all_reduce),
    "all_reduce_coalesced": (0, "tensors", 2, _ring_all_reduce),
    "reduce": (0, "tensor", 3, _whole),
    "reduce_scatter": (1, "input_list", 3, _ring_scatter),
    "reduce_scatter_tensor": (1, "input", 3, _ring_scatter),
    "reduce_scatter_single": (1, "input", 3, _ring_scatter),  # torch 2.13's name (FSDP2 calls it)
    "_reduce_scatter_base": (1, "input", 3, _ring_scatter),
    "all_gather": (1, "tensor", 2, _ring_gather),
    "all_gather_into_tensor": (1, "input_tensor", 2, _ring_gather),
    "all_gather_single": (1, "input_tensor", 2, _ring_gather),
    "_all_gather_base": (1, "input_tensor", 2, _ring_gather),
    "all_to_all_single": (1, "input", 4, _ring_scatter),
    "send": (0, "tensor", 2, _whole),
    "isend": (0, "tensor", 2, _whole),
    "broadcast": (0, "tensor", 2, _whole),  # on the source rank only (`_sent`)
}


def _sent(name: str, args: tuple, kwargs: dict) -> float:
    """The bytes this rank sends in one call of `name`."""
    import torch.distributed as dist

    at, keyword, group_at, share = SENDS[name]
    tensor = args[at] if len(args) > at else kwargs.get(keyword)
    group = args[group_at] if len(args) > group_at else kwargs.get("group")
    if name == "broadcast":
        src = args[1] if len(args) > 1 else kwargs.get("src")
        if src != dist.get_rank():
            return 0.0
    return _size(tensor) * share(max(dist.get_world_size(group), 1))


class ByteCounter:
    """Bytes sent through `torch.distributed` while `on`, summed until `read`."""

    def __init__(self) -> None:
        self.on = False
        self.timed = False  # also the seconds inside the calls (CPU workers: `init_distributed`)
        self._bytes = 0.0
        self._seconds = 0.0
        self._depth = 0  # torch's older names call the newer ones: count the outermost call only

    def install(self) -> None:
        """Wrap the sending functions of `torch.distributed` and of `distributed_c10d`, where
        they are defined (DeepSpeed calls some there), once per process. Before DeepSpeed's comm
        layer starts: it keeps its own references to the gather and reduce-scatter functions."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for name in SENDS:
            for module in (distributed_c10d, dist):
                original = getattr(module, name, None)
                if original is not None and not hasattr(original, "__kiln_counted__"):
                    wrapped = self._counting(name, original)
                    setattr(module, name, wrapped)
                    if module is distributed_c10d and getattr(dist, name, None) is original:
                        setattr(dist, name, wrapped)  # the same function, counted once

    def _counting(self, name: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            outermost = self.on and self._depth == 0
            if outermost:
                self._bytes += _sent(name, args, kwargs)
                start = time.perf_counter()
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if outermost:
                    self._seconds += time.perf_counter() - start

        counted.__kiln_counted__ = True  # type: ignore[attr-defined]
        counted.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps sets it
        return counted

    def read(self) -> float:
        """Bytes counted since the last read."""
        counted, self._bytes = self._bytes, 0.0
        return counted

    def metrics(self) -> dict[str, float]:
        """`comm/bytes_per_step` (and `comm/time_s` where timed) since the last read."""
        seconds, self._seconds = self._seconds, 0.0
        return {METRIC: self.read()} | ({TIME_METRIC: seconds} if self.timed else {})

    @contextmanager
    def apart(self) -> Iterator[dict[str, float]]:
        """Count the block's calls on their own, whether or not counting is on, leaving the
        running count as it was: `with COUNTER.apart() as sent: ...`, then `sent`, as `metrics`."""
        running, was = (self._bytes, self._seconds), self.on
        self._bytes, self._seconds, self.on = 0.0, 0.0, True
        sent: dict[str, float] = {}
        try:
            yield sent
        finally:
            sent.update(self.metrics())
            (self._bytes, self._seconds), self.on = running, was


COUNTER = ByteCounter()  # one per process: the functions it wraps are process-wide
