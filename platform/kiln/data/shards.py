"""One unit of `kiln data prepare`: its documents tokenized, packed into rows, shuffled and
written as Parquet shards. Runs in a tokenizer actor on Ray, or in the preparing process.

Layout of a shard: columns id (int64), tokens (fixed_size_list<int32>[seq_len + 1]) and starts
(list<int32>: the offsets in the row where a document or example begins), in row groups of
`row_group_rows` rows, so that a data-parallel replica reads the row groups that hold its
micro-batches and no others (`kiln.data.order.read_slice`). Ids are unique across the
dataset and consecutive within a shard, which records its first id in the manifest: unit u's
rows are numbered from u * 2**32, train rows first, then validation rows.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.data.chat import encode_chat
from kiln.data.inputs import ReadOptions, ReadStats, Unit, document_text, read_unit
from kiln.data.manifest import SAMPLE_ID, STARTS, TOKENS
from kiln.storage import resolve, write_once

UNIT_ID_BITS = 32  # a unit holds fewer than 2**32 rows; 2**31 units fit an int64 id
ENCODE_BATCH = 256  # documents handed to the tokenizer at once: its threads share them
ROW_GROUP_BYTES = 32 << 10  # a row group's size in bytes, about: small enough that a replica's
# micro-batch (a few rows of thousands of tokens) spans whole groups, large enough that a
# group's footer entry (~100 bytes per column) costs under 1% of it.
UNITS_DIR = "_units"  # a finished unit's record, while the prepare runs: what a resume keeps


def row_group_rows(seq_len: int) -> int:
    """Rows per row group for a sequence length: a power of two (micro-batches are usually
    one, so they start on group boundaries), about ROW_GROUP_BYTES of tokens, at least 1."""
    rows = max(1, ROW_GROUP_BYTES // (4 * (seq_len + 1)))
    return 1 << (rows.bit_length() - 1)


@dataclass
class UnitJob:
    """What a tokenizer task needs, sent to each actor once: the tokenizer (as its JSON, or
    'byte'), the read and pack settings, and where the staged dataset is written."""

    tokenizer: str
    eot_id: int
    seq_len: int
    rows_per_shard: int
    group_rows: int
    read: ReadOptions
    staged_uri: str
    s3_endpoint: str = ""
    key: str = ""
    """The prepare's key (inputs and settings): a record carries it, and a resume keeps only
    the records of its own key."""
    chat_template: str = ""
    """Chat data's template (kiln.data.chat); empty for other data."""
    companions: dict = field(default_factory=dict)
    """The tokenizer's companion files, whose special tokens the template uses."""

    def make_tokenizer(self):
        from kiln.data.tokenizer import BPETokenizer, ByteTokenizer

        if self.tokenizer == "byte":
            return ByteTokenizer()
        tok = BPETokenizer.from_json(self.tokenizer, self.eot_id)
        tok.companions = dict(self.companions)
        return tok


class UnitWorker:
    """Builds units with one tokenizer, made once (an actor of Ray Data's pool holds one)."""

    def __init__(self, job: UnitJob):
        self.job, self.tok = job, job.make_tokenizer()
        self.staged = resolve(job.staged_uri, job.s3_endpoint)

    def __call__(self, unit: Unit) -> dict:
        """The unit's record: its shards, counts and stats, after its shards and the record
        itself are written (so a resume keeps it)."""
        t0, started = time.perf_counter(), time.time()
        stats = ReadStats()
        streams, starts, digest = _token_streams(unit, self.job, self.tok, stats)
        width = self.job.seq_len + 1
        rows = {s: _rows(streams[s], width) for s in ("train", "val")}
        begins = {s: _rows(starts[s], width) for s in ("train", "val")}
        order = np.random.default_rng([self.job.read.seed, unit.index]).permutation(len(rows["train"]))
        train, begins["train"] = rows["train"][order], begins["train"][order]
        # Whole row groups: every unit's (and shard's) train rows start on a group boundary of
        # the split, so a micro-batch of whole groups never straddles two. The rows left out,
        # fewer than a group per unit, are random ones (shuffled first); a unit smaller than a
        # group keeps its rows (a corpus that small gains nothing from aligned reads).
        cut = len(train) % self.job.group_rows if len(train) >= self.job.group_rows else 0
        rows["train"], begins["train"] = train[: len(train) - cut], begins["train"][: len(train) - cut]
        counts = _token_counts(rows["train"], self.tok.vocab_size)
        base = unit.index << UNIT_ID_BITS
        splits = {
            "train": self._write(unit, "train", rows["train"], begins["train"], base),
            "val": self._write(unit, "val", rows["val"], begins["val"], base + len(rows["train"])),
        }
        record = {
            "unit": unit.index,
            "key": self.job.key,
            "bytes": unit.bytes,
            "digest": digest,
            "splits": splits,
            "counts": counts.tolist(),
            "stats": asdict(stats),
            "seconds": time.perf_counter() - t0,
            "started": started,
        }
        self.staged.join(UNITS_DIR, f"{unit.index:06d}.json").write_bytes(json.dumps(record).encode())
        return record

    def _write(self, unit: Unit, split: str, rows: np.ndarray, begins: np.ndarray, first_id: int) -> dict:
        shards = []
        for k, start in enumerate(range(0, len(rows), self.job.rows_per_shard)):
            end = start + self.job.rows_per_shard
            chunk = rows[start:end]
            data = shard_bytes(first_id + start, chunk, self.job.group_rows, begins[start:end])
            rel = f"{split}/part-{unit.index:06d}-{k:04d}.parquet"
            write_once(self.staged.join(rel), data)
            shards.append(
                {
                    "path": rel,
                    "rows": len(chunk),
                    "bytes": len(data),
                    "first_id": first_id + start,
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
        return {"rows": int(len(rows)), "tokens": int(rows.size - len(rows)), "shards": shards}


def _token_streams(
    unit: Unit, job: UnitJob, tok, stats: ReadStats
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]:
    """Each split's documents as one stream of ids joined by end-of-text, where each document
    starts in it (a bool stream beside it), and a digest of the text read (the dataset's
    fingerprint is made of these). An instruction example is its prompt's tokens stored as
    -(id + 1) (read, not scored), then its response's and the EOT: one document."""
    pending: dict[str, list] = {"train": [], "val": []}
    pieces: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    lengths: dict[str, list[int]] = {"train": [], "val": []}  # each document's tokens, EOT included
    digest = hashlib.sha256()
    eot = np.array([job.eot_id], dtype=np.int32)

    def add(split: str, *parts: np.ndarray) -> None:
        pieces[split].extend(parts)
        lengths[split].append(sum(len(p) for p in parts))

    def flush(split: str) -> None:
        docs, pending[split] = pending[split], []
        if docs and isinstance(docs[0], list):  # chat: the template's text, then an unscored end
            for messages in docs:
                add(split, encode_chat(tok, job.chat_template, job.companions, messages), -eot - 1)
        elif docs and not isinstance(docs[0], str):
            # BOS (where the tokenizer adds one) once, at the start of the example: not before its response
            prompts = tok.encode_batch([d[0] for d in docs])
            responses = tok.encode_batch([d[1] for d in docs], special=False)
            for p, r in zip(prompts, responses):
                add(split, -p - 1, r, eot)
        else:
            for ids in tok.encode_batch(docs):
                add(split, ids, eot)

    for split, doc in read_unit(unit, job.read, stats):
        digest.update(f"{split}\0{document_text(doc)}\0".encode("utf-8", errors="replace"))
        pending[split].append(doc)
        if len(pending[split]) >= ENCODE_BATCH:
            flush(split)
    for split in pending:
        flush(split)
    streams = {s: np.concatenate(p) if p else np.zeros(0, np.int32) for s, p in pieces.items()}
    starts = {s: np.zeros(len(streams[s]), dtype=bool) for s in streams}
    for s, n in lengths.items():
        sizes = np.asarray(n, dtype=np.int64)
        starts[s][np.cumsum(sizes) - sizes] = True  # each document's first token
    return streams, starts, digest.hexdigest()


def _rows(stream: np.ndarray, width: int) -> np.ndarray:
    """Rows of `width` tokens; the unit's tail that does not fill one is left out."""
    n = len(stream) // width
    return stream[: n * width].reshape(n, width)


def _token_counts(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    flat = rows.reshape(-1)
    return np.bincount(np.where(flat < 0, -flat - 1, flat), minlength=vocab_size)


def shard_bytes(first_id: int, rows: np.ndarray, group_rows: int, begins: np.ndarray | None = None) -> bytes:
    """A shard as Parquet: ids first_id.., its rows, in row groups of `group_rows`; with
    `begins` (a bool per token), each row's document starts as a list of its offsets."""
    width = rows.shape[1]
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1), pa.int32()), width)
    columns = {SAMPLE_ID: pa.array(np.arange(first_id, first_id + len(rows)), pa.int64()), TOKENS: tokens}
    if begins is not None:
        offsets = np.concatenate([[0], np.cumsum(begins.sum(axis=1))]).astype(np.int32)
        columns[STARTS] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.nonzero(begins)[1], pa.int32()))
    table = pa.table(columns)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=group_rows)
    return buf.getvalue()
