"""A checkpoint written by N data-parallel ranks resumes on M: 2 -> 1, 1 -> 2 and 2 -> 3, at
ZeRO-0 to ZeRO-3, ZeRO-2 with the optimizer offloaded and FSDP2 (ZeRO-3), through the same
`train_loop` that Ray Train and the local launcher call (real DeepSpeed and FSDP2 engines on
CPU/gloo, fp32, debug flavour).

Every run trains on 12 sequences a step (2 per micro-batch: 1 rank x 6, 2 x 3, 3 x 2) and saves
at step 8. A resumed run must go on as the run that wrote the checkpoint did: the same losses
(within 1e-3; in fact far closer), each sample id once, and, gathered whole, the same fp32
weights and optimizer state right after the load.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_harness import launch  # noqa: E402

pytestmark = pytest.mark.slow  # whole training jobs or engines: not in `make test-fast`

SAVED, STEPS, MICRO = 8, 12, 2
SEQUENCES = 12  # per step, on any of 1, 2 or 3 ranks
STAGES = {
    "zero0": ["parallel.zero_stage=0"],
    "zero1": ["parallel.zero_stage=1"],
    "zero2": ["parallel.zero_stage=2"],
    "zero3": ["parallel.zero_stage=3"],
    "zero2-offload": ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"],
    "fsdp2": ["parallel.engine=fsdp2", "parallel.zero_stage=3"],  # DCP re-slices its shards on load
}
SHARDED = [s for s in STAGES if s != "zero0"]  # whose optimizer state is cut per rank


def _run(name: str, ranks: int, stage: str, *more: str, state: bool = False) -> dict:
    """A spec of `ranks` ranks; grad accumulation is left to the resume unless `more` sets it."""
    spec = {
        "name": name,
        "set": [
            f"train.micro_batch_size={MICRO}",
            f"train.max_steps={STEPS}",
            f"train.checkpoint_every={SAVED}",
            *STAGES[stage],
            *more,
        ],
    }
    return spec | ({"state": True} if state else {})


def _writer(ranks: int, stage: str) -> dict:
    return _run(
        f"w{ranks}-{stage}",
        ranks,
        stage,
        f"train.grad_accum_steps={SEQUENCES // (MICRO * ranks)}",
        *_INDEXED.get(f"w{ranks}-{stage}", []),
    )


# data.index_log of the writer and the run that resumed its checkpoint on 3 ranks, in one directory
_INDEXED = {name: ["data.index_log={root}/indices"] for name in ("w2-zero1", "2to3-zero1")}


def _from(writer: str, stage: str) -> str:
    return f"train.resume_from={{root}}/{writer}-{stage}/step_{SAVED:08d}"


@pytest.fixture(scope="module")
def runs(byte_dataset, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("reshard")
    one = [_writer(1, s) for s in STAGES]
    two = [
        *(_writer(2, s) for s in STAGES),
        *(_run(f"1to2-{s}", 2, s, _from("w1", s)) for s in STAGES),
        *(_run(f"kept2-{s}", 2, s, _from("w2", s), state=True) for s in SHARDED),
    ]
    back = [_run(f"2to1-{s}", 1, s, _from("w2", s)) for s in STAGES]
    three = [
        *(_run(f"2to3-{s}", 3, s, _from("w2", s), *_INDEXED.get(f"2to3-{s}", [])) for s in STAGES),
        *(_run(f"cut3-{s}", 3, s, _from("w2", s), state=True) for s in SHARDED),
        # 3 ranks x 3 cannot make 12 a step: allowed, the run goes on with its own batch
        {
            "name": "2to3-changed",
            "set": [
                "train.micro_batch_size=3",
                f"train.max_steps={STEPS}",
                "parallel.zero_stage=2",
                "train.allow_batch_change=true",
                _from("w2", "zero2"),
            ],
        },
    ]
    results = launch(tmp, "one", one, 1, byte_dataset, timeout=600)
    results |= launch(tmp, "two", two, 2, byte_dataset, timeout=900)
    results |= launch(tmp, "back", back, 1, byte_dataset, timeout=600)
    results |= launch(tmp, "three", three, 3, byte_dataset, timeout=900)
    return {"results": results, "root": tmp / "ckpt"}


def _ids(run: dict, steps: int, per_step: int) -> list[int]:
    """The sample ids a run trained on in its first `steps` steps, over all ranks (each rank
    drew `per_step` micro-batches a step; what it read ahead is left out)."""
    return [i for rank in run["ids"] for batch in rank[: steps * per_step] for i in batch]


TRANSITIONS = [(1, 2), (2, 1), (2, 3)]


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("before,after", TRANSITIONS)
def test_a_checkpoint_resumes_on_another_number_of_ranks_as_if_nothing_changed(runs, stage, before, after):
    results = runs["results"]
    fixed, resumed = results[f"w{before}-{stage}"], results[f"{before}to{after}-{stage}"]
    assert resumed["steps"] == list(range(SAVED + 1, STEPS + 1))  # from the checkpoint's step, not from 0
    worst = max(abs(a - b) for a, b in zip(resumed["loss"], fixed["loss"][SAVED:]))
    assert worst < 1e-3, (resumed["loss"], fixed["loss"][SAVED:])
    # Each sample once: what the writer trained on before its checkpoint, then the resumed run,
    # is what the writer trained on in all its steps.
    first = _ids(fixed, SAVED, SEQUENCES // (MICRO * before))
    then = _ids(resumed, STEPS - SAVED, SEQUENCES // (MICRO * after))
    assert len(first) == SAVED * SEQUENCES and len(then) == (STEPS - SAVED) * SEQUENCES
    assert len(set(first + then)) == len(first + then)
    assert sorted(first + then) == sorted(_ids(fixed, STEPS, SEQUENCES // (MICRO * before)))


@pytest.mark.parametrize("stage", SHARDED)
def test_the_optimizer_state_cut_for_three_ranks_is_the_state_two_ranks_saved(runs, stage):
    """Gathered whole after the load: every parameter's fp32 weight, Adam's first and second
    moments, bitwise what the same checkpoint loads into the two ranks that wrote it."""
    kept = torch.load(runs["root"] / f"kept2-{stage}.pt")
    cut = torch.load(runs["root"] / f"cut3-{stage}.pt")
    assert sorted(kept) == sorted(cut) and any(k.endswith("/exp_avg_sq") for k in kept)
    for key, value in kept.items():
        assert torch.equal(value, cut[key]), key
    assert any(v.abs().sum() > 0 for k, v in kept.items() if k.endswith("/exp_avg"))  # trained, not fresh


def test_a_batch_that_cannot_be_kept_goes_on_changed_when_allowed(runs):
    """12 sequences a step cannot be 3 ranks x 3: with train.allow_batch_change the run goes on
    at the nearest, 3 x 3 x 1, from step 9, and reads no sample the writer had trained on."""
    results = runs["results"]
    resumed, fixed = results["2to3-changed"], results["w2-zero2"]
    assert resumed["steps"] == list(range(SAVED + 1, STEPS + 1))
    first = set(_ids(fixed, SAVED, SEQUENCES // (MICRO * 2)))
    then = _ids(resumed, STEPS - SAVED, 1)
    assert len(then) == (STEPS - SAVED) * 3 * 3 and not first & set(then)
    assert abs(resumed["loss"][0] - fixed["loss"][SAVED]) < 0.1  # the trained model, not a fresh one


def test_the_index_log_holds_each_step_as_the_run_that_kept_it_trained_it(runs):
    """The writer (2 ranks) trained steps 1-12 and saved at 8; the resumed run (3 ranks, a later
    worker group) trained 9-12 again. Read back, steps 1-8 are the writer's and 9-12 the resumed
    run's: each replica's micro-batches of the step, replica by replica, as the sources read them."""
    from kiln.data.indices import trained_ids

    results = runs["results"]
    writer, resumed = results["w2-zero1"], results["2to3-zero1"]
    trained = trained_ids(runs["root"] / "indices")
    assert sorted(trained) == list(range(1, STEPS + 1))

    def expected(run: dict, step: int, ranks: int) -> list[int]:  # its micro-batches of that step
        per = SEQUENCES // (MICRO * ranks)
        return [i for rank in run["ids"] for batch in rank[(step - 1) * per : step * per] for i in batch]

    for step in range(1, STEPS + 1):
        run, ranks, first = (writer, 2, 1) if step <= SAVED else (resumed, 3, SAVED + 1)
        assert [i for _, i in trained[step]] == expected(run, step - first + 1, ranks), step
    assert {e for ids in trained.values() for e, _ in ids} == {0}  # 144 of the byte dataset's rows: epoch 0
