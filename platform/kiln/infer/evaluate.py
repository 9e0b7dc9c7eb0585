"""`kiln eval`: a model's loss and bits per byte on a split of a prepared dataset.

Loss per token depends on the tokenizer (a bigger vocabulary packs more text into a token), so
it is also reported per byte of text: the summed loss in bits over the split's targets, divided
by the UTF-8 bytes those target tokens stand for. Models with different tokenizers compare on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.data.check import masks_by_default
from kiln.data.manifest import Manifest
from kiln.data.sources import ParquetSource
from kiln.data.tokenizer import token_bytes
from kiln.errors import ConfigError
from kiln.infer.load import LoadedModel
from kiln.model import IGNORE, inputs_and_targets


@dataclass
class EvalResult:
    split: str
    tokens: int
    """Target tokens scored."""
    bytes: int
    """UTF-8 bytes of text those tokens stand for."""
    loss: float
    """Mean cross-entropy, nats per token."""
    bits_per_byte: float

    def metrics(self) -> dict[str, float]:
        return {
            f"eval/{self.split}/loss": self.loss,
            f"eval/{self.split}/bits_per_byte": self.bits_per_byte,
            f"eval/{self.split}/tokens": float(self.tokens),
        }


def _batches(manifest: Manifest, split: str, batch_size: int, documents: bool) -> Iterator[torch.Tensor]:
    """Every row of `split` in manifest order, `batch_size` at a time, the last batch partial
    (a training source leaves out a tail that does not fill a micro-batch; scoring may not)."""
    held: list[torch.Tensor] = []
    for _, row in ParquetSource(manifest, 0, 1, 1, documents=documents).epoch(split):
        held.append(row)
        if len(held) == batch_size:
            yield torch.cat(held)
            held = []
    if held:
        yield torch.cat(held)


def evaluate(
    loaded: LoadedModel,
    manifest: Manifest,
    split: str = "val",
    batch_size: int = 8,
    max_batches: int = 0,
    device: str = "cpu",
    documents: bool | None = None,
) -> EvalResult:
    """Score every row of `split`, the last partial batch included (or the first `max_batches`
    batches), with `loaded`'s model; `documents`: attend within each row's documents (None:
    as a run's data.document_mask = auto does, for instruction and chat data that record them)."""
    if documents is None:
        documents = masks_by_default([manifest])
    if manifest.tokenizer().vocab() != loaded.tokenizer.vocab():
        raise ConfigError(
            f"--data {manifest.location.uri}: tokenized with another tokenizer than the model's; "
            "prepare it with the model's (kiln data prepare --tokenizer <its export>)"
        )
    if manifest.seq_len > loaded.cfg.seq_len:
        raise ConfigError(
            f"--data {manifest.location.uri}: rows of {manifest.seq_len} tokens exceed the model's "
            f"context of {loaded.cfg.seq_len}"
        )
    model = loaded.build(device)
    per_token = torch.from_numpy(token_bytes(loaded.tokenizer))
    nats, tokens, nbytes = 0.0, 0, 0
    for i, rows in enumerate(_batches(manifest, split, batch_size, documents)):
        if max_batches and i >= max_batches:
            break
        inputs, targets, docs = inputs_and_targets(rows.long(), documents)  # instruction data: responses only
        with torch.no_grad():
            # Over the tokenizer's vocab: Kiln's padding ids are never targets, and an export drops them.
            where = None if docs is None else docs.to(device)
            logits = model(inputs.to(device), documents=where)[..., : loaded.vocab_size].float()
        scored = targets != IGNORE
        nats += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).cpu(), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
        ).item()
        tokens += int(scored.sum())
        nbytes += int(per_token[targets[scored]].sum())
    if tokens == 0:
        raise ConfigError(f"--data {manifest.location.uri}: its {split} split has no token to score")
    return EvalResult(split, tokens, nbytes, nats / tokens, nats / math.log(2) / max(nbytes, 1))
