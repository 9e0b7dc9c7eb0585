"""Which engine moves the replicas' data: DeepSpeed's own, or Kiln's around it
(`kiln.parallel.replica_engine`) for PowerSGD and for local SGD or DiLoCo."""

from __future__ import annotations

from kiln.config import RunConfig
from kiln.core.optim import StepGate
from kiln.parallel.deepspeed_engine import DeepSpeedEngine
from kiln.parallel.periodic_sync import PeriodicSync
from kiln.parallel.powersgd import PowerSGDEngine


def own_communication_engine(
    wrapped: DeepSpeedEngine, cfg: RunConfig, gate: StepGate
) -> DeepSpeedEngine | PeriodicSync | PowerSGDEngine:
    """`wrapped`, or around it the engine that moves the replicas' data itself: local SGD or
    DiLoCo (`parallel.sync`), or PowerSGD (`kiln.parallel.replica_engine`)."""
    p, micro_batches = cfg.parallel, cfg.micro_batches_per_step
    if p.sync != "every_step":
        return PeriodicSync(
            wrapped,
            p.sync,
            p.sync_every,
            cfg.train.max_steps,
            gate,
            micro_batches,
            p.outer_lr,
            p.outer_momentum,
            p.grad_compression,
            guard=cfg.train.health.active,
        )
    if p.grad_compression == "powersgd":
        return PowerSGDEngine(
            wrapped,
            gate,
            micro_batches,
            p.powersgd_rank,
            p.powersgd_start_step,
            cfg.train.seed,
            shard=p.zero_stage == 1,
        )
    return wrapped
