"""The parallel layout has one home: `kiln.topology`. Its arithmetic, its rules, and a grep that
no other module spells the data-parallel formula again."""

import re
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.errors import ConfigError
from kiln.topology import ParallelConfig, ParallelDims

KILN = Path(__file__).resolve().parents[2] / "platform" / "kiln"
# world // stages, workers // (stages * tensor), ... : any integer division of a rank count.
FORMULA = re.compile(r"\b(world_size|num_workers|world)\s*//|//\s*\(?\s*[\w.]*(pipeline_stages|stages)\b")


def test_ranks_divide_into_stages_and_replicas_with_data_varying_fastest():
    dims = ParallelDims(world_size=6, pipeline_stages=3)
    assert dims.data_parallel_size == 2
    # DeepSpeed's (pipe, data) order: ranks 0, 1 are stage 0 of replicas 0, 1.
    assert [(c.data_parallel_rank, c.pipeline_stage) for c in map(dims.coords, range(6))] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (0, 2),
        (1, 2),
    ]
    assert dims.describe() == "2 data-parallel x 3 pipeline stages"
    assert ParallelDims(world_size=4).describe() == "4 data-parallel"
    assert ParallelDims.of(ParallelConfig(num_workers=8, pipeline_stages=2), world_size=4).data_parallel_size == 2


def test_a_layout_that_does_not_divide_the_workers_is_refused_naming_both_fields():
    with pytest.raises(
        ConfigError, match=r"parallel.num_workers = 3 is not a multiple of parallel.pipeline_stages = 2"
    ):
        load_config(None, ["parallel.num_workers=3", "parallel.pipeline_stages=2", "parallel.zero_stage=1"])
    cfg = load_config(None, ["parallel.num_workers=4", "parallel.pipeline_stages=2", "parallel.zero_stage=1"])
    assert cfg.data_parallel_size == cfg.dims.data_parallel_size == 2


def test_the_data_parallel_formula_is_written_once():
    found = []
    for path in sorted(KILN.rglob("*.py")):
        if path.name == "topology.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FORMULA.search(line.split("#")[0]):
                found.append(f"{path.relative_to(KILN)}:{n}: {line.strip()}")
    assert found == [], "ask kiln.topology.ParallelDims instead:\n" + "\n".join(found)
    # The grep itself: it finds the spellings it is meant to find.
    for spelled in (
        "dp = world_size // stages",
        "cfg.parallel.num_workers // cfg.parallel.pipeline_stages",
        "world.world_size // p.pipeline_stages",
        "n // (p.pipeline_stages * tp)",
    ):
        assert FORMULA.search(spelled), spelled
    assert (KILN / "topology.py").read_text().count(
        "self.world_size // (self.pipeline_stages * self.tensor_parallel)"
    ) == 1


def test_tensor_parallel_groups_are_consecutive_ranks_inside_replicas():
    dims = ParallelDims(world_size=8, tensor_parallel=2)
    assert dims.data_parallel_size == 4
    # DeepSpeed's (data, tensor) mesh: ranks 0, 1 are replica 0's two tensor-parallel ranks.
    assert [(c.data_parallel_rank, c.tensor_parallel_rank) for c in map(dims.coords, range(4))] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert dims.describe() == "4 data-parallel x 2 tensor-parallel"
    assert ParallelDims.of(ParallelConfig(num_workers=4, tensor_parallel=2, zero_stage=1)).data_parallel_size == 2


def test_tensor_parallel_splits_only_whole_heads_inside_a_node():
    dims = ParallelDims(world_size=8, tensor_parallel=4)
    assert dims.model_problem(n_head=32, kv_heads=8, ffn_hidden=11008) is None
    assert "does not divide model n_head = 6" in dims.model_problem(6, 6, 512)
    assert "does not divide model n_kv_head (key/value heads) = 2" in dims.model_problem(8, 2, 512)
    assert dims.node_problem(ranks_per_node=8) is None
    assert "would span nodes" in dims.node_problem(ranks_per_node=2)
    assert dims.node_problem(ranks_per_node=2, tp_within_node=False) is None
    assert (
        ParallelDims(3, tensor_parallel=2)
        .problem()
        .startswith("parallel.num_workers = 3 is not a multiple of parallel.pipeline_stages x parallel.tensor_parallel")
    )


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["parallel.pipeline_stages=2", "parallel.zero_stage=1"], "pipeline engine does not apply AutoTP"),
        (["parallel.zero_stage=3"], "zero_stage = 3"),
        (["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"], "ZeRO-Offload"),
    ],
)
def test_tensor_parallel_with_what_kiln_cannot_serve_is_refused(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["parallel.num_workers=4", "parallel.tensor_parallel=2", *sets])


def test_a_cluster_whose_nodes_cannot_hold_a_tensor_parallel_group_is_refused_before_launch():
    from kiln.launch.on_ray import check_tensor_parallel_nodes

    cfg = load_config(None, ["parallel.num_workers=4", "parallel.tensor_parallel=4", "parallel.zero_stage=1"])
    two_cpus = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 2.0}}]
    with pytest.raises(ConfigError, match=r"tensor_parallel = 4 with 2 rank\(s\) per node.*holds 2 worker"):
        check_tensor_parallel_nodes(cfg, two_cpus)
    check_tensor_parallel_nodes(cfg, [*two_cpus, {"Alive": True, "Resources": {"CPU": 4.0}}])  # one node fits
    loose = load_config(
        None,
        [
            "parallel.num_workers=4",
            "parallel.tensor_parallel=4",
            "parallel.zero_stage=1",
            "parallel.tp_within_node=false",
        ],
    )
    check_tensor_parallel_nodes(loose, two_cpus)
    # GPU workers on nodes without GPUs: no node holds any rank, let alone a group
    on_gpus = load_config(
        None, ["parallel.num_workers=2", "parallel.tensor_parallel=2", "parallel.zero_stage=1", "parallel.use_gpu=true"]
    )
    with pytest.raises(ConfigError, match=r"tensor_parallel = 2 with 0 rank\(s\) per node.*holds 0 worker"):
        check_tensor_parallel_nodes(on_gpus, two_cpus)


def test_an_elastic_run_names_its_range_and_keeps_the_batch_of_its_most_workers():
    """[min, max] in YAML or `--set` makes a run elastic; the layout, the planner's memory
    (its smallest group holds the most each) and Ray Train's scaling read min and max."""
    cfg = load_config(None, ["parallel.num_workers=[1, 2]", "model.vocab_size=256", "model.seq_len=64"])
    p = cfg.parallel
    assert (p.num_workers, p.min_workers, p.max_workers, p.elastic) == ([1, 2], 1, 2, True)
    assert cfg.dims.world_size == 2 and not load_config(None, ["parallel.num_workers=2"]).parallel.elastic
    from kiln.plan.memory import plan_input

    assert plan_input(cfg, cfg.model.shape(), 1.0).world_size == 1
    from kiln.core.resize import sized_for

    # 2 workers x 1 micro-batch at most: 1 worker runs 2 micro-batches a step, the same batch
    assert sized_for(cfg, ParallelDims(1)).micro_batches_per_step == 2 and sized_for(cfg, ParallelDims(2)) is None


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["parallel.num_workers=[3, 2]"], "parallel.num_workers = [3, 2]: expected [min, max] with min <= max"),
        (["parallel.num_workers=[1, 2, 3]"], "parallel.num_workers = [1, 2, 3]: expected [min, max]"),
        (["parallel.num_workers=[0, 2]"], "parallel.num_workers = [0, 2] is out of range"),
        (["parallel.num_workers=[2, 4]", "parallel.pipeline_stages=2"], "needs parallel.pipeline_stages = 1"),
        (
            ["parallel.num_workers=[1, 3]"],
            "which 2 workers cannot share evenly; set train.grad_accum_steps to a multiple of 2",
        ),
        (["parallel.num_workers=[2, 4]", "train.grad_accum_steps=2"], "a multiple of 3"),
    ],
)
def test_an_elastic_range_that_cannot_work_is_refused_in_one_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert needle in str(e.value)
    if "share evenly" in needle:  # the batch may change instead, when the user says so
        assert load_config(None, [*sets, "train.allow_batch_change=true"]).parallel.elastic
