"""The first batch is fetched on a thread; its errors must reach the training loop unchanged."""

import pytest
import torch

from kiln.train.loop import _prefetch_first


def test_yields_every_item_in_order():
    items = [torch.tensor([i]) for i in range(3)]
    assert [int(t) for t in _prefetch_first(iter(items))] == [0, 1, 2]


def test_empty_source_yields_nothing():
    assert list(_prefetch_first(iter([]))) == []


def test_fetch_error_is_reraised_not_lost():
    def broken():
        raise OSError("shard s3://bucket/part-0.parquet unreadable")
        yield  # pragma: no cover

    with pytest.raises(OSError, match="part-0.parquet"):
        next(_prefetch_first(broken()))
