"""The input listing of `kiln data prepare`, streamed: files in sorted order, cut into units of
work, and the units spilled to a file, so that no process holds the listing.

Memory is what makes this module: a corpus of a million small files is a listing of hundreds
of megabytes as Python objects. Here the listing is a stream (one directory level held at a
time), its key is a running hash, the seeded order is a shuffle within windows of
`WINDOW_FILES` files, and each unit is pickled to a spill file as it is cut. The driver keeps
one offset and one size per unit; an actor reads its unit from the spill by offset (the spill
lies in the staging place, which the actors write their shards to, so they can read it too).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import heapq
import logging
import os
import pickle
import posixpath
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow.fs as pafs

from kiln.data.inputs import TEXT_SUFFIXES, InputFile, Piece, Unit, read_range
from kiln.errors import DataError, StorageError
from kiln.storage import Location, resolve

log = logging.getLogger(__name__)

WINDOW_FILES = 8192  # files shuffled together: neighbours in a directory (one package's modules)
# land in different units, while the window (a few MB of listing) stays the same size however
# large the corpus is. A unit of 32 MiB holds ~2,000 source files, so a window spans several units.
CUT_RULE = 3  # how the listing is cut into units (1: one permutation of the whole listing, and a
# unit took the file that crossed unit_bytes; 2: windows, and a unit stays within unit_bytes;
# 3: a Parquet file over unit_bytes is cut into byte ranges, as a JSONL file is).
# Part of a prepare's key with WINDOW_FILES: a stopped prepare whose units were cut otherwise
# is not resumed (its unit numbers name other files), nor its dataset reused as this one.
COPY_CHUNK = 8 << 20  # bytes copied at a time when the spill is placed


# ---- the listing, streamed in sorted order -------------------------------------------------------
def list_inputs(inputs: list[str], s3_endpoint: str = "") -> Iterator[InputFile]:
    """Every input file, in the sorted order of their URIs, each once. A directory or s3://
    prefix is searched recursively for TEXT_SUFFIXES; a glob (quoted, so the shell left it) must
    match something. Each input is walked in sorted order and the walks are merged, so only one
    directory level per input is held at a time."""
    streams = [_expand(raw, s3_endpoint) for raw in inputs]
    last = None
    for f in heapq.merge(*streams, key=lambda f: f.uri):
        if f.uri != last:
            yield f
        last = f.uri


def _expand(raw: str, s3_endpoint: str) -> Iterator[InputFile]:
    if raw.startswith("s3://"):
        yield from _list_s3(raw, s3_endpoint)
        return
    if any(ch in raw for ch in "*?["):
        # a glob's matches are held as strings (glob cannot yield them sorted); a large corpus is
        # better given as its directory, which is walked
        matches = sorted(str(Path(m).absolute()) for m in glob.glob(os.path.expanduser(raw), recursive=True))
        found = 0
        for m in matches:
            if st := _regular(m):
                found += 1
                yield _local(m, st)
        if not found:
            raise DataError(f"input pattern {raw!r} matches no files")
        return
    p = Path(raw).expanduser()
    if not p.exists():
        raise DataError(f"input {raw!r} does not exist")
    if not p.is_dir():
        yield _local(str(p.absolute()))
        return
    found = 0
    for path in _walk(str(p.absolute()), raw, root=True):
        if posixpath.splitext(path)[1] in TEXT_SUFFIXES and (st := _regular(path)):
            found += 1
            yield _local(path, st)
    if not found:
        raise DataError(f"input directory {raw!r} holds no text files ({sorted(TEXT_SUFFIXES)})")


def _local(path: str, st: os.stat_result | None = None) -> InputFile:
    st = st or os.stat(path)
    return InputFile(path, st.st_size, str(st.st_mtime_ns))


def _regular(path: str) -> os.stat_result | None:
    """The stat of a regular file (symlinks followed), else None: one stat per file serves both
    the check and the listing's size and stamp."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _walk(folder: str, raw: str, root: bool = False) -> Iterator[str]:
    """Every entry under `folder` that is not a directory (`_regular` tells the files), in the
    sorted order of their paths: a directory sorts as its name plus '/', which is where its
    files' paths sort. Symlinked directories are not followed
    (as os.walk); an unreadable directory is an error that names it (Path.rglob would skip it)."""
    try:
        with os.scandir(folder) as it:
            entries = sorted((e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e.path) for e in it)
    except OSError as e:
        if root:
            raise DataError(f"input directory {raw!r} cannot be read ({e.strerror})") from None
        raise DataError(f"input {raw!r}: its directory {folder!r} cannot be read ({e.strerror})") from None
    for name, path in entries:
        if name.endswith("/"):
            yield from _walk(path, raw)
        else:
            yield path


def _list_s3(raw: str, s3_endpoint: str) -> Iterator[InputFile]:
    """An s3:// object, or every text object below a prefix (a glob is matched on the key),
    listed one level (S3 delimiter) at a time, in sorted order."""
    pattern = raw if any(ch in raw for ch in "*?[") else None
    base = raw.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0] if pattern else raw
    loc = resolve(base, s3_endpoint)
    info = loc.info()
    if info.is_file and pattern is None:
        yield InputFile(loc.uri, info.size, str(info.mtime_ns), s3_endpoint)
        return
    bucket = loc.uri[len("s3://") :].split("/", 1)[0]
    found = 0
    for i in _walk_s3(loc, raw, loc.path):
        uri = "s3://" + (i.path if i.path.startswith(bucket) else f"{bucket}/{i.path}")
        if pattern is not None and not fnmatch.fnmatchcase(uri, pattern):
            continue
        if pattern is None and posixpath.splitext(uri)[1] not in TEXT_SUFFIXES:
            continue
        found += 1
        yield InputFile(uri, i.size, str(i.mtime_ns), s3_endpoint)
    if not found and pattern is not None:
        raise DataError(f"input pattern {raw!r} matches no objects")
    if not found:
        raise DataError(f"input {raw!r} matches no text objects ({sorted(TEXT_SUFFIXES)})")


def _walk_s3(loc: Location, raw: str, path: str) -> Iterator[pafs.FileInfo]:
    try:
        infos = loc.fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    except OSError as e:
        raise StorageError(f"cannot list input {raw} (S3 endpoint {loc.endpoint or 'AWS'}): {e}") from None
    level = sorted(
        (
            (i.base_name + ("/" if i.type == pafs.FileType.Directory else ""), i)
            for i in infos
            if i.type in (pafs.FileType.Directory, pafs.FileType.File)
        ),
        key=lambda e: e[0],
    )
    del infos
    for name, info in level:
        if name.endswith("/"):
            yield from _walk_s3(loc, raw, info.path)
        else:
            yield info


# ---- units of work -------------------------------------------------------------------------------
def cut_units(files: Iterable[InputFile], unit_bytes: int, seed: int) -> Iterator[Unit]:
    """The listing in a seeded order, cut into units of at most `unit_bytes` (or one file, where
    a file is larger): small files bundled, a JSONL file larger than that split into byte
    ranges. The seeded order is the first half of the shuffle: each window of WINDOW_FILES
    files is permuted by (seed, window)."""
    stream = _cut(_windowed(files, seed), unit_bytes)
    first = next(stream, None)
    second = next(stream, None)
    if first is not None and second is None and len(first.pieces) == 1 and first.pieces[0].file.kind == "text":
        first = replace(first, tail_split=True)  # one text file: its tail is the validation split
    yield from (u for u in (first, second) if u is not None)
    yield from stream


def _windowed(files: Iterable[InputFile], seed: int) -> Iterator[InputFile]:
    window: list[InputFile] = []
    count = 0
    for f in files:
        window.append(f)
        if len(window) == WINDOW_FILES:
            yield from _shuffled(window, seed, count)
            window, count = [], count + 1
    yield from _shuffled(window, seed, count)


def _shuffled(window: list[InputFile], seed: int, count: int) -> list[InputFile]:
    order = np.random.default_rng([seed, 0x5EED, count]).permutation(len(window))
    return [window[int(i)] for i in order]


def _cut(files: Iterable[InputFile], unit_bytes: int) -> Iterator[Unit]:
    for index, pieces in enumerate(_bundles(files, unit_bytes)):
        yield Unit(index, pieces)


def _bundles(files: Iterable[InputFile], unit_bytes: int) -> Iterator[tuple[Piece, ...]]:
    """A unit never passes unit_bytes unless one file does, since a worker's peak memory is
    that of its largest unit."""
    pending: list[Piece] = []
    held = 0
    for f in files:
        ranges = f.kind in ("jsonl", "parquet") and f.size > unit_bytes
        if pending and (ranges or held + f.size > unit_bytes):
            yield tuple(pending)
            pending, held = [], 0
        if ranges:
            yield from ((Piece(f, s, min(f.size, s + unit_bytes)),) for s in range(0, f.size, unit_bytes))
            continue
        pending.append(Piece(f))
        held += f.size
        if held >= unit_bytes:
            yield tuple(pending)
            pending, held = [], 0
    if pending:
        yield tuple(pending)


# ---- the spill -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitRef:
    """Where a unit lies in the spill: what travels to an actor, a few dozen bytes."""

    index: int
    uri: str
    start: int
    end: int
    endpoint: str = ""

    def load(self) -> Unit:
        return pickle.loads(read_range(self.uri, self.start, self.end, self.endpoint))


@dataclass
class Units:
    """The units, pickled one after another in a file; the driver keeps their offsets and sizes."""

    offsets: np.ndarray
    """int64, one more than there are units: unit i is bytes [offsets[i], offsets[i + 1])."""
    sizes: np.ndarray
    """int64: each unit's input bytes."""
    key: str
    """The listing's identity: each file's URI, size and modification stamp, hashed in order."""
    files: int
    scratch: IO[bytes] | None = None
    """The spill before `place`: an unnamed temp file, which vanishes when closed or killed."""
    uri: str = ""
    endpoint: str = ""

    def __len__(self) -> int:
        return len(self.sizes)

    def ref(self, i: int) -> UnitRef:
        return UnitRef(i, self.uri, int(self.offsets[i]), int(self.offsets[i + 1]), self.endpoint)

    def __iter__(self) -> Iterator[Unit]:
        return (self.ref(i).load() for i in range(len(self)))

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.close()


def spill(inputs: list[str], s3_endpoint: str, unit_bytes: int, seed: int, scratch: str) -> Units:
    """List the inputs, cut the units and pickle them to an unnamed temp file in the directory
    `scratch` (no name is ever seen there, even after a kill); `place` copies it where the
    actors read it."""
    h = hashlib.sha256()
    counted = 0

    def keyed(files: Iterable[InputFile]) -> Iterator[InputFile]:
        nonlocal counted
        for f in files:
            h.update(f"{f.uri}\0{f.size}\0{f.stamp}\n".encode())
            counted += 1
            yield f

    out = tempfile.TemporaryFile(prefix=".kiln-units-", suffix=".pkl", dir=scratch)  # noqa: SIM115 (Units owns it)
    offsets, sizes = [0], []
    try:
        for unit in cut_units(keyed(list_inputs(inputs, s3_endpoint)), unit_bytes, seed):
            out.write(pickle.dumps(unit, protocol=pickle.HIGHEST_PROTOCOL))
            offsets.append(out.tell())
            sizes.append(unit.bytes)
    except BaseException:
        out.close()
        raise
    log.info("listed %d input files (%.1f MB) in %d units", counted, sum(sizes) / 1e6, len(sizes))
    return Units(np.asarray(offsets, np.int64), np.asarray(sizes, np.int64), h.hexdigest(), counted, out)


def place(units: Units, where: Location) -> Units:
    """The spill copied, a chunk at a time, from its scratch file to `where` (the staging place,
    local or S3, which every actor can read)."""
    assert units.scratch is not None, "the spill is placed once"
    units.scratch.seek(0)
    try:
        if not where.is_s3:
            Path(where.path).parent.mkdir(parents=True, exist_ok=True)
        with where.fs.open_output_stream(where.path) as dst:
            shutil.copyfileobj(units.scratch, dst, COPY_CHUNK)
    except OSError as e:
        s3 = f" (S3 endpoint {where.endpoint or 'AWS'})" if where.is_s3 else ""
        raise StorageError(f"cannot write {where.uri}{s3}: {e}") from None
    finally:
        units.close()
    return replace(units, scratch=None, uri=where.uri, endpoint=where.endpoint)
