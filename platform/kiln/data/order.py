"""Which rows each data-parallel replica reads, in which order, and where a resume starts.

Kiln owns the data order rather than Ray Data's streaming split, whose order depends on task
timing and whose iterators cannot seek (ray-project/ray#37633). The rule, the same for every
launcher (Megatron's, for a dataset of consecutive rows):

- an epoch's rows are taken in the order `kiln.data.epochs` lays them out (for one dataset
  without `data.reshuffle`: manifest order, shard by shard; `kiln data prepare` shuffled the
  train rows when it wrote them) and cut into chunks of one micro-batch each;
- replica r of n reads chunks r, r + n, r + 2n, ...: the micro-batches of one step, across all
  replicas, are consecutive rows whatever n is, so a run on n workers sees what one worker with
  an n times larger micro-batch sees;
- every replica reads as many chunks as the others (the tail that does not fill one chunk per
  replica is left out);
- a run resumed after k micro-batches continues with the replica's chunk k (of the epoch),
  reading from the shard that holds it: nothing is read twice or left out.

The stages of one pipeline share a data-parallel rank, so they read the same batches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.data.epochs import WINDOW_SHARDS, Layout
from kiln.data.manifest import SAMPLE_ID, STARTS, TOKENS
from kiln.storage import Location, retry_transient


@dataclass(frozen=True, eq=False)
class Slice:
    """The rows of shard number `shard` (its index in its dataset's split) that a replica reads
    next, in the order it uses them; `source`: the dataset's place in the run's mixture."""

    shard: int
    index: np.ndarray
    source: int = 0

    @property
    def rows(self) -> int:
        return len(self.index)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Slice)
            and (self.shard, self.source) == (other.shard, other.source)
            and np.array_equal(self.index, other.index)
        )

    def __repr__(self) -> str:
        return f"Slice(shard={self.shard}, source={self.source}, index={self.index.tolist()})"


def batches_per_epoch(rows: int, world: int, micro_batch: int) -> int:
    """An epoch of `rows` rows, cut into chunks of one micro-batch, gives each of `world`
    replicas this many (the tail that does not give every replica one more is left out)."""
    return rows // (micro_batch * world)


def replica_slices(layout: Layout, rank: int, world: int, micro_batch: int, skip_batches: int = 0) -> list[Slice]:
    """What replica `rank` of `world` reads of an epoch laid out as `layout`
    (`kiln.data.epochs`), after its first `skip_batches` micro-batches of the epoch (a resume):
    its chunks' rows, as one slice per run of consecutive rows from the same shard."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    per_epoch = batches_per_epoch(layout.rows, world, micro_batch)
    if not 0 <= skip_batches <= per_epoch:
        raise ValueError(f"skip_batches {skip_batches} is outside an epoch's {per_epoch} micro-batches")
    chunks = np.arange(skip_batches, per_epoch, dtype=np.int64)
    positions = (((chunks * world + rank) * micro_batch)[:, None] + np.arange(micro_batch)).reshape(-1)
    if len(positions) == 0:
        return []
    cum = np.concatenate([[0], np.cumsum(layout.size)])
    part = np.searchsorted(cum, positions, side="right") - 1
    rows = layout.rows_at(part, positions - cum[part])
    source, shard = layout.source[part], layout.shard[part]
    cuts = np.flatnonzero((source[1:] != source[:-1]) | (shard[1:] != shard[:-1])) + 1
    bounds = [0, *cuts.tolist(), len(positions)]
    return [Slice(int(shard[a]), rows[a:b], int(source[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def whole_shards(shard_rows: list[int]) -> Layout:
    """One dataset's split in manifest order, a block per shard: the epoch of a run without
    mixture or reshuffle, and of every validation split."""
    n = len(shard_rows)
    return Layout(
        np.zeros(n, dtype=np.int64),
        np.arange(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.asarray(shard_rows, dtype=np.int64),
        np.zeros(n, dtype=np.uint64),
        False,
    )


BYTES_READ = "_bytes_read"  # the bytes a slice's read cost, on its first row: it rides along
# with the rows out of Ray Data's read tasks, where a counter of the worker's could not see it


def read_slice(loc: Location, s: Slice) -> pa.Table:
    """The id, tokens and document starts (where recorded) of a slice's rows of one shard, and
    the bytes read for them (column
    BYTES_READ): only the row groups that hold the slice's rows are fetched, with the footer.
    Transient S3 errors are retried. (Runs in Ray Data's read tasks too: this module imports no torch, which would
    cost each new read process seconds.)"""

    def read() -> tuple[pa.Table, int, list[int], np.ndarray]:
        with loc.fs.open_input_file(loc.path) as raw:
            f = _Counted(raw)
            # pre_buffer off: coalescing would fill the holes between groups (other replicas' rows)
            pf = pq.ParquetFile(pa.PythonFile(f, mode="r"), metadata=_FOOTERS.get(loc.uri, f), pre_buffer=False)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            starts = np.cumsum([0, *sizes])
            groups = np.unique(np.searchsorted(starts, s.index, side="right") - 1).tolist()
            columns = [SAMPLE_ID, TOKENS, *([STARTS] if STARTS in pf.schema_arrow.names else [])]
            table = pf.read_row_groups(groups, columns=columns)
            return table, f.bytes_read, groups, starts

    table, nbytes, groups, starts = retry_transient(read, f"reading shard {loc.uri}")
    # A row's place in the table of the groups read: its offset in its group, after the
    # groups read before it.
    picked = np.asarray(groups)
    group_first = starts[picked]
    placed = np.cumsum([0, *(starts[picked + 1] - group_first)[:-1]])
    at = np.searchsorted(group_first, s.index, side="right") - 1
    table = table.take(pa.array(s.index - group_first[at] + placed[at]))
    counted = np.zeros(len(table), dtype=np.int64)
    counted[:1] = nbytes
    return table.append_column(BYTES_READ, pa.array(counted))


def expected_ids(slices: list[Slice], first_ids: list[list[int]]) -> Iterator[np.ndarray]:
    """The sample ids the slices' rows hold, in order: a shard's rows are numbered on from its
    first id (`first_ids[source][shard]`)."""
    for s in slices:
        yield first_ids[s.source][s.shard] + s.index


class _FooterCache:
    """The footers of the shards this process read last, by URI and size. A shuffled epoch
    reads a shard one row group at a time, and a footer (a few hundred bytes per group) would
    otherwise be read again for each. Bounded: readers keep few shards open (WINDOW_SHARDS per
    dataset, `kiln.data.epochs`)."""

    def __init__(self, capacity: int):
        self.capacity, self._lock = capacity, threading.Lock()
        self._held: dict = {}

    def get(self, uri: str, f: _Counted) -> pq.FileMetaData:
        # A shard rewritten in place with another content of the very same size would get a
        # stale footer: its rows would then fail the sample-id check, not pass silently.
        key = (uri, f.size())
        with self._lock:
            meta = self._held.pop(key, None)
        meta = meta or _footer(f)
        with self._lock:
            self._held[key] = meta
            while len(self._held) > self.capacity:
                self._held.pop(next(iter(self._held)))
        return meta


def _footer(f: _Counted) -> pq.FileMetaData:
    """A Parquet file's footer, read exactly (pyarrow's own open reads the last 64 KiB on
    speculation, which for a small shard is all of it)."""
    size = f.size()
    f.seek(size - 8)
    tail = f.read(8)
    length = int.from_bytes(tail[:4], "little")
    f.seek(size - 8 - length)
    return pq.read_metadata(pa.BufferReader(f.read(length) + tail))


_FOOTERS = _FooterCache(4 * WINDOW_SHARDS)


class _Counted:
    """A file that counts the bytes read through it: what a replica's reads cost, measured."""

    def __init__(self, f: Any) -> None:  # a file opened for reading (local or pyarrow S3)
        self.f, self.bytes_read = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bytes_read += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def size(self) -> int:
        return self.f.size()

    @property
    def closed(self) -> bool:
        return self.f.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True
