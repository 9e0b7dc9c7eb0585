"""The KV cache of generation: the keys and values of every token decoded so far, so that each
new token attends to them without recomputing them. Plain torch, like the model (`kiln.model`),
whose attention writes and reads it."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every token decoded so far, one pair per block, so that each new token
    attends to them without recomputing them (generation only; training never passes one).

    Rows may be left-padded: `valid` (B, S) marks the real tokens among the S cached ones, and a
    query attends to valid keys at or before its own position. Each token also always sees itself,
    so a padding row's softmax is never empty (its output is unused). Without padding, no mask is
    built: a new token sees every cached key, and a first batch is plainly causal."""

    def __init__(self, n_layer: int, capacity: int = 0):
        """`capacity`: the tokens a row will hold at most (prompt + new tokens), allocated at the
        first token, so that decoding writes each key in place instead of copying the whole cache
        every step; 0, or too few, grows by doubling."""
        self.k: list[torch.Tensor | None] = [None] * n_layer  # (B, KV heads, allocated, head_dim)
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.capacity = capacity
        self.length = 0  # tokens cached so far, S
        self.valid: torch.Tensor | None = None  # (B, S) bool, once any row has had padding

    def extend(
        self, T: int, valid: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Register T new tokens per row (`valid`: (B, T) bool, False for left padding; None: all
        real); return their positions ((B, T), or (T,) when every row has the same) and the
        attention mask (B, 1, T, S) for this forward, or None: see `CausalSelfAttention`."""
        start, S = self.length, self.length + T
        self.length = S
        if self.valid is None and (valid is None or bool(valid.all())):
            positions = torch.arange(start, S, device=device)
            if T == 1 or start == 0:
                return positions, None
            return positions, (positions[:, None] >= torch.arange(S, device=positions.device))[None, None]
        if valid is None:
            assert self.valid is not None  # else the branch above returned
            valid = torch.ones(self.valid.shape[0], T, dtype=torch.bool, device=device)
        past = (
            self.valid if self.valid is not None else torch.ones(valid.shape[0], start, dtype=torch.bool, device=device)
        )
        self.valid = torch.cat([past, valid], dim=1)
        counted = self.valid.long().cumsum(1) - 1  # a token's position counts only real tokens
        positions = counted[:, start:].clamp(min=0)
        q = torch.arange(start, S, device=device)[:, None]
        k = torch.arange(S, device=device)[None, :]
        mask = (k <= q)[None] & self.valid[:, None, :]  # causal, and only real keys
        mask = mask | (k == q)[None]  # a token always sees itself
        return positions, mask[:, None]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's T keys and values (B, KV heads, T, head_dim) after the cached ones
        (`extend` has counted them already); return all S so far, as views of the buffers."""
        end = self.length
        start = end - k.shape[2]
        held_k, held_v = self.k[layer], self.v[layer]
        if held_k is None or held_v is None or held_k.shape[2] < end:
            size = max(self.capacity, end, 2 * (held_k.shape[2] if held_k is not None else 0))
            grown_k, grown_v = (t.new_empty(*t.shape[:2], size, t.shape[3]) for t in (k, v))
            if held_k is not None and held_v is not None:
                grown_k[:, :, :start], grown_v[:, :, :start] = held_k[:, :, :start], held_v[:, :, :start]
            self.k[layer], self.v[layer] = held_k, held_v = grown_k, grown_v
        held_k[:, :, start:end] = k
        held_v[:, :, start:end] = v
        return held_k[:, :, :end], held_v[:, :, :end]
