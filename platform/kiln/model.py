"""A GPT decoder in plain PyTorch.

This file imports only torch and reads top to bottom: config and flavours, attention, MLP,
block, the model, and the FLOPs estimate used for MFU. Parallelism (DeepSpeed ZeRO, pipeline
stages) is applied from outside; nothing here knows about Ray, DeepSpeed or MLflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute  # activation checkpointing


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    """Padded to a multiple of 64: matmuls whose dims are multiples of 64 run faster on GPUs."""
    seq_len: int = 1024
    """Context length; also the size of the learned position table."""
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    dropout: float = 0.0
    """0 for pretraining: with one pass over lots of data, dropout only slows learning."""
    bias: bool = False
    """No biases in linears and norms: slightly faster and no worse (as in nanoGPT, PaLM)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward: trades ~33% more compute for memory."""


# Shapes follow GPT-2 (124M, 350M) and GPT-3 (1.3B XL, 2.7B, 6.7B; 13B with d_model 5120 so heads
# are 128 wide). `debug` is small enough that a training step takes milliseconds on one CPU core,
# so every test can run the whole training function. The large ones are for the memory planner.
FLAVOURS: dict[str, dict[str, int]] = {
    "debug": dict(n_layer=2, n_head=4, d_model=128, seq_len=128),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "350m": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024),
    "1.3b": dict(n_layer=24, n_head=16, d_model=2048, seq_len=2048),
    "2.7b": dict(n_layer=32, n_head=32, d_model=2560, seq_len=2048),
    "6.7b": dict(n_layer=32, n_head=32, d_model=4096, seq_len=2048),
    "13b": dict(n_layer=40, n_head=40, d_model=5120, seq_len=2048),
}


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    return ((vocab_size + multiple - 1) // multiple) * multiple


def config_for(flavour: str, **overrides) -> GPTConfig:
    """The GPTConfig of a named flavour, with any field overridden (e.g. vocab_size, seq_len)."""
    if flavour not in FLAVOURS:
        raise KeyError(f"unknown model flavour {flavour!r}; choose one of {sorted(FLAVOURS)}")
    return replace(GPTConfig(**FLAVOURS[flavour]), **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "d_model must be divisible by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA picks flash / memory-efficient kernels where available.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def embed(wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout, idx: torch.Tensor) -> torch.Tensor:
    """Token plus learned position embeddings, then dropout: the input of the first block (of
    the GPT, and of a pipeline's first stage)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    return drop(wte(idx) + wpe(pos))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions, in fp32 whatever the compute precision
    (a bf16 softmax over 50k logits loses the small probabilities)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, init_weights: bool = True):
        """`init_weights=False` leaves the init to the caller: a ZeRO-3 wrapper that builds the
        model already partitioned must gather each weight before `init_module` can fill it."""
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Weight tying: input embedding and output projection share one matrix (fewer params,
        # and better perplexity at small scale; Press & Wolf 2017).
        self.lm_head.weight = self.wte.weight
        if init_weights:
            self.apply(self.init_module)

    def init_module(self, module: nn.Module) -> None:
        # GPT-2 init: N(0, 0.02), with residual projections scaled by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for `idx` (B, T); with `targets`, also the mean next-token cross-entropy."""
        T = idx.shape[1]
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence of length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        x = embed(self.wte, self.wpe, self.drop, idx)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                x = recompute(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, next_token_loss(logits, targets)


def num_params(cfg: GPTConfig, non_embedding: bool = True) -> int:
    """Parameter count from shapes alone, so planners need not build the model."""
    d, L = cfg.d_model, cfg.n_layer
    norm = d * (2 if cfg.bias else 1)
    per_block = (3 * d * d + d * d + 8 * d * d) + 2 * norm
    if cfg.bias:
        per_block += 3 * d + d + 4 * d + d
    n = L * per_block + norm + cfg.vocab_size * d  # tied lm_head counts once
    if not non_embedding:
        n += cfg.seq_len * d
    return n


def largest_layer_params(cfg: GPTConfig) -> int:
    """Parameters of the biggest single module: what ZeRO-3 gathers at once."""
    return max(cfg.vocab_size * cfg.d_model, 4 * cfg.d_model * cfg.d_model)


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward): 6N + 12·L·d·T.

    6N counts the matmuls against the weights (2 forward, 4 backward per parameter), the second
    term the attention scores and weighted sums (Kaplan et al. 2020; PaLM appendix B).
    Activation recomputation is not counted: MFU measures useful work.
    """
    return 6 * num_params(cfg) + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
