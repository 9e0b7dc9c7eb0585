"""Which rows each data-parallel replica reads, in which order, and where a resume starts.

Kiln owns the data order rather than Ray Data's streaming split, whose order depends on task
timing and whose iterators cannot seek (ray-project/ray#37633). The rule, the same for every
launcher:

- a split's rows are numbered in manifest order (shard by shard; `kiln data prepare` shuffled
  the train rows once when it wrote them);
- replica r of n reads the contiguous rows [r * per, (r + 1) * per), with per = rows // n, so
  every replica has as many batches as the others and reads whole shards where it can;
- every epoch reads them in the same order, in micro-batches of consecutive rows, the last
  partial micro-batch dropped;
- a run resumed after k micro-batches starts at micro-batch k % batches_per_epoch of the epoch,
  reading from the shard that holds that row: nothing is read twice or left out.

The stages of one pipeline share a data-parallel rank, so they read the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.data.manifest import SAMPLE_ID, TOKENS
from kiln.storage import Location, retry_transient


@dataclass(frozen=True)
class Slice:
    """Rows [start, stop) of shard number `shard` (its index in the manifest's split)."""

    shard: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def rows_per_replica(shard_rows: list[int], world: int) -> int:
    return sum(shard_rows) // world


def batches_per_epoch(shard_rows: list[int], world: int, micro_batch: int) -> int:
    return rows_per_replica(shard_rows, world) // micro_batch


def replica_slices(shard_rows: list[int], rank: int, world: int, skip_rows: int = 0) -> list[Slice]:
    """The shard slices replica `rank` of `world` reads in one epoch, in order, starting
    `skip_rows` rows into its range (a resume mid-epoch)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    per = rows_per_replica(shard_rows, world)
    if not 0 <= skip_rows <= per:
        raise ValueError(f"skip_rows {skip_rows} is outside a replica's {per} rows")
    lo, hi = rank * per + skip_rows, (rank + 1) * per
    slices, first = [], 0  # first: the global number of the shard's first row
    for shard, n in enumerate(shard_rows):
        start, stop = max(lo, first), min(hi, first + n)
        if start < stop:
            slices.append(Slice(shard, start - first, stop - first))
        first += n
    return slices


def resume_point(skip_batches: int, per_epoch: int, micro_batch: int) -> tuple[int, int]:
    """(epoch, rows into the replica's range) after `skip_batches` micro-batches."""
    if per_epoch <= 0:
        return 0, 0
    return skip_batches // per_epoch, (skip_batches % per_epoch) * micro_batch


def read_slice(loc: Location, s: Slice) -> pa.Table:
    """The id and tokens of rows [s.start, s.stop) of one shard; transient S3 errors retried.
    (Runs in Ray Data's read tasks too: this module imports no torch, which would cost each new
    read process seconds.)"""
    def read() -> pa.Table:
        with loc.fs.open_input_file(loc.path) as f:
            return pq.read_table(f, columns=[SAMPLE_ID, TOKENS])

    return retry_transient(read, f"reading shard {loc.uri}").slice(s.start, s.rows)
