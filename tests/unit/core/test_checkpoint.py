"""Which directories count as checkpoints: complete ones only, from the same world size."""

from __future__ import annotations

import json

import pytest

from kiln.core import checkpoint
from kiln.errors import ConfigError


def _fake(root, step: int, world: int, markers: int | None = None, partial: bool = False,
          score: float | None = None):
    d = root / (f"step_{step:08d}" + (".partial" if partial else ""))
    (d / checkpoint.TAG).mkdir(parents=True)
    (d / "latest").write_text(checkpoint.TAG)  # what DeepSpeed writes, complete or not
    for rank in range(world if markers is None else markers):
        marker = {"step": step, "world_size": world, "rank": rank, "tag": checkpoint.TAG}
        if score is not None:
            marker[checkpoint.SCORE] = score
        (d / checkpoint.MARKER.format(rank=rank)).write_text(json.dumps(marker))
    return d


def test_latest_complete_skips_unmarked_partial_and_missing_rank_checkpoints(tmp_path):
    _fake(tmp_path, 10, world=2)
    _fake(tmp_path, 20, world=2, markers=1)  # rank 1 died before its marker
    _fake(tmp_path, 30, world=2, markers=0)  # DeepSpeed's files and `latest`, no marker at all
    _fake(tmp_path, 40, world=2, partial=True)  # never renamed
    assert checkpoint.latest_complete(str(tmp_path)) == str(tmp_path / "step_00000010")


def test_a_marker_from_another_step_does_not_complete_a_checkpoint(tmp_path):
    d = _fake(tmp_path, 20, world=2)
    (d / checkpoint.MARKER.format(rank=1)).write_text(json.dumps({"step": 10, "world_size": 2, "rank": 1}))
    assert not checkpoint.is_complete(str(d))
    (d / checkpoint.MARKER.format(rank=1)).write_text("{truncated")
    assert not checkpoint.is_complete(str(d))


def test_resume_from_a_root_takes_the_newest_complete_step(tmp_path):
    _fake(tmp_path, 10, world=2)
    _fake(tmp_path, 20, world=2)
    assert checkpoint.resolve_resume(str(tmp_path), world_size=2) == (str(tmp_path / "step_00000020"), 20)


def test_resume_from_a_ray_run_takes_its_complete_checkpoint_of_highest_step(tmp_path):
    """Under Ray Train a run's directory holds `checkpoint_<time>` copies of what the ranks reported."""
    for step, when in ((30, "2026-11-24_10-00-03.0"), (20, "2026-11-24_10-00-02.0"), (40, "2026-11-24_09-00-00.0")):
        _fake(tmp_path, step, world=2, markers=1 if step == 40 else None).rename(tmp_path / f"checkpoint_{when}")
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")
    assert checkpoint.resolve_resume(str(tmp_path), world_size=2) == (str(tmp_path / "checkpoint_2026-11-24_10-00-03.0"), 30)


def test_resume_from_an_incomplete_step_is_refused_by_name(tmp_path):
    d = _fake(tmp_path, 20, world=2, markers=1)
    with pytest.raises(ConfigError, match=r"step_00000020.*incomplete"):
        checkpoint.resolve_resume(str(d), world_size=2)


def test_resume_into_another_world_size_is_refused(tmp_path):
    d = _fake(tmp_path, 10, world=2)
    with pytest.raises(ConfigError, match=r"written by 2 ranks; this run has 4"):
        checkpoint.resolve_resume(str(d), world_size=4)


def test_resume_from_nothing_usable_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"no such directory"):
        checkpoint.resolve_resume(str(tmp_path / "missing"), world_size=1)
    _fake(tmp_path, 10, world=1, partial=True)
    with pytest.raises(ConfigError, match=r"holds no complete Kiln checkpoint"):
        checkpoint.resolve_resume(str(tmp_path), world_size=1)


def test_prune_keeps_the_newest_complete_and_leaves_incomplete_ones(tmp_path):
    for step in (10, 20, 30, 40):
        _fake(tmp_path, step, world=2)
    _fake(tmp_path, 50, world=2, markers=1)  # a writer died: not complete, not counted, not deleted
    deleted = checkpoint.prune(str(tmp_path), keep=2)
    assert [p.rsplit("/", 1)[1] for p in deleted] == ["step_00000010", "step_00000020"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040", "step_00000050"]
    assert checkpoint.prune(str(tmp_path), keep=0) == []  # 0 keeps everything
    assert checkpoint.latest_complete(str(tmp_path)).endswith("step_00000040")


def test_prune_by_val_loss_keeps_the_best_and_the_newest(tmp_path):
    for step, val in ((10, 3.0), (20, 2.5), (30, 2.7), (40, 2.4), (50, 2.9)):
        _fake(tmp_path, step, world=1, score=val)
    _fake(tmp_path, 60, world=1)  # saved without a score: ranks last, but it is the newest
    deleted = checkpoint.prune(str(tmp_path), keep=2, by="loss/val")
    assert [p.rsplit("/", 1)[1] for p in deleted] == ["step_00000010", "step_00000030", "step_00000050"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000020", "step_00000040", "step_00000060"]
    assert checkpoint.latest_complete(str(tmp_path)).endswith("step_00000060")


def _precision(*sets: str) -> dict:
    from kiln.config import load_config

    return checkpoint.precision_record(load_config(None, ["train.precision=bf16", *sets]))


AUTOCAST, WEIGHTS = _precision("train.mixed_precision=autocast"), _precision("train.mixed_precision=weights")


def test_a_gpu_at_zero0_records_bf16_as_autocast():
    assert _precision("parallel.use_gpu=true", "parallel.zero_stage=0") == AUTOCAST != WEIGHTS


@pytest.mark.parametrize("card", ["autocast", "weights", "none"])
def test_resume_across_precision_layouts_is_refused_naming_both(tmp_path, card):
    """bf16 as autocast (fp32 weights, torch's optimizer state) and as DeepSpeed's bf16 weights
    (its bf16 optimizer's state) cannot load into each other: refused, where DeepSpeed's load
    failed with a KeyError. A card from before the record says nothing and is not checked."""
    d = _fake(tmp_path, 10, world=1)
    if card != "none":
        (d / checkpoint.CARD).write_text(json.dumps({"precision": AUTOCAST if card == "autocast" else WEIGHTS}))
    assert checkpoint.resolve_resume(str(d), 1, WEIGHTS if card == "weights" else AUTOCAST)[1] == 10
    if card == "none":
        assert checkpoint.resolve_resume(str(d), 1, WEIGHTS)[1] == 10
        return
    fp32 = {"precision": "fp32", "bf16_autocast": False}  # fp32 weights, as autocast has them
    if card == "autocast":
        assert checkpoint.resolve_resume(str(d), 1, fp32)[1] == 10
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve_resume(str(d), 1, WEIGHTS if card == "autocast" else AUTOCAST)
    assert f"written with train.precision = 'bf16' as {card}; this run has" in str(e.value)
    assert "train.mixed_precision" in str(e.value)


def test_resume_at_another_tensor_parallel_size_is_refused_naming_both(tmp_path):
    """Each rank's file holds its own slices, cut for the size that wrote them; a card from
    before tensor parallelism was written unsplit (1)."""
    d = _fake(tmp_path, 10, world=2)
    assert checkpoint.resolve_resume(str(d), 2, None, 1)[1] == 10  # no card: unsplit
    (d / checkpoint.CARD).write_text(json.dumps({"parallel": {"zero_stage": 1, "pipeline_stages": 1,
                                                              "tensor_parallel": 2}}))
    assert checkpoint.resolve_resume(str(d), 2, None, 2)[1] == 10
    with pytest.raises(ConfigError, match=r"written with parallel.tensor_parallel = 2; this run has 1.*"
                                          r"set parallel.tensor_parallel = 2"):
        checkpoint.resolve_resume(str(d), 2, None, 1)
