"""`kiln data prepare`'s settings: `PrepareConfig`, each field documented, and the one set of
rules every way in (the CLI's flags, `kiln.data.prepare(**fields)`) is checked by, before any
listing, Ray or output is touched."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ConfigError
from kiln.limits import MAX_INT, MAX_SEQ_LEN
from kiln.schemas import validated

MAX_SHARD_TOKENS = 1 << 32  # 16 GiB of int32 tokens: a shard is built and read whole in memory


@dataclass
class PrepareConfig:
    inputs: list[str]
    """Text files, directories (searched recursively for text, .jsonl and .parquet files),
    quoted globs, and s3:// objects or prefixes."""
    output: str
    """Local directory or s3://bucket/prefix."""
    tokenizer: str = "bpe"
    """'byte' (257 ids, no training), 'bpe' (trained on a sample of the train split), or a
    pretrained one: a tokenizer.json, or a Hugging Face checkpoint directory holding one (to
    fine-tune that model)."""
    vocab_size: int = 4096
    """BPE vocabulary size, including the end-of-text token. Ignored for 'byte'."""
    seq_len: int = 128
    """Tokens a model sees per sequence; rows hold seq_len + 1 for the shifted targets."""
    val_fraction: float = 0.1
    """Share of documents held out for validation, each drawn on its own with this chance."""
    shard_tokens: int = 1 << 20
    """Target tokens per Parquet shard (~4 MiB at int32)."""
    text_field: str = "text"
    """Field of JSONL records / column of Parquet inputs that holds the text."""
    prompt_field: str = ""
    """Instruction data's prompt field; with response_field, see there."""
    response_field: str = ""
    """Instruction data: with both set, each JSONL record (or Parquet row) holds a prompt and a
    response, packed as prompt + response + EOT, and only the response and its EOT are scored
    (a prompt token is stored as -(id + 1): `kiln.model.inputs_and_targets`)."""
    chat_field: str = ""
    """Chat data: the field (JSONL) or column (Parquet) of each record holding a conversation,
    a list of {role, content} messages (roles system, user, assistant, tool). It is rendered with
    the tokenizer's chat template as transformers' apply_chat_template renders it, and only the
    assistant turns (each with the template's end of turn) are scored."""
    chat_template: str = ""
    """With chat_field: a Jinja chat template file to use instead of the tokenizer's own."""
    seed: int = 1234
    """Seeds the train/val split, the order of the inputs and the row shuffle."""
    if_exists: str = "error"
    """What to do if the output holds a dataset: 'error', 'reuse' (same inputs and settings
    only) or 'overwrite'."""
    s3_endpoint: str = ""
    """S3-compatible endpoint for s3:// inputs and output (default $AWS_ENDPOINT_URL)."""
    on_binary: str = "error"
    """A text input that holds binary data (NUL bytes): 'error' names it and stops, 'skip'
    leaves it out and counts it in the manifest."""
    on_bad_record: str = "error"
    """A JSONL record that is not JSON or lacks the field: 'error' names the file and line,
    'skip' leaves it out and counts it in the manifest."""
    unit_bytes: int = 32 << 20
    """Input bytes per unit of work: a tokenizer task reads, tokenizes and writes this much at
    once, so it bounds each worker's memory (a few times it at peak)."""
    bpe_sample_bytes: int = 64 << 20
    """Text the BPE is trained on, at most: the first train documents in the seeded order.
    Bounds the driver's memory and time for a corpus of any size."""


def config_from(fields: dict) -> PrepareConfig:
    known = {f.name: f for f in dataclasses.fields(PrepareConfig)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(f"prepare: unknown option(s) {unknown}; expected some of {sorted(known)}")
    missing = [n for n in ("inputs", "output") if n not in fields]
    if missing:
        raise ConfigError(f"prepare: {' and '.join(missing)} must be given")
    if isinstance(fields["inputs"], (str, os.PathLike)):
        fields = {**fields, "inputs": [fields["inputs"]]}  # one path is a list of one
    if isinstance(fields["inputs"], (list, tuple)):
        fields = {**fields, "inputs": [os.fspath(i) if isinstance(i, os.PathLike) else i for i in fields["inputs"]]}
    if isinstance(fields["output"], os.PathLike):
        fields = {**fields, "output": os.fspath(fields["output"])}
    # The same rules as the CLI's flags, strictly typed: "64" or 64.0 is not an integer here.
    validated(dict[str, typing.Any], fields, "prepare")
    for name, value in fields.items():
        validated(typing.get_type_hints(PrepareConfig)[name], value, f"prepare: {name}")
    return PrepareConfig(**fields)


def validate_config(cfg: PrepareConfig) -> None:
    """Every flag's rule, before any listing, Ray or output is touched."""
    if bool(cfg.prompt_field) != bool(cfg.response_field):
        raise ConfigError("--prompt-field and --response-field go together: give both for instruction data, or neither")
    if cfg.chat_field and cfg.prompt_field:
        raise ConfigError("--chat-field and --prompt-field/--response-field are two kinds of data: give one")
    if cfg.chat_template and not cfg.chat_field:
        raise ConfigError("--chat-template is for chat data: give --chat-field too")
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        raise ConfigError(f"--chat-template {cfg.chat_template!r}: no such file; expected a Jinja chat template")
    if cfg.tokenizer not in ("byte", "bpe") and not Path(cfg.tokenizer).exists():
        raise ConfigError(
            f"--tokenizer {cfg.tokenizer!r}: expected 'byte', 'bpe', or the path of a tokenizer.json "
            "or of a Hugging Face directory holding one"
        )
    if cfg.tokenizer == "bpe" and not 257 <= cfg.vocab_size <= 1 << 20:
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: expected 257..{1 << 20} for BPE")
    if cfg.vocab_size < 1:
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: expected a positive integer")
    if not 2 <= cfg.seq_len <= MAX_SEQ_LEN:
        raise ConfigError(f"--seq-len {cfg.seq_len}: expected an integer in [2, {MAX_SEQ_LEN:_}]")
    if cfg.shard_tokens < cfg.seq_len + 1:
        raise ConfigError(
            f"--shard-tokens {cfg.shard_tokens}: expected at least one row of --seq-len + 1 = "
            f"{cfg.seq_len + 1} tokens per shard"
        )
    if cfg.shard_tokens > MAX_SHARD_TOKENS:
        raise ConfigError(
            f"--shard-tokens {cfg.shard_tokens}: expected at most {MAX_SHARD_TOKENS:_} tokens "
            "per shard (a shard is read whole into memory)"
        )
    if not 0 <= cfg.seed <= MAX_INT:
        raise ConfigError(f"--seed {cfg.seed}: expected an integer in [0, 2**53]")
    if cfg.on_binary not in ("error", "skip"):
        raise ConfigError(f"--on-binary {cfg.on_binary!r}: expected error or skip")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {cfg.val_fraction}: expected a number in (0, 1)")
    if cfg.if_exists not in ("error", "reuse", "overwrite"):
        raise ConfigError(f"--if-exists {cfg.if_exists!r}: expected error, reuse or overwrite")
    if cfg.on_bad_record not in ("error", "skip"):
        raise ConfigError(f"--on-bad-record {cfg.on_bad_record!r}: expected error or skip")
    if cfg.unit_bytes < 1 << 10:
        raise ConfigError(f"--unit-bytes {cfg.unit_bytes}: expected at least 1024 bytes of input per unit")
    if cfg.bpe_sample_bytes < 1:
        raise ConfigError(f"--bpe-sample-bytes {cfg.bpe_sample_bytes}: expected a positive number of bytes")
