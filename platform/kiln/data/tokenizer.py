"""Tokenizers: raw bytes, or byte-level BPE trained with HF `tokenizers`.

Both append an end-of-text id between documents so the model learns where one stops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

EOT = "<|endoftext|>"
# A pretrained tokenizer's files beside its tokenizer.json that tell transformers how to use it
# (special tokens, the chat template): a dataset keeps them, and an export writes them back.
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus EOT = 256. Needs no training and no file."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: Sequence[str], special: bool = True) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        return EOT if i == self.eot_id else _bytes_to_unicode()[i]

    def special_id(self, name: str) -> int | None:
        return None  # no companion files name special tokens for raw bytes

    def vocab(self) -> dict[str, int]:
        return {self.id_to_token(i): i for i in range(self.vocab_size)}

    def to_json(self) -> str | None:
        return None

    def hf_json(self) -> str:
        """This tokenizer as a `tokenizers` file, for exports that other tools load: byte-level
        BPE with no merges, so each byte is its own token with the same id (GPT-2's byte-to-
        character table), and EOT a special token at 256."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        chars = _bytes_to_unicode()
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOT])
        return tok.to_str()


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) from the `tokenizers` library."""

    kind = "bpe"

    def __init__(self, tok, eot_id: int | None = None):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT) if eot_id is None else eot_id
        self.companions: dict[str, str] = {}  # COMPANIONS' texts, where it came with them

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def special_id(self, name: str) -> int | None:
        """The id of the special token its tokenizer_config.json names `name` (bos_token,
        eos_token, ...), or None."""
        from kiln.data.chat import special_tokens

        text = special_tokens(self.companions).get(name)
        return self.token_to_id(text) if isinstance(text, str) else None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A text's ids (no special tokens added around it) and each one's character span."""
        e = self._tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

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
    def from_json(cls, text: str, eot_id: int | None = None) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text), eot_id)

    def encode_batch(self, texts: Sequence[str], special: bool = True) -> list[np.ndarray]:
        """Each text's ids; `special`: with what the tokenizer's post-processor adds around a
        text (a Llama 3 tokenizer's BOS), as at the start of a document or an example."""
        return [
            np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(list(texts), add_special_tokens=special)
        ]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def id_to_token(self, i: int) -> str:
        return self._tok.id_to_token(i)

    def vocab(self) -> dict[str, int]:
        """Token text -> id, special tokens included: two tokenizers with equal vocabs (and
        merges, which follow from a file's vocab in practice) give the same ids."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str()

    def hf_json(self) -> str:
        return self._tok.to_str()


Tokenizer = ByteTokenizer | BPETokenizer  # what a dataset's manifest describes


def unigram_entropy_bits(counts: np.ndarray) -> float:
    """Entropy of the token frequency distribution, in bits per token: the loss floor of a model
    that knows only how often each token occurs."""
    p = counts[counts > 0].astype(np.float64)
    p /= p.sum()
    return float(-(p * np.log2(p)).sum())


# End-of-text tokens of common pretrained tokenizers (GPT-2, Llama 2, Llama 3, Qwen/ChatML, Gemma).
EOT_NAMES = (EOT, "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")


def pretrained(path: str) -> BPETokenizer:
    """A pretrained tokenizer: a `tokenizer.json`, or a Hugging Face checkpoint directory that
    holds one. Its end-of-text id is the directory's config.json `eos_token_id` where there is
    one, else the first of EOT_NAMES it knows."""
    import json
    from pathlib import Path

    from kiln.errors import ConfigError

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    try:
        text = file.read_text()
        tok = BPETokenizer.from_json(text, eot_id=-1)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"tokenizer {file}: not readable ({e}); expected a tokenizer.json or a directory holding one"
        ) from None
    except Exception as e:  # tokenizers raises its own exception type for a malformed file
        raise ConfigError(f"tokenizer {file}: not a tokenizers file ({str(e)[:200]})") from None
    eos = None
    config = file.parent / "config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if not (isinstance(eos, int) and 0 <= eos < tok.vocab_size):
        eos = next((tok._tok.token_to_id(n) for n in EOT_NAMES if tok._tok.token_to_id(n) is not None), None)
    if eos is None:
        raise ConfigError(
            f"tokenizer {file}: has no end-of-text token (none of {list(EOT_NAMES)}, and no "
            "eos_token_id in a config.json beside it)"
        )
    tok.eot_id = eos
    if p.is_dir():
        tok.companions = {name: (p / name).read_text() for name in COMPANIONS if (p / name).is_file()}
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, which byte-level BPE files use;
    `tokenizers` applies it internally but does not expose it in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def from_description(desc: dict, tokenizer_json: str | None, companions: dict[str, str] | None = None):
    """The tokenizer a manifest describes (`describe`'s dict), with its file's text for BPE and
    the COMPANIONS it came with."""
    if desc["type"] == "byte":
        return ByteTokenizer()
    if tokenizer_json is None:
        raise ValueError("a BPE tokenizer needs its tokenizer.json")
    tok = BPETokenizer.from_json(tokenizer_json, desc.get("eot_id"))
    tok.companions = dict(companions or {})
    return tok


def token_bytes(tok) -> np.ndarray:
    """UTF-8 bytes of text each token id stands for (special tokens: 0), so that a loss in nats
    per token becomes bits per byte, comparable across tokenizers. Byte-level BPE tokens map
    back through GPT-2's byte table (a token may hold part of a character); other pretrained
    tokens are measured by decoding them alone."""
    n = int(tok.vocab_size)
    if isinstance(tok, ByteTokenizer):
        out = np.ones(n, dtype=np.int64)
        out[tok.eot_id] = 0
        return out
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    special = {t.content for t in tok._tok.get_added_tokens_decoder().values() if t.special}
    out = np.zeros(n, dtype=np.int64)
    for i in range(n):
        text = tok.id_to_token(i)
        if text is None or text in special:
            continue
        out[i] = len(text) if all(c in to_byte for c in text) else len(tok.decode([i]).encode("utf-8"))
    return out


def describe(tok) -> dict:
    return {"type": tok.kind, "vocab_size": int(tok.vocab_size), "eot_id": int(tok.eot_id)}
