"""What `kiln data prepare` reads: a unit of work's documents, with the split each one goes to
(the listing and its cut into units are `kiln.data.listing`).

A unit is the work of one tokenizer task: consecutive files of the listing (in a seeded order)
up to `unit_bytes`, or a byte range of one large JSONL or Parquet file. Everything about a unit
(which documents it holds, which of them are validation documents, the order of its rows)
follows from the listing and the settings alone, never from which worker runs it or when, so
the dataset is byte-identical whatever the number of workers, and a prepare that was killed can
redo just the units it had not finished.
"""

from __future__ import annotations

import functools
import json
import logging
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.data.chat import message_problem
from kiln.errors import DataError
from kiln.storage import resolve, retry_transient

log = logging.getLogger(__name__)
T = TypeVar("T")

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".jsonl", ".parquet"}  # what a directory's walk takes
BINARY_SNIFF = 8192  # bytes looked at for a NUL: text of any encoding Kiln reads has none
LINE_READ = 1 << 20  # bytes read at a time past a JSONL range's end, to finish its last line


@dataclass(frozen=True)
class InputFile:
    uri: str
    size: int
    stamp: str
    """What changes when the file does: its modification time in ns."""
    endpoint: str = field(default="", compare=False)
    """The S3 endpoint it is read from (s3:// inputs)."""

    @property
    def kind(self) -> str:
        suffix = posixpath.splitext(self.uri)[1]
        return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


@dataclass(frozen=True)
class Piece:
    """A file, or the byte range [start, end) of a JSONL file (the lines that start in it) or of a
    Parquet file (the row groups that start in it)."""

    file: InputFile
    start: int = 0
    end: int = -1

    @property
    def stop(self) -> int:
        """Where the range ends: `end`, or the file's size for a whole file (end -1)."""
        return self.end if self.end >= 0 else self.file.size


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]
    tail_split: bool = False
    """The corpus is one text file: its tail is the validation split (it has no other documents)."""

    @property
    def bytes(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)


@dataclass
class ReadOptions:
    """The settings that say how a unit's documents are read and split."""

    text_field: str = "text"
    prompt_field: str = ""
    response_field: str = ""
    chat_field: str = ""
    val_fraction: float = 0.1
    seed: int = 1234
    on_binary: str = "error"
    on_bad_record: str = "error"


@dataclass
class ReadStats:
    """What reading found besides the text, recorded in the manifest (summed over units)."""

    binary_files_skipped: int = 0
    invalid_utf8_chars: int = 0
    """U+FFFD characters the decoding put where bytes were not UTF-8 (Latin-1 text, say)."""
    bad_records_skipped: int = 0
    """JSONL records that were not JSON or lacked a field, left out under --on-bad-record skip."""
    documents: dict = field(default_factory=lambda: {"train": 0, "val": 0})

    def add(self, other: ReadStats) -> None:
        self.binary_files_skipped += other.binary_files_skipped
        self.invalid_utf8_chars += other.invalid_utf8_chars
        self.bad_records_skipped += other.bad_records_skipped
        for k, v in other.documents.items():
            self.documents[k] = self.documents.get(k, 0) + v


class BinaryInput(DataError):
    """A text input that holds binary data."""


# ---- reading a unit -----------------------------------------------------------------------------
Document = str | tuple[str, str] | list  # a text, an instruction example's (prompt, response), a chat's messages


def document_text(doc: Document) -> str:
    """A document's text, for its digest and counts (a chat's as its messages' JSON)."""
    if isinstance(doc, str):
        return doc
    return f"{doc[0]}\x1f{doc[1]}" if isinstance(doc, tuple) else json.dumps(doc, ensure_ascii=False)


def read_unit(unit: Unit, opts: ReadOptions, stats: ReadStats) -> Iterator[tuple[str, Document]]:
    """(split, document) for each non-empty document of the unit, in order. A unit of n >= 2
    documents holds out max(1, round(val_fraction * n)) of them, chosen by a seed of its own;
    a unit of one document draws it with that chance. The split depends on where a document
    is, never on what else was read."""
    docs: list[Document] = []
    for piece in unit.pieces:
        try:
            docs.extend(_read_piece(piece, opts, stats))
        except BinaryInput as e:
            if opts.on_binary != "skip":
                raise DataError(f"{e}; leave it out of --input, or pass --on-binary skip") from None
            log.warning("%s: skipped", e)
            stats.binary_files_skipped += 1
    docs = [d for d in docs if isinstance(d, list) or (d if isinstance(d, str) else d[1]).strip()]
    for doc in docs:
        stats.invalid_utf8_chars += document_text(doc).count("\ufffd")
    if unit.tail_split and len(docs) == 1 and isinstance(docs[0], str):
        cut = int(len(docs[0]) * (1 - opts.val_fraction))  # one document: its tail is held out
        labelled: list[tuple[str, Document]] = [("train", docs[0][:cut]), ("val", docs[0][cut:])]
    else:
        labelled = [(split, d) for split, d in zip(_val_draw(len(docs), opts, unit.index), docs)]
    for split, doc in labelled:
        stats.documents[split] += 1
        yield split, doc


def _val_draw(n: int, opts: ReadOptions, unit: int) -> list[str]:
    rng = np.random.default_rng([opts.seed, unit])
    if n == 1:
        return ["val" if rng.random() < opts.val_fraction else "train"]
    held = set(rng.permutation(n)[: max(1, round(opts.val_fraction * n))].tolist())
    return ["val" if i in held else "train" for i in range(n)]


def _fields(opts: ReadOptions) -> tuple[str, ...]:
    if opts.chat_field:
        return (opts.chat_field,)
    return (opts.prompt_field, opts.response_field) if opts.prompt_field else (opts.text_field,)


def _record_problem(rec, fields: tuple[str, ...], chat: bool) -> str | None:
    """Why a JSONL record is not one document of the kind asked for, or None."""
    if chat:
        problem = message_problem(rec.get(fields[0]) if isinstance(rec, dict) else None)
        return None if problem is None else f"field {fields[0]!r}: {problem}"
    missing = [n for n in fields if not isinstance(rec, dict) or not isinstance(rec.get(n), str)]
    return f"expected an object with a string field {missing[0]!r}" if missing else None


def _read_piece(piece: Piece, opts: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    kind = piece.file.kind
    if kind == "jsonl":
        yield from _jsonl(piece, opts, stats)
    elif kind == "parquet":
        yield from _parquet(piece, opts)
    elif opts.prompt_field or opts.chat_field:
        raise DataError(
            f"input {piece.file.uri}: instruction and chat data (--prompt-field/--response-field, "
            "--chat-field) are read from .jsonl or .parquet files"
        )
    else:
        data = _read(piece.file, 0, -1)
        if b"\0" in data[:BINARY_SNIFF]:
            raise BinaryInput(f"input {piece.file.uri} holds binary data (NUL bytes), not text")
        yield data.decode("utf-8", errors="replace")


def _resolved(uri: str, endpoint: str):
    """A file's Location on a filesystem built once per bucket and endpoint: an S3 filesystem
    is not free to build, and a corpus has thousands of files."""
    if not uri.startswith("s3://"):
        return resolve(uri)
    bucket, _, key = uri[len("s3://") :].partition("/")
    return _bucket(bucket, endpoint).join(key)


@functools.lru_cache(maxsize=64)
def _bucket(bucket: str, endpoint: str):
    return resolve(f"s3://{bucket}", endpoint)


def _read(f: InputFile, start: int, end: int) -> bytes:
    return read_range(f.uri, start, end, f.endpoint)


def _opened(uri: str, endpoint: str, use: Callable[[pa.NativeFile], T]) -> T:
    """`use(handle)` on the input file, opened again while S3 fails transiently; a file gone
    since the listing is named. Other errors are the caller's to name."""
    loc = _resolved(uri, endpoint)

    def attempt() -> T:
        with loc.fs.open_input_file(loc.path) as h:
            return use(h)

    try:
        return retry_transient(attempt, f"reading {uri}")
    except FileNotFoundError:
        raise DataError(f"input {uri} disappeared while it was being read") from None


def read_range(uri: str, start: int, end: int, endpoint: str = "") -> bytes:
    """Bytes [start, end) of a file (end -1: to its end); a transient S3 error is retried, then
    named with the file."""

    def read(h: pa.NativeFile) -> bytes:
        stop = h.size() if end < 0 else min(end, h.size())
        return h.read_at(max(0, stop - start), start) if stop > start else b""

    try:
        return _opened(uri, endpoint, read)
    except OSError as e:
        raise DataError(f"input {uri} cannot be read: {getattr(e, 'strerror', None) or e}") from None


def _jsonl_lines(piece: Piece) -> tuple[bytes, int]:
    """The whole lines that start in the piece's range, and the offset of the first one. A line
    belongs to the range its first byte lies in, so ranges split a file without a line lost or
    read twice."""
    f, end = piece.file, piece.stop
    begin = max(0, piece.start - 1)  # one byte back: whether the range starts a line
    data = _read(f, begin, end)
    first = 0
    if piece.start > 0:
        nl = data.find(b"\n")
        if nl < 0:
            return b"", end
        first = nl + 1
    body = bytearray(data[first:])
    pos = end
    while body and not body.endswith(b"\n") and pos < f.size:  # finish the last line
        more = _read(f, pos, pos + LINE_READ)
        nl = more.find(b"\n")
        body += more if nl < 0 else more[: nl + 1]
        pos += len(more)
        if nl >= 0 or not more:
            break
    return bytes(body), begin + first


def _jsonl(piece: Piece, opts: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    fields = _fields(opts)
    body, offset = _jsonl_lines(piece)
    text = body.decode("utf-8", errors="replace")
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        problem = None
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg})"
        else:
            problem = _record_problem(rec, fields, bool(opts.chat_field))
        if problem is None:
            yield rec[fields[0]] if len(fields) == 1 else (rec[fields[0]], rec[fields[1]])
        elif opts.on_bad_record == "skip":
            stats.bad_records_skipped += 1
        else:
            lineno = _line_number(piece.file, offset) + i
            raise DataError(
                f"{piece.file.uri}:{lineno}: {problem}; fix the record, or pass --on-bad-record skip "
                "to leave such records out (they are counted in the manifest)"
            )


def _line_number(f: InputFile, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` (read only for an error)."""
    lines, pos = 1, 0
    while pos < offset:
        chunk = _read(f, pos, min(offset, pos + (16 << 20)))
        if not chunk:
            break
        lines += chunk.count(b"\n")
        pos += len(chunk)
    return lines


def _parquet(piece: Piece, opts: ReadOptions) -> Iterator[Document]:
    """The documents of the row groups that start in the piece's byte range (all of them for a
    whole file), from the columns asked for only. A large file is cut into ranges as a JSONL
    file is, a row group going to the range its first byte lies in, so a worker holds its
    range's row groups (one larger than a range, whole), never the whole file."""
    f, fields = piece.file, _fields(opts)

    def read(h: pa.NativeFile) -> pa.Table:
        pf = pq.ParquetFile(h)
        names = pf.schema_arrow.names
        for name in fields:
            if name not in names:  # a DataError: not retried, not taken for an unreadable file
                raise DataError(f"input {f.uri} has no column {name!r} (columns: {names})")
            kind = pf.schema_arrow.field(name).type
            if opts.chat_field and (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                continue  # a list of {role, content} structs, each row checked as it is read
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise DataError(f"input {f.uri}: column {name!r} holds {kind}, not text; expected a string column")
        groups = [i for i in range(pf.num_row_groups) if piece.start <= _group_start(pf.metadata, i) < piece.stop]
        return pf.read_row_groups(groups, columns=list(fields))

    try:
        table = _opened(f.uri, f.endpoint, read)
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"input {f.uri} is not a readable Parquet file: {e}") from None
    columns = [table.column(n).to_pylist() for n in fields]
    if opts.chat_field:
        for i, messages in enumerate(columns[0]):
            problem = message_problem(messages)
            if problem:
                raise DataError(f"input {f.uri}: row {i} of its row groups: column {fields[0]!r}: {problem}")
        yield from columns[0]
        return
    if len(fields) == 1:
        yield from (c for c in columns[0] if c)
    else:
        yield from ((p, r) for p, r in zip(*columns) if p is not None and r is not None)


def _group_start(meta: pq.FileMetaData, i: int) -> int:
    """The offset of row group i's first byte: the first page of its first column chunk in the
    file (a dictionary page, where there is one, comes before the data pages)."""
    group = meta.row_group(i)
    starts = []
    for j in range(group.num_columns):
        col = group.column(j)
        dictionary = col.dictionary_page_offset if col.has_dictionary_page else None
        starts.append(dictionary or col.data_page_offset)  # some writers record a dictionary at 0
    return min(starts)
