"""Where a worker's batches come from: a Ray Data shard, or Parquet read directly.

Both yield int64 tensors of shape (micro_batch, seq_len + 1) and give every rank the same
number of batches per epoch, so no rank waits in a collective for one that ran out of data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kiln.data.manifest import TOKENS, Manifest, read_failure
from kiln.storage import retry_transient

# What a shard that cannot be read raises, also when Ray Data re-raises it from a read task
# (its RayTaskError subclasses the original type). A lost actor or node is not among them.
READ_ERRORS = (OSError, pa.ArrowException)


class BatchSource(Protocol):
    def prefetch(self) -> None:
        """Start fetching ahead (called once before the model is built)."""

    def train_batches(self, skip: int = 0) -> Iterator[torch.Tensor]:
        """Endless: epoch after epoch, starting after the first `skip` batches (a resume)."""

    def val_batches(self) -> Iterable[torch.Tensor]:
        """One pass over this rank's part of the validation split."""


class RayShardSource:
    """This worker's `get_dataset_shard` iterators (Ray Data streaming split, equal=True)."""

    def __init__(self, train_it, val_it, micro_batch: int, prefetch: int = 2, max_val_batches: int = 0,
                 explain: Callable[[str, BaseException], Exception] | None = None):
        self.train_it, self.val_it = train_it, val_it
        self.explain = explain  # turns a failed read into an error that names the shard
        self.micro_batch, self.prefetch_batches = micro_batch, prefetch
        self.max_val_batches = max_val_batches
        self._val_cache: list[torch.Tensor] = []
        self._val_error: Exception | None = None
        self._val_thread: threading.Thread | None = None

    def prefetch(self) -> None:
        # Validation reads the same batches every time, and each Ray Data epoch costs seconds of
        # start-up on a busy node, so this worker's val batches are read once, in the background
        # from the start, and kept.
        self._val_thread = threading.Thread(target=self._fill_val_cache, daemon=True, name="kiln-val-prefetch")
        self._val_thread.start()

    def _fill_val_cache(self) -> None:
        try:
            for batch in self._iter(self.val_it, "val"):
                self._val_cache.append(batch)
                if self.max_val_batches and len(self._val_cache) >= self.max_val_batches:
                    break
        except Exception as e:  # noqa: BLE001 - handed to the training thread in val_batches()
            self._val_error = e

    def _iter(self, it, split: str) -> Iterator[torch.Tensor]:
        try:
            for batch in it.iter_torch_batches(
                batch_size=self.micro_batch, drop_last=True, prefetch_batches=self.prefetch_batches
            ):
                yield batch[TOKENS].long()
        except READ_ERRORS as e:
            if self.explain is None:
                raise
            raise self.explain(split, e) from None

    def train_batches(self, skip: int = 0) -> Iterator[torch.Tensor]:
        # Ray Data iterators cannot seek (ray-project/ray#37633): skipping reads and drops.
        for i, batch in enumerate(self._endless()):
            if i >= skip:
                yield batch

    def _endless(self) -> Iterator[torch.Tensor]:
        while True:
            yield from self._iter(self.train_it, "train")

    def val_batches(self) -> Iterable[torch.Tensor]:
        if self._val_thread is None:
            self.prefetch()
        self._val_thread.join()
        if self._val_error is not None:
            raise self._val_error
        return self._val_cache


class ParquetSource:
    """Reads the shards itself: for runs without Ray (torchrun, a single GPU box, benchmarks),
    and for pipeline parallelism, where the stages of one pipeline must read the same batches.

    Replica r of n takes rows r, r + n, r + 2n, ... of each split, truncated so every replica has
    the same count. Under pipeline parallelism r and n are the data-parallel rank and size, not
    the global ones. The order is fixed, so `skip` resumes exactly.
    """

    def __init__(self, manifest: Manifest, rank: int, world_size: int, micro_batch: int):
        self.micro_batch = micro_batch
        self._rows = {s: self._load(manifest, s, rank, world_size) for s in ("train", "val")}

    def prefetch(self) -> None:
        pass  # everything is in memory already

    @staticmethod
    def _load(manifest: Manifest, split: str, rank: int, world: int) -> torch.Tensor:
        parts = []
        for loc in manifest.shard_locations(split):
            def read(loc=loc):
                with loc.fs.open_input_file(loc.path) as f:
                    return pq.read_table(f, columns=[TOKENS]).column(TOKENS).combine_chunks()

            try:
                col = retry_transient(read, f"reading shard {loc.uri}")
            except READ_ERRORS as e:
                raise read_failure(manifest, split, e) from None
            parts.append(col.values.to_numpy().reshape(len(col), -1))
        rows = np.concatenate(parts)
        per_rank = len(rows) // world
        return torch.from_numpy(rows[rank::world][:per_rank].astype(np.int64))

    def _iter(self, rows: torch.Tensor) -> Iterator[torch.Tensor]:
        for i in range(0, len(rows) - self.micro_batch + 1, self.micro_batch):
            yield rows[i : i + self.micro_batch]

    def train_batches(self, skip: int = 0) -> Iterator[torch.Tensor]:
        per_epoch = len(self._rows["train"]) // self.micro_batch
        first = skip % per_epoch if per_epoch else 0
        while True:
            for i, batch in enumerate(self._iter(self._rows["train"])):
                if i >= first:
                    yield batch
            first = 0

    def val_batches(self) -> Iterable[torch.Tensor]:
        return self._iter(self._rows["val"])
