"""One typed config for a whole run, loaded from YAML with `--set a.b=c` overrides.

`RunConfig` composes the sections, each of which lives beside the code that uses it, with its
fields' types, defaults, ranges and docstrings (litgpt style) and its own `check`:

    data      kiln.data.config        DataConfig, MixSource
    model     kiln.model_config       ModelConfig (and the model's shape)
    parallel  kiln.topology           ParallelConfig (and the layout, ParallelDims)
    optim     kiln.core.optim         OptimConfig (and the OPTIMIZERS registry)
    schedule  kiln.core.schedule      ScheduleConfig (and the SCHEDULES registry)
    train     kiln.core.config        TrainConfig (profile: kiln.core.profiling, health: kiln.core.health)
    logging   kiln.core.config        LoggingConfig

The language they share (`knob`, strict loading, overrides, field docs) is `kiln.knobs`. Here
are the composition, the rules that span sections, and loading. Loading is strict and does no
I/O beyond reading the YAML file: every check runs before Ray, DeepSpeed or MLflow start.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kiln import knobs, yamlfile
from kiln.core.config import LoggingConfig, TrainConfig, default_experiment
from kiln.core.health import HealthConfig  # noqa: F401  (a section, importable from here)
from kiln.core.optim import OptimConfig
from kiln.core.profiling import ProfileConfig  # noqa: F401  (a section, importable from here)
from kiln.core.resize import elastic_batch_problem
from kiln.core.schedule import ScheduleConfig
from kiln.data.config import DataConfig, MixSource  # noqa: F401  (MixSource: a section's item)
from kiln.errors import ConfigError
from kiln.layout_rules import own_communication
from kiln.lora import layout_problem
from kiln.model_config import ModelConfig
from kiln.storage import absolute, is_url
from kiln.topology import ParallelConfig, ParallelDims


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Where the tokenized Parquet shards are and how they are streamed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Workers and DeepSpeed parallelism."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch sizes, precision, validation and checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """MLflow and console output."""

    def validate(self) -> RunConfig:
        """Each section's own checks, then the rules that span sections; raise ConfigError
        naming the field."""
        self.data.check()
        self.model.check()
        self.parallel.check()
        self.optim.check()
        self.schedule.check()
        self.train.check(self.parallel.pipeline_stages, self.parallel.min_workers)
        self.logging.check()
        _check_across(self)
        return self

    @property
    def dims(self) -> ParallelDims:
        """The parallel layout of the config's workers."""
        return ParallelDims.of(self.parallel)

    @property
    def data_parallel_size(self) -> int:
        return self.dims.data_parallel_size

    @property
    def autocast(self) -> bool:
        """Whether bf16 runs as torch.autocast over fp32 weights (`bf16_autocast`)."""
        t, p = self.train, self.parallel
        return bf16_autocast(t.precision, t.mixed_precision, p.use_gpu, p.deepspeed_stage, p.pipeline_stages, p.engine)

    @property
    def cpu_adam(self) -> bool:
        """Optimizer offload with an optimizer that steps on the host with DeepSpeed's vectorised
        `cpu_adam` op (`Optimizer.cpu_adam` in the registry); others run their torch step there."""
        return self.parallel.offload_optimizer != "none" and self.optim.spec.cpu_adam

    def tokens_per_step(self, data_parallel_size: int | None = None) -> int:
        """Tokens one optimizer step trains on over all replicas (model.seq_len resolved):
        `data_parallel_size` of them, by default as many as the config's workers make."""
        replicas = data_parallel_size or self.data_parallel_size
        return self.train.micro_batch_size * self.micro_batches_per_step * replicas * self.model.seq_len

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        return self.parallel.micro_batches if self.parallel.pipeline_stages > 1 else self.train.grad_accum_steps

    def local_run_dir(self) -> str:
        """This run's directory on this machine, for what is not a checkpoint (worker logs,
        metrics MLflow never took): beside the checkpoints when `train.storage_path` is local,
        else in the temp dir (checkpoints on S3)."""
        storage = self.train.storage_path or "runs"
        root = tempfile.gettempdir() if is_url(storage) else absolute(storage)
        return os.path.join(root, self.logging.run_name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check_across(cfg: RunConfig) -> None:
    """Combinations of sections that DeepSpeed would reject (or silently mishandle), named before launch."""
    p, t = cfg.parallel, cfg.train
    if p.pipeline_stages > 1 and t.grad_accum_steps != 1:
        raise ConfigError(
            f"train.grad_accum_steps = {t.grad_accum_steps} with pipeline parallelism: a pipeline "
            "accumulates over parallel.micro_batches; expected train.grad_accum_steps = 1"
        )
    if cfg.data.document_mask == "true" and p.pipeline_stages > 1:
        raise ConfigError(
            f"data.document_mask = true with parallel.pipeline_stages = {p.pipeline_stages}: a pipeline's "
            "stages hand each other activations only, not the rows' documents; expected "
            "parallel.pipeline_stages = 1, or data.document_mask = false"
        )
    if t.mixed_precision == "autocast" and (t.precision != "bf16" or p.pipeline_stages > 1):  # explicit only
        raise ConfigError(
            f"train.mixed_precision = 'autocast' with train.precision = {t.precision!r} and "
            f"parallel.pipeline_stages = {p.pipeline_stages}: autocast is for bf16 without a pipeline"
        )
    if p.engine == "fsdp2":
        _check_fsdp2(cfg)
    elif t.compile and (p.zero_stage == 3 or p.pipeline_stages > 1):
        raise ConfigError(
            f"train.compile = true with parallel.zero_stage = {p.zero_stage} and parallel.pipeline_stages "
            f"= {p.pipeline_stages}: compile works with ZeRO 0-2 and no pipeline (ZeRO-3's "
            "parameter gathering and the pipeline's schedule break the compiled graph)"
        )
    problem = elastic_batch_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if own_communication(p.sync, p.grad_compression):
        _check_sync(cfg)
    if cfg.model.lora.on:
        _check_lora(cfg)


def _check_lora(cfg: RunConfig) -> None:
    """Where LoRA runs: on DeepSpeed at ZeRO 0-2, one stage, no tensor parallelism, from a
    pretrained checkpoint."""
    p = cfg.parallel
    if not cfg.model.init_from:
        raise ConfigError(
            "model.lora.rank > 0 without model.init_from: adapters train on top of a pretrained "
            "model, and a LoRA checkpoint holds only them; expected a checkpoint to start from"
        )
    problem = layout_problem(p.engine, p.zero_stage, p.pipeline_stages, p.tensor_parallel)
    if problem:
        raise ConfigError(problem)


def _check_sync(cfg: RunConfig) -> None:
    """What Kiln's own communication (local SGD, DiLoCo, PowerSGD) needs of the training: fp32
    weights and gradients, and for a sync, validation where the replicas agree (its layout
    rules: `kiln.topology.sync_refusal`)."""
    p, t = cfg.parallel, cfg.train
    sync = own_communication(p.sync, p.grad_compression)
    if t.precision == "fp16" or (t.precision == "bf16" and not cfg.autocast):
        raise ConfigError(
            f"{sync} with train.precision = {t.precision!r}: Kiln averages the replicas' fp32 weights "
            "or gradients, and DeepSpeed's bf16/fp16 training keeps its fp32 master copies apart from "
            "the model; expected 'fp32', or 'bf16' with train.mixed_precision = 'autocast'"
        )
    if p.sync == "every_step":
        return
    if t.eval_every % p.sync_every:
        raise ConfigError(
            f"train.eval_every = {t.eval_every} with {sync}: validation runs where the replicas agree, "
            f"after a sync; expected a multiple of parallel.sync_every = {p.sync_every}"
        )
    if t.keep_checkpoints_by == "loss/val" and (t.checkpoint_every % p.sync_every or t.checkpoint_every_minutes):
        raise ConfigError(
            f"train.keep_checkpoints_by = 'loss/val' with {sync}: each checkpoint is scored by a "
            "validation, which runs after a sync only; expected train.checkpoint_every a multiple of "
            f"parallel.sync_every = {p.sync_every} and train.checkpoint_every_minutes = 0"
        )


def _check_fsdp2(cfg: RunConfig) -> None:
    """What `parallel.engine = 'fsdp2'` leaves to DeepSpeed (its parallel-only limits are in
    `kiln.layout_rules.deepspeed_refusal`)."""
    p, t = cfg.parallel, cfg.train
    if t.precision == "fp16":
        raise ConfigError(
            "train.precision = 'fp16' with parallel.engine = 'fsdp2': Kiln's FSDP2 engine has no loss "
            "scaler; expected 'bf16' or 'fp32', or engine 'deepspeed'"
        )
    if t.mixed_precision != "auto":
        raise ConfigError(
            f"train.mixed_precision = {t.mixed_precision!r} with parallel.engine = 'fsdp2': FSDP2 keeps "
            "fp32 weights and computes bf16 copies of each block's (its MixedPrecisionPolicy), and "
            "the setting chooses between DeepSpeed's layouts only; expected 'auto'"
        )
    if p.deepspeed:
        raise ConfigError(
            "parallel.deepspeed with parallel.engine = 'fsdp2': that passthrough configures DeepSpeed, "
            "which this run does not use; expected it empty"
        )


def bf16_autocast(
    precision: str,
    mixed_precision: str,
    use_gpu: bool,
    zero_stage: int,
    pipeline_stages: int,
    engine: str = "deepspeed",
) -> bool:
    """Whether a run computes in bf16 through torch.autocast over fp32 weights (else, in bf16,
    through DeepSpeed's bf16 weights): `train.mixed_precision`, with `auto` resolved. FSDP2 runs
    neither: its bf16 is a mixed-precision policy (`kiln.parallel.fsdp2_engine`)."""
    if precision != "bf16" or engine == "fsdp2":
        return False
    if mixed_precision == "auto":
        return use_gpu and zero_stage == 0 and pipeline_stages == 1
    return mixed_precision == "autocast"


# ---- loading ----------------------------------------------------------------------------------
def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML run config (or the defaults), apply `a.b=c` overrides, validate."""
    tree = yamlfile.read_mapping(path, f"config file {str(path)!r}") if path is not None else {}
    return config_from_dict(tree, overrides)


def fork_overrides(overrides: Iterable[str], fork: str | None) -> list[str]:
    """`--fork RUN` as the override it stands for, `train.resume_from=RUN`, beside the new run's
    own settings. A fork and a `train.resume_from` override name two starting points: refused."""
    overrides = list(overrides)
    if not fork:
        return overrides
    if any(knobs.parse_override(o)[0] == "train.resume_from" for o in overrides):
        raise ConfigError(f"--fork {fork} and --set train.resume_from both say where the run starts: give one")
    return [*overrides, f"train.resume_from={fork}"]


def config_from_dict(tree: dict[str, Any], overrides: Iterable[str] = ()) -> RunConfig:
    """A validated config from a tree shaped like the YAML (left as it was), with `a.b=c`
    overrides applied as `--set` applies them."""
    tree = copy.deepcopy(tree)
    for text in overrides:
        key, value = knobs.parse_override(text)
        knobs.set_dotted(RunConfig, tree, key, value)
    _experiment_from_environment(tree)
    _deepspeed_from_file(tree)
    return knobs.build_section(RunConfig, tree).validate()


def _deepspeed_from_file(tree: dict[str, Any]) -> None:
    """`parallel.deepspeed: ds_config.json`: the mapping that file holds (JSON is YAML)."""
    section = tree.get("parallel")
    if isinstance(section, dict) and isinstance(section.get("deepspeed"), str):
        path = section["deepspeed"]
        section["deepspeed"] = yamlfile.read_mapping(path, f"parallel.deepspeed file {path!r}")


def _experiment_from_environment(tree: dict[str, Any]) -> None:
    """A config that names no experiment gets `default_experiment()` (MLflow's own
    $MLFLOW_EXPERIMENT_NAME, else the field's default)."""
    section = tree.get("logging")
    named = isinstance(section, dict) and "experiment" in section
    if not named and (section is None or isinstance(section, dict)):
        tree["logging"] = {**(section or {}), "experiment": default_experiment()}


def annotated_yaml(cfg: RunConfig | None = None) -> str:
    """The config as YAML with each field's docstring, and its allowed range, as a comment above it."""
    return knobs.annotated_yaml(cfg or RunConfig())


def field_range(dotted: str):
    """The (ok, allowed) of a RunConfig field (`knobs.field_range`)."""
    return knobs.field_range(RunConfig, dotted)
