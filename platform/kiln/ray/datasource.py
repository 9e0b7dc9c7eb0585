"""A Ray Data datasource for the rows Kiln assigned to one worker: read tasks over its shard slices, in order.

Ray's own `read_parquet` samples files with tasks of a whole CPU each before it reads (stuck
forever where the training workers hold every CPU); `ShardSliceDatasource` takes row counts and
sizes from the manifest, so it plans without touching storage. Each task reads its slices, only
the row groups that hold their rows (`kiln.data.order.read_slice`). This module
imports no torch: a new read process would pay seconds for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from kiln.data.order import Slice, read_slice
from kiln.storage import Location

TASK_BYTES = 4 << 20  # rows a read task returns at least, where slices are smaller: a shuffled
# epoch reads a row group (32 KiB) at a time, and a Ray task for each would cost more than its read


class ShardSliceDatasource(Datasource):
    """`locations[source][shard]`: the shards of each dataset of the run; `slices`: what to read,
    in order. Consecutive slices share a read task up to TASK_BYTES."""

    def __init__(self, locations: list[list[Location]], slices: list[Slice], row_bytes: int):
        super().__init__()
        self.locations, self.slices, self.row_bytes = locations, slices, row_bytes
        self.groups = _grouped(slices, row_bytes)

    @property
    def tasks(self) -> int:
        return len(self.groups)

    def get_name(self) -> str:
        return "KilnShards"

    def estimate_inmemory_data_size(self) -> int:
        return sum(s.rows for s in self.slices) * self.row_bytes

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context=None
    ) -> list[ReadTask]:
        def task(group: list[Slice]) -> ReadTask:
            where = [(self.locations[s.source][s.shard], s) for s in group]

            def read() -> Iterable[pa.Table]:
                return [read_slice(loc, s) for loc, s in where]

            rows = sum(s.rows for s in group)
            meta = BlockMetadata(
                num_rows=rows,
                size_bytes=rows * self.row_bytes,
                input_files=sorted({loc.uri for loc, _ in where}),
                exec_stats=None,
            )
            return ReadTask(read, meta)

        # Order preserved by the executor (DataContext.execution_options.preserve_order).
        return [task(g) for g in self.groups]


def _grouped(slices: list[Slice], row_bytes: int) -> list[list[Slice]]:
    """Consecutive slices in groups of at least TASK_BYTES of rows (the last may be smaller)."""
    groups: list[list[Slice]] = [[]]
    held = 0
    for s in slices:
        if held >= TASK_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(s)
        held += s.rows * row_bytes
    return groups if groups[0] else []
