"""A sweep file: a base run config, a search space over any of its fields, and how to search.

    name: optimizers-x-schedules
    base: ../debug.yaml                 # a run config, relative to this file
    overrides: {train.max_steps: 60}    # like --set, on the base
    space:                              # dotted field -> one distribution
      optim.name: {grid: [sgd, adamw]}
      optim.lr: {loguniform: [1.0e-4, 1.0e-2]}
    conditional:                        # fixed values whenever a sampled field takes a value
      optim.name=sgd: {optim.lr: 0.3}
    search: random                      # random | grid | optuna
    scheduler: {name: asha, grace_period: 10}
    metric: loss/val
    mode: min

Everything is checked before any trial starts: each field the space names must exist, and each
value a trial could draw is validated against that field like a run config would be.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kiln import yamlfile
from kiln.config import RunConfig
from kiln.errors import ConfigError
from kiln.knobs import build_section, flatten, parse_override, set_dotted, span
from kiln.storage import absolute, is_url

STATE_FILE = "kiln-sweep.json"  # beside Tune's experiment state: what `--resume` restarts from

KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
MAX_TRIALS = 10_000  # a sweep that would start more is a typo (a grid multiplies), not a plan
# What every trial reports to Tune: the loop's metrics (kiln.core.loop, kiln.core.meter).
REPORTED = (
    "loss/val",
    "loss/train",
    "throughput/tokens_per_s",
    "throughput/tokens_per_s_per_device",
    "mfu",
    "grad_norm",
    "lr",
    "time/step_s",
    "tokens/seen",
)


@dataclass
class SchedulerConfig:
    name: Literal["fifo", "asha", "median", "pbt"] = "asha"
    """Trial scheduler: fifo runs every trial to the end; asha (async successive halving) and
    median (median stopping rule) stop trials that trail the others at the same step; pbt
    (population-based training) restarts a trailing trial from a leading trial's checkpoint with
    mutated settings (kiln.sweep.pbt)."""
    grace_period: int = 10
    """Optimizer steps every trial runs before it can be stopped (ASHA's first rung)."""
    reduction_factor: float = 2.0
    """ASHA: keep the best 1/reduction_factor of trials at each rung."""
    min_samples_required: int = 3
    """median: trials that must have reached a step before the rule compares at it."""
    perturbation_interval: int = 0
    """pbt: optimizer steps between a trial's exploit-or-explore decisions; 0 takes the base's
    train.checkpoint_every (a decision needs a checkpoint to fork from, so a multiple of it)."""
    quantile_fraction: float = 0.25
    """pbt: the bottom fraction of trials that copy one of the top fraction (Tune's default)."""
    synch: bool = False
    """pbt: decide only when every trial has reached the same step (Tune's synchronous PBT,
    Jaderberg et al.'s appendix A.1): slower, as trials wait for the last one, but each decision
    sees the whole population, so the bottom trials always copy the top ones."""
    resample_probability: float = 0.25
    """pbt: chance that a mutated field is drawn afresh from its space entry rather than moved
    (x0.8 or x1.2, or the neighbouring choice); either way it stays within the entry's bounds."""


@dataclass
class TrialResources:
    num_workers: int = 2
    """Ray Train workers per trial (parallel.num_workers of every trial)."""
    cpus_per_worker: float = 1.0
    """Logical CPUs per worker; fractional or oversubscribed values are fine on small nodes."""
    use_gpu: bool = False
    """One GPU per worker."""


@dataclass
class SweepConfig:
    name: str = ""
    """Sweep name: the Tune experiment under storage_path and the MLflow parent run."""
    base: str = ""
    """Run config YAML every trial starts from (a path relative to the sweep file)."""
    overrides: dict = field(default_factory=dict)
    """Dotted field -> value, applied to the base like --set."""
    space: dict = field(default_factory=dict)
    """Dotted field -> {choice|grid: [values]} or {uniform|loguniform|randint: [low, high]}."""
    conditional: dict = field(default_factory=dict)
    """'field=value' -> {dotted field: value}: fixed settings applied when a trial draws that value
    (say, SGD's learning rate when optim.name=sgd)."""
    search: Literal["random", "grid", "optuna"] = "random"
    """Search algorithm. grid needs every space entry to be grid or choice; optuna needs the
    optuna package installed."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Early stopping of trials."""
    num_samples: int = 1
    """Trials to draw (random, optuna), or repeats of the whole grid."""
    metric: str = "loss/val"
    """Metric that ranks trials; trials report it every train.eval_every steps."""
    mode: Literal["min", "max"] = "min"
    """Whether lower or higher metric is better."""
    max_concurrent_trials: int = 1
    """Trials running at once. Each needs resources_per_trial, plus CPUs for Ray Data."""
    resources_per_trial: TrialResources = field(default_factory=TrialResources)
    """Workers and CPUs/GPUs of every trial (they override the base's parallel section)."""
    storage_path: str = "runs/sweeps"
    """Where Tune keeps the sweep's state (resume reads it from here): a local path or s3://."""
    seed: int = 0
    """Seed of the random search (the trials' own seed is the base's train.seed)."""


@dataclass
class Sweep:
    """A loaded, validated sweep: its config plus the resolved base run-config tree."""

    config: SweepConfig
    base_tree: dict[str, Any]
    source: str

    @property
    def base_config(self) -> RunConfig:
        return build_section(RunConfig, copy.deepcopy(self.base_tree)).validate()

    def trial_config(self, params: dict[str, Any]) -> RunConfig:
        return trial_config(self.base_tree, params, self.config.conditional)

    def to_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "base_tree": self.base_tree, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sweep:
        return cls(build_section(SweepConfig, d["config"]), d["base_tree"], d["source"])


def trial_config(base_tree: dict[str, Any], params: dict[str, Any], conditional: dict[str, Any]) -> RunConfig:
    """The run config of one trial: the base, the drawn params, then matching conditionals."""
    tree = copy.deepcopy(base_tree)
    for dotted, value in params.items():
        set_dotted(RunConfig, tree, dotted, value)
    for cond, fixed in conditional.items():
        key, want = cond.split("=", 1)
        if str(params.get(key.strip())) == want.strip():
            for dotted, value in fixed.items():
                set_dotted(RunConfig, tree, dotted, value)
    cfg = build_section(RunConfig, tree).validate()
    return cfg


def load_sweep(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Sweep:
    """Read and validate a sweep file; `overrides` are `a.b=c` on the sweep file itself."""
    p = Path(path)
    raw = yamlfile.read_mapping(p, f"sweep file {str(p)!r}")
    for text in overrides:
        key, value = parse_override(text)
        head, _, rest = key.partition(".")
        if head in ("overrides", "space", "conditional") and rest:  # their keys are dotted fields
            raw.setdefault(head, {})[rest] = value
            continue
        node = raw
        *parents, last = key.split(".")
        for i, k in enumerate(parents):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parents[: i + 1])!r} is not a section of the sweep file")
        node[last] = value
    cfg = build_section(SweepConfig, raw, "sweep")
    if not cfg.name.strip():
        raise ConfigError(f"sweep file {str(p)!r}: 'name' is empty; expected a name for the sweep")
    if not cfg.base:
        raise ConfigError(f"sweep file {str(p)!r}: 'base' is empty; expected a run config path")
    base_path = (p.parent / cfg.base) if not os.path.isabs(cfg.base) else Path(cfg.base)
    if not base_path.is_file():
        raise ConfigError(
            f"sweep.base = {cfg.base!r}: {str(base_path)!r} does not exist; expected a run "
            "config YAML, relative to the sweep file"
        )
    base_tree = yamlfile.read_mapping(base_path, f"sweep.base {str(base_path)!r}")
    for dotted, value in cfg.overrides.items():
        set_dotted(RunConfig, base_tree, dotted, value)
    r = cfg.resources_per_trial
    for key, value in (("num_workers", r.num_workers), ("cpus_per_worker", r.cpus_per_worker), ("use_gpu", r.use_gpu)):
        set_dotted(RunConfig, base_tree, f"parallel.{key}", value)
    sweep = Sweep(cfg, base_tree, str(p))
    validate(sweep)
    return sweep


def validate(sweep: Sweep) -> None:
    cfg = sweep.config
    base = sweep.base_config  # the base itself must be a valid run config
    if not cfg.space:
        raise ConfigError("sweep.space is empty: expected at least one field to search over")
    for key, value in (
        ("num_samples", cfg.num_samples),
        ("max_concurrent_trials", cfg.max_concurrent_trials),
        ("scheduler.grace_period", cfg.scheduler.grace_period),
        ("resources_per_trial.num_workers", cfg.resources_per_trial.num_workers),
    ):
        ok, allowed = span(1, 100_000)
        if not ok(value):
            raise ConfigError(f"sweep.{key} = {value} is out of range: expected {allowed}")
    trials = expected_trials(cfg)
    if trials > MAX_TRIALS:
        raise ConfigError(
            f"sweep: num_samples x the grid's sizes is {trials:,} trials; expected at most {MAX_TRIALS:,}"
        )
    if cfg.metric not in REPORTED:
        raise ConfigError(
            f"sweep.metric = {cfg.metric!r} is not a metric trials report; expected one of {list(REPORTED)}"
        )
    if cfg.scheduler.name == "pbt":
        _check_pbt(cfg, base)
    if cfg.scheduler.reduction_factor <= 1:
        raise ConfigError(f"sweep.scheduler.reduction_factor = {cfg.scheduler.reduction_factor}: expected > 1")
    if cfg.scheduler.grace_period > base.train.max_steps:
        raise ConfigError(
            f"sweep.scheduler.grace_period = {cfg.scheduler.grace_period} exceeds train.max_steps = "
            f"{base.train.max_steps}: expected a step within the run"
        )
    if cfg.metric.startswith("loss/val") and not base.train.eval_every:
        raise ConfigError(
            f"sweep.metric = {cfg.metric!r} needs train.eval_every > 0 in the base, so that trials "
            "report it while they train (the scheduler compares trials at those steps)"
        )
    for dotted, spec in cfg.space.items():
        _check_entry(sweep, str(dotted), spec)
        if cfg.search == "grid" and next(iter(spec)) not in ("grid", "choice"):
            raise ConfigError(
                f"sweep.space.{dotted} is {next(iter(spec))}: search 'grid' needs every space "
                "entry to be grid or choice (or use search: random)"
            )
    for cond, fixed in cfg.conditional.items():
        if "=" not in str(cond) or not isinstance(fixed, dict):
            raise ConfigError(f"sweep.conditional.{cond}: expected 'field=value: {{field: value, ...}}'")
        key, want = str(cond).split("=", 1)
        _check_field(sweep, key.strip(), "sweep.conditional")
        for dotted, value in fixed.items():
            _try(sweep, {key.strip(): _typed(want.strip()), dotted: value}, f"sweep.conditional.{cond}.{dotted}")
    if cfg.search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise ConfigError("sweep.search = 'optuna' needs the optuna package: pip install optuna") from None


# What a fork can change in a running trial: the optimizer's hyperparameters, the schedule and
# clipping. Anything else (the model, the optimizer itself, the batch, the data) a checkpoint
# cannot take, or a trial would no longer be comparable with the others at the same step.
PBT_MUTABLE = (
    "optim.lr",
    "optim.weight_decay",
    "optim.beta1",
    "optim.beta2",
    "optim.eps",
    "optim.momentum",
    "optim.rmsprop_alpha",
    "schedule.",
    "train.grad_clip",
)


def _check_pbt(cfg: SweepConfig, base: RunConfig) -> None:
    """PBT forks trials from their checkpoints while they train (kiln.sweep.pbt): it needs
    checkpoints, the metric at each of them, fields a fork can change, and storage a fork reads."""
    s, t = cfg.scheduler, base.train
    if not t.checkpoint_every:
        raise ConfigError(
            "sweep.scheduler.name = 'pbt' forks trials from their checkpoints: set train.checkpoint_every "
            "> 0 in the base (the steps between a trial's exploit-or-explore decisions)"
        )
    if cfg.metric == "loss/val" and t.checkpoint_every % t.eval_every:
        raise ConfigError(
            f"sweep.scheduler.name = 'pbt' compares trials at their checkpoints: train.checkpoint_every = "
            f"{t.checkpoint_every} must be a multiple of train.eval_every = {t.eval_every}, so that each "
            "checkpoint's report carries loss/val"
        )
    if cfg.metric == "loss/val" and t.checkpoint_every_minutes:
        raise ConfigError(
            f"train.checkpoint_every_minutes = {t.checkpoint_every_minutes:g} with sweep.scheduler.name = 'pbt': "
            "a timed checkpoint falls between evaluations, where a report carries no loss/val for PBT to "
            "compare; expected 0 (PBT's checkpoints come every train.checkpoint_every steps)"
        )
    interval = s.perturbation_interval or t.checkpoint_every
    if interval % t.checkpoint_every or interval >= t.max_steps:
        raise ConfigError(
            f"sweep.scheduler.perturbation_interval = {s.perturbation_interval}: expected a multiple of "
            f"train.checkpoint_every = {t.checkpoint_every} below train.max_steps = {t.max_steps} (0 takes "
            "train.checkpoint_every)"
        )
    if not 0 < s.quantile_fraction <= 0.5:
        raise ConfigError(f"sweep.scheduler.quantile_fraction = {s.quantile_fraction}: expected a number in (0, 0.5]")
    if not 0 <= s.resample_probability <= 1:
        raise ConfigError(
            f"sweep.scheduler.resample_probability = {s.resample_probability}: expected a number in [0, 1]"
        )
    if expected_trials(cfg) < 2:
        raise ConfigError(
            "sweep.scheduler.name = 'pbt' copies one trial into another: expected at least 2 trials "
            "(sweep.num_samples, times the grid)"
        )
    for dotted in cfg.space:
        if not any(dotted == m or (m.endswith(".") and dotted.startswith(m)) for m in PBT_MUTABLE):
            raise ConfigError(
                f"sweep.space.{dotted}: PBT changes a trial's settings while it trains, by a fork from a "
                f"checkpoint, which can change {', '.join(m + '*' if m.endswith('.') else m for m in PBT_MUTABLE)} "
                f"only; search {dotted} with asha, median or fifo"
            )
    if is_url(cfg.storage_path):
        raise ConfigError(
            f"sweep.storage_path = {cfg.storage_path!r}: PBT forks a trial from another's checkpoint "
            "by path, which Kiln reads from a local or shared disk only so far; give a shared directory"
        )


def _typed(text: str) -> Any:
    return yamlfile.load_text(text, "sweep.conditional")


def _check_field(sweep: Sweep, dotted: str, where: str) -> None:
    try:
        set_dotted(RunConfig, copy.deepcopy(sweep.base_tree), dotted, None)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if dotted not in flatten(dataclasses.asdict(sweep.base_config)):
        raise ConfigError(f"{where}: {dotted!r} is not a field of the run config")


def _try(sweep: Sweep, params: dict[str, Any], where: str) -> None:
    try:
        trial_config(sweep.base_tree, params, {})
    except ConfigError as e:
        raise ConfigError(f"{where}: a trial would get {e}") from None


def _check_entry(sweep: Sweep, dotted: str, spec: Any) -> None:
    where = f"sweep.space.{dotted}"
    _check_field(sweep, dotted, where)
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"{where} = {spec!r}: expected one of {{{', '.join(k + ': ...' for k in KINDS)}}}")
    kind, arg = next(iter(spec.items()))
    if kind in ("choice", "grid"):
        if not isinstance(arg, list) or not arg:
            raise ConfigError(f"{where}.{kind} = {arg!r}: expected a non-empty list of values")
        for value in arg:
            _try(sweep, {dotted: value}, f"{where}.{kind} value {value!r}")
        return
    if not (
        isinstance(arg, list)
        and len(arg) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in arg)
    ):
        raise ConfigError(f"{where}.{kind} = {arg!r}: expected [low, high] numbers")
    low, high = arg
    if kind in ("uniform", "loguniform") and _field_type(dotted) is int:
        raise ConfigError(
            f"{where}: {dotted} is an integer field and {kind} draws fractions; use randint [low, high) or choice"
        )
    if low >= high:
        raise ConfigError(f"{where}.{kind} = [{low}, {high}]: low must be below high")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}.loguniform = [{low}, {high}]: low must be > 0 for a log scale")
    if kind == "randint":
        if not all(isinstance(v, int) for v in arg):
            raise ConfigError(f"{where}.randint = {arg!r}: expected integers [low, high), high exclusive")
        high = high - 1
    for value in (low, high):  # PBT's mutations stay within these bounds (kiln.sweep.pbt)
        _try(
            sweep,
            {dotted: value},
            f"{where}.{kind} bound {value!r}"
            + (" (PBT mutates the field within it)" if sweep.config.scheduler.name == "pbt" else ""),
        )


def _field_type(dotted: str) -> Any:
    """The annotated type of a dotted RunConfig field (None for a free-form one)."""
    import typing

    cls: Any = RunConfig
    for key in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        cls = typing.get_type_hints(cls).get(key)
    return cls


def grid_axes(cfg: SweepConfig) -> dict[str, list]:
    """The axes Tune enumerates in full, every value once per sample: each `grid`, and each
    `choice` when `search: grid`."""
    axes = {}
    for dotted, spec in cfg.space.items():
        kind, arg = next(iter(spec.items()))
        if kind == "grid" or (kind == "choice" and cfg.search == "grid"):
            axes[dotted] = list(arg)
    return axes


def expected_trials(cfg: SweepConfig) -> int:
    """Trials the sweep will start: num_samples times the product of the grid axes."""
    n = cfg.num_samples
    for values in grid_axes(cfg).values():
        n *= len(values)
    return n


def param_space(cfg: SweepConfig) -> dict[str, Any]:
    """The Tune search space: {dotted field: tune distribution}."""
    from ray import tune

    space = {}
    grid = grid_axes(cfg)
    for dotted, spec in cfg.space.items():
        kind, arg = next(iter(spec.items()))
        if dotted in grid:
            space[dotted] = tune.grid_search(grid[dotted])
        elif kind == "choice":
            space[dotted] = tune.choice(list(arg))
        elif kind == "uniform":
            space[dotted] = tune.uniform(*arg)
        elif kind == "loguniform":
            space[dotted] = tune.loguniform(*arg)
        else:
            space[dotted] = tune.randint(*arg)
    return space


def stored_sweep(storage_path: str, name: str) -> Sweep:
    """The sweep as it was started, from its state file (for --resume)."""
    import json

    root = absolute(storage_path)
    state = os.path.join(root, name, STATE_FILE)
    if not os.path.isfile(state):
        found = (
            sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, STATE_FILE)))
            if os.path.isdir(root)
            else []
        )
        raise ConfigError(f"no sweep {name!r} to resume under {root} (no {STATE_FILE}); sweeps there: {found}")
    try:
        with open(state) as f:
            saved = json.load(f)
        removed, tree = saved.get("secrets_removed", []), saved["sweep"]
        sweep = Sweep.from_dict(tree)
        if not removed:
            validate(sweep)  # what starting it checked, before any Ray contact
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, ConfigError) as e:
        raise ConfigError(
            f"{state} is not a Kiln sweep state file that can be resumed ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]})"
        ) from None
    if removed:
        raise ConfigError(
            f"sweep {name!r} cannot be resumed: its state was saved without the secrets in {', '.join(removed)} "
            "(Kiln never writes one to disk). Give credentials through the environment instead "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_USERNAME / _PASSWORD) and start it again"
        )
    return sweep
