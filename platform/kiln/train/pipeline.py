"""Pipeline parallelism: the same GPT blocks as a DeepSpeed PipelineModule.

The GPT stays a plain nn.Module. This module re-expresses it as a sequence of layers that
DeepSpeed can split across stages: embeddings, the blocks, the final norm, and the output
projection, which shares its weight with the token embedding (a tied layer DeepSpeed keeps in
sync across the first and last stage). It is built from a constructed GPT, so a pipeline run
starts from exactly the weights a single-device run would.

Every rank builds the whole GPT once and DeepSpeed keeps its stage's layers; fine up to a few
billion parameters of host RAM. The stages of one pipeline must read the same batches: the
first stage needs the inputs and the last the labels (see `kiln.train.sources`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.config import ParallelConfig
from kiln.model import GPT


class EmbeddingStage(nn.Module):
    """Token + position embeddings; as the last layer, also the tied output projection."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


def _output_projection(embedding: EmbeddingStage, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embedding.wte.weight)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def to_pipeline(gpt: GPT, p: ParallelConfig, activation_checkpointing: bool):
    from deepspeed.pipe import PipelineModule, TiedLayerSpec

    layers = [
        TiedLayerSpec("embedding", EmbeddingStage, gpt, tied_weight_attr="wte.weight"),
        *gpt.blocks,
        gpt.ln_f,
        TiedLayerSpec("embedding", EmbeddingStage, gpt, forward_fn=_output_projection,
                      tied_weight_attr="wte.weight"),
    ]
    if p.pipeline_stages > len(layers):
        from kiln.errors import ConfigError

        raise ConfigError(f"parallel.pipeline_stages = {p.pipeline_stages} exceeds the model's "
                          f"{len(layers)} pipeline layers (embedding, {len(gpt.blocks)} blocks, norm, head)")
    return PipelineModule(
        layers=layers,
        num_stages=p.pipeline_stages,
        loss_fn=_loss,
        partition_method=p.partition_method,
        # Recompute every block in backward (interval 1 = per block), as the GPT itself does.
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        activation_checkpoint_func=functools.partial(checkpoint, use_reentrant=False),
        checkpointable_layers=["Block"],
    )


def data_parallel_coords(rank: int, world_size: int, stages: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of a global rank.

    DeepSpeed's PipeDataParallelTopology orders axes (pipe, data): data varies fastest, so
    ranks 0..D-1 are stage 0 of replicas 0..D-1. `check_coords` verifies this against the
    engine's own grid.
    """
    dp = world_size // stages
    return rank % dp, dp


def check_coords(engine, rank: int, world_size: int, stages: int) -> None:
    expected = data_parallel_coords(rank, world_size, stages)
    actual = (engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size())
    if expected != actual:
        raise RuntimeError(f"pipeline topology changed: expected (dp rank, dp size) {expected}, got {actual}")
