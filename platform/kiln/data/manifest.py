"""The dataset manifest: what `kiln data prepare` wrote, and the checks run before training.

The manifest is written last, so a dataset without one is incomplete and is never read.
It records the tokenizer, vocab size, sequence length, row and token counts per split, and each
shard with its size and SHA-256, so that a corrupt or replaced shard is caught before launch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import pydantic

from kiln.data.tokenizer import from_description
from kiln.errors import DataError
from kiln.storage import Location

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
TOKENS = "tokens"  # fixed-size list<int32> of seq_len + 1 ids: inputs [:-1], targets [1:]
SAMPLE_ID = "id"  # int64, unique across the dataset
STARTS = "starts"  # list<int32>: where in the row a document begins (absent in older datasets)
COLUMNS = (SAMPLE_ID, TOKENS, STARTS)  # a shard's, as `kiln data prepare` writes them now


@dataclass
class Manifest:
    raw: dict[str, Any]
    location: Location

    @property
    def seq_len(self) -> int:
        return int(self.raw["seq_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.raw["tokenizer"]["vocab_size"])

    @property
    def fingerprint(self) -> str:
        return self.raw["fingerprint"]

    @property
    def document_starts(self) -> bool:
        """Whether the shards record where each document begins (column STARTS): datasets of
        an older prepare do not."""
        return STARTS in self.raw.get("columns", {})

    @property
    def examples(self) -> bool:
        """Instruction or chat data (a loss mask: only responses are scored), not plain text."""
        return "loss_mask" in self.raw

    def tokenizer(self):
        """The tokenizer the shards were written with (byte, or BPE from its tokenizer.json)."""
        desc = self.raw["tokenizer"]
        text = self.location.join(desc["file"]).read_bytes().decode() if desc.get("file") else None
        companions = {name: self.location.join(name).read_bytes().decode() for name in desc.get("companions", [])}
        return from_description(desc, text, companions)

    def split(self, name: str) -> dict[str, Any]:
        return self.raw["splits"][name]

    def shard_locations(self, split: str) -> list[Location]:
        return [self.location.join(s["path"]) for s in self.split(split)["shards"]]

    def first_ids(self, split: str) -> list[int]:
        """The id of each shard's first row (its rows are numbered on from there). A manifest
        of an older prepare has none: its train rows were numbered 0.. in shard order, the
        val rows on after them."""
        entries = self.split(split)["shards"]
        if all("first_id" in e for e in entries):
            return [int(e["first_id"]) for e in entries]
        start = self.split("train")["rows"] if split == "val" else 0
        return [start + int(sum(e["rows"] for e in entries[:i])) for i in range(len(entries))]

    def shards(self, split: str) -> list[tuple[dict[str, Any], Location]]:
        """Each shard's manifest entry (path, rows, bytes, sha256) with its location."""
        return list(zip(self.split(split)["shards"], self.shard_locations(split)))


def load_manifest(loc: Location) -> Manifest:
    mloc = loc.join(MANIFEST)
    if not mloc.exists():
        if loc.exists():
            raise DataError(
                f"{loc.uri} holds no {MANIFEST}: not a dataset written by `kiln data prepare`, "
                "or one whose writing did not finish"
            )
        raise DataError(f"dataset {loc.uri} does not exist; create it with `kiln data prepare`")
    try:
        raw = json.loads(mloc.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{mloc.uri} is not valid JSON: {e}") from None
    if isinstance(raw, dict) and "format_version" in raw and raw["format_version"] != FORMAT_VERSION:
        raise DataError(f"{mloc.uri} has format_version {raw['format_version']}, expected {FORMAT_VERSION}")
    try:
        _ManifestSchema.model_validate(raw)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "the file"
        what = "expected an object" if first["type"] == "model_type" else first["msg"]
        raise DataError(
            f"{mloc.uri} is not a Kiln manifest: {field}: {what} (got "
            f"{_short(first.get('input'))}); re-run `kiln data prepare`"
        ) from None
    return Manifest(raw, loc)


def is_kiln_manifest(raw: Any) -> bool:
    """Whether parsed JSON is a manifest `kiln data prepare` (of this format) wrote."""
    if not isinstance(raw, dict) or raw.get("format_version") != FORMAT_VERSION:
        return False
    try:
        _ManifestSchema.model_validate(raw)
    except pydantic.ValidationError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Schema(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")  # later Kiln versions may add fields


class _Shard(_Schema):
    path: str
    rows: pydantic.NonNegativeInt
    bytes: pydantic.NonNegativeInt
    sha256: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")
    first_id: pydantic.NonNegativeInt | None = None  # absent before streamed prepares: see first_ids


class _Split(_Schema):
    rows: pydantic.NonNegativeInt
    tokens: pydantic.NonNegativeInt
    shards: list[_Shard]


class _Tokenizer(_Schema):
    type: Literal["byte", "bpe"]
    vocab_size: pydantic.PositiveInt
    eot_id: pydantic.NonNegativeInt


class _Splits(_Schema):
    train: _Split
    val: _Split


class _ManifestSchema(_Schema):
    """What `kiln data prepare` writes; checked the moment a manifest is read, so a file of the
    wrong shape is one error naming the field, not a crash later in training."""

    format_version: int
    fingerprint: str
    seq_len: int = pydantic.Field(ge=2)
    tokenizer: _Tokenizer
    splits: _Splits
    unigram_entropy_bits: float


def check_shards(manifest: Manifest) -> None:
    """Read every shard's Parquet footer and compare it with the manifest.

    Costs one small read per shard, catches a missing, truncated, corrupt or foreign file, and
    names it. (Full checksums are verified by `kiln data verify`, `find_corrupt_shards`.)
    """
    want = pa.list_(pa.int32(), manifest.seq_len + 1)
    for split in ("train", "val"):
        for entry, loc in manifest.shards(split):
            info = loc.info()
            if info.type.name == "NotFound":
                raise DataError(f"shard {loc.uri} listed in the manifest is missing")
            if info.size != entry["bytes"]:
                raise DataError(
                    f"shard {loc.uri} is {info.size} bytes but the manifest says {entry['bytes']}: "
                    "it is truncated, corrupt or was replaced"
                )
            try:
                with loc.fs.open_input_file(loc.path) as f:
                    meta = pq.read_metadata(f)
                    schema = meta.schema.to_arrow_schema()
            except (OSError, pa.ArrowInvalid) as e:
                raise DataError(f"shard {loc.uri} is not a readable Parquet file: {e}") from None
            found = schema.field(TOKENS).type if TOKENS in schema.names else "no such column"
            if found != want:
                raise DataError(
                    f"shard {loc.uri} has column {TOKENS!r}: {found}, but the manifest (seq_len "
                    f"{manifest.seq_len}) needs {want}"
                )
            if meta.num_rows != entry["rows"]:
                raise DataError(f"shard {loc.uri} has {meta.num_rows} rows but the manifest says {entry['rows']}")
            low, high = _token_range(meta)
            # Instruction data stores prompt tokens as -(id + 1) (kiln.model.inputs_and_targets).
            lowest = -manifest.vocab_size if manifest.examples else 0
            if low is not None and high is not None and (low < lowest or high >= manifest.vocab_size):
                raise DataError(
                    f"shard {loc.uri} holds token ids {low}..{high}, but the manifest's "
                    f"tokenizer.vocab_size is {manifest.vocab_size}: expected ids in "
                    f"0..{manifest.vocab_size - 1}"
                )


def _token_range(meta: pq.FileMetaData) -> tuple[int | None, int | None]:
    """The smallest and largest token id in a shard, from its footer's column statistics (no
    data read); (None, None) where a writer left them out."""
    lows, highs = [], []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            col = group.column(c)
            if col.path_in_schema.split(".")[0] != TOKENS:
                continue
            stats = col.statistics
            if stats is None or not stats.has_min_max:
                return None, None
            lows.append(stats.min)
            highs.append(stats.max)
    return (min(lows), max(highs)) if highs else (None, None)


def find_corrupt_shards(
    manifest: Manifest, splits: tuple[str, ...] = ("train", "val"), budget_s: float | None = None
) -> tuple[list[str], bool]:
    """Hash every shard and compare it with the SHA-256 its manifest recorded.

    Returns the problems found (one line each, naming the shard) and whether every shard was
    checked: with `budget_s` it stops when time is up, since it reads the whole dataset."""
    problems: list[str] = []
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for split in splits:
        for entry, loc in manifest.shards(split):
            if deadline is not None and time.monotonic() > deadline:
                return problems, False
            digest = hashlib.sha256()
            try:
                with loc.fs.open_input_stream(loc.path) as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
            except OSError as e:
                problems.append(f"shard {loc.uri} cannot be read: {e}")
                return problems, False  # storage itself failing: the next shards would too
            if digest.hexdigest() != entry["sha256"]:
                problems.append(
                    f"shard {loc.uri} does not match the SHA-256 in its manifest: it was "
                    "corrupted or replaced after `kiln data prepare` wrote it"
                )
    return problems, True


def read_failure(
    manifests: Manifest | list[Manifest], split: str, error: BaseException, budget_s: float = 120.0
) -> DataError:
    """The DataError for a read of `split` that failed mid-run, naming the culprit shard if a
    checksum pass over the split (of each of the run's datasets, within one time budget) finds
    it (Ray Data's read errors do not say which file)."""
    manifests = manifests if isinstance(manifests, list) else [manifests]
    root = getattr(error, "cause", None) or error  # Ray's RayTaskError keeps the reader's own error
    lines = str(root).strip().splitlines()
    what = f"{type(root).__name__}: {lines[0] if lines else ''}"
    deadline, complete = time.monotonic() + budget_s, True
    for manifest in manifests:
        problems, checked = find_corrupt_shards(manifest, (split,), max(0.0, deadline - time.monotonic()))
        if problems:
            return DataError(f"reading the {split} split failed ({what}); " + "; ".join(problems))
        complete = complete and checked
    uris = " and ".join(m.location.uri for m in manifests)
    where = (
        "every shard still matches its manifest"
        if complete
        else f"no bad shard found in {budget_s:.0f} s: run "
        + " and ".join(f"`kiln data verify {m.location.uri}`" for m in manifests)
        + " to check them all"
    )
    return DataError(f"reading the {split} split of {uris} failed ({what}); {where}")
