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
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert dims.describe() == "2 data-parallel x 3 pipeline stages"
    assert ParallelDims(world_size=4).describe() == "4 data-parallel"
    assert ParallelDims.of(ParallelConfig(num_workers=8, pipeline_stages=2), world_size=4).data_parallel_size == 2


def test_a_layout_that_does_not_divide_the_workers_is_refused_naming_both_fields():
    with pytest.raises(ConfigError, match=r"parallel.num_workers = 3 is not a multiple of parallel.pipeline_stages = 2"):
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
    for spelled in ("dp = world_size // stages", "cfg.parallel.num_workers // cfg.parallel.pipeline_stages",
                    "world.world_size // p.pipeline_stages", "n // (p.pipeline_stages * tp)"):
        assert FORMULA.search(spelled), spelled
    assert (KILN / "topology.py").read_text().count("self.world_size // (self.pipeline_stages * self.tensor_parallel)") == 1
