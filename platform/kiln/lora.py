"""LoRA: low-rank adapters on a frozen model (Hu et al. 2021), the `model.lora` section.

A targeted projection computes `W x + (alpha / rank) * B A x`, with W frozen, A (rank x in)
drawn as PEFT draws it and B (out x rank) zero, so training starts from the base model exactly.
Only the adapters train: the optimizer, its state, the gradients and the checkpoints hold them
alone.

Written here rather than taken from PEFT, which wraps custom modules too, for two reasons:
- Kiln fuses q/k/v into one matmul (`attn.qkv`) and gate/up into another (`mlp.fc`), where PEFT
  would give the fused matrix one adapter; Hugging Face's Llama, and the PEFT adapters users
  share, have one per projection. Here each projection keeps its own A and B, so the adapters
  export in PEFT's layout for the unfused checkpoint (`kiln.hf_export.write_adapters`).
- PEFT renames the wrapped weight (`q_proj.base_layer.weight`), and every name Kiln's
  checkpoints, ZeRO, export and the loaders use would change with it. Here the base weight keeps
  its name and Parameter; the adapters add `<module>.lora_a.<target>` and `.lora_b.<target>`.

Like the model, this file imports only torch (and the config's knob language).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ConfigError
from kiln.knobs import check_ranges, knob, span
from kiln.model import GPT, GPTConfig

# Hugging Face's Llama names, which PEFT configs use; in Kiln's model, (module, row slice).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LLAMA = ("gate_proj", "up_proj", "down_proj")
MLP_GPT = ("up_proj", "down_proj")  # GPT-2's MLP has no gate: c_fc is its up projection
ALL_TARGETS = ATTENTION + MLP_LLAMA
DEFAULT_TARGETS = ",".join(ALL_TARGETS)


@dataclass
class LoraConfig:
    rank: int = knob(0, *span(0, 4096, note="0: no LoRA, every weight trains"))
    """The adapters' rank r; 0 trains every weight (full fine-tuning). 8-64 is usual: LoRA's
    paper matched full fine-tuning of GPT-3 at r = 4-8, and QLoRA used 64 on every linear."""
    alpha: float = knob(16.0, lambda v: v > 0, "a positive number")
    """The update is scaled by alpha / rank, so a change of rank keeps the LR's meaning (the
    paper's choice; 16 with r = 8 is PEFT's and litgpt's common setting)."""
    dropout: float = knob(0.0, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
    """Dropout on the adapters' input only (the frozen path is untouched); 0.05-0.1 helps small
    datasets."""
    targets: str = DEFAULT_TARGETS
    """Comma-separated projections that get adapters, in Hugging Face's Llama names: q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (GPT-2 has no gate_proj). The default
    is every one: QLoRA found adapters on all linears needed to match full fine-tuning."""

    def check(self) -> None:
        check_ranges(self, "model.lora")
        unknown = [t for t in self.target_list if t not in ALL_TARGETS]
        if unknown or not self.target_list:
            raise ConfigError(
                f"model.lora.targets = {self.targets!r}: expected comma-separated names among {list(ALL_TARGETS)}"
            )

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_rows(cfg: GPTConfig) -> dict[str, tuple[str, int, int]]:
    """Each target this architecture has: (the Kiln module under a block, its first output row,
    one past its last). The one statement of where q, k, v, gate and up sit in the fused
    matrices (as `kiln.hf_checkpoint` reads them)."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    rows = {
        "q_proj": ("attn.qkv", 0, q),
        "k_proj": ("attn.qkv", q, q + kv),
        "v_proj": ("attn.qkv", q + kv, q + 2 * kv),
        "o_proj": ("attn.proj", 0, cfg.d_model),
        "down_proj": ("mlp.proj", 0, cfg.d_model),
    }
    if cfg.arch == "llama":
        rows |= {"gate_proj": ("mlp.fc", 0, cfg.hidden), "up_proj": ("mlp.fc", cfg.hidden, 2 * cfg.hidden)}
    else:
        rows["up_proj"] = ("mlp.fc", 0, cfg.hidden)
    return rows


def in_features(cfg: GPTConfig, module: str) -> int:
    return {"attn.qkv": cfg.d_model, "attn.proj": cfg.n_head * cfg.head_dim, "mlp.fc": cfg.d_model}.get(
        module, cfg.hidden
    )


def problem(lora: LoraConfig, cfg: GPTConfig) -> str | None:
    """Why these targets do not fit this architecture, naming the field, or None."""
    rows = target_rows(cfg)
    missing = [t for t in lora.target_list if t not in rows]
    if missing:
        return (
            f"model.lora.targets: {missing} match no module of the {cfg.arch} architecture "
            f"(it has {sorted(rows, key=ALL_TARGETS.index)})"
        )
    return None


def layout_problem(engine: str, zero_stage: int, pipeline_stages: int, tensor_parallel: int) -> str | None:
    """Why LoRA cannot train in this parallel layout, naming the field, or None: DeepSpeed at
    ZeRO 0-2 without pipeline or tensor parallelism (asked by the config and the planner)."""
    layout = [
        ("parallel.engine", engine, engine == "deepspeed", "'deepspeed'"),
        ("parallel.zero_stage", zero_stage, zero_stage <= 2, "0, 1 or 2"),
        ("parallel.pipeline_stages", pipeline_stages, pipeline_stages == 1, "1"),
        ("parallel.tensor_parallel", tensor_parallel, tensor_parallel == 1, "1"),
    ]
    for name, value, ok, expected in layout:
        if not ok:
            return (
                f"{name} = {value!r} with model.lora: LoRA runs on DeepSpeed at ZeRO 0-2 without pipeline or "
                f"tensor parallelism; expected {expected}"
            )
    return None


def adapter_params(cfg: GPTConfig, lora: LoraConfig) -> int:
    """The trainable parameters LoRA adds: r x (in + out) per target per block (the formula the
    planner counts and a test checks against the built model)."""
    if not lora.on:
        return 0
    rows = target_rows(cfg)
    per_block = sum(lora.rank * (in_features(cfg, rows[t][0]) + rows[t][2] - rows[t][1]) for t in lora.target_list)
    return cfg.n_layer * per_block


def describe(lora: LoraConfig, cfg: GPTConfig, total: int) -> str:
    """The console's words for what trains: '' for full training, else the adapters' share of
    `total`, the model's parameters."""
    if not lora.on:
        return ""
    n = adapter_params(cfg, lora)
    return (
        f", LoRA rank {lora.rank} on {len(lora.target_list)} projections: {n / 1e6:.2f}M trained "
        f"({100 * n / max(total, 1):.2g}%)"
    )


class LoRALinear(nn.Module):
    """A frozen linear (its own `weight` and `bias` Parameters, under their names) plus one
    adapter per target, each adding to its rows of the output."""

    def __init__(self, base: nn.Linear, targets: dict[str, tuple[int, int]], lora: LoraConfig):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.targets, self.scale = targets, lora.scale
        self.dropout = nn.Dropout(lora.dropout)
        dev, n_in = base.weight.device, base.weight.shape[1]
        self.lora_a = nn.ParameterDict({t: nn.Parameter(torch.empty(lora.rank, n_in, device=dev)) for t in targets})
        self.lora_b = nn.ParameterDict(
            {t: nn.Parameter(torch.zeros(hi - lo, lora.rank, device=dev)) for t, (lo, hi) in targets.items()}
        )
        for a in self.lora_a.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear and PEFT draw A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        x = self.dropout(x)
        parts, at = [], 0
        for t, (lo, hi) in sorted(self.targets.items(), key=lambda kv: kv[1]):
            if lo > at:  # rows no adapter touches
                parts.append(y.new_zeros(*y.shape[:-1], lo - at))
            parts.append(F.linear(F.linear(x, self.lora_a[t]), self.lora_b[t]) * self.scale)
            at = hi
        if at < y.shape[-1]:
            parts.append(y.new_zeros(*y.shape[:-1], y.shape[-1] - at))
        return y + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))


def apply(model: GPT, lora: LoraConfig, seed: int) -> GPT:
    """Freeze `model` and put adapters on `lora`'s targets in every block, in place; the A
    matrices are drawn from `seed` alone, so every rank and every build draws the same."""
    found = problem(lora, model.cfg)
    if found:
        raise ConfigError(found)
    for p in model.parameters():
        p.requires_grad_(False)
    rows = target_rows(model.cfg)
    by_module: dict[str, dict[str, tuple[int, int]]] = {}
    for t in lora.target_list:
        module, lo, hi = rows[t]
        by_module.setdefault(module, {})[t] = (lo, hi)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for block in model.blocks:
            for path, targets in by_module.items():
                parent_name, name = path.split(".")
                parent = getattr(block, parent_name)
                setattr(parent, name, LoRALinear(getattr(parent, name), targets, lora))
    finally:
        torch.random.set_rng_state(state)
    return model


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter's."""
    return ".lora_a." in name or ".lora_b." in name


def merge(state: dict[str, torch.Tensor], cfg: GPTConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """`state` (the base weights and the adapters, in Kiln's names) with every adapter folded
    into its weight and removed: the plain model that computes what the adapted one does."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    rows = target_rows(cfg)
    for i in range(cfg.n_layer):
        merged: dict[str, torch.Tensor] = {}
        for t in lora.target_list:
            module, lo, hi = rows[t]
            key = f"blocks.{i}.{module}"
            # In float64, rounded once to the weight's dtype: the merged weight is the nearest
            # one to W + (alpha / rank) B A.
            weight = merged.setdefault(key, out[f"{key}.weight"].double())
            a, b = state[f"{key}.lora_a.{t}"].double(), state[f"{key}.lora_b.{t}"].double()
            weight[lo:hi] += lora.scale * b @ a
        for key, weight in merged.items():
            out[f"{key}.weight"] = weight.to(state[f"{key}.weight"].dtype)
    return out
