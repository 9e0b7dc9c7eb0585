"""Which rows each data-parallel replica reads, in which order, and where a resume starts.

Kiln owns the data order rather than Ray Data's streaming split, whose order depends on task
timing and whose iterators cannot seek (ray-project/ray#37633). The rule, the same for every
launcher (Megatron's, for a dataset of consecutive rows):

- a split's rows are taken in manifest order (shard by shard; `kiln data prepare` shuffled
  the train rows when it wrote them) and cut into chunks of one micro-batch each;
- replica r of n reads chunks r, r + n, r + 2n, ...: the micro-batches of one step, across all
  replicas, are consecutive rows whatever n is, so a run on n workers sees what one worker with
  an n times larger micro-batch sees;
- every replica reads as many chunks as the others (the tail that does not fill one chunk per
  replica is left out), in the same order every epoch;
- a run resumed after k micro-batches continues with the replica's chunk k (of the epoch),
  reading from the shard that holds it: nothing is read twice or left out.

The stages of one pipeline share a data-parallel rank, so they read the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.data.manifest import SAMPLE_ID, TOKENS
from kiln.storage import Location, retry_transient


@dataclass(frozen=True)
class Slice:
    """The rows of shard number `shard` (its index in the manifest's split) that a replica
    reads, in order, as [start, stop) ranges."""

    shard: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def rows(self) -> int:
        return sum(b - a for a, b in self.ranges)


def batches_per_epoch(shard_rows: list[int], world: int, micro_batch: int) -> int:
    return sum(shard_rows) // (micro_batch * world)


def replica_slices(shard_rows: list[int], rank: int, world: int, micro_batch: int,
                   skip_batches: int = 0) -> list[Slice]:
    """What replica `rank` of `world` reads in one epoch, shard by shard, after its first
    `skip_batches` micro-batches of the epoch (a resume)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    per_epoch = batches_per_epoch(shard_rows, world, micro_batch)
    if not 0 <= skip_batches <= per_epoch:
        raise ValueError(f"skip_batches {skip_batches} is outside an epoch's {per_epoch} micro-batches")
    firsts = np.cumsum([0, *shard_rows])  # global number of each shard's first row
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for j in range(skip_batches, per_epoch):
        lo = (j * world + rank) * micro_batch
        hi = lo + micro_batch
        shard = int(np.searchsorted(firsts, lo, side="right")) - 1
        while lo < hi:  # a chunk may run over into the next shard
            end = min(hi, int(firsts[shard + 1]))
            ranges = by_shard.setdefault(shard, [])
            a, b = lo - int(firsts[shard]), end - int(firsts[shard])
            if ranges and ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], b)  # adjacent (world 1): one range
            else:
                ranges.append((a, b))
            lo, shard = end, shard + 1
    return [Slice(s, tuple(r)) for s, r in sorted(by_shard.items())]


def resume_point(skip_batches: int, per_epoch: int) -> tuple[int, int]:
    """(epoch, micro-batch of that epoch) after `skip_batches` micro-batches."""
    if per_epoch <= 0:
        return 0, 0
    return divmod(skip_batches, per_epoch)


BYTES_READ = "_bytes_read"  # the bytes a slice's read cost, on its first row: it rides along
# with the rows out of Ray Data's read tasks, where a counter of the worker's could not see it


def read_slice(loc: Location, s: Slice) -> pa.Table:
    """The id and tokens of a slice's rows of one shard, and the bytes read for them (column
    BYTES_READ): only the row groups that hold the slice's rows are fetched, with the footer.
    Transient S3 errors are retried. (Runs in Ray Data's read tasks too: this module imports no torch, which would
    cost each new read process seconds.)"""
    def read() -> tuple[pa.Table, int, list[int], np.ndarray]:
        with loc.fs.open_input_file(loc.path) as raw:
            f = _Counted(raw)
            # pre_buffer off: coalescing would fill the holes between groups (other replicas' rows)
            pf = pq.ParquetFile(pa.PythonFile(f, mode="r"), metadata=_footer(f), pre_buffer=False)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            starts = np.cumsum([0, *sizes])
            groups = sorted({g for a, b in s.ranges
                             for g in range(int(np.searchsorted(starts, a, side="right")) - 1,
                                            int(np.searchsorted(starts, b, side="left")))})
            table = pf.read_row_groups(groups, columns=[SAMPLE_ID, TOKENS])
            return table, f.bytes_read, groups, starts

    table, nbytes, groups, starts = retry_transient(read, f"reading shard {loc.uri}")
    # A row's place in the table of the groups read: its offset in its group, after the
    # groups read before it.
    picked = np.asarray(groups)
    group_first = starts[picked]
    placed = np.cumsum([0, *(starts[picked + 1] - group_first)[:-1]])
    rows = np.concatenate([np.arange(a, b) for a, b in s.ranges])
    at = np.searchsorted(group_first, rows, side="right") - 1
    table = table.take(pa.array(rows - group_first[at] + placed[at]))
    counted = np.zeros(len(table), dtype=np.int64)
    counted[:1] = nbytes
    return table.append_column(BYTES_READ, pa.array(counted))


def expected_ids(slices: list[Slice], first_ids: list[int]) -> Iterator[np.ndarray]:
    """The sample ids the slices' rows hold, in order: a shard's rows are numbered on from its
    first id."""
    for s in slices:
        for a, b in s.ranges:
            yield np.arange(first_ids[s.shard] + a, first_ids[s.shard] + b)


def _footer(f: _Counted) -> pq.FileMetaData:
    """A Parquet file's footer, read exactly (pyarrow's own open reads the last 64 KiB on
    speculation, which for a small shard is all of it)."""
    size = f.size()
    f.seek(size - 8)
    tail = f.read(8)
    length = int.from_bytes(tail[:4], "little")
    f.seek(size - 8 - length)
    return pq.read_metadata(pa.BufferReader(f.read(length) + tail))


class _Counted:
    """A file that counts the bytes read through it: what a replica's reads cost, measured."""

    def __init__(self, f):
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
