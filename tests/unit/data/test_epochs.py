"""The epochs' order (kiln.data.epochs): passes, reshuffles, windows and mixture quotas, on
block tables alone."""

import numpy as np
import pytest

from kiln.data.epochs import WINDOW_SHARDS, Blocks, EpochOrder, quotas
from kiln.data.order import replica_slices


def _rows(layout) -> list[tuple[int, int, int]]:
    """(dataset, shard, row) of every row of an epoch, in order."""
    parts = np.repeat(np.arange(len(layout.size)), layout.size)
    offsets = np.concatenate([np.arange(n) for n in layout.size])
    rows = layout.rows_at(parts, offsets)
    return list(zip(layout.source[parts].tolist(), layout.shard[parts].tolist(), rows.tolist()))


def test_one_dataset_without_reshuffle_is_manifest_order_every_epoch():
    order = EpochOrder([Blocks.of([70, 5, 64], 32)], [1.0], seed=3, reshuffle=False)
    want = [(0, s, r) for s, n in enumerate([70, 5, 64]) for r in range(n)]
    assert _rows(order.layout(0)) == _rows(order.layout(7)) == want


def test_a_reshuffled_pass_is_every_row_once_in_another_order_each_epoch_within_windows():
    shard_rows = [32 * 3] * 40 + [20]  # 41 shards: three windows of up to WINDOW_SHARDS shards
    order = EpochOrder([Blocks.of(shard_rows, 32)], [1.0], seed=11, reshuffle=True)
    epochs = [_rows(order.layout(e)) for e in range(3)]
    for rows in epochs:
        assert sorted(rows) == [(0, s, r) for s, n in enumerate(shard_rows) for r in range(n)]
        # a reader holds few shards at once: the epoch walks windows of WINDOW_SHARDS shards
        firsts = {}
        for i, (_, s, _) in enumerate(rows):
            firsts.setdefault(s, i)
        opened = sorted(firsts, key=firsts.get)
        lasts = {s: i for i, (_, s, _) in enumerate(rows)}
        assert all(sum(firsts[t] <= i <= lasts[t] for t in opened) <= WINDOW_SHARDS for i in range(0, len(rows), 97))
    assert epochs[0] != epochs[1] != epochs[2]
    again = EpochOrder([Blocks.of(shard_rows, 32)], [1.0], seed=11, reshuffle=True)
    assert _rows(again.layout(1)) == epochs[1]  # a function of the seed and the epoch alone
    other_seed = EpochOrder([Blocks.of(shard_rows, 32)], [1.0], seed=12, reshuffle=True)
    assert _rows(other_seed.layout(1)) != epochs[1]
    # rows within a block are permuted too, so micro-batches smaller than a block differ
    block = epochs[0][:32]
    assert len({s for _, s, _ in block}) == 1 and [r for *_, r in block] != sorted(r for *_, r in block)


def test_quotas_share_blocks_by_weight():
    assert quotas([1, 3], 100) == [25, 75]
    assert quotas([1, 1, 1], 10) == [4, 3, 3]  # the remainder to the earliest
    assert quotas([1, 1e6], 10) == [1, 9]  # every dataset gets a block
    assert sum(quotas([0.3, 0.7], 7)) == 7


def test_a_mixture_follows_its_weights_and_covers_each_dataset_once_per_pass():
    small, large = Blocks.of([64] * 4, 16), Blocks.of([64] * 30, 16)  # 16 and 120 blocks
    order = EpochOrder([small, large], [1.0, 1.0], seed=5, reshuffle=True)
    assert order.quota == [68, 68]  # 136 blocks an epoch: the small set is upsampled
    epochs = [_rows(order.layout(e)) for e in range(4)]
    stream = {d: [r for rows in epochs for r in rows if r[0] == d] for d in (0, 1)}
    for d, n_rows in ((0, 4 * 64), (1, 30 * 64)):
        passes = [stream[d][i : i + n_rows] for i in range(0, len(stream[d]) - n_rows + 1, n_rows)]
        assert passes and all(len(set(p)) == n_rows for p in passes), d  # every row once per pass
    # the interleave: in any stretch, the share of each dataset is its weight up to sampling error
    labels = np.array([r[0] for r in epochs[0]])
    for lo in range(0, len(labels) - 512, 512):
        share = labels[lo : lo + 512].mean()
        assert abs(share - 0.5) < 4 * np.sqrt(0.25 / (512 / 16)), (lo, share)  # blocks of 16 rows


def test_replicas_of_a_shuffled_epoch_read_disjoint_rows_whose_steps_cover_it():
    order = EpochOrder([Blocks.of([96, 96, 40], 32), Blocks.of([128], 32)], [2.0, 1.0], seed=1, reshuffle=True)
    layout = order.layout(2)
    world, micro = 3, 8
    got = [
        [(s.source, s.shard, int(r)) for s in replica_slices(layout, rank, world, micro) for r in s.index]
        for rank in range(world)
    ]
    rows = _rows(layout)
    per = len(got[0])
    assert all(len(g) == per for g in got) and per == layout.rows // (world * micro) * micro
    steps = [row for j in range(per // micro) for g in got for row in g[j * micro : (j + 1) * micro]]
    assert steps == rows[: len(steps)]  # the chunks of a step are consecutive rows of the epoch


@pytest.mark.parametrize("reshuffle", [False, True])
def test_rows_by_source_counts_an_epochs_prefix(reshuffle):
    order = EpochOrder([Blocks.of([50, 50], 16), Blocks.of([33], 16)], [1.0, 1.0], seed=9, reshuffle=reshuffle)
    layout = order.layout(1)
    labels = [d for d, *_ in _rows(layout)]
    for n in (0, 1, 17, 40, layout.rows):
        assert layout.rows_by_source(n, 2).tolist() == [labels[:n].count(0), labels[:n].count(1)]
