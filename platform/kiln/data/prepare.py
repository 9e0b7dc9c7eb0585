"""`kiln data prepare`: text files, dirs, JSONL or Parquet -> tokenized Parquet shards.

Output layout (local dir or s3://bucket/prefix):

    manifest.json            written last: its presence means the dataset is complete
    tokenizer.json           BPE only
    train/part-00000.parquet columns: id int64, tokens fixed_size_list<int32>[seq_len + 1]
    val/part-00000.parquet

Documents are split into train/val before tokenizing (no document is in both), joined with an
end-of-text id, and packed into rows of seq_len + 1 tokens; train rows are shuffled once with a
seed so streaming them in order is already a random order.
Locally everything is written to a temp dir that is renamed into place; on S3 the manifest goes
last and every written object is deleted if anything fails. Either way an interrupted or failed
prepare leaves nothing that looks like a dataset.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import kiln
from kiln.config import MAX_INT, MAX_SEQ_LEN
from kiln.data import replace
from kiln.data.manifest import FORMAT_VERSION, MANIFEST, SAMPLE_ID, TOKENIZER_FILE, TOKENS
from kiln.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    describe,
    pretrained,
    unigram_entropy_bits,
)
from kiln.errors import ConfigError, DataError
from kiln.storage import Location, resolve

log = logging.getLogger(__name__)

MAX_SHARD_TOKENS = 1 << 32  # 16 GiB of int32 tokens: a shard is built and read whole in memory
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".jsonl", ".parquet"}


@dataclass
class PrepareConfig:
    inputs: list[str]
    """Text files, directories (searched recursively for TEXT_SUFFIXES), .jsonl or .parquet."""
    output: str
    """Local directory or s3://bucket/prefix."""
    tokenizer: str = "bpe"
    """'byte' (257 ids, no training), 'bpe' (trained on the train split), or a pretrained one: a
    tokenizer.json, or a Hugging Face checkpoint directory holding one (to fine-tune that model)."""
    vocab_size: int = 4096
    """BPE vocabulary size, including the end-of-text token. Ignored for 'byte'."""
    seq_len: int = 128
    """Tokens a model sees per sequence; rows hold seq_len + 1 for the shifted targets."""
    val_fraction: float = 0.1
    """Share of documents held out for validation (at least one)."""
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
    seed: int = 1234
    """Seeds the train/val split and the row shuffle."""
    if_exists: str = "error"
    """What to do if the output holds a dataset: 'error', 'reuse' (same inputs and settings
    only) or 'overwrite'."""
    s3_endpoint: str = ""
    """S3-compatible endpoint for an s3:// output (default $AWS_ENDPOINT_URL)."""
    on_binary: str = "error"
    """A text input that holds binary data (NUL bytes): 'error' names it and stops, 'skip'
    leaves it out and counts it in the manifest."""


# ---- reading the corpus ------------------------------------------------------------------------
def _input_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in inputs:
        if any(ch in raw for ch in "*?["):  # a glob the shell did not expand (quoted)
            matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(raw), recursive=True))
            if not matches:
                raise DataError(f"input pattern {raw!r} matches no files")
            files.extend(m for m in matches if m.is_file())
            continue
        p = Path(raw).expanduser()
        if not p.exists():
            raise DataError(f"input {raw!r} does not exist")
        if p.is_dir():
            found = sorted(f for f in _walk(p, raw) if f.suffix in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"input directory {raw!r} holds no text files ({sorted(TEXT_SUFFIXES)})")
            files.extend(found)
        else:
            files.append(p)
    return files


def _walk(root: Path, raw: str) -> Iterator[Path]:
    """Every file under `root`. Unlike `Path.rglob`, which skips a directory it cannot list
    without a word, an unreadable directory is an error that names it."""
    def refuse(e: OSError) -> None:
        if Path(e.filename) == root:
            raise DataError(f"input directory {raw!r} cannot be read ({e.strerror})")
        raise DataError(f"input {raw!r}: its directory {e.filename!r} cannot be read ({e.strerror})")

    for folder, _, names in os.walk(root, onerror=refuse):
        for name in names:
            f = Path(folder) / name
            if f.is_file():
                yield f


Document = str | tuple[str, str]  # a text, or an instruction example's (prompt, response)


def _read_documents(path: Path, cfg: PrepareConfig) -> Iterator[Document]:
    fields = (cfg.prompt_field, cfg.response_field) if cfg.prompt_field else (cfg.text_field,)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                for name in fields:
                    if not isinstance(rec, dict) or not isinstance(rec.get(name), str):
                        raise DataError(f"{path}:{lineno}: expected an object with a string field {name!r}")
                yield rec[fields[0]] if len(fields) == 1 else (rec[fields[0]], rec[fields[1]])
    elif path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"input {path} is not a readable Parquet file: {e}") from None
        for name in fields:
            if name not in table.column_names:
                raise DataError(f"input {path} has no column {name!r} (columns: {table.column_names})")
        columns = [table.column(n).to_pylist() for n in fields]
        yield from (c[0] for c in zip(*columns) if c[0]) if len(fields) == 1 else zip(*columns)
    elif cfg.prompt_field:
        raise DataError(f"input {path}: instruction data (--prompt-field/--response-field) is read from .jsonl or "
                        ".parquet files")
    else:
        yield read_text(path)


BINARY_SNIFF = 8192  # bytes looked at for a NUL: text of any encoding Kiln reads has none


class BinaryInput(DataError):
    """A text input that holds binary data."""


def read_text(path: Path) -> str:
    """A text file as UTF-8; invalid bytes become U+FFFD and are counted by `read_corpus`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"input {path} cannot be read: {e.strerror or e}") from None
    if b"\0" in data[:BINARY_SNIFF]:
        raise BinaryInput(f"input {path} holds binary data (NUL bytes), not text")
    return data.decode("utf-8", errors="replace")


@dataclass
class CorpusStats:
    """What reading the corpus found besides the text, recorded in the manifest."""

    binary_files_skipped: int = 0
    invalid_utf8_chars: int = 0
    """U+FFFD characters the decoding put where bytes were not UTF-8 (Latin-1 text, say)."""


def read_corpus(cfg: PrepareConfig, stats: CorpusStats | None = None) -> tuple[list[Document], str]:
    """All non-empty documents, and a content hash of the inputs for the fingerprint."""
    stats = stats if stats is not None else CorpusStats()
    digest = hashlib.sha256()
    docs: list[Document] = []
    for path in _input_files(cfg.inputs):
        try:
            file_docs = list(_read_documents(path, cfg))
        except BinaryInput as e:
            if cfg.on_binary != "skip":
                raise DataError(f"{e}; leave it out of --input, or pass --on-binary skip") from None
            log.warning("%s: skipped", e)
            stats.binary_files_skipped += 1
            continue
        for doc in file_docs:
            text = doc if isinstance(doc, str) else f"{doc[0]}\x1f{doc[1]}"  # a separator no text holds
            if (doc if isinstance(doc, str) else doc[1]).strip():
                stats.invalid_utf8_chars += text.count("\ufffd")
                docs.append(doc)
                digest.update(text.encode("utf-8", errors="replace"))
                digest.update(b"\0")
    if stats.invalid_utf8_chars:
        log.warning("the corpus is not all UTF-8: %d invalid byte sequence(s) were replaced by U+FFFD",
                    stats.invalid_utf8_chars)
    if not docs:
        raise DataError(f"the corpus is empty: {cfg.inputs} hold no non-blank text")
    return docs, digest.hexdigest()


# ---- tokenizing and packing --------------------------------------------------------------------
def _split_documents(docs: list[Document], frac: float, seed: int) -> tuple[list[Document], list[Document]]:
    if len(docs) == 1 and not isinstance(docs[0], str):
        raise DataError("instruction data needs at least two examples: one for training, one for validation")
    if len(docs) == 1:  # one document: hold out its tail instead
        cut = int(len(docs[0]) * (1 - frac))
        return [docs[0][:cut]], [docs[0][cut:]]
    order = np.random.default_rng(seed).permutation(len(docs))
    n_val = min(len(docs) - 1, max(1, round(frac * len(docs))))
    return [docs[i] for i in order[n_val:]], [docs[i] for i in order[:n_val]]


def _pack(tok, docs: list[Document], seq_len: int, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Rows of seq_len + 1 tokens from the documents joined by EOT, and the token counts. An
    instruction example is its prompt's tokens, stored as -(id + 1) (read, not scored), then its
    response's and the EOT."""
    pieces, counts = [], np.zeros(tok.vocab_size, dtype=np.int64)
    eot = np.array([tok.eot_id], dtype=np.int32)
    for i in range(0, len(docs), batch):
        chunk = docs[i : i + batch]
        if chunk and not isinstance(chunk[0], str):
            prompts, responses = tok.encode_batch([d[0] for d in chunk]), tok.encode_batch([d[1] for d in chunk])
            for p, r in zip(prompts, responses):
                pieces.extend((-p - 1, r, eot))
        else:
            for ids in tok.encode_batch(chunk):
                pieces.extend((ids, eot))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    counts += np.bincount(np.where(stream < 0, -stream - 1, stream), minlength=tok.vocab_size)
    n_rows = len(stream) // (seq_len + 1)
    return stream[: n_rows * (seq_len + 1)].reshape(n_rows, seq_len + 1), counts


# ---- writing -----------------------------------------------------------------------------------
def _parquet_bytes(ids: np.ndarray, rows: np.ndarray) -> bytes:
    width = rows.shape[1]
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), pa.int32()), width)
    table = pa.table({SAMPLE_ID: pa.array(ids, pa.int64()), TOKENS: tokens})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _write_split(out: Location, split: str, rows: np.ndarray, id_offset: int, rows_per_shard: int,
                 written: list[str]) -> dict:
    """Write a split's shards under `out`, each path appended to `written` as it is written."""
    shards = []
    for n, start in enumerate(range(0, len(rows), rows_per_shard)):
        chunk = rows[start : start + rows_per_shard]
        data = _parquet_bytes(np.arange(id_offset + start, id_offset + start + len(chunk)), chunk)
        rel = f"{split}/part-{n:05d}.parquet"
        written.append(rel)
        out.join(rel).write_bytes(data)
        shards.append({"path": rel, "rows": len(chunk), "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    return {"rows": int(len(rows)), "tokens": int(rows.size - len(rows)), "shards": shards}


def fingerprint(cfg: PrepareConfig, corpus_hash: str, pretrained_tok=None) -> str:
    tokenizer, vocab = cfg.tokenizer, cfg.vocab_size if cfg.tokenizer == "bpe" else 257
    if pretrained_tok is not None:  # the tokenizer's content, wherever its file lies
        tokenizer = "sha256:" + hashlib.sha256(pretrained_tok.to_json().encode()).hexdigest()
        vocab = pretrained_tok.vocab_size
    settings = dict(tokenizer=tokenizer, vocab_size=vocab,
                    seq_len=cfg.seq_len, val_fraction=cfg.val_fraction, seed=cfg.seed,
                    corpus=corpus_hash, format=FORMAT_VERSION)
    if cfg.prompt_field:  # the same records packed with a loss mask are another dataset
        settings["loss_mask"] = [cfg.prompt_field, cfg.response_field]
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _config_from(fields: dict) -> PrepareConfig:
    known = {f.name: f for f in dataclasses.fields(PrepareConfig)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError(f"prepare: unknown option(s) {unknown}; expected some of {sorted(known)}")
    missing = [n for n in ("inputs", "output") if n not in fields]
    if missing:
        raise ConfigError(f"prepare: {' and '.join(missing)} must be given")
    if isinstance(fields["inputs"], (str, os.PathLike)):
        fields = {**fields, "inputs": [fields["inputs"]]}  # one path is a list of one
    return PrepareConfig(**{k: (list(map(str, v)) if k == "inputs" else v) for k, v in fields.items()})


def _validate(cfg: PrepareConfig) -> None:
    if bool(cfg.prompt_field) != bool(cfg.response_field):
        raise ConfigError("--prompt-field and --response-field go together: give both for instruction data, or neither")
    if cfg.tokenizer not in ("byte", "bpe") and not Path(cfg.tokenizer).exists():
        raise ConfigError(f"--tokenizer {cfg.tokenizer!r}: expected 'byte', 'bpe', or the path of a tokenizer.json "
                          "or of a Hugging Face directory holding one")
    if cfg.tokenizer == "bpe" and not 257 <= cfg.vocab_size <= 1 << 20:
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: expected 257..{1 << 20} for BPE")
    if cfg.vocab_size < 1:
        raise ConfigError(f"--vocab-size {cfg.vocab_size}: expected a positive integer")
    if not 2 <= cfg.seq_len <= MAX_SEQ_LEN:
        raise ConfigError(f"--seq-len {cfg.seq_len}: expected an integer in [2, {MAX_SEQ_LEN:_}]")
    if cfg.shard_tokens < cfg.seq_len + 1:
        raise ConfigError(f"--shard-tokens {cfg.shard_tokens}: expected at least one row of --seq-len + 1 = "
                          f"{cfg.seq_len + 1} tokens per shard")
    if cfg.shard_tokens > MAX_SHARD_TOKENS:
        raise ConfigError(f"--shard-tokens {cfg.shard_tokens}: expected at most {MAX_SHARD_TOKENS:_} tokens "
                          "per shard (a shard is read whole into memory)")
    if not 0 <= cfg.seed <= MAX_INT:
        raise ConfigError(f"--seed {cfg.seed}: expected an integer in [0, 2**53]")
    if cfg.on_binary not in ("error", "skip"):
        raise ConfigError(f"--on-binary {cfg.on_binary!r}: expected error or skip")
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {cfg.val_fraction}: expected a number in (0, 1)")
    if cfg.if_exists not in ("error", "reuse", "overwrite"):
        raise ConfigError(f"--if-exists {cfg.if_exists!r}: expected error, reuse or overwrite")


def _check_output(cfg: PrepareConfig, out: Location, fp: str) -> dict | None:
    """The Kiln dataset already at `out` that `if_exists` allows to reuse or replace (None: the
    output is new or empty); refuse anything else before any work is done."""
    if cfg.if_exists == "overwrite":
        replace.refuse_protected(out)
    first = out.first_entry() if out.exists() else None
    if first is None:
        return None
    old = replace.kiln_manifest(out)
    if old is None:  # found without listing the tree below: --output / must not walk the disk
        raise DataError(f"output {out.uri} already holds files that are not a Kiln dataset (such as "
                        f"{first}); Kiln never writes over them. Choose a new or empty --output")
    same = old.get("fingerprint") == fp
    if same and cfg.if_exists == "reuse":
        return old
    if cfg.if_exists != "overwrite":
        raise DataError(
            f"output {out.uri} already holds {'this same dataset' if same else 'a different dataset'}; it "
            f"is never overwritten silently. Choose another --output, or pass --if-exists "
            f"{'reuse' if same else 'overwrite'}")
    return old


def prepare(cfg: PrepareConfig | None = None, /, **fields) -> dict:
    """Build the dataset and return its manifest (or the existing one, with if_exists=reuse).
    Takes a `PrepareConfig`, or its fields as keywords (`kiln.data.prepare(inputs=[...],
    output=..., tokenizer="bpe")`)."""
    cfg = cfg if cfg is not None else _config_from(fields)
    _validate(cfg)
    given = pretrained(cfg.tokenizer) if cfg.tokenizer not in ("byte", "bpe") else None
    out = resolve(cfg.output, cfg.s3_endpoint)
    if not out.is_s3:
        replace.writable_ancestor(out)
    stats = CorpusStats()
    docs, corpus_hash = read_corpus(cfg, stats)
    fp = fingerprint(cfg, corpus_hash, given)

    old = _check_output(cfg, out, fp)
    if old is not None and cfg.if_exists == "reuse":
        log.info("%s already holds this dataset (fingerprint %s); reusing it", out.uri, fp)
        return old

    t0 = time.time()
    train_docs, val_docs = _split_documents(docs, cfg.val_fraction, cfg.seed)
    if given is not None:
        tok = given
    elif cfg.tokenizer == "byte":
        tok = ByteTokenizer()
    else:
        log.info("training a %d-token BPE on %d documents", cfg.vocab_size, len(train_docs))
        tok = BPETokenizer.train([d if isinstance(d, str) else f"{d[0]}{d[1]}" for d in train_docs], cfg.vocab_size)
    train_rows, train_counts = _pack(tok, train_docs, cfg.seq_len)
    val_rows, _ = _pack(tok, val_docs, cfg.seq_len)
    for name, rows, n_docs in (("train", train_rows, len(train_docs)), ("val", val_rows, len(val_docs))):
        if len(rows) == 0:
            raise DataError(
                f"the corpus is too small for --seq-len {cfg.seq_len}: its {name} split "
                f"({n_docs} documents) has fewer than {cfg.seq_len + 1} tokens"
            )
    train_rows = train_rows[np.random.default_rng(cfg.seed).permutation(len(train_rows))]
    rows_per_shard = max(1, cfg.shard_tokens // (cfg.seq_len + 1))

    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "kiln_version": kiln.__version__,
        "created_unix": int(time.time()),
        "sources": [str(Path(p).expanduser()) for p in cfg.inputs],
        "documents": {"train": len(train_docs), "val": len(val_docs)},
        "tokenizer": describe(tok) | ({"file": TOKENIZER_FILE} if tok.to_json() else {})
        | ({"pretrained": str(Path(cfg.tokenizer).absolute())} if given is not None else {}),
        "seq_len": cfg.seq_len,
        "columns": {SAMPLE_ID: "int64", TOKENS: f"fixed_size_list<int32>[{cfg.seq_len + 1}]"},
        **({"loss_mask": {"scored": "response", "prompt_field": cfg.prompt_field, "response_field": cfg.response_field,
                          "encoding": "a prompt token is stored as -(id + 1): read, not scored"}}
           if cfg.prompt_field else {}),
        "unigram_entropy_bits": unigram_entropy_bits(train_counts),
        "input": dataclasses.asdict(stats),
        "splits": {},
    }
    if old is not None and out.is_s3:
        replace.remove_dataset(out, old)  # no rename on S3: the new dataset is written in place
    staged, written = replace.staging(out), []
    try:
        if tok.to_json():
            staged.join(TOKENIZER_FILE).write_bytes(tok.to_json().encode())
            written.append(TOKENIZER_FILE)
        manifest["splits"]["train"] = _write_split(staged, "train", train_rows, 0, rows_per_shard, written)
        manifest["splits"]["val"] = _write_split(staged, "val", val_rows, len(train_rows), rows_per_shard, written)
        written.append(MANIFEST)
        staged.join(MANIFEST).write_bytes(json.dumps(manifest, indent=2).encode())  # last: commit
        replace.commit(staged, out, old)
    except BaseException:
        replace.discard(staged, written)
        raise
    log.info(
        "wrote %s: %d train / %d val rows of %d tokens, vocab %d, in %.1fs",
        out.uri, len(train_rows), len(val_rows), cfg.seq_len + 1, tok.vocab_size, time.time() - t0,
    )
    return manifest
