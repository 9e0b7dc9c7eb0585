"""A Ray Data datasource for the rows Kiln assigned to one worker: one read task per shard slice.

Ray's own `read_parquet` samples files with tasks of a whole CPU each before it reads (stuck
forever where the training workers hold every CPU); `ShardSliceDatasource` takes row counts and
sizes from the manifest, so it plans without touching storage. Each task reads the whole shard
its slice lies in, only the row groups of the slice's rows (`kiln.data.order.read_slice`). This module
imports no torch: a new read process would pay seconds for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from kiln.data.order import Slice, read_slice
from kiln.storage import Location


class ShardSliceDatasource(Datasource):
    def __init__(self, locations: list[Location], slices: list[Slice], row_bytes: int):
        super().__init__()
        self.locations, self.slices, self.row_bytes = locations, slices, row_bytes

    def get_name(self) -> str:
        return "KilnShards"

    def estimate_inmemory_data_size(self) -> int:
        return sum(s.rows for s in self.slices) * self.row_bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        def task(loc: Location, s: Slice) -> ReadTask:
            def read() -> Iterable[pa.Table]:
                return [read_slice(loc, s)]

            meta = BlockMetadata(num_rows=s.rows, size_bytes=s.rows * self.row_bytes,
                                 input_files=[loc.uri], exec_stats=None)
            return ReadTask(read, meta)

        # Order preserved by the executor (DataContext.execution_options.preserve_order).
        return [task(self.locations[s.shard], s) for s in self.slices]
