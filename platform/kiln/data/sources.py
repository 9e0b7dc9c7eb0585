"""Where a worker's batches come from: its own rows of each split, in Kiln's order.

Both sources yield int64 tensors of shape (micro_batch, seq_len + 1), in the order
`kiln.data.order` fixes: every replica has as many batches per epoch as the others (no
rank waits in a collective for one that ran out of data), and a resume after k micro-batches
continues with the k+1-th, reading from the shard that holds it. `ParquetSource` reads them with
pyarrow (runs without Ray: a single process, torchrun, benchmarks); `kiln.ray.source.
RayDataSource` streams them through Ray Data on Ray Train workers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch

from kiln.data.epochs import Blocks, EpochOrder, Layout
from kiln.data.manifest import SAMPLE_ID, STARTS, TOKENS, Manifest, read_failure
from kiln.data.mixture import Dataset
from kiln.data.order import BYTES_READ, Slice, batches_per_epoch, expected_ids, read_slice, replica_slices, whole_shards
from kiln.data.shards import row_group_rows
from kiln.errors import DataError
from kiln.model import DOC_START

# What a shard that cannot be read raises, also when Ray Data re-raises it from a read task
# (its RayTaskError subclasses the original type). A lost actor or node is not among them.
READ_ERRORS = (OSError, pa.ArrowException)

Samples = tuple[np.ndarray, torch.Tensor]  # (sample ids, token rows) of one micro-batch


class BatchSource(Protocol):
    documents: bool
    """Whether each document's first token in the rows carries kiln.model.DOC_START."""

    def prefetch(self) -> None:
        """Start fetching ahead (called once before the model is built)."""

    def train_batches(self, skip: int = 0) -> Iterator[torch.Tensor]:
        """Endless: epoch after epoch, starting after the first `skip` batches (a resume)."""

    def numbered_samples(self, skip: int = 0) -> Iterator[tuple[int, np.ndarray, torch.Tensor]]:
        """The same micro-batches as `train_batches`, each with its epoch and sample ids."""

    def val_batches(self) -> Iterable[torch.Tensor]:
        """One pass over this rank's part of the validation split."""

    def data_metrics(self, consumed: int) -> dict[str, float]:
        """The data's metrics after this replica's first `consumed` micro-batches."""

    def rescaled_skip(self, consumed: int, replicas: int, micro_batch: int) -> int:
        """This replica's micro-batches to skip to go on where `replicas` replicas of
        `micro_batch` rows each had consumed `consumed` micro-batches apiece."""


class OrderedSource:
    """The data order and resume logic; subclasses say how a list of shard slices is read
    (`_tables`: the slices' rows as Arrow tables with the id and tokens columns, in order)."""

    def __init__(
        self,
        data: Manifest | list[Dataset],
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        max_val_batches: int = 0,
        seed: int = 0,
        reshuffle: bool = False,
        documents: bool = False,
    ):
        """`data`: one dataset, or the run's weighted datasets (`kiln.data.mixture`). `dp_rank`
        of `dp_size`: this worker's data-parallel coordinates (the stages of one pipeline share
        them, and read the same rows). `seed` and `reshuffle`: the epochs' order
        (`kiln.data.epochs`). `documents`: mark each document's first token in the rows
        (`kiln.model.DOC_START`), for attention within documents (`data.document_mask`)."""
        self.datasets = data if isinstance(data, list) else [Dataset(data, 1.0, "data", "data.path")]
        self.manifest = self.datasets[0].manifest
        self.documents = documents
        lacking = [d.manifest.location.uri for d in self.datasets if not d.manifest.document_starts]
        if documents and lacking:
            raise DataError(f"{lacking[0]} records no document starts: prepare it again to mask documents")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch, self.max_val_batches = micro_batch, max_val_batches
        self.orders = {split: self._order(split, seed, reshuffle) for split in ("train", "val")}
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}  # micro-batches, rows used per dataset
        self._val_cache: list[torch.Tensor] = []
        self._val_error: Exception | None = None
        self._val_thread: threading.Thread | None = None
        self._val_wanted = False  # prefetch() asked for validation's read ahead of its first use
        self._val_lock = threading.Lock()
        self.bytes_read = 0
        """Bytes of shards this replica has read (`data/bytes_read`): about 1/n of a split's
        for n replicas where micro-batches span whole row groups."""

    def _order(self, split: str, seed: int, reshuffle: bool) -> EpochOrder | Layout:
        """The split's epochs; one fixed layout, a block per shard, where every epoch is in
        manifest order (one dataset without reshuffle, and every validation split)."""
        shard_rows = [[int(e["rows"]) for e, _ in d.manifest.shards(split)] for d in self.datasets]
        if split == "val" or (len(self.datasets) == 1 and not reshuffle):
            return _concatenated(shard_rows)
        blocks = [Blocks.of(rows, block_rows(d.manifest)) for rows, d in zip(shard_rows, self.datasets)]
        return EpochOrder(blocks, [d.weight for d in self.datasets], seed, reshuffle)

    def layout(self, split: str, epoch: int = 0) -> Layout:
        order = self.orders[split]
        return order if isinstance(order, Layout) else order.layout(epoch)

    def batches_in_epoch(self, epoch: int) -> int:
        """This replica's train micro-batches in `epoch` (the same for every replica)."""
        if epoch in self._epochs:
            return self._epochs[epoch][0]
        layout = self.layout("train", epoch)
        n = batches_per_epoch(layout.rows, self.dp_size, self.micro_batch)
        used = layout.rows_by_source(n * self.dp_size * self.micro_batch, len(self.datasets))
        self._epochs[epoch] = n, used  # small: two numbers a dataset, for every epoch run
        if n == 0:
            raise DataError(
                f"train epoch {epoch} of {self.manifest.location.uri} gives no micro-batch to each of "
                f"{self.dp_size} replicas: lower train.micro_batch_size, or prepare more data"
            )
        return n

    def resume_point(self, skip: int) -> tuple[int, int]:
        """(epoch, micro-batch of that epoch) after this replica's first `skip` micro-batches."""
        epoch = 0
        while skip >= (n := self.batches_in_epoch(epoch)):
            skip, epoch = skip - n, epoch + 1
        return epoch, skip

    def rescaled_skip(self, consumed: int, replicas: int, micro_batch: int) -> int:
        """See `BatchSource.rescaled_skip`. An epoch's rows are the same whatever the number of
        replicas, so the position carries over as rows into an epoch: the next run goes on at
        the first of its micro-batches not yet begun (rounded up: rows are never read twice;
        where the global batch is kept, nothing is left out either). Only each epoch's
        left-out tail depends on the number of replicas (`batches_per_epoch`)."""
        epoch, rows = 0, consumed * replicas * micro_batch  # rows read by all replicas
        while rows >= (
            n := batches_per_epoch(self.layout("train", epoch).rows, replicas, micro_batch) * replicas * micro_batch
        ):
            rows, epoch = rows - n, epoch + 1
        step = self.dp_size * self.micro_batch  # rows per micro-batch of every replica together
        into = -(-rows // step)
        if into >= self.batches_in_epoch(epoch):
            epoch, into = epoch + 1, 0
        return sum(self.batches_in_epoch(e) for e in range(epoch)) + into

    def data_metrics(self, consumed: int) -> dict[str, float]:
        """The data metrics after `consumed` micro-batches of this replica: its bytes read so
        far, and for a mixture each dataset's share of the train rows all replicas used
        (`data/mix/<name>_frac`), computed from the order itself, so exact and equal on every rank."""
        metrics = {"data/bytes_read": float(self.bytes_read)}
        if len(self.datasets) > 1:
            epoch, into = self.resume_point(consumed)
            counts = sum(
                (self._epochs[e][1] for e in range(epoch)),
                self.layout("train", epoch).rows_by_source(into * self.dp_size * self.micro_batch, len(self.datasets)),
            )
            total = max(1, int(counts.sum()))
            metrics |= {f"data/mix/{d.name}_frac": float(c) / total for d, c in zip(self.datasets, counts)}
        return metrics

    def _tables(self, split: str, slices: list[Slice]) -> Iterator[pa.Table]:
        raise NotImplementedError

    def epoch(self, split: str, skip_batches: int = 0, number: int = 0) -> Iterator[Samples]:
        """Epoch `number` of this replica's micro-batches, after its first `skip_batches`."""
        slices = replica_slices(self.layout(split, number), self.dp_rank, self.dp_size, self.micro_batch, skip_batches)
        if not slices:
            return
        rows = _arrays(self._tables(split, slices), self)
        first_ids = [d.manifest.first_ids(split) for d in self.datasets]
        try:
            yield from _checked_order(
                _micro_batches(rows, self.micro_batch),
                split,
                self.manifest.location.uri,
                expected_ids(slices, first_ids),
            )
        except READ_ERRORS as e:  # also Ray Data's re-raise of a read task's error
            raise read_failure([d.manifest for d in self.datasets], split, e) from None

    def numbered_samples(self, skip: int = 0) -> Iterator[tuple[int, np.ndarray, torch.Tensor]]:
        """Endless (epoch, ids, tokens) micro-batches, after the first `skip`."""
        number, first = self.resume_point(skip)
        while True:
            for ids, tokens in self.epoch("train", first, number):
                if self._val_wanted and self._val_thread is None:  # the lock only until it starts
                    self._start_val()
                yield number, ids, tokens
            number, first = number + 1, 0

    def train_samples(self, skip: int = 0) -> Iterator[Samples]:
        """Endless (ids, tokens) micro-batches, after the first `skip`."""
        for _, ids, tokens in self.numbered_samples(skip):
            yield ids, tokens

    def train_batches(self, skip: int = 0) -> Iterator[torch.Tensor]:
        for _, tokens in self.train_samples(skip):
            yield tokens

    def prefetch(self) -> None:
        # Validation reads the same batches every time, so they are read once, in the
        # background, and kept: from the first train batch on (numbered_samples), not beside the
        # train read's start. On Ray each read running beside another takes a Ray worker process
        # started for it (2-2.5 CPU-s each: two a training worker, in the demo's start-up);
        # after the first batch, a train read of one task has left its process free for this one.
        self._val_wanted = True

    def _start_val(self) -> threading.Thread:
        with self._val_lock:  # the train read's thread, or an evaluation before its first batch
            if self._val_thread is None:
                self._val_thread = threading.Thread(target=self._fill_val_cache, daemon=True, name="kiln-val-prefetch")
                self._val_thread.start()
            return self._val_thread

    def _fill_val_cache(self) -> None:
        try:
            for _, batch in self.epoch("val"):
                self._val_cache.append(batch)
                if self.max_val_batches and len(self._val_cache) >= self.max_val_batches:
                    break
        except Exception as e:  # noqa: BLE001 - handed to the training thread in val_batches()
            self._val_error = e

    def val_batches(self) -> Iterable[torch.Tensor]:
        self._start_val().join()
        if self._val_error is not None:
            raise self._val_error
        return self._val_cache


class ParquetSource(OrderedSource):
    """Reads its rows with pyarrow, shard by shard; for runs without Ray."""

    def _tables(self, split: str, slices: list[Slice]) -> Iterator[pa.Table]:
        locations = [d.manifest.shard_locations(split) for d in self.datasets]
        for s in slices:
            yield read_slice(locations[s.source][s.shard], s)


def block_rows(manifest: Manifest) -> int:
    """The rows of a block (`kiln.data.epochs`): the dataset's row group; a dataset of an older
    prepare has none recorded, and gets what a streamed prepare would write."""
    return int(manifest.raw.get("row_group_rows") or row_group_rows(manifest.seq_len))


def _concatenated(shard_rows: list[list[int]]) -> Layout:
    """Each dataset's shards in manifest order, one after another, a block per shard."""
    parts = [whole_shards(rows) for rows in shard_rows]
    source = np.concatenate([np.full(len(p.size), d, dtype=np.int64) for d, p in enumerate(parts)])
    shard, start, size, key = (
        np.concatenate([getattr(p, f) for p in parts]) for f in ("shard", "start", "size", "key")
    )
    return Layout(source, shard, start, size, key, False)


def _arrays(tables: Iterator[pa.Table], source: OrderedSource) -> Iterator[Samples]:
    """(ids, token rows) as numpy arrays, table by table; the bytes read counted on `source`.
    Where `source.documents`, each document's first token carries DOC_START."""
    for table in tables:
        if BYTES_READ in table.column_names:
            source.bytes_read += int(pa.compute.sum(table.column(BYTES_READ)).as_py() or 0)
        tokens = table.column(TOKENS).combine_chunks()
        rows = tokens.values.to_numpy().reshape(len(tokens), -1)
        if source.documents:
            starts = table.column(STARTS).combine_chunks()
            at = starts.values.to_numpy()
            row_of = np.repeat(np.arange(len(starts)), np.diff(starts.offsets.to_numpy()))
            rows = rows.astype(np.int64)
            rows[row_of, at] += DOC_START
        yield table.column(SAMPLE_ID).to_numpy(), rows


def _micro_batches(rows: Iterator[Samples], micro_batch: int) -> Iterator[Samples]:
    """Consecutive rows cut into micro-batches of `micro_batch`; a partial last one is dropped."""
    ids_buf, tok_buf, held = [], [], 0
    for ids, tokens in rows:
        ids_buf.append(ids)
        tok_buf.append(tokens)
        held += len(ids)
        if held < micro_batch:
            continue
        all_ids, all_tokens = np.concatenate(ids_buf), np.concatenate(tok_buf)
        full = held - held % micro_batch
        for i in range(0, full, micro_batch):
            yield all_ids[i : i + micro_batch], torch.from_numpy(all_tokens[i : i + micro_batch].astype(np.int64))
        ids_buf, tok_buf, held = [all_ids[full:]], [all_tokens[full:]], held - full


def _checked_order(
    batches: Iterator[Samples], split: str, uri: str, expected: Iterator[np.ndarray]
) -> Iterator[Samples]:
    """Each micro-batch must hold the ids its slices say (a shard's rows are numbered on from
    its first id): anything else means a reader reordered the rows, and the exact-resume
    guarantee would silently not hold."""
    held = np.zeros(0, dtype=np.int64)
    for ids, tokens in batches:
        while len(held) < len(ids):
            held = np.concatenate([held, next(expected)])
        want, held = held[: len(ids)], held[len(ids) :]
        if not np.array_equal(ids, want):
            raise DataError(
                f"the {split} rows of {uri} arrived out of order (sample ids {ids[0]}..{ids[-1]}, "
                f"expected {want[0]}..{want[-1]}): was the dataset written by `kiln data prepare`?"
            )
        yield ids, tokens
