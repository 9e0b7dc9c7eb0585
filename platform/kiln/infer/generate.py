"""Sampling text from a GPT: the controls, the decode loop with its KV cache, and streaming.

Ray-free and DeepSpeed-free: it takes a plain `kiln.model.GPT` and lists of token ids. The
sampling rules follow the definitions users know from transformers' `generate`, so the same
settings mean the same thing in both: repetition penalty as in CTRL (Keskar et al. 2019: a
seen token's positive logit is divided by the penalty, a negative one multiplied), then
temperature, then top-k, then top-p (nucleus: the smallest set of tokens whose probability
reaches p). Temperature 0 is greedy decoding.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.infer.sampling import Sampling
from kiln.kv_cache import KVCache, StaticKVCache
from kiln.model import GPT

log = logging.getLogger(__name__)


@dataclass
class Generated:
    tokens: list[list[int]]
    """The new tokens of each prompt, end-of-text excluded."""
    prefill_s: float
    """Seconds spent on the prompts (one forward over all of them)."""
    decode_s: float
    """Seconds spent generating after the prompts."""

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second, prompt processing included."""
        return self.new_tokens / max(self.prefill_s + self.decode_s, 1e-9)


def next_tokens(
    logits: torch.Tensor, history: torch.Tensor, s: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from `logits` (B, V); `history` (B, n) are the latest token ids of each
    row (-1: none), for the repetition penalty."""
    logits = logits.float()
    if s.repetition_penalty != 1.0 and history.numel():
        seen = history.clamp(min=0)
        picked = logits.gather(1, seen)
        penalised = torch.where(picked > 0, picked / s.repetition_penalty, picked * s.repetition_penalty)
        penalised = torch.where(history >= 0, penalised, picked)
        logits = logits.scatter(1, seen, penalised)
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the likelier tokens
        drop = before >= s.top_p  # the likeliest token always stays (its `before` is 0)
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


STATIC_CACHE_STEP = 32  # a compiled decode's cache holds a multiple of this many slots (see generate)

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights' versions, step)


def compiled_step(model: GPT) -> Callable:
    """`model.decode_step` under `torch.compile`, made once per model and kept while the model
    lives: dynamo's guards then match every later step and call of the same shapes, so it
    traces again only for a new batch or cache size. `fullgraph`: a graph break would split
    the step into pieces that each recompile per layer (the attention reads its layer's
    cache slot), so one is an error here, not a slow fallback. `freezing`: inductor folds the
    weights in as constants and prepacks them for the CPU's matmul kernels (bench/results/generation.md:
    1.34x the unfrozen compile at batch 8 on 2 cores); a frozen graph would keep old
    weights after an in-place update, which dynamo's guards do not see, so a change of any
    weight's version counter drops dynamo's caches and compiles afresh."""
    versions = tuple((id(p), p._version) for p in model.parameters())  # a new or changed weight
    held = _COMPILED.get(model)
    if held is not None and held[0] != versions:
        torch._dynamo.reset()  # the only way to drop a frozen graph whose guards still pass
        held = None
    if held is None:
        step = torch.compile(model.decode_step, fullgraph=True)
        held = versions, functools.partial(_frozen, step)
        _COMPILED[model] = held
    return held[1]


def _frozen(step: Callable, *args):
    """Call `step` with inductor's freezing on, as dynamo reads it when it traces (the same
    key in `torch.compile`'s options comes too late: the weights are graph inputs by then)."""
    with torch._inductor.config.patch(freezing=True):
        return step(*args)


def _left_pad(prompts: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), width), pad, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, p in enumerate(prompts):
        idx[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        valid[row, width - len(p) :] = True
    return idx.to(device), valid.to(device)


def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    s: Sampling,
    eot_id: int,
    vocab_size: int,
    on_tokens: Callable[[list[int | None]], None] | None = None,
    use_cache: bool = True,
    stop_ids: Sequence[int] = (),
    compile: bool = False,
) -> Generated:
    """New tokens for each prompt (a batch, left-padded to one length).

    `vocab_size` is the tokenizer's: ids above it (the model's padding to a multiple of 64) are
    never sampled. `on_tokens` gets each step's token per row (None for a finished row), for
    streaming. `use_cache=False` recomputes every position at each step: the baseline the KV
    cache is measured against. `stop_ids`: tokens that end a row as end-of-text does (a chat
    template's end of turn). `compile`: decode over a StaticKVCache with the step compiled
    (`compiled_step`): the first call per model and batch shape compiles for seconds, then
    each token costs less (bench/results/generation.md); the prompt's forward stays eager."""
    if compile and not use_cache:
        raise ValueError("compile needs the KV cache (use_cache=True)")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max(len(p) for p in prompts) + s.max_new_tokens > model.cfg.seq_len:
        raise ValueError(
            f"prompt plus max_new_tokens ({max(len(p) for p in prompts)} + {s.max_new_tokens}) "
            f"exceeds the model's context of {model.cfg.seq_len} tokens"
        )
    device = next(model.parameters()).device
    model.eval()
    generator = torch.Generator(device=device).manual_seed(s.seed)
    idx, valid = _left_pad(prompts, eot_id, device)
    history = torch.where(valid, idx, -1)[:, -s.repetition_window :] if s.repetition_window else idx[:, :0]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in prompts]
    capacity = idx.shape[1] + s.max_new_tokens  # the most a row will hold: the cache is allocated once
    if compile:  # whole steps of slots: a new prompt length seldom means a new shape to compile, and
        # each step attends over every slot, so steps of 32 waste less than 64 (bench/results/generation.md)
        capacity = min(-(-capacity // STATIC_CACHE_STEP) * STATIC_CACHE_STEP, model.cfg.seq_len)
    cache = (StaticKVCache if compile else KVCache)(model.cfg.n_layer, capacity)
    feed, feed_valid, fast = idx, valid, compiled_step(model) if compile else None
    start = time.perf_counter()
    prefill_s = 0.0
    for step in range(s.max_new_tokens):
        if not use_cache:  # everything so far, from scratch
            cache, feed, feed_valid = KVCache(model.cfg.n_layer), idx, valid
        logits = model.decode(feed, cache, feed_valid, fast if step else None)[:, :vocab_size]
        if step == 0:
            prefill_s = time.perf_counter() - start
        token = next_tokens(logits, history, s, generator)
        token = torch.where(done, torch.full_like(token, eot_id), token)
        finished_now = ((token == eot_id) | torch.isin(token, stops)) & s.stop_at_eot
        emitted = [None if (d or f) else t for d, f, t in zip(done.tolist(), finished_now.tolist(), token.tolist())]
        for row, t in enumerate(emitted):
            if t is not None:
                out[row].append(t)
        if on_tokens is not None:
            on_tokens(emitted)
        done = done | finished_now
        if bool(done.all()):
            break
        feed, feed_valid = token[:, None], None  # all real: a finished row's filler is ignored
        if not use_cache:  # only a recompute reads the whole sequence back
            idx, valid = torch.cat([idx, feed], 1), torch.cat([valid, torch.ones_like(feed, dtype=torch.bool)], 1)
        if s.repetition_window:
            history = torch.cat([history, feed], 1)[:, -s.repetition_window :]
    total = time.perf_counter() - start
    return Generated(out, prefill_s, total - prefill_s)


class TextStream:
    """Turns one row's tokens into text as they come, printing only what is final.

    A token may end in the middle of a UTF-8 character (byte-level BPE splits multi-byte
    characters), which decodes to U+FFFD until its other bytes arrive; such text is held back.
    Decoding the pending tokens together (not one by one) keeps BPE merges and byte runs whole.
    The pending window restarts after whitespace, so the cost per token stays small."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._pending: list[int] = []
        self._shown = ""

    def push(self, token: int) -> str:
        self._pending.append(token)
        text = self._decode(self._pending)
        if text.endswith("\ufffd"):
            return ""
        new, self._shown = text[len(self._shown) :], text
        if text and text[-1].isspace():
            self._pending, self._shown = [], ""
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self._decode(self._pending) if self._pending else ""
        new = text[len(self._shown) :]
        self._pending, self._shown = [], ""
        return new
