"""Kiln's data order: which rows each replica reads, and an exact resume counted by sample ids."""

import itertools

import numpy as np
import pytest
import torch

from kiln.data.manifest import load_manifest
from kiln.data.order import Slice, batches_per_epoch, expected_ids, read_slice, replica_slices, whole_shards
from kiln.data.sources import ParquetSource, _checked_order, _micro_batches
from kiln.errors import DataError
from kiln.storage import resolve


def _rows(slices: list[Slice], shard_rows: list[int]) -> list[int]:
    firsts = np.cumsum([0, *shard_rows])
    return [int(firsts[s.shard]) + int(r) for s in slices for r in s.index]


def _slice(shard: int, *ranges: tuple[int, int]) -> Slice:
    return Slice(shard, np.concatenate([np.arange(a, b) for a, b in ranges]))


def _slices(shard_rows: list[int], rank: int, world: int, micro: int, skip: int = 0) -> list[Slice]:
    return replica_slices(whole_shards(shard_rows), rank, world, micro, skip)


@pytest.mark.parametrize(
    "shard_rows,world,micro", [([10, 10, 10], 2, 4), ([7, 3, 11, 1], 3, 2), ([5], 4, 1), ([4, 4], 1, 3)]
)
def test_each_step_reads_consecutive_rows_whatever_the_world_size(shard_rows, world, micro):
    per_epoch = batches_per_epoch(sum(shard_rows), world, micro)
    got = [_rows(_slices(shard_rows, r, world, micro), shard_rows) for r in range(world)]
    assert [len(g) for g in got] == [per_epoch * micro] * world
    # micro-batch j of every replica, side by side: the rows of step j, consecutive
    steps = [row for j in range(per_epoch) for g in got for row in g[j * micro : (j + 1) * micro]]
    assert steps == list(range(per_epoch * micro * world))


def test_a_resume_mid_epoch_starts_at_the_shard_that_holds_its_chunk():
    shard_rows = [10, 10, 10]  # micro 4, 2 replicas: chunks of 4 rows, replica 1 reads chunks 1, 3, 5
    assert _slices(shard_rows, 1, 2, 4) == [_slice(0, (4, 8)), _slice(1, (2, 6)), _slice(2, (0, 4))]
    assert _slices(shard_rows, 1, 2, 4, skip=2) == [_slice(2, (0, 4))]
    assert _slices(shard_rows, 0, 2, 4, skip=1) == [_slice(0, (8, 10)), _slice(1, (0, 2), (6, 10))]
    assert _slices(shard_rows, 1, 2, 4, skip=3) == []
    with pytest.raises(ValueError):
        _slices(shard_rows, 1, 2, 4, skip=4)
    assert batches_per_epoch(sum(shard_rows), 2, 4) == 3  # 30 rows: 3 chunks each, 6 rows left out


def test_micro_batches_cut_a_stream_of_uneven_blocks():
    blocks = [(np.arange(a, b), np.arange(a, b)[:, None].repeat(3, 1)) for a, b in ((0, 3), (3, 4), (4, 11))]
    out = list(_micro_batches(iter(blocks), 4))
    assert [ids.tolist() for ids, _ in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 8..10 dropped
    assert all(torch.equal(t[:, 0], torch.from_numpy(ids)) and t.dtype == torch.int64 for ids, t in out)


def test_rows_out_of_order_are_refused():
    slices = [_slice(0, (0, 2), (6, 8)), _slice(1, (1, 3))]  # 3 replicas; a shard numbered from 100
    want = lambda: expected_ids(slices, [[0, 100]])  # noqa: E731
    ok = [(np.arange(0, 2), None), (np.array([6, 7]), None), (np.array([101, 102]), None)]
    assert len(list(_checked_order(iter(ok), "train", "ds", want()))) == 3
    across = [(np.array([0, 1, 6]), None), (np.array([7, 101, 102]), None)]  # micro-batches across shards
    assert len(list(_checked_order(iter(across), "train", "ds", want()))) == 2
    swapped = [(np.arange(6, 8), None), (np.arange(0, 2), None)]
    with pytest.raises(DataError, match="train rows of ds arrived out of order"):
        list(_checked_order(iter(swapped), "train", "ds", want()))


def test_a_slice_reads_exactly_its_rows(byte_dataset):
    import pyarrow.parquet as pq

    manifest = load_manifest(resolve(str(byte_dataset)))
    _, loc = manifest.shards("train")[1]
    ids = pq.read_table(loc.path).column("id").to_pylist()
    assert read_slice(loc, _slice(1, (3, 13))).column("id").to_pylist() == ids[3:13]
    assert read_slice(loc, _slice(1, (0, 2), (5, 7))).column("id").to_pylist() == ids[0:2] + ids[5:7]
    backwards = Slice(1, np.array([9, 2, 8, 0]))  # a reshuffled epoch reads rows in any order
    assert read_slice(loc, backwards).column("id").to_pylist() == [ids[9], ids[2], ids[8], ids[0]]
    assert ids == list(range(manifest.first_ids("train")[1], manifest.first_ids("train")[1] + len(ids)))


def test_a_resumed_source_sees_every_sample_once_across_an_epoch_boundary(byte_dataset):
    """Replica 1 of 2: k micro-batches, then a new source resumed at k (as after a restart)
    gives exactly the uninterrupted stream; each epoch is the replica's rows, each once."""
    manifest = load_manifest(resolve(str(byte_dataset)))
    per_epoch = batches_per_epoch(manifest.split("train")["rows"], 2, 8)
    assert len(manifest.shards("train")) > 1 and per_epoch > 4
    assert ParquetSource(manifest, 1, 2, 8).resume_point(2 * per_epoch + 1) == (2, 1)  # epoch 2, its second batch

    def ids(source, n):
        return [s[0].tolist() for s in itertools.islice(source.train_samples(skip=source.skip), n)]

    def source(skip):
        s = ParquetSource(manifest, 1, 2, 8)
        s.skip = skip
        return s

    total = per_epoch + 5  # into the second epoch
    uninterrupted = ids(source(0), total)
    for k in (3, per_epoch - 1, per_epoch + 2):
        assert ids(source(0), k) + ids(source(k), total - k) == uninterrupted, k
    epoch = list(itertools.chain(*uninterrupted[:per_epoch]))
    assert len(set(epoch)) == len(epoch) == per_epoch * 8
    rows = [
        i
        for (e, _), first in zip(manifest.shards("train"), manifest.first_ids("train"))
        for i in range(first, first + e["rows"])
    ]  # the split's rows in manifest order
    assert uninterrupted[:per_epoch] == [
        rows[(2 * j + 1) * 8 : (2 * j + 2) * 8] for j in range(per_epoch)
    ]  # chunks 1, 3, 5, ...
    assert uninterrupted[per_epoch] == uninterrupted[0]  # the next epoch starts over, same order
    replica0 = ParquetSource(manifest, 0, 2, 8)
    replica0.skip = 0
    assert not {i for b in ids(replica0, per_epoch) for i in b} & set(epoch)  # replicas read different samples


@pytest.mark.parametrize("before,after", [(2, 3), (2, 1), (1, 2), (3, 2)])
def test_a_resume_on_another_number_of_replicas_goes_on_at_the_same_row(byte_dataset, before, after):
    """`before` replicas read k micro-batches each, then `after` replicas go on from
    `rescaled_skip`: they start at the first row of the epoch not yet read, or, where
    `after` replicas' micro-batches do not end there, at the next row they do (never a row
    twice, fewer than one micro-batch per replica left out); at and after an epoch's end too."""
    manifest = load_manifest(resolve(str(byte_dataset)))
    rows = [
        i
        for (e, _), first in zip(manifest.shards("train"), manifest.first_ids("train"))
        for i in range(first, first + e["rows"])
    ]  # an epoch's rows in order (one dataset)
    micro = 4
    per_epoch = batches_per_epoch(len(rows), before, micro)
    for k in (6, 7, per_epoch - 1, per_epoch, per_epoch + 3):
        _, read = divmod(k * before * micro, per_epoch * before * micro)  # rows read of that epoch
        skips = [ParquetSource(manifest, r, after, micro).rescaled_skip(k, before, micro) for r in range(after)]
        assert len(set(skips)) == 1  # every replica skips alike
        sources = [ParquetSource(manifest, r, after, micro) for r in range(after)]
        first = [next(iter(s.train_samples(skip=skips[0])))[0].tolist() for s in sources]
        start = rows.index(first[0][0])
        assert [i for b in first for i in b] == rows[
            start : start + after * micro
        ]  # consecutive rows, replica by replica
        if read + after * micro > batches_per_epoch(len(rows), after, micro) * after * micro:
            assert start == 0  # the epoch's tail for `after` replicas: the next epoch begins
        else:
            assert 0 <= start - read < after * micro and (start - read == 0) == (read % (after * micro) == 0), k
