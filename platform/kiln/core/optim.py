"""Optimizers and their parameter groups.

Weight decay applies to the groups `optim.no_decay` leaves: by default matmul weights only.
Decaying norm gains, biases and embeddings hurts, as they are not over-parameterised the way
matmuls are. The LR schedule is in kiln.core.schedule.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kiln.config import OptimConfig, ScheduleConfig, no_decay_kinds
from kiln.core.lamb import Lamb
from kiln.core.schedule import lr_multiplier

NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, getattr(nn, "RMSNorm", nn.LayerNorm))


def parameter_kinds(model: nn.Module) -> dict[int, str]:
    """id(param) -> 'embeddings' | 'norms' | 'biases' | 'matmuls'. A tied weight counts as an
    embedding (it is one, shared with the output head)."""
    kinds: dict[int, str] = {}
    rank = {"matmuls": 0, "biases": 1, "norms": 2, "embeddings": 3}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                kind = "embeddings"
            elif name == "bias":
                kind = "biases"
            elif isinstance(module, NORMS):
                kind = "norms"
            else:
                # A ZeRO-3 partitioned weight is a flat shard; its real shape is `ds_shape`.
                kind = "matmuls" if len(getattr(p, "ds_shape", p.shape)) >= 2 else "norms"
            if rank[kind] >= rank.get(kinds.get(id(p), "matmuls"), 0):
                kinds[id(p)] = kind
    return kinds


def param_groups(model: nn.Module, weight_decay: float, no_decay: str = "norms,biases,embeddings") -> list[dict]:
    exempt = no_decay_kinds(no_decay)
    kinds = parameter_kinds(model)
    decay, rest = [], []
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            (rest if kinds.get(id(p), "matmuls") in exempt else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    # A pipeline stage can hold no matmul at all (say ln_f + tied head); ZeRO drops an empty
    # group after the LR scheduler has counted it, so never hand one over.
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig, on_cuda: bool) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay)
    # fused kernels on CUDA (one launch for all params); foreach on CPU.
    impl = {"fused": True} if on_cuda else {"foreach": True}
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **impl)
    if cfg.name == "adam":
        # Adam's weight decay is L2 added to the gradient, not decoupled.
        return torch.optim.Adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **impl)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **impl)
    if cfg.name == "rmsprop":
        # torch has no fused RMSprop; foreach is its fast path on both devices.
        return torch.optim.RMSprop(groups, lr=cfg.lr, alpha=cfg.rmsprop_alpha, eps=cfg.eps,
                                   momentum=cfg.momentum, foreach=True)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


class StepGate:
    """Whether the optimizer step under way may change the weights.

    DeepSpeed takes the step inside `engine.step()` (clipping, ZeRO's partitions, the fp32
    master copy), so the only place Kiln can withhold it, without reaching into ZeRO's internals,
    is the torch optimizer at the bottom of that stack: `gate_optimizer` makes its `step` a no-op
    while the gate is shut, and `GatedLambdaLR` holds the schedule still with it. The health
    guard shuts the gate when the step's verdict is bad; DeepSpeed zeroes the gradients as usual.
    """

    def __init__(self):
        self.open = True
        self.withheld = 0  # steps the gate kept from the optimizer


def gate_optimizer(opt: torch.optim.Optimizer, gate: StepGate) -> torch.optim.Optimizer:
    """`opt`, its `step` a no-op while `gate` is shut (the instance's own step, patched: any
    wrapper around it, DeepSpeed's or an LR scheduler's, calls through this)."""
    inner = opt.step

    def step(self, *args, **kwargs):
        if gate.open:
            return inner(*args, **kwargs)
        gate.withheld += 1
        return None

    opt.step = types.MethodType(step, opt)  # a bound method, as LR schedulers expect to wrap
    return opt


class GatedLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR that does not advance on a step the gate withheld: the schedule counts steps taken."""

    def __init__(self, opt: torch.optim.Optimizer, lr_lambda, gate: StepGate):
        self.gate = gate
        super().__init__(opt, lr_lambda)

    def step(self, *args, **kwargs):
        if self.gate.open:
            super().step(*args, **kwargs)


def build_scheduler(opt: torch.optim.Optimizer, sched: ScheduleConfig, max_steps: int,
                    gate: StepGate | None = None):
    """The LR schedule; with `gate`, one that stands still on withheld steps."""
    lr_lambda = lambda step: lr_multiplier(step, sched, max_steps)  # noqa: E731
    if gate is None:
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return GatedLambdaLR(opt, lr_lambda, gate)
