"""kiln.data.indices: what each step trained on, read back across worker groups and rollbacks."""

import numpy as np
import pytest
import torch

from kiln.config import load_config
from kiln.data.indices import IndexLog, trained_ids
from kiln.errors import ConfigError


def _group(directory, start: int, replicas: int, steps: range, first_id: int, consumed: int = 0) -> None:
    """`replicas` replicas of one worker group, each reading 2 micro-batches of 2 rows a step
    (replica r's ids numbered on from `first_id` + 100 r), recording `steps`."""
    for r in range(replicas):
        log = IndexLog(str(directory), start, r)
        ids = iter(range(first_id + 100 * r, 10**6))
        batches = log.tap(((0, np.array([next(ids), next(ids)]), torch.zeros(2, 3)) for _ in range(10**6)), consumed)
        for step in steps:
            next(batches), next(batches)
            consumed += 2
            log.record(step, consumed)
        consumed -= 2 * len(steps)
        log.close()


def test_a_later_group_wins_the_steps_it_trained_again(tmp_path):
    _group(tmp_path, 1_000, 2, range(1, 6), 0)  # two replicas, steps 1-5
    _group(tmp_path, 2_000, 1, range(4, 7), 50, consumed=6)  # one replica, resumed at 3: 4-6 again
    got = trained_ids(tmp_path)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert [i for _, i in got[1]] == [0, 1, 2, 3, 100, 101, 102, 103]  # replica 0's, then replica 1's
    assert [i for _, i in got[4]] == [50, 51, 52, 53]  # the later group's only
    assert all(e == 0 for ids in got.values() for e, _ in ids)


def test_within_a_group_the_last_line_wins_and_skipped_steps_are_not_trained(tmp_path):
    log = IndexLog(str(tmp_path), 7, 0)
    batches = log.tap(((e, np.array([i]), torch.zeros(1, 2)) for i, e in zip(range(100), [0] * 3 + [1] * 97)), 0)
    steps = [(1, "trained"), (2, "skipped"), (2, "trained"), (3, "dropped"), (3, "trained"), (2, "trained")]
    for consumed, (step, status) in enumerate(steps, start=1):  # a micro-batch a step
        next(batches)
        log.record(step, consumed, status)
    log.close()
    got = trained_ids(tmp_path)
    # step 2 was skipped (row 1), trained (row 2), then trained again after a rollback (row 5)
    assert got == {1: [(0, 0)], 2: [(1, 5)], 3: [(1, 4)]}


def test_an_s3_index_log_is_refused():
    with pytest.raises(ConfigError, match="data.index_log = 's3://b/x': expected a local directory"):
        load_config(None, ["data.index_log=s3://b/x"])
