"""The sampling controls of `kiln generate`, apart from the decode loop (kiln.infer.generate).

Torch-free, so the CLI can take its defaults for `kiln generate --help` without importing torch
into every `kiln` command (it cost `kiln data prepare` 1.5 s and about 250 MiB before).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    """Tokens to generate per prompt at most (fewer where end-of-text comes first)."""
    temperature: float = 0.8
    """Divides the logits: < 1 sharpens, > 1 flattens; 0 is greedy (always the likeliest token)."""
    top_k: int = 0
    """Sample only among the k likeliest tokens; 0: no limit."""
    top_p: float = 1.0
    """Sample only among the likeliest tokens whose probabilities sum to p; 1: no limit."""
    repetition_penalty: float = 1.0
    """> 1 makes tokens seen in the last `repetition_window` tokens less likely; 1: off."""
    repetition_window: int = 64
    """How many of the latest tokens (prompt included) the repetition penalty looks at."""
    seed: int = 0
    """Seeds the sampler's own generator, so the same settings give the same text."""
    stop_at_eot: bool = True
    """Stop a row at the end-of-text token (it is not printed)."""
