"""Which directories count as checkpoints (complete ones only), and which layouts resume them."""

from __future__ import annotations

import json

import pytest

from kiln.core import checkpoint
from kiln.errors import ConfigError


def _fake(root, step: int, world: int, markers: int | None = None, partial: bool = False, score: float | None = None):
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
    assert checkpoint.resolve_resume(str(tmp_path), world_size=2) == checkpoint.Resume(
        str(tmp_path / "step_00000020"), 20, None
    )


def test_resume_from_a_ray_run_takes_its_complete_checkpoint_of_highest_step(tmp_path):
    """Under Ray Train a run's directory holds `checkpoint_<time>` copies of what the ranks reported."""
    for step, when in ((30, "2026-11-24_10-00-03.0"), (20, "2026-11-24_10-00-02.0"), (40, "2026-11-24_09-00-00.0")):
        _fake(tmp_path, step, world=2, markers=1 if step == 40 else None).rename(tmp_path / f"checkpoint_{when}")
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")
    assert checkpoint.resolve_resume(str(tmp_path), world_size=2).directory == str(
        tmp_path / "checkpoint_2026-11-24_10-00-03.0"
    )


def test_resume_from_an_incomplete_step_is_refused_by_name(tmp_path):
    d = _fake(tmp_path, 20, world=2, markers=1)
    with pytest.raises(ConfigError, match=r"step_00000020.*incomplete"):
        checkpoint.resolve_resume(str(d), world_size=2)


def _card(world: int = 1, micro: int = 4, accum: int = 1, stages: int = 1, tp: int = 1, **more) -> dict:
    return {
        "parallel": {"zero_stage": 2, "pipeline_stages": stages, "tensor_parallel": tp},
        "batch": {"micro_batch_size": micro, "micro_batches_per_step": accum},
    } | more


def test_another_number_of_replicas_keeps_the_global_batch_through_accumulation(tmp_path):
    """2 replicas x 3 micro-batches x 2 = 12 sequences a step: on 1 replica that is 6
    micro-batches, on 3 it is 2 (or 1 of 4 sequences), on 6 it is 1. 4 replicas x 2 cannot
    make 12: refused, unless train.allow_batch_change, which takes the nearest batch they make."""
    d = _fake(tmp_path, 10, world=2)
    (d / checkpoint.CARD).write_text(json.dumps(_card(micro=2, accum=3)))
    assert checkpoint.resolve_resume(str(d), 2, _card(micro=2, accum=1)).regroup is None  # same size: as it is
    same = checkpoint.resolve_resume(str(d), 2, _card(micro=3, accum=1)).regroup  # another micro-batch only
    assert (same.micro_batches_per_step, same.batch_changed, same.reshard) == (2, False, False)
    for world, micro, accum in ((1, 2, 6), (3, 2, 2), (3, 4, 1), (6, 2, 1)):
        regroup = checkpoint.resolve_resume(str(d), world, _card(micro=micro, accum=7)).regroup
        assert (regroup.data_parallel_size, regroup.micro_batches_per_step, regroup.batch_changed) == (
            world,
            accum,
            False,
        )
        assert regroup.reshard
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve_resume(str(d), 4, _card(micro=2, accum=1))
    assert (
        "trained on 12 sequences per step (2 replicas x 3 micro-batches x 2), which 4 replicas x "
        "train.micro_batch_size = 2 cannot divide"
    ) in str(e.value) and "train.allow_batch_change" in str(e.value)
    changed = checkpoint.resolve_resume(str(d), 4, _card(micro=2, accum=1), allow_batch_change=True).regroup
    assert (changed.micro_batches_per_step, changed.batch_changed) == (2, True)  # 16 is nearer 12 than 8 (a tie)
    assert "from 12 to 16 sequences per step" in changed.describe()
    fewer = checkpoint.resolve_resume(str(d), 5, _card(micro=2, accum=1), allow_batch_change=True).regroup
    assert (fewer.micro_batches_per_step, fewer.sequences(5)) == (1, 10)


def test_a_resume_that_changes_the_pipeline_or_tensor_split_is_refused(tmp_path):
    """Each rank's files hold its own stage's layers or its own slices; a pipeline or tensor-
    parallel checkpoint resumes only on as many replicas; a checkpoint from before Kiln recorded
    its batch resumes only on as many ranks. A card from before tensor parallelism was unsplit."""
    d = _fake(tmp_path, 10, world=2)
    assert checkpoint.resolve_resume(str(d), 2, _card()).step == 10  # no card: unsplit, as many ranks
    with pytest.raises(ConfigError, match=r"before Kiln recorded a checkpoint's batch.*parallel.num_workers = 2"):
        checkpoint.resolve_resume(str(d), 4, _card())
    (d / checkpoint.CARD).write_text(json.dumps(_card(tp=2)))
    assert checkpoint.resolve_resume(str(d), 2, _card(tp=2)).step == 10
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel = 2; this run has 1 and 1.*set them as the"):
        checkpoint.resolve_resume(str(d), 2, _card())
    with pytest.raises(
        ConfigError,
        match=r"written by 1 data-parallel replicas; this run has 2.*"
        r"parallel.num_workers = 2",
    ):
        checkpoint.resolve_resume(str(d), 4, _card(tp=2))
    (d / checkpoint.CARD).write_text(json.dumps(_card(stages=2)))
    with pytest.raises(
        ConfigError,
        match=r"parallel.pipeline_stages = 2 and parallel.tensor_parallel = 1; this run "
        r"has 1 and 1",
    ):
        checkpoint.resolve_resume(str(d), 2, _card())


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

    def resume(precision: dict) -> int:
        return checkpoint.resolve_resume(str(d), 1, {"precision": precision}).step

    assert resume(WEIGHTS if card == "weights" else AUTOCAST) == 10
    if card == "none":
        assert resume(WEIGHTS) == 10
        return
    fp32 = {"precision": "fp32", "bf16_autocast": False}  # fp32 weights, as autocast has them
    if card == "autocast":
        assert resume(fp32) == 10
    with pytest.raises(ConfigError) as e:
        resume(WEIGHTS if card == "autocast" else AUTOCAST)
    assert f"written with train.precision = 'bf16' as {card}; this run has" in str(e.value)
    assert "train.mixed_precision" in str(e.value)


def test_resume_across_engines_is_refused_naming_both(tmp_path):
    """DeepSpeed's per-rank files and FSDP2's distributed checkpoint load in their own engine
    only: a resume across them is one line naming both. A card from before `parallel.engine`
    was DeepSpeed's."""
    from kiln.config import load_config

    def card(*sets: str) -> dict:
        return checkpoint.layout_card(load_config(None, ["parallel.zero_stage=3", *sets]))

    ours, fsdp2 = card(), card("parallel.engine=fsdp2", "train.precision=fp32")
    d = _fake(tmp_path, 10, world=1)
    old = {k: v for k, v in ours.items() if k != "parallel"} | {"parallel": {"zero_stage": 3, "pipeline_stages": 1}}
    (d / checkpoint.CARD).write_text(json.dumps(old))
    assert checkpoint.resolve_resume(str(d), 1, ours).step == 10  # an old card: DeepSpeed's, as this run
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve_resume(str(d), 1, fsdp2)
    assert "was written by parallel.engine = 'deepspeed'; this run has 'fsdp2'" in str(e.value)
    (d / checkpoint.CARD).write_text(json.dumps(fsdp2))
    assert checkpoint.resolve_resume(str(d), 1, fsdp2).step == 10
    # FSDP2 keeps fp32 weights and state in bf16 too: bf16 and fp32 runs resume each other.
    assert checkpoint.resolve_resume(str(d), 1, card("parallel.engine=fsdp2", "train.precision=bf16")).step == 10
    with pytest.raises(ConfigError, match="set parallel.engine = 'fsdp2'"):
        checkpoint.resolve_resume(str(d), 1, ours)


def test_resume_between_lora_and_full_training_is_refused_naming_both(tmp_path):
    """A LoRA checkpoint holds its adapters alone and a full one no adapters: a resume from one
    into the other, or onto other adapters, is one line naming both; the same adapters resume."""
    from kiln.config import load_config

    def card(*sets: str) -> dict:
        return checkpoint.layout_card(load_config(None, ["model.init_from=/base", *sets]))

    lora, full = card("model.lora.rank=8"), card()
    d = _fake(tmp_path, 10, world=1)
    (d / checkpoint.CARD).write_text(json.dumps(lora))
    assert checkpoint.resolve_resume(str(d), 1, lora).step == 10
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve_resume(str(d), 1, full)
    assert "model.lora = rank 8 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; this run has off" in str(
        e.value
    )
    with pytest.raises(ConfigError, match="this run has rank 4 on q_proj"):
        checkpoint.resolve_resume(str(d), 1, card("model.lora.rank=4", "model.lora.targets=q_proj"))
    (d / checkpoint.CARD).write_text(json.dumps(full))
    with pytest.raises(ConfigError, match="model.lora = off .every weight trained.; this run has rank 8"):
        checkpoint.resolve_resume(str(d), 1, lora)
