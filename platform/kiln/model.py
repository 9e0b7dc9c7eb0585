"""A decoder-only transformer in plain PyTorch, in two families.

- `gpt`: GPT-2's architecture. Learned positions, LayerNorm, a GELU MLP, tied embeddings.
- `llama`: what Llama, Mistral and Qwen-style checkpoints use. Rotary positions (RoPE), RMSNorm,
  a SwiGLU MLP, grouped-query attention (fewer key/value heads than query heads), and
  embeddings tied or not.

Both share one set of module names (wte, blocks.i.{ln_1, attn, ln_2, mlp}, ln_f, lm_head), so
that ZeRO, pipeline stages, activation checkpointing, the memory planner and MFU treat them
alike. This file imports only torch (and generation's KV cache, `kiln.kv_cache`) and reads top
to bottom: config and flavours, norms and rotary positions, attention, MLPs, block, the packed
rows' inputs, targets and document masks, and the model. Parallelism (DeepSpeed ZeRO, pipeline
stages) is applied from outside; nothing here knows about Ray, DeepSpeed or MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute  # activation checkpointing

from kiln.kv_cache import KVCache  # generation's cache of keys and values (also imported from here)


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
    arch: str = "gpt"
    """'gpt' (GPT-2) or 'llama' (RoPE, RMSNorm, SwiGLU, grouped-query attention)."""
    n_kv_head: int = 0
    """Key/value heads (llama); 0: n_head. Fewer than n_head shares each among n_head/n_kv_head
    query heads, which shrinks the KV cache at little cost in quality (GQA, Ainslie et al. 2023)."""
    ffn_hidden: int = 0
    """The MLP's hidden width; 0: 4 x d_model for gpt, and for llama 8/3 x d_model rounded up to
    a multiple of 256 (SwiGLU has three matrices, so 8/3 keeps the parameter count of 4 x)."""
    tie_embeddings: bool = True
    """The output projection shares the token embedding's matrix (fewer params, and better
    perplexity at small scale; Press & Wolf 2017). Large Llamas untie them."""
    head_size: int = 0
    """Width of one attention head; 0: d_model / n_head. Checkpoints whose heads are wider or
    narrower than that (Qwen3, Gemma) set it."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only, with `bias` off elsewhere (Qwen2):
    they let a head shift its queries and keys, which Qwen's training used."""
    rope_theta: float = 10000.0
    """RoPE's base: the wavelengths of the rotary frequencies (10k in Llama 2, 500k in Llama 3)."""
    norm_eps: float = 1e-5
    """Added to the variance in every norm (GPT-2 and Llama 2 use 1e-5, Llama 3 1e-5 too)."""
    rope_scaling: str = ""
    """How a pretrained checkpoint stretched RoPE to a longer context: '' (not at all), 'linear'
    (every frequency divided by rope_factor) or 'llama3' (Llama 3.1's: wavelengths longer than
    rope_original_context / rope_low_freq_factor divided by rope_factor, those shorter than
    rope_original_context / rope_high_freq_factor kept, a smooth blend between)."""
    rope_factor: float = 1.0
    """The scaling's factor (8 in Llama 3.1, 32 in Llama 3.2)."""
    rope_low_freq_factor: float = 1.0
    """llama3: rope_original_context over the wavelength where the divided ones begin."""
    rope_high_freq_factor: float = 4.0
    """llama3: rope_original_context over the wavelength where the kept ones end."""
    rope_original_context: int = 8192
    """llama3: the context the model was pretrained at before it was stretched."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_head

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return 4 * self.d_model if self.arch == "gpt" else -(-8 * self.d_model // 3 // 256) * 256


def shape_problem(cfg: GPTConfig) -> str | None:
    """Why these shapes make no model, in words naming the fields, or None: the one statement
    of it, asked by the model, the config, checkpoint readers and the planner."""
    if cfg.arch not in ("gpt", "llama"):
        return f"arch = {cfg.arch!r}: expected 'gpt' or 'llama'"
    for name in ("n_layer", "n_head", "d_model"):
        if getattr(cfg, name) < 1:
            return f"{name} = {getattr(cfg, name)}: expected a positive integer"
    if cfg.n_kv_head < 0 or cfg.ffn_hidden < 0 or cfg.head_size < 0:
        return "n_kv_head, ffn_hidden and head_size must be 0 (the default) or positive"
    if not cfg.head_size and cfg.d_model % cfg.n_head:
        return f"d_model = {cfg.d_model} is not divisible by n_head = {cfg.n_head}: each head needs a whole share"
    if cfg.n_head % cfg.kv_heads:
        return f"n_head = {cfg.n_head} is not a multiple of n_kv_head = {cfg.kv_heads}"
    if cfg.arch == "llama" and cfg.head_dim % 2:
        return f"head size d_model / n_head = {cfg.head_dim} is odd; RoPE rotates pairs of dimensions"
    return _rope_problem(cfg)


ROPE_SCALINGS = ("", "linear", "llama3")  # what rope_frequencies computes


def _rope_problem(cfg: GPTConfig) -> str | None:
    if cfg.rope_scaling not in ROPE_SCALINGS:
        return f"rope_scaling = {cfg.rope_scaling!r}: expected one of {list(ROPE_SCALINGS)}"
    if cfg.rope_scaling and not cfg.rope_factor > 0:
        return f"rope_factor = {cfg.rope_factor}: expected a positive number"
    if cfg.rope_scaling == "llama3" and not (
        0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor and cfg.rope_original_context > 0
    ):
        return (
            "llama3 RoPE scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor and a positive "
            "rope_original_context"
        )
    return None


# Shapes follow GPT-2 (124M, 350M) and GPT-3 (1.3B XL, 2.7B, 6.7B; 13B with d_model 5120 so heads
# are 128 wide), and Llama 2 7B and Llama 3.2 1B. The debug ones are small enough that a
# training step takes milliseconds on one CPU core, so every test can run the whole training
# function; llama-debug has GQA and untied embeddings, so the tests cover both.
FLAVOURS: dict[str, dict] = {
    "debug": dict(n_layer=2, n_head=4, d_model=128, seq_len=128),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024),
    "350m": dict(n_layer=24, n_head=16, d_model=1024, seq_len=1024),
    "1.3b": dict(n_layer=24, n_head=16, d_model=2048, seq_len=2048),
    "2.7b": dict(n_layer=32, n_head=32, d_model=2560, seq_len=2048),
    "6.7b": dict(n_layer=32, n_head=32, d_model=4096, seq_len=2048),
    "13b": dict(n_layer=40, n_head=40, d_model=5120, seq_len=2048),
    "llama-debug": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=128, seq_len=128, tie_embeddings=False),
    "llama-1b": dict(
        arch="llama",
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        d_model=2048,
        ffn_hidden=8192,
        seq_len=2048,
        rope_theta=500000.0,
    ),
    "llama-7b": dict(
        arch="llama", n_layer=32, n_head=32, d_model=4096, ffn_hidden=11008, seq_len=4096, tie_embeddings=False
    ),
}


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    return ((vocab_size + multiple - 1) // multiple) * multiple


def config_for(flavour: str, **overrides: Any) -> GPTConfig:
    """The GPTConfig of a named flavour, with any field overridden (e.g. vocab_size, seq_len)."""
    if flavour not in FLAVOURS:
        raise KeyError(f"unknown model flavour {flavour!r}; choose one of {sorted(FLAVOURS)}")
    return replace(GPTConfig(**FLAVOURS[flavour]), **overrides)


def norm(cfg: GPTConfig) -> nn.Module:
    """LayerNorm for gpt; RMSNorm for llama (no mean, no bias: cheaper, and as good)."""
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_frequencies(cfg: GPTConfig, device: torch.device) -> torch.Tensor:
    """RoPE's frequency for each channel pair i: theta^(-2i/head_dim) (Su et al. 2021), with the
    checkpoint's scaling (`GPTConfig.rope_scaling`), in fp32."""
    hd, f = cfg.head_dim, cfg.rope_factor
    inv_freq = cfg.rope_theta ** -(torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
    if cfg.rope_scaling == "linear":
        return inv_freq / f
    if cfg.rope_scaling == "llama3":  # Meta's apply_scaling (llama-models), as transformers does it
        wavelen = 2 * math.pi / inv_freq
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        smooth = (cfg.rope_original_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / f + smooth * inv_freq
        long, short = wavelen > cfg.rope_original_context / low, wavelen < cfg.rope_original_context / high
        return torch.where(long, inv_freq / f, torch.where(short, inv_freq, blended))
    return inv_freq


def rotary(positions: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, T, head_dim) of RoPE's angles for `positions` (B, T) or (T,): channel
    pair i turns by position x its frequency (`rope_frequencies`), in fp32."""
    angles = positions.float()[..., None] * rope_frequencies(cfg, positions.device)
    angles = torch.cat([angles, angles], dim=-1)  # the half-split layout Llama checkpoints use
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, None], angles.sin()[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + turned * sin).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        problem = shape_problem(cfg)
        if problem:
            raise ValueError(problem)
        self.cfg, self.layer = cfg, layer  # layer: which of a KVCache's slots is this block's
        hd = cfg.head_dim
        # One matmul for queries, keys and values (faster than three).
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * hd, bias=cfg.bias or cfg.qkv_bias)
        self.proj = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_projection = True

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.cfg.n_head, self.cfg.kv_heads, self.cfg.head_dim
        qkv = self.qkv(x)
        # Tensor parallelism splits the projection by whole heads, so a rank holds 1/k of them:
        # its share of q, k and v heads follows from the width it computed (k = 1: all of them).
        shards = (H + 2 * KV) * hd // qkv.shape[-1]
        H, KV = H // shards, KV // shards
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=2)
        # (B, T, heads * hd) -> (B, heads, T, hd)
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        if self.cfg.arch == "llama":
            if rope is None:  # called alone (a pipeline stage's block): positions 0..T-1
                rope = rotary(torch.arange(T, device=x.device), self.cfg)
            q, k = rotate(q, *rope), rotate(k, *rope)
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
        # SDPA picks flash / memory-efficient kernels where available. No mask is causal, or with
        # one query (a decode step) every cached key; a KVCache gives one where rows are padded
        # or the queries are the last T of S > T positions, and packed documents give their
        # block-diagonal causal one (`document_attention`).
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            enable_gqa=KV != H,
            dropout_p=self.cfg.dropout if self.training else 0.0,
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, H * hd))


class MLP(nn.Module):
    """GELU (gpt), or SwiGLU for llama: down(silu(gate(x)) * up(x)) (Shazeer 2020), with gate
    and up in one matmul."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        self.fc = nn.Linear(cfg.d_model, (2 if self.swiglu else 1) * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.dropout(self.proj(F.silu(gate) * up))
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, cache, mask)
        return x + self.mlp(self.ln_2(x))


def embed(
    wte: nn.Embedding,
    wpe: nn.Embedding | None,
    drop: nn.Dropout,
    idx: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token embeddings, plus learned position embeddings where the model has them (gpt; llama
    rotates queries and keys instead), then dropout: the input of the first block (of the model,
    and of a pipeline's first stage). `positions` (B, T) default to 0..T-1."""
    x = wte(idx)
    if wpe is not None:
        x = x + wpe(torch.arange(idx.shape[1], device=idx.device) if positions is None else positions)
    return drop(x)


IGNORE = -100  # a target that is not scored (F.cross_entropy's ignore_index)
DOC_START = 1 << 32  # added to a row's token where a document begins (in memory: the data source marks it)


def inputs_and_targets(
    rows: torch.Tensor, documents: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A batch of packed rows (B, T + 1) as the model's inputs (B, T), targets (B, T) and, with
    `documents`, each input's document within its row (B, T), else None.

    Instruction data stores a context token (a prompt's) as -(id + 1): the model reads it, but
    is not scored on predicting it, so the loss counts only response tokens. Pretraining rows
    hold no negative ids, and every target counts. A token that begins a document carries
    DOC_START on top (whatever its sign: the ids are below 2**31, so a marked one is above).
    With `documents`, the target at the token before a document's first (the previous
    document's last) is not scored: a document's first token is never predicted from another,
    as when each document is trained alone."""
    marked = rows >= DOC_START // 2
    rows = rows - marked.long() * DOC_START
    ids = torch.where(rows < 0, -rows - 1, rows)
    targets = torch.where(rows[:, 1:] < 0, IGNORE, rows[:, 1:])
    if not documents:
        return ids[:, :-1], targets, None
    doc = marked.long().cumsum(1)  # the row's first (partial) document is 0
    targets = torch.where(doc[:, 1:] != doc[:, :-1], IGNORE, targets)
    return ids[:, :-1], targets, doc[:, :-1]


def document_attention(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row's document ids (B, T): every token's position within its document (B, T),
    and the block-diagonal causal mask (B, 1, T, T) that lets a token attend to the earlier
    tokens of its own document only (SDPA's boolean attn_mask: True attends)."""
    T = documents.shape[1]
    at = torch.arange(T, device=documents.device)
    first = torch.where(documents[:, 1:] != documents[:, :-1], at[1:], 0)  # where each document begins
    first = torch.cat([torch.zeros_like(documents[:, :1]), first], dim=1).cummax(1).values
    same = documents[:, :, None] == documents[:, None, :]
    return at - first, (same & (at[:, None] >= at[None, :]))[:, None]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the scored next-token predictions (targets equal to IGNORE are
    not), in fp32 whatever the compute precision (a bf16 softmax over 50k logits loses the
    small probabilities). A batch with nothing to score has loss 0, not NaN."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=IGNORE, reduction="sum")
    return total / (flat != IGNORE).sum().clamp(min=1)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, init_weights: bool = True):
        """`init_weights=False` leaves the init to the caller: a ZeRO-3 wrapper that builds the
        model already partitioned must gather each weight before `init_module` can fill it."""
        super().__init__()
        self.cfg = cfg
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see `_decode_rope`
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.arch == "gpt" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie()
        if init_weights:
            self.apply(self.init_module)

    def tie(self) -> None:
        """Share the token embedding with the output projection, where the config ties them
        (again after anything that makes new tensors, such as materializing from meta)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

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

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin once per forward for all blocks (llama); None for gpt."""
        return rotary(positions, self.cfg) if self.cfg.arch == "llama" else None

    def _decode_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`_rope` for a decode step, looked up in a table of every position's cos/sin computed
        once per device (the same values: each position's angles are computed alike). Training
        keeps computing them per forward, so a compiled training graph never reads this state."""
        if self.cfg.arch != "llama":
            return None
        table = self._rope_table
        if table is None or table[0].device != positions.device:
            cos, sin = rotary(torch.arange(self.cfg.seq_len, device=positions.device), self.cfg)
            self._rope_table = table = (cos[0, 0], sin[0, 0])  # (seq_len, head_dim) each
        cos, sin = table[0][positions], table[1][positions]
        if cos.dim() == 2:  # positions (T,): one row of angles for the whole batch
            cos, sin = cos[None], sin[None]
        return cos[:, None], sin[:, None]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for `idx` (B, T); with `targets`, also the mean next-token cross-entropy. With
        `documents` (B, T: each token's document in its row, `inputs_and_targets`), a token
        attends only within its document, whose positions count from 0 (packed documents do
        not see each other); without, the whole row is one causal sequence."""
        T = idx.shape[1]
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence of length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        positions, mask = torch.arange(T, device=idx.device), None
        if documents is not None:
            positions, mask = document_attention(documents)
        x = embed(self.wte, self.wpe, self.drop, idx, positions if mask is not None else None)
        rope = self._rope(positions)
        for block in self.blocks:
            if self.cfg.activation_checkpointing and self.training:
                x = recompute(block, x, rope, None, mask, use_reentrant=False)
            else:
                x = block(x, rope, None, mask)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, next_token_loss(logits, targets)

    @torch.no_grad()
    def decode(
        self,
        idx: torch.Tensor,
        cache: KVCache,
        valid: torch.Tensor | None = None,
        step: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits of the last position of each row, for `idx` (B, T) fed after what `cache` holds
        (the prompt first, then one token at a time). `valid` marks real tokens (False: left
        padding); default all real. `step`: what runs the forward, default `decode_step`
        (generation passes it compiled, over a StaticKVCache)."""
        if cache.length + idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"{cache.length + idx.shape[1]} tokens exceed the model's seq_len {self.cfg.seq_len}")
        positions, mask = cache.extend(idx.shape[1], valid, idx.device)  # the host's bookkeeping
        return (step or self.decode_step)(idx, positions, mask, cache)

    def decode_step(
        self, idx: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: KVCache
    ) -> torch.Tensor:
        """The forward of `decode`, tensors in and out: what `torch.compile` traces."""
        x = embed(self.wte, self.wpe, self.drop, idx, positions)
        rope = self._decode_rope(positions)
        for block in self.blocks:
            x = block(x, rope, cache, mask)
        return self.lm_head(self.ln_f(x[:, -1]))
