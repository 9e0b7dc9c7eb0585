"""Pipeline parallelism: the same GPT blocks as a DeepSpeed PipelineModule.

The GPT stays a plain nn.Module. This module re-expresses it as a sequence of layers that
DeepSpeed can split across stages: embeddings, the blocks, the final norm, and the output
projection, which shares its weight with the token embedding (a tied layer DeepSpeed keeps in
sync across the first and last stage). It is built from a constructed GPT, so a pipeline run
starts from exactly the weights a single-device run would.

Every rank builds the whole GPT once and DeepSpeed keeps its stage's layers; fine up to a few
billion parameters of host RAM. The stages of one pipeline must read the same batches: the
first stage needs the inputs and the last the labels (see `kiln.data.sources`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute  # activation checkpointing

from kiln.model import GPT, embed, next_token_loss
from kiln.topology import ParallelConfig, ParallelDims


class EmbeddingStage(nn.Module):
    """Token (+ position) embeddings; as the last layer of a tied model, also the output projection."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return embed(self.wte, self.wpe, self.drop, idx)


def _output_projection(embedding: EmbeddingStage, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embedding.wte.weight)


def to_pipeline(gpt: GPT, p: ParallelConfig, activation_checkpointing: bool):
    from deepspeed.pipe import PipelineModule, TiedLayerSpec

    if gpt.cfg.tie_embeddings:
        embedding = TiedLayerSpec("embedding", EmbeddingStage, gpt, tied_weight_attr="wte.weight")
        head = TiedLayerSpec(
            "embedding", EmbeddingStage, gpt, forward_fn=_output_projection, tied_weight_attr="wte.weight"
        )
    else:  # an untied output projection is a layer of its own on the last stage
        embedding, head = EmbeddingStage(gpt), gpt.lm_head
    layers = [embedding, *gpt.blocks, gpt.ln_f, head]
    check_partition(len(gpt.blocks), p)
    module = PipelineModule(
        layers=layers,
        num_stages=p.pipeline_stages,
        loss_fn=next_token_loss,
        partition_method=p.partition_method,
        # Recompute every block in backward (interval 1 = per block), as the GPT itself does.
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        activation_checkpoint_func=functools.partial(recompute, use_reentrant=False),
        checkpointable_layers=["Block"],
    )
    check_stages_hold_blocks(list(module.parts), len(gpt.blocks), p)  # DeepSpeed's own split
    return module


def uniform_parts(num_items: int, num_parts: int) -> list[int]:
    """Stage boundaries of DeepSpeed's 'uniform' method (deepspeed.runtime.utils.partition_uniform):
    equal layer counts, the remainder going one each to the first stages."""
    if num_items <= num_parts:
        return [min(i, num_items) for i in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [i * chunk + min(i, residual) for i in range(num_parts + 1)]


def check_stages_hold_blocks(parts: list[int], n_layer: int, p: ParallelConfig) -> None:
    """Every stage must run at least one transformer block. A stage holding only the norm and the
    tied head does no useful work, and its lone parameter group desynchronises ZeRO's per-group
    collectives with the other stages (a hang, not an error)."""
    from kiln.errors import ConfigError

    for stage in range(len(parts) - 1):
        # Pipeline layers: 0 embedding, 1..n_layer blocks, n_layer+1 norm, n_layer+2 head.
        blocks = range(max(parts[stage], 1), min(parts[stage + 1], n_layer + 1))
        if len(blocks) == 0:
            raise ConfigError(
                f"parallel.pipeline_stages = {p.pipeline_stages} with partition_method = "
                f"{p.partition_method!r} leaves stage {stage} without a transformer block (layer "
                f"boundaries {parts} over embedding, {n_layer} blocks, norm, head); use fewer "
                f"stages, partition_method = 'parameters', or a deeper model (model.n_layer)"
            )


def check_partition(n_layer: int, p: ParallelConfig) -> None:
    """Before launch: stages vs. the model's depth (exact for 'uniform'; 'parameters' is checked
    from DeepSpeed's split when the module is built)."""
    from kiln.errors import ConfigError

    if p.pipeline_stages <= 1:
        return
    if p.pipeline_stages > n_layer:
        raise ConfigError(
            f"parallel.pipeline_stages = {p.pipeline_stages} exceeds the model's "
            f"{n_layer} transformer blocks; each stage needs at least one"
        )
    if p.partition_method == "uniform":
        check_stages_hold_blocks(uniform_parts(n_layer + 3, p.pipeline_stages), n_layer, p)


def check_coords(engine, rank: int, dims: ParallelDims) -> None:
    """The engine's own grid against Kiln's layout (`kiln.topology`): the data a rank reads
    follows Kiln's, so a disagreement would feed stages of one pipeline different rows."""
    coords = dims.coords(rank)
    expected = (coords.data_parallel_rank, dims.data_parallel_size)
    actual = (engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size())
    if expected != actual:
        raise RuntimeError(f"pipeline topology changed: expected (dp rank, dp size) {expected}, got {actual}")
