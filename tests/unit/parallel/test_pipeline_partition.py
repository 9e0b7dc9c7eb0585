"""Kiln's pre-launch view of a pipeline split is DeepSpeed's own."""

import pytest

from kiln.errors import ConfigError
from kiln.parallel.pipeline import check_partition, uniform_parts
from kiln.topology import ParallelConfig


def test_uniform_parts_match_deepspeed():
    from deepspeed.runtime.utils import partition_uniform

    for items in range(1, 40):
        for parts in range(1, 9):
            assert uniform_parts(items, parts) == list(partition_uniform(items, parts)), (items, parts)


def test_every_stage_needs_a_block():
    uniform = ParallelConfig(num_workers=2, zero_stage=1, pipeline_stages=2, partition_method="uniform")
    check_partition(4, uniform)  # [embedding, 3 blocks | 1 block, norm, head]
    with pytest.raises(ConfigError, match="stage 1 without a transformer block"):
        check_partition(2, uniform)
    with pytest.raises(ConfigError, match="exceeds the model's 2 transformer blocks"):
        check_partition(2, ParallelConfig(num_workers=4, zero_stage=1, pipeline_stages=4))
