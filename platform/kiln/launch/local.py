"""Run the training loop without Ray: one process, or one per rank under torchrun.

This is the same `train_loop` Ray Train runs, fed by `ParquetSource` instead of Ray Data, for
GPU boxes without Ray and for debugging. MLflow is used when it is installed.

CPU smoke:   python -m kiln.launch.local --config jobs/configs/debug.yaml --set train.max_steps=20
Two ranks:   torchrun --nproc-per-node 2 -m kiln.launch.local --config jobs/configs/debug.yaml
One GPU:     python -m kiln.launch.local --config jobs/configs/gpt2-124m.yaml --set parallel.use_gpu=true
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time

import torch

from kiln.clock import process_start, startup_mark
from kiln.config import RunConfig, fork_overrides, load_config
from kiln.core.process import WorldInfo
from kiln.core.sinks import NullLogger, Sinks
from kiln.data.sources import ParquetSource
from kiln.devices import name_deepspeed_accelerator
from kiln.errors import KilnError
from kiln.guard import check_file_target
from kiln.launch.console import run_reporting_errors
from kiln.launch.preflight import preflight
from kiln.launch.resume import lineage, record_run
from kiln.launch.summary import RUN_SUMMARY, Summary
from kiln.parallel.ops import init_distributed, shutdown_distributed
from kiln.parallel.worker import run_worker
from kiln.ports import free_port  # noqa: F401 (tests and benches take it from here too)
from kiln.redact import configure_logging
from kiln.storage import write_whole
from kiln.ui.progress import sink_for

log = logging.getLogger(__name__)


def _world_from_env(use_gpu: bool) -> WorldInfo:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; a lone process gets world size 1,
    whose process group needs no address (`init_distributed` makes it in-process)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if use_gpu:
        if not torch.cuda.is_available():
            raise KilnError("parallel.use_gpu = true but torch sees no CUDA device")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return WorldInfo(
        rank=rank,
        world_size=world,
        device=device,
        local_rank=local,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )


def agree_on_run_name(cfg: RunConfig, world: WorldInfo) -> RunConfig:
    """Take rank 0's run name and storage path on every rank.

    Under torchrun each rank names the run from its own clock, to the second; ranks that start
    either side of a second would write their checkpoint shards into different directories,
    and neither would be complete. (Under Ray the driver names the run once for all workers.)
    """
    if world.world_size == 1:
        return cfg
    import torch.distributed as dist

    chosen = [(cfg.logging.run_name, cfg.train.storage_path)]
    dist.broadcast_object_list(chosen, src=0)
    name, storage = chosen[0]
    return dataclasses.replace(
        cfg,
        logging=dataclasses.replace(cfg.logging, run_name=name),
        train=dataclasses.replace(cfg.train, storage_path=storage),
    )


def _run_root(cfg: RunConfig) -> str:
    """Where this run's checkpoints (and any metrics MLflow never took) are written: a local
    directory (preflight refuses a URL for this launcher)."""
    return cfg.local_run_dir()


def run_local(cfg: RunConfig, started: float | None = None) -> Summary | None:
    """Train in this process; returns the summary on rank 0 (None on other ranks)."""
    started = started or time.time()
    marks = startup_mark("command", started)
    checked = preflight(cfg, local_storage=True, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    cfg, manifest, tracking_uri = checked.cfg, checked.manifest, checked.tracking_uri
    marks |= startup_mark("preflight")
    name_deepspeed_accelerator(cfg.parallel.use_gpu)  # a bad input is refused above, before DeepSpeed speaks
    world = _world_from_env(cfg.parallel.use_gpu)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, num_workers=world.world_size)).validate()
    init_distributed(world.device.type == "cuda")
    cfg = agree_on_run_name(cfg, world)

    run = None
    logger: NullLogger | MLflowLogger = NullLogger()
    if world.rank == 0:
        from kiln.tracking.client import installed

        if not installed():
            log.warning("mlflow is not installed here: metrics go to the console only")
        else:
            from kiln.tracking.mlflow_run import MLflowLogger, open_run

            run = open_run(
                cfg, checked.datasets, tracking_uri, {"num_nodes": 1, "launcher": "local"}, tags=lineage(cfg)
            )
            record_run(cfg, run.run_id, tracking_uri)  # a fork of this run finds its MLflow run
            logger = MLflowLogger(
                tracking_uri, run.run_id, spill_dir=_run_root(cfg), outage_wait_s=cfg.logging.outage_wait_s
            )
            marks |= startup_mark("mlflow")

    def source(dp_rank: int, dp_size: int) -> ParquetSource:
        return ParquetSource(
            checked.datasets,
            dp_rank,
            dp_size,
            cfg.train.micro_batch_size,
            cfg.train.eval_batches,
            seed=cfg.train.seed,
            reshuffle=cfg.data.reshuffle,
            documents=cfg.data.masks_documents,
        )

    ckpt_root = _run_root(cfg)
    with run.finishing() if run is not None else contextlib.nullcontext():
        # The loop shows progress on rank 0 only: a bar when stderr is a terminal, else log lines.
        progress = sink_for(sys.stderr, cfg.logging.progress_every)
        final = run_worker(cfg, checked.model, world, source, Sinks(logger=logger, progress=progress), ckpt_root, marks)
        shutdown_distributed()
        if world.rank != 0:
            return None
        checkpoint = f"{ckpt_root}/step_{final['step']:08d}"
        summary = Summary.of_run(cfg, manifest, final, run.run_id if run else "-", tracking_uri, started, checkpoint)
        if run is not None:
            summary.record(run)
    return summary


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    p = argparse.ArgumentParser(prog="python -m kiln.launch.local", description=__doc__.splitlines()[0])
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--fork", metavar="RUN", default=None)
    p.add_argument("--summary-json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    def command() -> int:
        cfg = load_config(args.config, fork_overrides(args.overrides, args.fork))
        if args.summary_json:  # checked before the run, written whole after it, as `kiln train` does
            check_file_target(args.summary_json, RUN_SUMMARY, f"--summary-json {args.summary_json}")
        summary = run_local(cfg, started=process_start())
        if summary is not None:
            print(summary.render())
            if args.summary_json:
                write_whole(args.summary_json, summary.to_json(), kind=RUN_SUMMARY)
        return 0

    return run_reporting_errors(command)


if __name__ == "__main__":
    sys.exit(main())
