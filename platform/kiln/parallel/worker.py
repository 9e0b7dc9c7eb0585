"""The one worker set-up every launcher calls: this rank's rows, the engine, the loop.

A launcher says who the worker is (`WorldInfo`), how it reads its rows (a factory of a
`BatchSource` for a data-parallel rank) and where its output goes (`Sinks`); `run_worker` does
the rest, in the same order everywhere. The Ray Train worker (`kiln.ray.trainer`) and the local
launcher (`kiln.launch.local`) are each a few lines around it, and so is a third launcher.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.clock import startup_mark
from kiln.config import RunConfig
from kiln.core.loop import train_loop
from kiln.core.process import WorldInfo
from kiln.core.sinks import Sinks
from kiln.data.sources import BatchSource
from kiln.model import GPTConfig
from kiln.parallel.engine import build_engine
from kiln.topology import ParallelDims

SourceFactory = Callable[[int, int], BatchSource]  # (data-parallel rank, data-parallel size) -> rows


def run_worker(
    cfg: RunConfig,
    mcfg: GPTConfig,
    world: WorldInfo,
    make_source: SourceFactory,
    sinks: Sinks,
    checkpoint_root: str | None,
    startup: dict[str, float],
) -> dict[str, float]:
    """Train this rank's share of the run; the loop's final metrics.

    The rows are chosen by data-parallel rank (`kiln.topology`): the stages of one pipeline
    read the same batches, so a restarted group resumes at the exact row its checkpoint
    recorded. The engine is built after the source, so the source's start-up overlaps it.
    """
    dims = ParallelDims.of(cfg.parallel, world.world_size)
    source = make_source(dims.coords(world.rank).data_parallel_rank, dims.data_parallel_size)
    engine, scheduler = build_engine(cfg, mcfg, world)
    return train_loop(
        cfg, mcfg, world, engine, scheduler, source, sinks, checkpoint_root, startup | startup_mark("engine")
    )
