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
        return _masked(self.valid, start, S)

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


class StaticKVCache(KVCache):
    """A KV cache of one shape for a whole generation, for a compiled decode step (`generate`'s
    `compile`): buffers of `capacity` slots per row, written at the slots this forward fills
    (`slots`, a tensor), and a mask over every slot. Each decode step then has the same shapes
    and reads its position from tensors, so `torch.compile` traces it once; `KVCache`'s views
    grow by a key each step, which a static-shape compile would trace again every step. The
    price: each step attends over all `capacity` slots, the unwritten ones masked (as
    transformers' StaticCache does). Same interface and masking rules as `KVCache`; `valid` is
    (B or 1, capacity), every slot's, and `length` is host-side (the compiled step never reads
    it)."""

    def __init__(self, n_layer: int, capacity: int):
        super().__init__(n_layer, capacity)
        self.slots: torch.Tensor | None = None  # (T,): the slots this forward writes

    def extend(self, T: int, valid: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """As `KVCache.extend`, always with positions (B or 1, T) and a mask (B or 1, 1, T,
        capacity); without padding, one row of each serves the whole batch."""
        start, S = self.length, self.length + T
        if self.capacity < S:
            raise ValueError(f"{S} tokens exceed the static cache's {self.capacity} slots")
        self.length = S
        rows = 1 if self.valid is None else self.valid.shape[0]
        new = torch.ones(rows, T, dtype=torch.bool, device=device) if valid is None else valid
        if self.valid is None:
            self.valid = torch.zeros(new.shape[0], self.capacity, dtype=torch.bool, device=device)
        elif rows < new.shape[0]:  # padding after a first forward without: one row for each
            self.valid = self.valid.expand(new.shape[0], -1).clone()
        self.valid[:, start:S] = new
        self.slots = torch.arange(start, S, device=device)
        return _masked(self.valid, start, S)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys and values (B, KV heads, T, head_dim) at `slots`; return the
        whole buffers. They start as zeros: a masked slot's value still enters the matmul with
        weight 0, and uninitialized memory may hold a NaN, which 0 does not cancel."""
        assert self.slots is not None, "extend() first"
        if self.k[layer] is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        held_k, held_v = self.k[layer], self.v[layer]
        assert held_k is not None and held_v is not None
        held_k.index_copy_(2, self.slots, k)
        held_v.index_copy_(2, self.slots, v)
        return held_k, held_v


def _masked(valid: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (B, T) and the attention mask (B, 1, T, keys) of the tokens in slots
    start..end-1, given `valid` (B, keys) over every key: a token's position counts only the
    real tokens before it; a query attends to real keys at or before its own slot, and always
    to itself, so a padding row's softmax is never empty (its output is unused)."""
    positions = (valid.long().cumsum(1) - 1)[:, start:end].clamp(min=0)
    q = torch.arange(start, end, device=valid.device)[:, None]
    k = torch.arange(valid.shape[1], device=valid.device)[None, :]
    mask = ((k <= q)[None] & valid[:, None, :]) | (k == q)[None]
    return positions, mask[:, None]
