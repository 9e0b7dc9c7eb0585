"""Which rows each data-parallel replica reads, in which order, and where a resume starts.

Kiln owns the data order rather than Ray Data's streaming split, whose order depends on task
timing and whose iterators cannot seek (ray-project/ray#37633). The rule, the same for every
launcher (Megatron's, for a dataset of consecutive rows):

- a split's rows are numbered in manifest order (shard by shard; `kiln data prepare` shuffled
  the train rows once when it wrote them) and cut into chunks of one micro-batch each;
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


def read_slice(loc: Location, s: Slice) -> pa.Table:
    """The id and tokens of a slice's rows of one shard; transient S3 errors retried.
    (Runs in Ray Data's read tasks too: this module imports no torch, which would cost each new
    read process seconds.)"""
    def read() -> pa.Table:
        with loc.fs.open_input_file(loc.path) as f:
            return pq.read_table(f, columns=[SAMPLE_ID, TOKENS])

    table = retry_transient(read, f"reading shard {loc.uri}")
    if len(s.ranges) == 1:
        (a, b), = s.ranges
        return table.slice(a, b - a)
    return table.take(pa.array(np.concatenate([np.arange(a, b) for a, b in s.ranges])))
