"""Optimizers: the `optim` section, the registry of optimizers, and their parameter groups.

Weight decay applies to the groups `optim.no_decay` leaves: by default matmul weights only.
Decaying norm gains, biases and embeddings hurts, as they are not over-parameterised the way
matmuls are. The LR schedule is in kiln.core.schedule.

A new optimizer is one module with its torch optimizer (as `kiln.core.lamb`) and one line in
`OPTIMIZERS`: the config's allowed names, `kiln plan --optimizer`'s choices and the planner's
count of optimizer states all read that table.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.core.lamb import Lamb
from kiln.core.schedule import ScheduleConfig, lr_multiplier
from kiln.errors import ConfigError
from kiln.knobs import check_ranges, choice, knob, span

NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, getattr(nn, "RMSNorm", nn.LayerNorm))
NO_DECAY_KINDS = ("norms", "biases", "embeddings")
Impl = dict[str, bool]  # the fast implementation's flag: fused, on CUDA and on CPU


@dataclass(frozen=True)
class Optimizer:
    """One entry of OPTIMIZERS."""

    build: Callable[[list[dict], OptimConfig, Impl], torch.optim.Optimizer]
    """The torch optimizer over parameter groups, from the `optim` section."""
    states: int
    """fp32 tensors of optimizer state per parameter (Adam's two moments: 2, momentum: 1): the
    memory planner's k."""
    cpu_adam: bool = False
    """Under optimizer offload, step on the host with DeepSpeed's vectorised CPU Adam (5-7x
    torch's Adam on CPU); other optimizers run their own torch step there."""
    decoupled: bool = False
    """Weight decay decoupled from the gradient (AdamW-style) rather than added as L2."""
    fused_on_shards: bool = True
    """torch's fused kernel steps FSDP2's DTensor shards: Adam's and AdamW's have DTensor
    sharding strategies; SGD's has none in torch 2.13 (NotImplementedError at the first step),
    so under FSDP2 it steps with foreach."""


def _betas(o: OptimConfig) -> tuple[float, float]:
    return (o.beta1, o.beta2)


# torch has no fused RMSprop; foreach is its fast path on both devices. Adam's weight decay is
# L2 added to the gradient, not decoupled.
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(
        lambda g, o, impl: torch.optim.AdamW(g, lr=o.lr, betas=_betas(o), eps=o.eps, **impl),
        states=2,
        cpu_adam=True,
        decoupled=True,
    ),
    "adam": Optimizer(
        lambda g, o, impl: torch.optim.Adam(g, lr=o.lr, betas=_betas(o), eps=o.eps, **impl), states=2, cpu_adam=True
    ),
    "sgd": Optimizer(
        lambda g, o, impl: torch.optim.SGD(g, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, **impl),
        states=1,
        fused_on_shards=False,
    ),
    "rmsprop": Optimizer(
        lambda g, o, impl: torch.optim.RMSprop(
            g, lr=o.lr, alpha=o.rmsprop_alpha, eps=o.eps, momentum=o.momentum, foreach=True
        ),
        states=1,
    ),
    "lamb": Optimizer(lambda g, o, impl: Lamb(g, lr=o.lr, betas=_betas(o), eps=o.eps), states=2, decoupled=True),
}


def no_decay_kinds(text: str) -> set[str]:
    return {k.strip() for k in text.split(",") if k.strip()}


@dataclass
class OptimConfig:
    name: str = choice("adamw", OPTIMIZERS)
    """Optimizer: a name in OPTIMIZERS. AdamW and LAMB decouple weight decay from the gradient;
    Adam, SGD and RMSprop add it to the gradient as L2, as each defines it. LAMB is Kiln's own
    (kiln.core.lamb)."""
    lr: float = knob(1e-3, lambda v: 0.0 < v < 10.0, "a number in (0, 10)")
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = knob(0.1, *span(0, 10, "a number"))
    """Weight decay (decoupled for adamw and lamb, L2 for the others), on the groups no_decay leaves."""
    no_decay: str = knob(
        "norms,biases,embeddings",
        lambda v: no_decay_kinds(v) <= set(NO_DECAY_KINDS),
        "a comma list of norms, biases, embeddings (or '')",
    )
    """Comma list of parameter kinds exempt from weight decay: norms, biases, embeddings ('' decays
    all). Decaying norm gains, biases and embeddings hurts: they are not over-parameterised."""
    beta1: float = knob(0.9, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """First-moment decay (Adam, AdamW, LAMB)."""
    beta2: float = knob(0.95, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Second-moment decay (Adam, AdamW, LAMB); 0.95 rather than 0.999 is steadier for LLMs."""
    eps: float = knob(1e-8, *span(0, 1, "a number", lo_open=True))
    """Denominator epsilon (Adam, AdamW, LAMB, RMSprop)."""
    momentum: float = knob(0.9, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Momentum for SGD and RMSprop (0 disables it)."""
    nesterov: bool = False
    """Nesterov momentum for SGD (needs momentum > 0)."""
    rmsprop_alpha: float = knob(0.99, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """RMSprop's decay of the squared-gradient average (torch's default)."""

    def check(self) -> None:
        check_ranges(self, "optim")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):
            raise ConfigError(
                f"optim.nesterov = true with optim.name = {self.name!r} and optim.momentum = "
                f"{self.momentum}: Nesterov needs optim.name = 'sgd' and optim.momentum > 0"
            )

    @property
    def spec(self) -> Optimizer:
        return OPTIMIZERS[self.name]


def parameter_kinds(model: nn.Module, shape_of: Callable[[nn.Parameter], tuple] = lambda p: p.shape) -> dict[int, str]:
    """id(param) -> 'embeddings' | 'norms' | 'biases' | 'matmuls'. A tied weight counts as an
    embedding (it is one, shared with the output head). `shape_of`: a parameter's full shape
    (an engine that partitions weights says how to read it)."""
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
                kind = "matmuls" if len(shape_of(p)) >= 2 else "norms"
            if rank[kind] >= rank.get(kinds.get(id(p), "matmuls"), 0):
                kinds[id(p)] = kind
    return kinds


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay: str = "norms,biases,embeddings",
    shape_of: Callable[[nn.Parameter], tuple] = lambda p: p.shape,
) -> list[dict]:
    exempt = no_decay_kinds(no_decay)
    kinds = parameter_kinds(model, shape_of)
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            (rest if kinds.get(id(p), "matmuls") in exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    # A pipeline stage can hold no matmul at all (say ln_f + tied head); ZeRO drops an empty
    # group after the LR scheduler has counted it, so never hand one over.
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    shape_of: Callable[[nn.Parameter], tuple] = lambda p: p.shape,
    sharded: bool = False,
) -> torch.optim.Optimizer:
    """The torch optimizer of `cfg.name`, over `param_groups`; `sharded`: the parameters are
    FSDP2's DTensors (`Optimizer.fused_on_shards`)."""
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay, shape_of)
    # torch's fused kernels on both devices: on CUDA one launch for all parameters; on CPU
    # AdamW's step took 1.3 ms against foreach's 6.6 for 12 blocks of the debug width, and 57
    # against 251 ms for gpt2-124m (bench/optimizer_step.py).
    fused = not sharded or cfg.spec.fused_on_shards
    return cfg.spec.build(groups, cfg, {"fused": True} if fused else {"foreach": True})


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

    def state_dict(self) -> dict:
        # LambdaLR saves every attribute; the gate is this process's link to the optimizer's
        # patched step, and one loaded from a checkpoint would be a copy that nothing opens.
        return {k: v for k, v in super().state_dict().items() if k != "gate"}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "gate"})


@dataclass(frozen=True)
class Settings:
    """The optimizer's hyperparameters and the schedule's peak LRs as this run's config built
    them, taken before a checkpoint is loaded and put back after it.

    A load brings back the checkpoint's: DeepSpeed restores each param group's hyperparameters
    with the optimizer state, and LambdaLR's `base_lrs` with the schedule's step. A run resumed
    or forked with another `optim.lr`, weight decay, betas or schedule would silently keep the
    old ones. The moments and the step count stay the checkpoint's."""

    groups: tuple[dict, ...]
    base_lrs: tuple[float, ...]

    @classmethod
    def of(cls, scheduler: torch.optim.lr_scheduler.LambdaLR) -> Settings:
        groups = scheduler.optimizer.param_groups
        return cls(tuple({k: v for k, v in g.items() if k != "params"} for g in groups), tuple(scheduler.base_lrs))

    def restore(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        """This run's settings again, and the LR its schedule gives at the loaded step."""
        groups = scheduler.optimizer.param_groups
        if len(groups) != len(self.groups):
            raise ConfigError(
                f"the checkpoint's optimizer has {len(groups)} parameter groups and this run's "
                f"{len(self.groups)}: optim.no_decay must stay as the checkpoint had it"
            )
        scheduler.base_lrs = list(self.base_lrs)
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(self.base_lrs, scheduler.lr_lambdas)]
        for group, was, lr in zip(groups, self.groups, lrs):
            group.update(was)
            group["lr"] = lr
        scheduler._last_lr = lrs  # what get_last_lr() reports until the next step


def build_scheduler(opt: torch.optim.Optimizer, sched: ScheduleConfig, max_steps: int, gate: StepGate | None = None):
    """The LR schedule; with `gate`, one that stands still on withheld steps."""
    lr_lambda = lambda step: lr_multiplier(step, sched, max_steps)  # noqa: E731
    if gate is None:
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return GatedLambdaLR(opt, lr_lambda, gate)
