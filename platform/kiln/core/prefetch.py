"""Batches ahead of the step: fetched on a thread, pinned, and copied to the device on a side stream.

A training step should never wait for its data. `DevicePrefetcher` keeps `depth` batches read
ahead on a thread (the source's own reads, Ray Data's or Parquet's, overlap the step), puts each
in pinned (page-locked) host memory where a CUDA device is present, and starts the next batch's
host-to-device copy with `non_blocking` on a side stream while the current step computes. On
CPU the same thread and queue run; there is nothing to pin or copy.

Hand-written because torch's DataLoader owns its workers and sampler, while Kiln's batches come
from Ray Data's iterator or a Parquet reader that already split and ordered them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

_END = object()
_POLL_S = 0.1  # how often a blocked fetch thread looks whether it was closed


class DevicePrefetcher:
    """Iterate `batches` on `device`, `depth` batches read ahead. Errors the source raises reach
    the consumer unchanged, at the batch where they happened. `close()` stops the thread."""

    def __init__(self, batches: Iterator[torch.Tensor], device: torch.device, depth: int = 2):
        self.device = device
        self.cuda = device.type == "cuda"
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._closed = threading.Event()
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._in_flight: torch.Tensor | None = None  # the next batch, its copy under way
        self._finished = False
        self._thread = threading.Thread(target=self._fetch, args=(batches,), daemon=True, name="kiln-prefetch")
        self._thread.start()  # the first read starts now, while the caller builds the rest

    def _fetch(self, batches: Iterator[torch.Tensor]) -> None:
        try:
            for batch in batches:
                if self.cuda:
                    batch = batch.pin_memory()  # page-locked: the copy can run asynchronously
                if not self._put(batch):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer thread
            self._put(e)
            return
        self._put(_END)

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if not self.cuda:
            return self._take()
        batch = self._in_flight if self._in_flight is not None else self._to_device(self._take())
        self._in_flight = None
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)  # the copy is done before the step reads the batch
        batch.record_stream(current)  # and its memory is not reused while the step uses it
        try:  # start the next copy now, if its batch is already here (never wait for it)
            item = self._q.get_nowait()
        except queue.Empty:
            return batch
        if item is _END or isinstance(item, BaseException):
            self._q.put(item)  # seen again on the next call
        else:
            self._in_flight = self._to_device(item)
        return batch

    def _take(self) -> torch.Tensor:
        if self._finished:
            raise StopIteration
        item = self._q.get()
        if item is _END or isinstance(item, BaseException):
            self._finished = True
            if isinstance(item, BaseException):
                raise item
            raise StopIteration
        return item

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self._stream):
            return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
