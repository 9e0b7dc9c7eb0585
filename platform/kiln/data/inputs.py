"""What `kiln data prepare` reads: the input listing, its cut into units of work, and a unit's
documents with the split each one goes to.

A unit is the work of one tokenizer task: consecutive files of the listing (in a seeded order)
up to `unit_bytes`, or a byte range of one large JSONL file. Everything about a unit (which
documents it holds, which of them are validation documents, the order of its rows) follows from
the listing and the settings alone, never from which worker runs it or when, so the dataset is
byte-identical whatever the number of workers, and a prepare that was killed can redo just the
units it had not finished.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import hashlib
import json
import logging
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from kiln.errors import DataError, StorageError
from kiln.storage import resolve, retry_transient

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".jsonl", ".parquet"}
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
    """A file, or the byte range [start, end) of a JSONL file (lines that start in it)."""

    file: InputFile
    start: int = 0
    end: int = -1


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]
    tail_split: bool = False
    """The corpus is one text file: its tail is the validation split (it has no other documents)."""

    @property
    def bytes(self) -> int:
        return sum((p.end if p.end >= 0 else p.file.size) - p.start for p in self.pieces)


@dataclass
class ReadOptions:
    """The settings that say how a unit's documents are read and split."""

    text_field: str = "text"
    prompt_field: str = ""
    response_field: str = ""
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


# ---- the listing --------------------------------------------------------------------------------
def list_inputs(inputs: list[str], s3_endpoint: str = "") -> list[InputFile]:
    """Every input file, sorted by URI, each once. A directory or s3:// prefix is searched
    recursively for TEXT_SUFFIXES; a glob (quoted, so the shell left it) must match something."""
    found: dict[str, InputFile] = {}
    for raw in inputs:
        for f in _expand(raw, s3_endpoint):
            found.setdefault(f.uri, f)
    return [found[k] for k in sorted(found)]


def _expand(raw: str, s3_endpoint: str) -> list[InputFile]:
    if raw.startswith("s3://"):
        return _list_s3(raw, s3_endpoint)
    if any(ch in raw for ch in "*?["):
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(raw), recursive=True))
        files = [_local(m) for m in matches if m.is_file()]
        if not files:
            raise DataError(f"input pattern {raw!r} matches no files")
        return files
    p = Path(raw).expanduser()
    if not p.exists():
        raise DataError(f"input {raw!r} does not exist")
    if not p.is_dir():
        return [_local(p)]
    found = sorted(f for f in _walk(p, raw) if f.suffix in TEXT_SUFFIXES)
    if not found:
        raise DataError(f"input directory {raw!r} holds no text files ({sorted(TEXT_SUFFIXES)})")
    return [_local(f) for f in found]


def _local(p: Path) -> InputFile:
    st = p.stat()
    return InputFile(str(p.absolute()), st.st_size, str(st.st_mtime_ns))


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


def _list_s3(raw: str, s3_endpoint: str) -> list[InputFile]:
    """An s3:// object, or every text object below a prefix (a glob is matched on the key)."""
    pattern = raw if any(ch in raw for ch in "*?[") else None
    base = raw.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0] if pattern else raw
    loc = resolve(base, s3_endpoint)
    info = loc.info()
    if info.is_file and pattern is None:
        return [InputFile(loc.uri, info.size, str(info.mtime_ns), s3_endpoint)]
    try:
        infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except OSError as e:
        raise StorageError(f"cannot list input {raw} (S3 endpoint {loc.endpoint or 'AWS'}): {e}") from None
    bucket = loc.uri[len("s3://"):].split("/", 1)[0]
    files = []
    for i in infos:
        uri = "s3://" + (i.path if i.path.startswith(bucket) else f"{bucket}/{i.path}")
        if i.type != pafs.FileType.File:
            continue
        if pattern is not None and not fnmatch.fnmatchcase(uri, pattern):
            continue
        if pattern is None and posixpath.splitext(uri)[1] not in TEXT_SUFFIXES:
            continue
        files.append(InputFile(uri, i.size, str(i.mtime_ns), s3_endpoint))
    if not files and pattern is not None:
        raise DataError(f"input pattern {raw!r} matches no objects")
    if not files:
        raise DataError(f"input {raw!r} matches no text objects ({sorted(TEXT_SUFFIXES)})")
    return files


def listing_key(files: list[InputFile]) -> str:
    """Identifies the listing without reading it: each file's URI, size and modification stamp."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.uri}\0{f.size}\0{f.stamp}\n".encode())
    return h.hexdigest()


# ---- units of work ------------------------------------------------------------------------------
def make_units(files: list[InputFile], unit_bytes: int, seed: int) -> list[Unit]:
    """The listing in a seeded order, cut into units of about `unit_bytes`: small files bundled,
    a JSONL file larger than that split into byte ranges. The seeded order is the first half of
    the shuffle: neighbours in a directory (one package's modules) land in different units."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(files))
    units: list[Unit] = []
    pending: list[Piece] = []
    held = 0

    def close() -> None:
        nonlocal pending, held
        if pending:
            units.append(Unit(len(units), tuple(pending)))
        pending, held = [], 0

    for i in order:
        f = files[int(i)]
        if f.kind == "jsonl" and f.size > unit_bytes:
            close()
            for start in range(0, f.size, unit_bytes):
                units.append(Unit(len(units), (Piece(f, start, min(f.size, start + unit_bytes)),)))
            continue
        pending.append(Piece(f))
        held += f.size
        if held >= unit_bytes:
            close()
    close()
    if len(files) == 1 and files[0].kind == "text" and units:
        units[0] = Unit(0, units[0].pieces, tail_split=True)
    return units


# ---- reading a unit -----------------------------------------------------------------------------
Document = str | tuple[str, str]  # a text, or an instruction example's (prompt, response)


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
    docs = [d for d in docs if (d if isinstance(d, str) else d[1]).strip()]
    for doc in docs:
        stats.invalid_utf8_chars += (doc if isinstance(doc, str) else doc[0] + doc[1]).count("\ufffd")
    if unit.tail_split and len(docs) == 1 and isinstance(docs[0], str):
        cut = int(len(docs[0]) * (1 - opts.val_fraction))  # one document: its tail is held out
        labelled = [("train", docs[0][:cut]), ("val", docs[0][cut:])]
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
    return (opts.prompt_field, opts.response_field) if opts.prompt_field else (opts.text_field,)


def _read_piece(piece: Piece, opts: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    kind = piece.file.kind
    if kind == "jsonl":
        yield from _jsonl(piece, opts, stats)
    elif kind == "parquet":
        yield from _parquet(piece.file, opts)
    elif opts.prompt_field:
        raise DataError(f"input {piece.file.uri}: instruction data (--prompt-field/--response-field) is read from "
                        ".jsonl or .parquet files")
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
    bucket, _, key = uri[len("s3://"):].partition("/")
    return _bucket(bucket, endpoint).join(key)


@functools.lru_cache(maxsize=64)
def _bucket(bucket: str, endpoint: str):
    return resolve(f"s3://{bucket}", endpoint)


def _read(f: InputFile, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file (end -1: to its end); a transient S3 error is retried, then
    named with the file."""
    loc = _resolved(f.uri, f.endpoint)

    def read() -> bytes:
        with loc.fs.open_input_file(loc.path) as h:
            stop = h.size() if end < 0 else min(end, h.size())
            return h.read_at(max(0, stop - start), start) if stop > start else b""

    try:
        return retry_transient(read, f"reading {f.uri}")
    except FileNotFoundError:
        raise DataError(f"input {f.uri} disappeared while it was being read") from None
    except OSError as e:
        raise DataError(f"input {f.uri} cannot be read: {getattr(e, 'strerror', None) or e}") from None


def _jsonl_lines(piece: Piece) -> tuple[bytes, int]:
    """The whole lines that start in the piece's range, and the offset of the first one. A line
    belongs to the range its first byte lies in, so ranges split a file without a line lost or
    read twice."""
    f, end = piece.file, piece.end if piece.end >= 0 else piece.file.size
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
            missing = [n for n in fields if not isinstance(rec, dict) or not isinstance(rec.get(n), str)]
            if missing:
                problem = f"expected an object with a string field {missing[0]!r}"
        if problem is None:
            yield rec[fields[0]] if len(fields) == 1 else (rec[fields[0]], rec[fields[1]])
        elif opts.on_bad_record == "skip":
            stats.bad_records_skipped += 1
        else:
            lineno = _line_number(piece.file, offset) + i
            raise DataError(f"{piece.file.uri}:{lineno}: {problem}; fix the record, or pass --on-bad-record skip "
                            "to leave such records out (they are counted in the manifest)")


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


def _parquet(f: InputFile, opts: ReadOptions) -> Iterator[Document]:
    fields = _fields(opts)
    try:
        table = pq.read_table(pa.BufferReader(_read(f, 0, -1)))
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"input {f.uri} is not a readable Parquet file: {e}") from None
    for name in fields:
        if name not in table.column_names:
            raise DataError(f"input {f.uri} has no column {name!r} (columns: {table.column_names})")
    columns = [table.column(n).to_pylist() for n in fields]
    if len(fields) == 1:
        yield from (c for c in columns[0] if c)
    else:
        yield from ((p, r) for p, r in zip(*columns) if p is not None and r is not None)
