"""The dataset manifest: what `kiln data prepare` wrote, and the checks run before training.

The manifest is written last, so a dataset without one is incomplete and is never read.
It records the tokenizer, vocab size, sequence length, row and token counts per split, and each
shard with its size and SHA-256, so that a corrupt or replaced shard is caught before launch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.errors import DataError
from kiln.storage import Location

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
TOKENS = "tokens"  # fixed-size list<int32> of seq_len + 1 ids: inputs [:-1], targets [1:]
SAMPLE_ID = "id"  # int64, unique across the dataset


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

    def split(self, name: str) -> dict[str, Any]:
        return self.raw["splits"][name]

    def shard_locations(self, split: str) -> list[Location]:
        return [self.location.join(s["path"]) for s in self.split(split)["shards"]]


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
    except json.JSONDecodeError as e:
        raise DataError(f"{mloc.uri} is not valid JSON: {e}") from None
    for key in ("format_version", "seq_len", "tokenizer", "splits", "fingerprint"):
        if key not in raw:
            raise DataError(f"{mloc.uri} lacks the field {key!r}; re-run `kiln data prepare`")
    if raw["format_version"] != FORMAT_VERSION:
        raise DataError(f"{mloc.uri} has format_version {raw['format_version']}, expected {FORMAT_VERSION}")
    return Manifest(raw, loc)


def check_shards(manifest: Manifest) -> None:
    """Read every shard's Parquet footer and compare it with the manifest.

    Costs one small read per shard, catches a missing, truncated, corrupt or foreign file, and
    names it. (Full checksums are verified by `kiln data verify`.)
    """
    want = pa.list_(pa.int32(), manifest.seq_len + 1)
    for split in ("train", "val"):
        for entry, loc in zip(manifest.split(split)["shards"], manifest.shard_locations(split)):
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
            if TOKENS not in schema.names or schema.field(TOKENS).type != want:
                raise DataError(
                    f"shard {loc.uri} has schema {schema}, expected column {TOKENS!r} of type {want}"
                )
            if meta.num_rows != entry["rows"]:
                raise DataError(
                    f"shard {loc.uri} has {meta.num_rows} rows but the manifest says {entry['rows']}"
                )
