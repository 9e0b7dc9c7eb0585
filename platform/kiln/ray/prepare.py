"""`kiln data prepare` on Ray: the units of work through a pool of Ray Data actors.

    units (from the listing) -> map_batches(_UnitActor): read, tokenize, pack, shuffle, write
    shards -> each unit's record back to the driver -> manifest last (kiln.data.prepare)

Each actor builds its tokenizer once and writes its unit's shards itself, so the driver holds
only records and the shards are written in parallel, to local disk or S3. A row carries where
its unit lies in the listing's spill (`kiln.data.listing`), so an actor holds the unit it runs,
not the listing. A unit's output does not depend on which actor ran it, so any number of actors
gives the same dataset.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Iterator

import numpy as np

from kiln.data.listing import UnitRef
from kiln.data.prepare import Executor, run_here
from kiln.data.shards import UnitJob, UnitWorker
from kiln.errors import DataError, KilnError

log = logging.getLogger(__name__)


class _UnitActor:
    """One tokenizer; the units it is handed, one batch (of one unit's place in the spill) at a time."""

    def __init__(self, job: UnitJob):
        import ray

        # One tokenizer thread: the actor has one CPU, and HF tokenizers would start a thread per
        # core and oversubscribe the node. Set here, in the actor's own process, which tokenizers
        # reads at each encode, rather than by a runtime_env, whose agent would set up a
        # separate worker environment for the actors (their start, and its CPU, on every node).
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.worker = UnitWorker(job)
        self.where = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        records = []
        for blob in batch["unit"]:
            try:
                records.append(json.dumps(self.worker(pickle.loads(blob).load()) | self.where))
            except KilnError as e:  # a bad input: its message reaches the user as it is
                records.append(json.dumps({"error": str(e), "type": type(e).__name__}))
        return {"record": np.array(records, dtype=object)}


def on_ray(address: str | None = None, workers: int = 0) -> Executor:
    """The executor that runs units on Ray: the cluster at `address` (or $RAY_ADDRESS), else an
    embedded one; `workers` tokenizer actors (0: one per CPU of the cluster), never more than
    there are units. One unit and no cluster: it runs here, where Ray would only add its start."""

    def run(job: UnitJob, units: list[UnitRef]) -> Iterator[dict]:
        where = address or os.environ.get("RAY_ADDRESS")
        if len(units) <= 1 and not where:
            log.info("one unit of work: tokenizing in this process")
            return run_here(job, units)
        import ray

        started = _connect(where)  # now, not at the first record: Ray's start is not the pipeline's time
        n = min(len(units), workers or max(1, int(ray.cluster_resources().get("CPU", 1))))
        log.info("preparing %d units with %d tokenizer actors on Ray", len(units), n)
        return _records(job, units, n, started)

    return run


ACTOR_START_S = 300  # the longest a tokenizer actor may take to start (a node's runtime env
# included) before the prepare gives up on a cluster that cannot place them all


def _records(job: UnitJob, units: list[UnitRef], n: int, started: bool) -> Iterator[dict]:
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # Kiln draws its own bar over bytes, rows and tokens/s
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "bars disabled"
    ctx.print_on_execution_start = False
    # Ray Data's poll of each map worker's USS, every second, in the actor (it reads the
    # process's smaps): CPU taken from the tokenizer for a figure Kiln does not use.
    ctx.memory_usage_poll_interval_s = None
    # Every actor up before the first unit is handed out: otherwise the first ones to start take
    # all the units of a small corpus, and the pool (and its nodes) go half unused. They start
    # together, so this waits for the slowest start, not their sum.
    # (Where the cluster has fewer CPUs than actors asked for, say an autoscaling one, nothing
    # waits: the units go to the actors as they come.)
    fits = n <= int(ray.cluster_resources().get("CPU", 0))
    waited, ctx.wait_for_min_actors_s = ctx.wait_for_min_actors_s, ACTOR_START_S if fits else -1
    # Each row carries where its unit lies in the listing's spill (a few dozen bytes), and the
    # actor reads the unit from there: the driver never holds the units, and an actor holds
    # the one it runs (shipping the listing to every actor made its memory grow with the corpus).
    ds = ray.data.from_items([{"unit": pickle.dumps(u)} for u in units], override_num_blocks=len(units))
    # One CPU per actor (and its tokenizer on one thread: _UnitActor). The actors spread over the
    # nodes, whose disks and network each read and write a share: Ray Data's own default
    # (DataContext.scheduling_strategy, "SPREAD"; passing it through map_batches is deprecated).
    out = ds.map_batches(
        _UnitActor,
        fn_constructor_kwargs={"job": job},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=n),
        num_cpus=1,
        batch_format="numpy",
    )
    try:
        for row in out.iter_rows():
            rec = json.loads(row["record"])
            if "error" in rec:
                raise DataError(rec["error"])
            yield rec
    except ray.exceptions.GetTimeoutError:
        free = int(ray.available_resources().get("CPU", 0))
        raise KilnError(
            f"the cluster did not start {n} tokenizer actors (one CPU each) in {ACTOR_START_S} s; "
            f"{free} CPU(s) are free now: lower --workers, or add nodes"
        ) from None
    finally:
        ctx.wait_for_min_actors_s = waited
        if started:
            ray.shutdown()


def _connect(address: str | None) -> bool:
    """Join `address`, or start an embedded Ray; whether this call started one (to stop)."""
    import ray

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset notices
    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, logging_level=logging.ERROR)
        except ConnectionError as e:
            raise KilnError(
                f"could not join the Ray cluster at {address}: {e}. A cluster started with `ray start "
                "--head` uses token auth: set RAY_AUTH_MODE=token"
            ) from None
        return False
    log.info("starting an embedded local Ray (no cluster address given)")
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, logging_level=logging.ERROR)
    return True
