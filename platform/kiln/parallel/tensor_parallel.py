"""Tensor parallelism for Kiln's GPT: how each weight splits over k ranks, said once.

DeepSpeed's AutoTP does the splitting and the collectives (`tensor_parallel.autotp_size` with a
`partition_config`); this module only states Kiln's layout to it, and undoes that layout when a
checkpoint is exported. Both read `splits(cfg)`, so the two cannot disagree:

- `attn.qkv`: column-parallel, as three sub-matrices (q, k, v) each split by whole heads, so a
  rank holds [q_r; k_r; v_r] and the model (`kiln.model.CausalSelfAttention`) reads its share of
  heads off the width it computes.
- `mlp.fc`: column-parallel; for llama as two sub-matrices (gate, up), split alike.
- `attn.proj`, `mlp.proj`: row-parallel (split along their inputs), their outputs all-reduced;
  their biases stay whole.
- everything else (embeddings, norms, the head) stays whole on every rank.

The merge is written here because DeepSpeed has no offline one for AutoTP checkpoints that
yields a plain state dict (its universal-checkpoint conversion needs the ZeRO optimizer files
and produces per-parameter folders). Torch only; no DeepSpeed import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kiln.model import GPTConfig


@dataclass(frozen=True)
class Split:
    """How one parameter splits: along `dim` (0: output rows, column-parallel; 1: input columns,
    row-parallel), as the given sub-matrices (each split k ways), or whole."""

    pattern: str
    dim: int
    parts: tuple[int, ...] = ()


def splits(cfg: GPTConfig) -> list[Split]:
    """The split of every tensor-parallel parameter of a model of shape `cfg`."""
    H, KV, hd, hidden = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.hidden
    qkv = (H * hd, KV * hd, KV * hd)
    fc = (hidden, hidden) if cfg.arch == "llama" else ()
    return [
        Split(r"blocks\.\d+\.attn\.qkv\.(weight|bias)", 0, qkv),
        Split(r"blocks\.\d+\.mlp\.fc\.(weight|bias)", 0, fc),
        Split(r"blocks\.\d+\.(attn|mlp)\.proj\.weight", 1),
    ]


def partition_config(cfg: GPTConfig) -> dict:
    """DeepSpeed AutoTP's `partition_config` for this model: Kiln's own specs only (no built-in
    presets, which name HF modules), the head left whole."""
    specs = []
    for s in splits(cfg):
        spec: dict = {"patterns": [f".*{s.pattern}$"], "partition_type": "column" if s.dim == 0 else "row"}
        if s.parts:
            spec |= {"shape": [list(s.parts), -1] if len(set(s.parts)) > 1 else [len(s.parts), -1], "partition_dim": 0}
        specs.append(spec)
    specs.append({"patterns": [r".*lm_head\.weight$"], "partition_type": "skip"})
    return {"use_default_specs": False, "layer_specs": specs}


def split_of(name: str, cfg: GPTConfig) -> Split | None:
    return next((s for s in splits(cfg) if re.fullmatch(s.pattern, name)), None)


def merge_shards(shards: list[dict[str, torch.Tensor]], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The whole model's state dict from its k tensor-parallel ranks' state dicts (rank order)."""
    k = len(shards)
    merged = {}
    for name, first in shards[0].items():
        split = split_of(name, cfg)
        pieces = [shard[name] for shard in shards]
        if split is None:
            merged[name] = first
        elif not split.parts:
            merged[name] = torch.cat(pieces, dim=split.dim)
        else:  # each rank: [a_r; b_r; ...]; whole: [a_0 .. a_k-1; b_0 .. b_k-1; ...]
            per_rank = [p.split([n // k for n in split.parts], dim=0) for p in pieces]
            merged[name] = torch.cat([torch.cat([r[i] for r in per_rank], dim=0) for i in range(len(split.parts))])
    return merged


def shard_of(state: dict[str, torch.Tensor], cfg: GPTConfig, rank: int, k: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of a whole state dict: the inverse of `merge_shards` (for tests and
    for checking a merge)."""
    out = {}
    for name, t in state.items():
        split = split_of(name, cfg)
        if split is None:
            out[name] = t
        elif not split.parts:
            out[name] = t.chunk(k, dim=split.dim)[rank]
        else:
            out[name] = torch.cat([part.chunk(k, dim=0)[rank] for part in t.split(list(split.parts), dim=0)])
    return out
