"""A Ray Train worker's batches: its own rows, in Kiln's order, streamed through Ray Data."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from kiln.data.manifest import Manifest
from kiln.data.mixture import Dataset
from kiln.data.order import Slice
from kiln.data.sources import OrderedSource
from kiln.ray.datasource import ShardSliceDatasource


class RayDataSource(OrderedSource):
    """A Ray Train worker's rows, streamed by Ray Data from the shards they lie in, order kept.

    Each worker runs its own small Ray Data read over just its shards: Ray Data does the
    reading and prefetching; Kiln decides which rows and in which order."""

    def __init__(
        self,
        data: Manifest | list[Dataset],
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        prefetch: int = 2,
        max_val_batches: int = 0,
        read_task_cpus: float = 0.5,
        seed: int = 0,
        reshuffle: bool = False,
        documents: bool = False,
    ):
        super().__init__(data, dp_rank, dp_size, micro_batch, max_val_batches, seed, reshuffle, documents)
        self.prefetch_batches, self.read_task_cpus = prefetch, read_task_cpus
        self._locations = {s: [d.manifest.shard_locations(s) for d in self.datasets] for s in ("train", "val")}

    def _tables(self, split: str, slices: list[Slice]) -> Iterator[pa.Table]:
        import ray.data

        configure_ray_data()
        row_bytes = 8 + 4 * (self.manifest.seq_len + 1)  # int64 id, int32 tokens
        source = ShardSliceDatasource(self._locations[split], slices, row_bytes)
        ds = ray.data.read_datasource(
            source,
            num_cpus=self.read_task_cpus,
            # tasks in flight: enough to read ahead, few enough that
            # CPU-free reads do not flood a node with processes
            concurrency=max(1, self.prefetch_batches),
            override_num_blocks=source.tasks,
        )
        yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=self.prefetch_batches)


def configure_ray_data() -> None:
    """This process's Ray Data settings for Kiln's reads."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = True  # Kiln's order, not the order reads finish in
    ctx.enable_progress_bars = False  # Kiln prints its own progress
    ctx.print_on_execution_start = False
    # No retried_io_errors here: Ray applies them to its own file readers only; Kiln's read
    # tasks retry transient S3 errors themselves (kiln.data.order.read_slice).
