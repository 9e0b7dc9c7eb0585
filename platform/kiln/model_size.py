"""The model's size from its config alone: parameter counts and training FLOPs per token.

Planners, the meter and preflight read these without building the model (a 70B config is counted
in microseconds). They follow `kiln.model`'s layers exactly; `tests/unit/test_model.py` checks
each count against a built model's parameters.
"""

from __future__ import annotations

from kiln.model import GPT, GPTConfig


def num_params(cfg: GPTConfig, non_embedding: bool = True) -> int:
    """Parameter count from shapes alone, so planners need not build the model. Non-embedding
    leaves out the learned position table only: the token embedding is also the output
    projection's matmul (or an untied head is counted beside it)."""
    d = cfg.d_model
    n = cfg.n_layer * block_params(cfg) + _norm_size(cfg) + cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    if not non_embedding and cfg.arch == "gpt":
        n += cfg.seq_len * d
    return n


def block_params(cfg: GPTConfig) -> int:
    """One transformer block's parameters: the projections, their two norms, and the output
    projections' biases (what FSDP2 gathers as one unit)."""
    return _projection_params(cfg) + 2 * _norm_size(cfg) + (2 * cfg.d_model if cfg.bias else 0)


def _norm_size(cfg: GPTConfig) -> int:
    return cfg.d_model * (2 if cfg.bias and cfg.arch == "gpt" else 1)  # LayerNorm's bias too


def split_params(cfg: GPTConfig) -> int:
    """Weights of the blocks' four projections (qkv, attention out, MLP in and out, with their
    column biases): what tensor parallelism divides over its ranks. Embeddings, norms, the head
    and the output projections' biases stay whole on every rank."""
    return cfg.n_layer * _projection_params(cfg)


def _projection_params(cfg: GPTConfig) -> int:
    """One block's qkv, attention-out, MLP-in and MLP-out weights, and the biases of qkv and
    MLP-in (the output projections' biases are counted with the norms)."""
    d, qkv_out = cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
    mlp_in = (2 if cfg.arch == "llama" else 1) * cfg.hidden
    weights = d * qkv_out + cfg.n_head * cfg.head_dim * d + d * mlp_in + cfg.hidden * d
    return weights + (qkv_out if cfg.bias or cfg.qkv_bias else 0) + (mlp_in if cfg.bias else 0)


def largest_layer_params(cfg: GPTConfig) -> int:
    """Parameters of the biggest single module: what ZeRO-3 gathers at once."""
    mlp_in = (2 if cfg.arch == "llama" else 1) * cfg.hidden * cfg.d_model
    return max(cfg.vocab_size * cfg.d_model, mlp_in)


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward): 6N + 12·L·d·T.

    6N counts the matmuls against the weights (2 forward, 4 backward per parameter), the second
    term the attention scores and weighted sums (Kaplan et al. 2020; PaLM appendix B).
    Activation recomputation is not counted: MFU measures useful work.
    """
    return 6 * num_params(cfg) + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def param_shapes(cfg: GPTConfig) -> list[tuple[int, ...]]:
    """Each parameter's shape, in the model's order, from a model built on the meta device (no
    memory, no init): what PowerSGD's planner rule (`kiln.parallel.powersgd`) needs."""
    import torch

    with torch.device("meta"):
        model = GPT(cfg, init_weights=False)
    return [tuple(p.shape) for p in model.parameters()]
