"""Tokenizers: raw bytes, or byte-level BPE trained with HF `tokenizers`.

Both append an end-of-text id between documents so the model learns where one stops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

EOT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus EOT = 256. Needs no training and no file."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str | None:
        return None


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) from the `tokenizers` library."""

    kind = "bpe"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def to_json(self) -> str:
        return self._tok.to_str()


def unigram_entropy_bits(counts: np.ndarray) -> float:
    """Entropy of the token frequency distribution, in bits per token: the loss floor of a model
    that knows only how often each token occurs."""
    p = counts[counts > 0].astype(np.float64)
    p /= p.sum()
    return float(-(p * np.log2(p)).sum())


def describe(tok) -> dict:
    return {"type": tok.kind, "vocab_size": int(tok.vocab_size), "eot_id": int(tok.eot_id)}

